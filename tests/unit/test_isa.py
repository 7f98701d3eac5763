"""The instruction-set tiers (perfxlm.ops.isa): detection from CPU flags, forcing, clear errors."""

import pytest

from perfxlm.ops import cpu_plan, isa

ZEN3 = frozenset({"sse4_2", "avx", "avx2", "fma", "f16c", "bmi2"})
ZEN4 = ZEN3 | {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512cd", "avx512_vnni", "avx512_bf16"}
SPR = ZEN4 | {"avx_vnni", "amx_tile", "amx_int8", "amx_bf16"}
ALDER = ZEN3 | {"avx_vnni"}


@pytest.mark.parametrize("flags,top,count", [(frozenset(), "scalar", 1), (ZEN3, "avx2", 2), (ALDER, "avx_vnni", 3),
                                             (ZEN4, "avx512_bf16", 5), (SPR, "amx", 7)])
def test_detect_names_the_highest_tier_a_cpu_has(flags, top, count):
    assert isa.detect(flags) == top
    assert len(isa.supported(flags)) == count


def test_unknown_tier_is_an_error_that_lists_the_names(monkeypatch):
    monkeypatch.setenv(isa.ENV, "avx3")
    with pytest.raises(ValueError, match="avx2, avx_vnni"):
        isa.requested()


def test_a_tier_above_the_cpu_is_refused_naming_what_is_missing(monkeypatch):
    above = [t.name for t in isa.TIERS if t.name not in isa.supported()]
    if not above:
        pytest.skip("this CPU runs every tier")
    monkeypatch.setenv(isa.ENV, above[-1])
    with pytest.raises(ValueError, match="this CPU lacks"):
        isa.requested()


@pytest.mark.parametrize("tier", ["scalar", "avx2"])
def test_a_forced_tier_hides_higher_flags_from_the_plan(monkeypatch, tier):
    if tier not in isa.supported():
        pytest.skip(f"this CPU cannot run {tier}")
    monkeypatch.setenv(isa.ENV, tier)
    flags = isa.visible_flags()
    assert not flags & {"avx512f", "avx512_bf16", "amx_bf16", "avx_vnni"}
    assert isa.compile_flags() == list({t.name: t for t in isa.TIERS}[tier].cflags)
    cpu_plan.reset()
    try:
        plan = cpu_plan.detect()
        assert plan.isa == tier and plan.layout == "panels"  # no bf16 arithmetic below avx512_bf16
        assert f"isa={tier}" in plan.describe()
    finally:
        cpu_plan.reset()


def test_auto_builds_for_this_cpu(monkeypatch):
    monkeypatch.delenv(isa.ENV, raising=False)
    monkeypatch.delenv("PERFXLM_NATIVE_MARCH", raising=False)
    assert isa.compile_flags() == ["-march=native"] and isa.selected() == isa.detect()
