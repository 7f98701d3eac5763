"""The kernels' other ISA tiers (perfxlm.ops.isa), built and tested on this machine against the same
plain-torch references: every distinct kernel path below the CPU's own tier that it can run (the scalar
loops everywhere; AVX2 + FMA, AVX-VNNI and AVX512-VNNI where the CPU has them), so a tier is checked
on any machine that has it, not only on machines of that kind."""

import os
import subprocess
import sys

import pytest

from perfxlm.ops import isa, native
from tests import tier_cases

KERNEL_TESTS = ["tests/unit/test_linear_ops.py", "tests/unit/test_bf16_dots.py", "tests/unit/test_attention_ops.py", "tests/unit/test_prefill_attention_kernel.py", "tests/unit/test_fused_ops.py",
                "tests/unit/test_kv_quant.py", "tests/unit/test_quant_linear_ops.py", "tests/unit/test_kquant_ops.py",
                "tests/unit/test_moe.py", "tests/unit/test_mxfp4.py", "tests/unit/test_mla_kernel.py",
                "tests/unit/test_fp8_linear.py", "tests/quant/test_quant_search.py",
                "tests/unit/test_int8_rows.py", "tests/unit/test_quant_gemm.py", "tests/unit/test_act_order_products.py", "tests/unit/test_row_groups.py",
                "tests/unit/test_row_groups_k.py", "tests/unit/test_row_groups_k_layout.py", "tests/unit/test_row_groups_k_gemm.py",
                "tests/unit/test_row_groups_m.py", "tests/unit/test_row_tiles.py", "tests/unit/test_gemv_streams.py", "tests/unit/test_act_blocks.py",
                "tests/unit/test_act_blocks_q8k.py",
                "tests/unit/test_moe_row_groups.py", "tests/unit/test_moe_routed.py", "tests/unit/test_split_rows.py",
                "tests/quant/test_int4_two_level.py::test_native_products_match_the_reference_and_the_flat_form",
                "tests/quant/test_int4_two_level.py::test_every_group_through_the_block_kernels_alone_and_in_a_batch",
                # the fused decode layer's LoRA rows against the module path
                "tests/unit/test_lora_kernel.py",
                "tests/lora/test_lora_vs_peft.py::test_fused_decode_adds_the_adapters",
                # the decode stack (one call for a step's layers) against the per-layer calls, bit for bit
                "tests/model/test_fused_decode_families.py::test_decode_stack_gives_the_per_layer_calls_bits"
                "[gemma2-softcap-local-global-float32]",
                "tests/model/test_fused_decode_families.py::test_decode_stack_gives_the_per_layer_calls_bits"
                "[qwen3-qknorm-headdim-bias-int8-cache]",
                "tests/model/test_fused_decode_families.py::test_decode_stack_gives_the_per_layer_calls_bits"
                "[qwen2-bias-tied-sliding-bf16-rows-native]",
                # verification rows against the decode steps, bit for bit: routed experts with gpt-oss's padded
                # activation, DeepSeek's row-by-row router and latent attention
                "tests/engine/test_spec_decode_families.py::test_guesses_verified_as_the_decode_steps_they_stand_for"
                "[gptoss-sinks-alternating-bfloat16]",
                "tests/engine/test_spec_decode_families.py::test_guesses_verified_as_the_decode_steps_they_stand_for"
                "[deepseekv3-rotate-half-bfloat16]"]


@pytest.mark.slow
@pytest.mark.parametrize("tier", isa.DISTINCT_PATHS)
def test_each_lower_tier_matches_references(tier_build_env, tier):
    if native.kernels() is None:
        pytest.skip("no compiler for the native kernels on this machine")
    if tier not in isa.supported():
        pytest.skip(f"this CPU cannot run the {tier} tier (it runs {', '.join(isa.supported())})")
    if tier == isa.detect():
        pytest.skip(f"{tier} is this CPU's own tier: the rest of the suite runs its kernels")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, **tier_build_env(tier))
    env.pop("PERFXLM_NATIVE_MARCH", None)
    env[tier_cases.TIER_RUN_ENV] = "1"  # the cross products pairwise, the torch-only variants left out
    # That run's session start also checks that the build is the tier's and the CPU plan knows it
    # (tier_cases.check_build: a failure there errors every test). The plugins installed beside pytest
    # (schemathesis, hypothesis, anyio, benchmark) are not loaded: no kernel test uses them, and importing
    # them cost each tier's run ~3 s of CPU; pytest-timeout is, for the ini's timeout.
    env["PYTEST_DISABLE_PLUGIN_AUTOLOAD"] = "1"
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "pytest_timeout", *KERNEL_TESTS],
        env=env, cwd=root, capture_output=True, text=True, timeout=1200,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
    assert " passed" in run.stdout and "skipped" not in run.stdout.splitlines()[-1]


def test_a_build_lock_left_by_a_killed_build_does_not_hang_the_next_start(tmp_path, monkeypatch):
    # torch's builder waits forever for its `lock` file to vanish; one left by a build that was killed
    # (Ctrl-C during the first start) must be cleared by the next process, not waited on.
    (tmp_path / "lock").touch()
    seen = []
    with native._build_guard(tmp_path):
        seen.append((tmp_path / "lock").exists())
    assert seen == [False]


def test_a_lower_optimisation_level_builds_in_its_own_folder(tmp_path, monkeypatch):
    # PERFXLM_NATIVE_OPT (the tier tests' -O1 builds) must never find or replace an -O3 build, and a level
    # that could change results (-Ofast) is refused by name
    monkeypatch.setenv("PERFXLM_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("PERFXLM_NATIVE_OPT", raising=False)
    default = native._build_dir()
    monkeypatch.setenv("PERFXLM_NATIVE_OPT", "-O3")
    assert native._build_dir() == default
    monkeypatch.setenv("PERFXLM_NATIVE_OPT", "-O1")
    assert native._build_dir() != default
    monkeypatch.setenv("PERFXLM_NATIVE_OPT", "-Ofast")
    with pytest.raises(ValueError, match="PERFXLM_NATIVE_OPT='-Ofast'"):
        native._build_dir()
