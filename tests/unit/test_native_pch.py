"""The precompiled torch headers of the native build (perfxlm.ops.native_pch): only torch's headers go in,
the flags a build gets do not depend on whether the .gch could be made, a compiler that cannot make one
leaves the build as it was, and the .gch of this session's build is one the compiler actually uses.
(That an extension built with and without it passes the same kernel tests: test_portable_kernels builds
one lower tier without it.)"""

import os
import subprocess
import sys

import pytest

from perfxlm.ops import native, native_pch


def _sources(tmp_path, texts: dict[str, str]):
    for name, text in texts.items():
        (tmp_path / name).write_text(text)
    return [tmp_path / n for n in texts if n.endswith(".cpp")]


def test_only_torch_headers_go_in_sorted_from_sources_and_headers_beside_them(tmp_path):
    sources = _sources(tmp_path, {
        "b.cpp": '#include <torch/library.h>\n#include "own.h"\n#include <vector>\n'
                 "  # include <ATen/Parallel.h>\n",
        "a.cpp": "#include <c10/util/Half.h>\n#include <immintrin.h>\n",
        "own.h": "#pragma once\n#include <ATen/ATen.h>\n#include <cstdint>\n",
    })  # fmt: skip
    assert native_pch.torch_includes(sources) == ["ATen/ATen.h", "ATen/Parallel.h", "c10/util/Half.h",
                                                  "torch/library.h"]  # fmt: skip


def test_the_same_flags_with_or_without_the_gch_and_a_broken_compiler_leaves_none(tmp_path, monkeypatch):
    # torch's builder rebuilds every object whose command changed, so a folder built once must get the same
    # flags when it is only loaded; a compiler that cannot make the .gch just leaves the sources to read
    # the plain header (the same includes)
    sources = _sources(tmp_path, {"k.cpp": "#include <ATen/ATen.h>\n"})
    build = tmp_path / "build"
    build.mkdir()
    monkeypatch.setenv("CXX", "false")
    monkeypatch.delenv("PERFXLM_NATIVE_PCH", raising=False)
    made = native_pch.flags(build, "k", sources, ["-O1"], build=True)
    assert made == ["-include", str(build / native_pch.HEADER), "-Winvalid-pch"]
    assert native_pch.flags(build, "k", sources, ["-O1"], build=False) == made
    assert (build / native_pch.HEADER).read_text() == "#include <ATen/ATen.h>\n"
    assert sorted(p.name for p in build.iterdir()) == [native_pch.HEADER]  # no .gch, no partial one
    monkeypatch.setenv("PERFXLM_NATIVE_PCH", "0")
    assert native_pch.flags(build, "k", sources, ["-O1"], build=True) == []


def test_with_and_without_it_build_in_separate_folders(tmp_path, monkeypatch):
    monkeypatch.setenv("PERFXLM_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("PERFXLM_NATIVE_PCH", raising=False)
    with_pch = native._build_dir()
    monkeypatch.setenv("PERFXLM_NATIVE_PCH", "0")
    assert native._build_dir() != with_pch


def test_a_missing_compiler_still_falls_back_to_torch_ops(tmp_path):
    env = dict(os.environ, CXX="/nonexistent/c++", PERFXLM_CACHE_DIR=str(tmp_path))
    env.pop("PERFXLM_NATIVE_PCH", None)
    run = subprocess.run([sys.executable, "-c", "from perfxlm.ops import native; print(native.kernels())"],
                         env=env, capture_output=True, text=True, timeout=300)  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.split()[-1] == "None"
    assert "native CPU kernels unavailable" in run.stderr


def test_this_sessions_build_made_a_gch_the_compiler_uses(tmp_path):
    if native.kernels() is None:
        pytest.skip("no compiler for the native kernels on this machine")
    if not native_pch.enabled():
        pytest.skip("PERFXLM_NATIVE_PCH=0")
    build = native._build_dir()
    header = build / native_pch.HEADER
    assert (build / (native_pch.HEADER + ".gch")).exists()
    cflags = [native._opt(), *native._march(), "-fopenmp", "-ffp-contract=off"]
    command = native_pch.compile_command(tmp_path, native._NAME, native._SOURCES, cflags)
    (tmp_path / "u.cpp").write_text("int used() { return at::get_num_threads(); }\n")
    # an unusable .gch makes the compiler read the header's text with a warning: here, an error
    run = subprocess.run(
        [*command, "-include", str(header), "-Werror=invalid-pch", "-fsyntax-only", str(tmp_path / "u.cpp")],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:]
