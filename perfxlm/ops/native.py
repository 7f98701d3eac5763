"""The native CPU kernels (perfxlm/csrc/*.cpp), compiled once per machine at first use.

Built with torch's extension tools into a per-user cache keyed by the source, the torch version, the
CPU's flags and the instruction-set tier built for (perfxlm.ops.isa: -march=native, or a forced tier's
flags), then loaded as `torch.ops.perfxlm.*`. Where there is no compiler (or
PERFXLM_NATIVE=0), `kernels()` returns None and every caller takes its plain-torch path: same results,
slower.

PERFXLM_NATIVE_OPT=-O1|-O2 compiles at that optimisation level instead of -O3 (part of the cache key): a
knob for the test suite's builds of the lower tiers, which it compiles only to check their results (the
sources round as torch does at any level: intrinsics, no contraction); the engine's builds stay -O3.

Every source includes torch's headers, and parsing them is most of a build's time, so the torch headers
the sources include are compiled once per build folder into a precompiled header (perfxlm.ops.native_pch)
that each source then starts from. It only changes how the extension is built; where it cannot be made
(or PERFXLM_NATIVE_PCH=0), the sources are compiled as before.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import platform
import threading
import time
from pathlib import Path
from typing import Any

import torch

from perfxlm.ops import native_pch

logger = logging.getLogger(__name__)

_CSRC = Path(__file__).resolve().parent.parent / "csrc"
# One extension: the layer kernels, the KV cache kernels and the quantized-weight products (the fused
# layer calls all three), the quantizers' group search (used at load), and the passes around W8A8's
# integer GEMM (int8_rows.cpp), the int8 GEMM of many rows over block-quantized codes (quant_gemm.cpp),
# multi-head latent attention's decode step (mla_kernels.cpp), products over FP8 e4m3 weight bytes
# (fp8_linear.cpp), many rows against bf16 rows by bf16 dot products (bf16_dots.cpp), and causal
# prefill attention over a prompt's own keys and its cached context (prefill_attention.cpp), and every
# decoder layer of an all-decode step in one call (decode_stack.cpp).
_SOURCES = [_CSRC / "cpu_kernels.cpp", _CSRC / "attention_kernels.cpp", _CSRC / "quant_linear.cpp",
            _CSRC / "quant_search.cpp", _CSRC / "lora_kernels.cpp", _CSRC / "int8_rows.cpp",
            _CSRC / "quant_gemm.cpp", _CSRC / "moe_kernels.cpp", _CSRC / "mla_kernels.cpp",
            _CSRC / "fp8_linear.cpp", _CSRC / "bf16_dots.cpp", _CSRC / "prefill_attention.cpp",
            _CSRC / "decode_stack.cpp"]
_NAME = "perfxlm_cpu_kernels"
_lock = threading.Lock()
_state: dict[str, Any] = {}


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor()


def _march() -> list[str]:
    from perfxlm.ops import isa

    return isa.compile_flags()


_OPT_LEVELS = ("-O1", "-O2", "-O3")


def _opt() -> str:
    value = os.environ.get("PERFXLM_NATIVE_OPT", "").strip() or "-O3"
    if value not in _OPT_LEVELS:
        raise ValueError(f"PERFXLM_NATIVE_OPT={value!r}: expected one of {', '.join(_OPT_LEVELS)}.")
    return value


def _build_dir() -> Path:
    sources = b"".join(f.read_bytes() for f in sorted(_CSRC.glob("*.[ch]*")))  # the sources and their headers
    # The folder is part of the key: torch's builder writes the sources' absolute paths into build.ninja,
    # so two checkouts sharing one build folder would each rebuild everything whenever the other loaded.
    key = hashlib.sha256(
        sources + str(_CSRC.resolve()).encode() + torch.__version__.encode() + _cpu_flags().encode()
        + " ".join(_march()).encode()
        # only a level other than the default joins the key, so the engine's builds keep their folders
        + (b"" if _opt() == "-O3" else _opt().encode())
        # a build with the PCH in a folder of its own: one built before it is not recompiled without the .gch
        + (b"pch" if native_pch.enabled() else b"")
    ).hexdigest()[:16]
    root = Path(os.environ.get("PERFXLM_CACHE_DIR", Path.home() / ".cache" / "perfxlm"))
    path = root / "kernels" / key
    path.mkdir(parents=True, exist_ok=True)
    return path


@contextlib.contextmanager
def _build_guard(build_dir: Path):
    """One build per folder at a time, robust to a builder that was killed.

    torch's builder marks a build in progress with a `lock` file and waits for it to vanish, forever if
    the process that made it died (Ctrl-C during the first start). An flock is released by the kernel
    when its holder exits, so whoever holds it knows a `lock` file left behind is stale and removes it.
    """
    import fcntl

    with open(build_dir / "build.flock", "w") as guard:
        fcntl.flock(guard, fcntl.LOCK_EX)
        try:
            (build_dir / "lock").unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(guard, fcntl.LOCK_UN)


def enabled() -> bool:
    return os.environ.get("PERFXLM_NATIVE", "1") not in ("0", "false", "no")


def kernels() -> Any | None:
    """`torch.ops.perfxlm` with the kernels loaded, or None where they cannot be built."""
    try:
        return _state["ops"]  # hot path: called several times per layer per step
    except KeyError:
        pass
    if not enabled():
        return None
    from perfxlm.ops import isa

    isa.requested()  # a bad PERFXLM_ISA is the user's error to fix, not a reason to fall back quietly
    _opt()  # as a bad PERFXLM_NATIVE_OPT
    from perfxlm.quant import act_blocks  # late: the quant package imports the ops package

    act_blocks.mode()  # as a bad PERFXLM_ACT_BLOCKS
    with _lock:
        if "ops" in _state:
            return _state["ops"]
        _state["ops"] = _load()
        return _state["ops"]


def kernels_for(t: Any) -> Any | None:
    """The kernels where tensor `t` lives in CPU memory, None for a tensor on another device (a GPU's):
    callers then take their torch path, which runs anywhere. Never builds the kernels for such a tensor."""
    return kernels() if t.device.type == "cpu" else None


def _load() -> Any | None:
    try:
        from torch.utils.cpp_extension import load

        build_dir = _build_dir()
        fresh = not any(build_dir.glob("*.so"))
        if fresh:
            # Printed, not logged: a first start spends ~1 minute here and should say why.
            print("perfxlm: compiling CPU kernels (once per machine)...", flush=True)
        t0 = time.perf_counter()
        # -fopenmp: at::parallel_for is inline OpenMP; the runtime resolves to the libgomp.so.1
        # torch has already loaded, so kernels share torch's thread pool.
        # -ffp-contract=off: elementwise kernels round exactly as torch's ops (explicit FMAs stay).
        cflags = [_opt(), *_march(), "-fopenmp", "-ffp-contract=off"]
        with _build_guard(build_dir):
            # the same flags for a fresh folder and a built one (a changed command would rebuild it); the
            # .gch itself is only compiled for a build
            cflags += native_pch.flags(build_dir, _NAME, _SOURCES, cflags, build=fresh)
            load(
                name=_NAME,
                sources=[str(p) for p in _SOURCES],
                extra_cflags=cflags,
                extra_ldflags=["-fopenmp"],
                build_directory=str(build_dir),
                is_python_module=False,
                verbose=False,
            )
        if fresh:
            print(f"perfxlm: CPU kernels ready ({time.perf_counter() - t0:.0f} s)", flush=True)
        from perfxlm.quant import act_blocks  # late: the quant package imports the ops package

        act_blocks.applied_by(torch.ops.perfxlm.set_act_blocks)  # PERFXLM_ACT_BLOCKS, checked before use
        return torch.ops.perfxlm
    except Exception as exc:  # no compiler, no ninja, read-only home...: fall back, say so once
        logger.warning("perfxlm: native CPU kernels unavailable (%s); using plain PyTorch ops.", exc)
        return None
