import pytest

from perfxlm import SamplingParams
from perfxlm.sampling_params import SamplingType


def test_defaults_match_vllm():
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.min_p, p.max_tokens) == (1, 1.0, 1.0, -1, 0.0, 16)
    assert p.stop == [] and p.stop_token_ids == [] and not p.ignore_eos
    assert p.sampling_type == SamplingType.RANDOM


def test_greedy_and_seed_types():
    assert SamplingParams(temperature=0).sampling_type == SamplingType.GREEDY
    assert SamplingParams(seed=3).sampling_type == SamplingType.RANDOM_SEED
    assert SamplingParams(stop="x").stop == ["x"]


@pytest.mark.parametrize(
    "kwargs,field",
    [
        ({"temperature": -0.1}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"min_p": 1.5}, "min_p"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"n": 0}, "n"),
        ({"min_tokens": 5, "max_tokens": 2}, "min_tokens"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"presence_penalty": 3.0}, "presence_penalty"),
    ],
)
def test_invalid_values_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


@pytest.mark.parametrize(
    "kwargs,field",
    [
        ({"logit_bias": {5: 200.0}}, "logit_bias"),
        ({"logit_bias": {"x": 1.0}}, "logit_bias"),
        ({"allowed_token_ids": []}, "allowed_token_ids"),
        ({"bad_words": [""]}, "bad_words"),
        ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
        ({"n": 3, "best_of": 2}, "best_of"),
        ({"logprobs": -1}, "logprobs"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
    ],
)
def test_more_invalid_values(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


@pytest.mark.parametrize(
    "kwargs,field",
    [
        ({"seed": 2**63}, "seed"),
        ({"seed": -(2**63) - 1}, "seed"),
        ({"seed": True}, "seed"),
        ({"seed": "7"}, "seed"),
        ({"n": True}, "n"),
        ({"top_k": 3.0}, "top_k"),
        ({"temperature": float("inf")}, "temperature"),
        ({"temperature": "hot"}, "temperature"),
        ({"top_p": float("nan")}, "top_p"),
        ({"repetition_penalty": float("nan")}, "repetition_penalty"),
        ({"logprobs": 1.5}, "logprobs"),
        ({"prompt_logprobs": True}, "prompt_logprobs"),
        ({"best_of": 2.5}, "best_of"),
        ({"stop": 5}, "stop"),
        ({"stop_token_ids": 5}, "stop_token_ids"),
    ],
)
def test_types_and_ranges_are_values_errors_naming_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_seed_minus_one_means_random_and_int64_bounds_are_accepted():
    assert SamplingParams(seed=-1).seed is None
    assert SamplingParams(seed=-1, temperature=1.0).sampling_type == SamplingType.RANDOM
    assert SamplingParams(seed=2**63 - 1).seed == 2**63 - 1
    assert SamplingParams(seed=-(2**63)).seed == -(2**63)


@pytest.mark.parametrize("kwargs,kind", [({"regex": ""}, "regex"), ({"json": {}}, "json"), ({"grammar": ""}, "grammar"),
                                         ({"json": ""}, "json"), ({"json_object": True}, "json_object")])
def test_empty_constraints_still_have_a_kind(kwargs, kind):
    """Found by the server fuzz test: an empty regex or schema passed the checks but had no kind
    (StopIteration in the grammar compile, which left the request waiting forever)."""
    from perfxlm.sampling_params import StructuredOutputsParams

    assert StructuredOutputsParams(**kwargs).kind == kind
