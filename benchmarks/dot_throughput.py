"""The CPU's throughput of the dot-product instructions the decode kernels are built on, per instruction:
what an extra verification row of speculative decoding can cost at best (the bound the kernels' per-row
figures are compared with in the README's CPU sections).

    python benchmarks/dot_throughput.py            # every instruction this CPU has
    python benchmarks/dot_throughput.py --iters 50000000

Each kernel runs 12 independent accumulator chains (more than any latency needs), so the time per
step is its reciprocal throughput (a step is one instruction, or the three of AVX2's int8 dot, which
has no single instruction for it). On a shared machine, run it while nothing else does. It is compiled here with the system's C compiler for this
CPU (-march=native); instructions the CPU lacks are skipped. One thread; the clock is the wall clock.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile


def _vec(width: int, kind: str) -> tuple[str, str]:
    """(the intrinsics' prefix, the register type) of a width and element kind ("ps" float, "i" integer)."""
    prefix = "_mm512" if width == 512 else "_mm256"
    return prefix, f"__m{width}" + ("i" if kind == "i" else "")


def _vnni(width: int) -> tuple[str, str, str, str, str]:
    p, reg = _vec(width, "i")
    return ("__AVX512VNNI__", reg, f"{p}_set1_epi32(i)", f"{p}_dpbusd_epi32(a[i], x, y)",
            f"{reg} x = {p}_set1_epi8(3), y = {p}_set1_epi8(5);")


def _fma(width: int) -> tuple[str, str, str, str, str]:
    p, reg = _vec(width, "ps")
    return ("__AVX512F__" if width == 512 else "__FMA__", reg, f"{p}_set1_ps(i)", f"{p}_fmadd_ps(a[i], x, y)",
            f"{reg} x = {p}_set1_ps(1.0001f), y = {p}_set1_ps(0.999f);")


# name -> (compiler feature guard, C type of the accumulators, their initialiser, the step, operands)
KERNELS = {
    "vdpbf16ps zmm (AVX512-BF16)": ("__AVX512BF16__", "__m512", "_mm512_set1_ps(i)",
                                    "_mm512_dpbf16_ps(a[i], (__m512bh)x, (__m512bh)y)",
                                    "__m512i x = _mm512_set1_epi16(0x3f80), y = _mm512_set1_epi16(0x3f00);"),
    "vpdpbusd zmm (AVX512-VNNI)": _vnni(512),
    "vpdpbusd ymm (AVX512-VNNI/VL)": _vnni(256),
    # the chain's own value as the signed bytes: with constant operands the product would be one per iteration
    "vpmaddubsw+vpmaddwd+vpaddd ymm (AVX2 int8 dot)": (
        "__AVX2__", "__m256i", "_mm256_set1_epi32(i)",
        "_mm256_add_epi32(a[i], _mm256_madd_epi16(_mm256_maddubs_epi16(x, a[i]), ones))",
        "__m256i x = _mm256_set1_epi8(3), ones = _mm256_set1_epi16(1);"),
    "vfmadd231ps zmm (AVX-512F)": _fma(512),
    "vfmadd231ps ymm (FMA)": _fma(256),
}

_SOURCE_HEAD = """#include <immintrin.h>
#include <stdio.h>
#include <string.h>
#include <time.h>
static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + t.tv_nsec * 1e-9; }
"""

_KERNEL = """
#ifdef {guard}
static void run_{n}(long iters) {{
  {operands}
  {ctype} a[12];
  for (int i = 0; i < 12; i++) a[i] = {init};
  double t = now();
  for (long it = 0; it < iters; it++) {{
#pragma GCC unroll 12
    for (int i = 0; i < 12; i++) a[i] = {step};
    __asm__ volatile("" : "+v"(x));  /* the operands stay live: no hoisting out of the loop */
  }}
  double dt = now() - t;
  unsigned char sink = 0;
  for (int i = 0; i < 12; i++) {{ unsigned char b[sizeof(a[0])]; memcpy(b, &a[i], sizeof b); sink ^= b[0]; }}
  printf("%s\\t%.4f\\t%d\\n", "{name}", dt / (iters * 12.0) * 1e9, sink);  /* printed: the sums stay live */
}}
#endif
"""


def source(iters: int) -> str:
    parts = [_SOURCE_HEAD]
    calls = []
    for n, (name, (guard, ctype, init, step, operands)) in enumerate(KERNELS.items()):
        parts.append(_KERNEL.format(guard=guard, n=n, operands=operands, ctype=ctype, init=init, step=step, name=name))
        calls.append(f"#ifdef {guard}\n  run_{n}({iters}L);\n#endif")
    parts.append("int main(void) {\n" + "\n".join(calls) + "\n  return 0;\n}\n")
    return "".join(parts)


def measure(iters: int) -> dict[str, float]:
    """Nanoseconds per step of every kernel this CPU has, by KERNELS' name (compiled here, one thread)."""
    cc = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc") or shutil.which("clang")
    if cc is None:
        raise SystemExit("no C compiler found (set CC)")
    with tempfile.TemporaryDirectory() as tmp:
        src, exe = os.path.join(tmp, "dots.c"), os.path.join(tmp, "dots")
        with open(src, "w") as f:
            f.write(source(iters))
        subprocess.run([cc, "-O2", "-march=native", src, "-o", exe], check=True)
        out = subprocess.run([exe], check=True, capture_output=True, text=True).stdout
    return {name: float(ns) for name, ns, _ in (line.split("\t") for line in out.strip().splitlines())}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--iters", type=int, default=100_000_000, help="loop iterations (12 instructions each)")
    args = ap.parse_args()
    print("| step (one instruction; AVX2's int8 dot is three) | ns per step | steps per ns |")
    print("|---|---:|---:|")
    for name, ns in measure(args.iters).items():
        print(f"| {name} | {ns:.3f} | {1 / ns:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
