"""Run a benchmark with both engines built for one instruction-set tier (benchmarks/compare_llamacpp.py
--isa): a fair proxy, on a machine of a higher tier, for a CPU of that tier.

Forcing a tier means all of it: perfxlm's kernels and CPU plan (PERFXLM_ISA), torch's own kernels
(ATEN_CPU_CAPABILITY, ONEDNN_MAX_CPU_ISA; read when torch starts, hence a fresh process) and a
llama.cpp built for that tier only (llama-cpp-python compiled with the tier's GGML options, installed
into its own folder under ~/.cache/perfxlm/compare/, so builds for several tiers sit side by side with
the native one in site-packages). Imports nothing heavy: it runs before torch is imported.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

CACHE_DIR = Path.home() / ".cache" / "perfxlm" / "compare"
CHILD = "PERFXLM_COMPARE_TIER_CHILD"

_GGML_BASE = "-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON"
TIERS = {
    # name: (PERFXLM_ISA, ATEN_CPU_CAPABILITY, ONEDNN_MAX_CPU_ISA, llama.cpp CMAKE_ARGS)
    "avx2": ("avx2", "avx2", "AVX2",
             f"{_GGML_BASE} -DGGML_AVX512=OFF -DGGML_AVX512_VNNI=OFF -DGGML_AVX512_BF16=OFF -DGGML_AVX_VNNI=OFF "
             "-DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF"),
    # AVX-512 with VNNI, no BF16 and no AMX: Intel Cascade Lake / Ice Lake servers' tier
    "avx512_vnni": ("avx512_vnni", "avx512", "AVX512_CORE_VNNI",
                    f"{_GGML_BASE} -DGGML_AVX512=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=OFF -DGGML_AVX_VNNI=OFF "
                    "-DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF"),
    # AVX-512 with VNNI and BF16, no AMX: AMD Zen 4's tier
    "avx512": ("avx512_bf16", "avx512", "AVX512_CORE_BF16",
               f"{_GGML_BASE} -DGGML_AVX512=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON -DGGML_AVX_VNNI=OFF "
               "-DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF"),
}


# MKL_ENABLE_INSTRUCTIONS per tier
_MKL = {"avx2": "AVX2", "avx512_vnni": "AVX512", "avx512": "AVX512"}


def requested(argv: list[str]) -> str:
    """--isa's value in argv (native when absent), read before argparse so torch is not imported yet."""
    for i, arg in enumerate(argv):
        if arg == "--isa" and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith("--isa="):
            return arg.split("=", 1)[1]
    return "native"


def llama_cpp_folder(tier: str) -> Path:
    """llama-cpp-python built for the tier, in its own folder (built on first use: ~10 minutes)."""
    import importlib.metadata

    folder = CACHE_DIR / f"llama-cpp-python-{tier}"
    marker = folder / "CMAKE_ARGS"  # what the folder was built with: a build for other options is redone
    if (folder / "llama_cpp").is_dir() and marker.is_file() and marker.read_text() == TIERS[tier][3]:
        return folder
    try:
        version = importlib.metadata.version("llama-cpp-python")
        spec = f"llama-cpp-python=={version}"
    except importlib.metadata.PackageNotFoundError:
        spec = "llama-cpp-python"
    print(f"building {spec} for the {tier} tier into {folder} (once; about 10 minutes on 2 cores)...",
          flush=True)
    env = dict(os.environ, CMAKE_ARGS=TIERS[tier][3], FORCE_CMAKE="1")
    tmp = folder.with_suffix(".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    # --no-cache-dir: pip's wheel cache is keyed by version, not CMAKE_ARGS, and would hand back the
    # native build (AVX-512 code in an "AVX2" folder) without compiling anything
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-binary", "llama-cpp-python",
                    "--no-cache-dir", "--target", str(tmp), spec], env=env, check=True)
    (tmp / "CMAKE_ARGS").write_text(TIERS[tier][3])
    shutil.rmtree(folder, ignore_errors=True)
    tmp.rename(folder)
    return folder


def reexec_for_tier(argv: list[str]) -> str:
    """For --isa avx2 | avx512_vnni | avx512: re-run this script in a process set up for the tier (returns only in
    that process, or for native). Returns the tier this process runs."""
    tier = requested(argv)
    if tier == "native" or os.environ.get(CHILD) == tier:
        return tier
    if tier not in TIERS:
        raise SystemExit(f"--isa {tier}: expected native, {', '.join(TIERS)}")
    perfxlm_isa, aten, onednn, _ = TIERS[tier]
    folder = llama_cpp_folder(tier)
    # MKL (torch's float32 GEMM on x86) picks its own code path: without this a forced AVX2 tier's
    # prefill would still run AVX-512 GEMMs
    env = dict(os.environ, PERFXLM_ISA=perfxlm_isa, ATEN_CPU_CAPABILITY=aten, ONEDNN_MAX_CPU_ISA=onednn,
               MKL_ENABLE_INSTRUCTIONS=_MKL[tier])
    env[CHILD] = tier
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(folder), env.get("PYTHONPATH", "")) if p)
    env.pop("PERFXLM_NATIVE_MARCH", None)
    os.execve(sys.executable, [sys.executable, *argv], env)
    raise AssertionError("unreachable")


def describe(tier: str) -> str:
    if tier == "native":
        return "native (both engines built for this CPU)"
    perfxlm_isa, aten, onednn, cmake = TIERS[tier]
    return (f"{tier}, forced: perfxlm PERFXLM_ISA={perfxlm_isa}, torch ATEN_CPU_CAPABILITY={aten} "
            f"ONEDNN_MAX_CPU_ISA={onednn} MKL_ENABLE_INSTRUCTIONS={_MKL[tier]}; llama.cpp CMAKE_ARGS=\"{cmake}\"")
