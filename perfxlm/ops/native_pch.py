"""A precompiled header of the torch headers the native kernels include, shared by their sources.

Each source of the extension includes ATen, and parsing those headers is most of a build's time (about
70 % at -O1): compiled once into a .gch beside a one-line-per-include header in the build folder, every
source starts from it via `-include` instead. Only torch's headers go in (the project's own headers
change with the kernels and stay ordinary includes), found by reading the sources' `#include <ATen/..>`,
`<c10/..>` and `<torch/..>` lines, so a new source's torch headers join without a list to keep.

A PCH is only valid for the flags it was compiled with, so it is compiled with exactly the compiler and
flags of the extension's own build (read from the ninja file torch's builder writes for them) into the
build folder, which is keyed by those flags. Nothing depends on it being used: `-include` names the plain
header, whose text is those same includes, and the compiler reads the text wherever the .gch is missing,
failed to build or does not match (-Winvalid-pch says which, in a verbose build). So the flags added to
a build are the same whether the .gch exists or not, and torch's builder never sees a changed command.

PERFXLM_NATIVE_PCH=0 builds without it (a separate build folder: native._build_dir keys it).

Measured, cold builds, CPU time (user+sys of the whole build, the .gch's compile included), on a loaded
2-core Zen 4: the avx2 tier at -O1 210 s without, 131 s with; the CPU's own tier (avx512_bf16) at -O3
306 s without, 234 s with (more of an -O3 build is code generation, which the PCH does not share).
"""

from __future__ import annotations

import logging
import os
import re
import shlex
import subprocess
from pathlib import Path

logger = logging.getLogger(__name__)

HEADER = "torch_headers.h"
_TORCH_INCLUDE = re.compile(r"^\s*#\s*include\s*<((?:ATen|c10|torch)/[^>]+)>", re.MULTILINE)


def enabled() -> bool:
    return os.environ.get("PERFXLM_NATIVE_PCH", "1") not in ("0", "false", "no")


def torch_includes(sources: list[Path]) -> list[str]:
    """The torch headers that the sources and the headers beside them include, sorted (so the header's
    text, and the .gch's validity, depend only on which headers, not on the order files were read)."""
    names: set[str] = set()
    folders = {p.parent for p in sources}
    for path in [*sources, *(h for d in sorted(folders) for h in sorted(d.glob("*.h")))]:
        names.update(_TORCH_INCLUDE.findall(path.read_text(errors="replace")))
    return sorted(names)


def flags(build_dir: Path, name: str, sources: list[Path], cflags: list[str], build: bool) -> list[str]:
    """The flags that start each source from the precompiled torch headers ([] when disabled or when no
    source includes a torch header). Writes the header; with `build`, also compiles its .gch when it is
    missing (a failure there is logged and the build goes on without it)."""
    if not enabled():
        return []
    includes = torch_includes(sources)
    if not includes:
        return []
    header = build_dir / HEADER
    text = "".join(f"#include <{h}>\n" for h in includes)
    if not header.exists() or header.read_text() != text:
        header.write_text(text)
        Path(str(header) + ".gch").unlink(missing_ok=True)  # compiled from other text
    if build and not Path(str(header) + ".gch").exists():
        try:
            _compile(build_dir, name, sources, cflags, header)
        except Exception as exc:  # an old torch's builder, a compiler without PCH support...: no PCH
            logger.info("perfxlm: no precompiled torch headers (%s); each source parses them.", exc)
    return ["-include", str(header), "-Winvalid-pch"]


def compile_command(build_dir: Path, name: str, sources: list[Path], cflags: list[str]) -> list[str]:
    """The compiler and flags torch's builder uses for the extension's sources (everything before the
    source file in its compile rule), read from the ninja file it writes for these arguments."""
    from torch.utils import cpp_extension

    probe = build_dir / "pch_probe.ninja"
    cpp_extension._write_ninja_file_to_build_library(
        path=str(probe), name=name, sources=[str(p) for p in sources], extra_cflags=cflags,
        extra_cuda_cflags=[], extra_sycl_cflags=[], extra_ldflags=[], extra_include_paths=[],
        with_cuda=False, with_sycl=False, is_standalone=False,
    )  # fmt: skip
    variables = {}
    for line in probe.read_text().splitlines():
        key, sep, value = line.partition(" = ")
        if sep and not line.startswith(" "):
            variables[key.strip()] = value
    probe.unlink()
    unescape = lambda v: v.replace("$ ", " ").replace("$:", ":").replace("$$", "$")  # noqa: E731
    return [*shlex.split(unescape(variables["cxx"])), *shlex.split(unescape(variables["cflags"])),
            *shlex.split(unescape(variables.get("post_cflags", "")))]  # fmt: skip


def _compile(build_dir: Path, name: str, sources: list[Path], cflags: list[str], header: Path) -> None:
    command = compile_command(build_dir, name, sources, cflags)
    out = Path(str(header) + ".gch")
    partial = out.with_suffix(f".gch.{os.getpid()}")  # renamed when whole: a killed build leaves no bad .gch
    run = subprocess.run([*command, "-x", "c++-header", str(header), "-o", str(partial)],
                         capture_output=True, text=True)  # fmt: skip
    if run.returncode != 0:
        partial.unlink(missing_ok=True)
        raise RuntimeError(f"compiling {header.name} failed: {run.stderr.strip()[-500:]}")
    partial.replace(out)
