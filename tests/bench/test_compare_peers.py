"""benchmarks/compare_llamacpp.py --peer NAME=PATH: argument checks, the peer tools' output parsers on
captured outputs, the tier check, and one round end to end with a fake peer build standing in for the
binaries (no real build needed)."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
OUTPUTS = Path(__file__).resolve().parent / "peer_outputs"
sys.path.insert(0, str(BENCH))
import isa_tiers  # noqa: E402
import peer_tools  # noqa: E402


def fake_build(folder: Path, in_bin: bool = True) -> Path:
    """A build folder whose llama-bench and llama-batched-bench are the fake tools script."""
    tools_dir = folder / "bin" if in_bin else folder
    tools_dir.mkdir(parents=True, exist_ok=True)
    source = (OUTPUTS / "fake_llama_tools.py").read_text()
    for tool in peer_tools.TOOLS:
        exe = tools_dir / tool
        exe.write_text(f"#!{sys.executable}\n{source}")
        exe.chmod(exe.stat().st_mode | stat.S_IXUSR)
    return folder


def calls(folder: Path) -> list[list[str]]:
    log = folder / "bin" / "calls.log"
    return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []


# ---- arguments ---------------------------------------------------------------------------------------

def test_peer_arg_is_name_equals_path(tmp_path):
    assert peer_tools.parse_peer_arg(f"ik_llama.cpp={tmp_path}", set()) == ("ik_llama.cpp", tmp_path)
    name, path = peer_tools.parse_peer_arg("x=~/builds/b7", set())
    assert name == "x" and "~" not in str(path) and path.name == "b7"


@pytest.mark.parametrize("bad, match", [("ik_llama.cpp", "expected NAME=PATH"), ("=/tmp/b", "NAME=PATH"),
                                        ("ik=", "NAME=PATH"), ("llama.cpp=/tmp/b", "already used")])
def test_bad_peer_args_say_what_to_write(bad, match):
    with pytest.raises(SystemExit, match=match):
        peer_tools.parse_peer_arg(bad, {"perfxlm", "llama.cpp"})


def test_tools_are_found_in_the_folder_or_its_bin(tmp_path):
    flat, nested = fake_build(tmp_path / "flat", in_bin=False), fake_build(tmp_path / "nested")
    assert peer_tools.find_tools("a", flat)["llama-bench"] == flat / "llama-bench"
    assert peer_tools.find_tools("a", nested)["llama-batched-bench"] == nested / "bin" / "llama-batched-bench"


def test_a_missing_binary_names_the_folder(tmp_path):
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "llama-bench").write_text("")
    with pytest.raises(SystemExit, match=r"no llama-batched-bench in .*--target llama-bench llama-batched"):
        peer_tools.find_tools("ik", tmp_path)


# ---- captured outputs --------------------------------------------------------------------------------

def test_llama_bench_json_gives_the_prompt_test():
    text = (OUTPUTS / "llama_bench_prefill.json").read_text()
    test = peer_tools.parse_llama_bench_json("warning: a log line on stdout\n" + text + "\n", 512)
    assert test["avg_ns"] == 417642000 and test["build_commit"] == "8337e4cd"
    with pytest.raises(ValueError, match="n_prompt=511"):
        peer_tools.parse_llama_bench_json(text, 511)
    with pytest.raises(ValueError, match="no JSON list"):
        peer_tools.parse_llama_bench_json("error: failed to load model", 512)


def test_batched_bench_table_rows_by_header():
    decode = peer_tools.batched_bench_row((OUTPUTS / "batched_bench_decode.txt").read_text(), 512, 128, 1)
    assert decode["T_TG s"] == pytest.approx(0.688) and decode["S_TG t/s"] == pytest.approx(186.05)
    text = (OUTPUTS / "batched_bench_parallel.txt").read_text()
    rows = peer_tools.parse_batched_bench_table(text)
    assert [(r["B"], r["T s"]) for r in rows] == [(16, 10.179), (64, 29.344)]
    assert peer_tools.batched_bench_row(text, 128, 128, 64)["N_KV"] == 16384
    with pytest.raises(ValueError, match="PP=128 TG=128 B=17"):
        peer_tools.batched_bench_row(text, 128, 128, 17)
    with pytest.raises(ValueError, match="no PP"):
        peer_tools.parse_batched_bench_table("main: error: unable to load model\n")


# ---- the tier a peer was built for -------------------------------------------------------------------

def _cmake_cache(folder: Path, **options: str) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    lines = ["# This is the CMakeCache file.", "CMAKE_BUILD_TYPE:STRING=Release"]
    lines += [f"{k}:BOOL={v}" for k, v in options.items()]
    (folder / "CMakeCache.txt").write_text("\n".join(lines) + "\n")


def test_tier_check_reads_the_build_options(tmp_path):
    avx2 = isa_tiers.TIERS["avx2"][3]
    _cmake_cache(tmp_path / "native", GGML_NATIVE="ON")
    options = peer_tools.build_options(tmp_path / "native" / "bin")  # found one folder up from bin/
    assert options == {"GGML_NATIVE": "ON"}
    assert any(m.startswith("GGML_NATIVE=ON") for m in peer_tools.tier_mismatches(options, avx2))
    # ik_llama.cpp spells AVX-VNNI GGML_AVXVNNI; an option the build lacks counts as off.
    built = dict(GGML_NATIVE="OFF", GGML_AVX="ON", GGML_AVX2="ON", GGML_FMA="ON", GGML_F16C="ON",
                 GGML_BMI2="ON", GGML_AVX512="OFF", GGML_AVXVNNI="OFF")
    assert peer_tools.tier_mismatches(built, avx2) == []
    assert peer_tools.tier_mismatches({**built, "GGML_AVXVNNI": "ON"}, avx2) == [
        "GGML_AVX_VNNI=ON (the tier needs OFF)"]
    avx512 = isa_tiers.TIERS["avx512"][3]
    assert "GGML_AVX512=OFF (the tier needs ON)" in peer_tools.tier_mismatches(built, avx512)
    assert "options are unknown" in peer_tools.tier_mismatches({}, avx2)[0]
    # AVX-512 without BF16: a build with BF16 on is another tier
    vnni = isa_tiers.TIERS["avx512_vnni"][3]
    on512 = {**built, "GGML_AVX512": "ON", "GGML_AVX512_VNNI": "ON", "GGML_AVX512_BF16": "OFF"}
    assert peer_tools.tier_mismatches(on512, vnni) == []
    assert peer_tools.tier_mismatches({**on512, "GGML_AVX512_BF16": "ON"}, vnni) == [
        "GGML_AVX512_BF16=ON (the tier needs OFF)"]


# ---- running a peer ----------------------------------------------------------------------------------

def test_peer_columns_commands_and_times(tmp_path):
    folder = fake_build(tmp_path / "build")
    plain, rtr = peer_tools.peer_engines("ik", folder, "/m.gguf", 3, "both")
    assert (plain.name, rtr.name) == ("ik", "ik -rtr")
    cmd = rtr.commands("decode", (1, 515, 130))
    assert cmd[cmd.index("-ntg") + 1] == "129" and cmd[cmd.index("-c") + 1] == "768" and cmd[-1] == "-rtr"
    assert cmd[cmd.index("-t") + 1] == cmd[cmd.index("-tb") + 1] == "3"
    assert cmd[cmd.index("-m") + 1] == "/m.gguf"
    assert rtr.commands("prefill", (1, 33, 1))[-2:] == ["-rtr", "1"]

    t = plain.measure("prefill", (1, 33, 1))
    assert t["total"] == pytest.approx(0.033) and plain.build_commit == "fake0001"
    assert rtr.measure("decode", (1, 9, 4))["decode"] == pytest.approx(0.3)  # 3 steps of 0.2 s, halved
    t = plain.measure("p5", (5, 7, 3))
    assert t["total"] == pytest.approx(0.35 + 0.6)
    assert [c[0] for c in calls(folder)][-3:] == ["llama-bench", "llama-batched-bench", "llama-batched-bench"]


def test_repack_choice(tmp_path, monkeypatch):
    folder = fake_build(tmp_path / "build")
    assert [e.repack for e in peer_tools.peer_engines("ik", folder, "m", 2, "on")] == [True]
    assert [e.repack for e in peer_tools.peer_engines("ik", folder, "m", 2, "off")] == [False]
    monkeypatch.setenv("FAKE_PEER_NO_RTR", "1")  # a mainline build: no -rtr
    assert [e.repack for e in peer_tools.peer_engines("ll", folder, "m", 2, "both")] == [False]
    with pytest.raises(SystemExit, match="has no --run-time-repack"):
        peer_tools.peer_engines("ll", folder, "m", 2, "on")


def test_a_failing_or_unreadable_tool_names_the_command(tmp_path, monkeypatch):
    (engine,) = peer_tools.peer_engines("ik", fake_build(tmp_path / "build"), "/m.gguf", 2, "off")
    monkeypatch.setenv("FAKE_PEER_FAIL", "1")
    with pytest.raises(peer_tools.PeerError, match=r"batched-bench -m /m.gguf .* exited with 1:\n.*load"):
        engine.measure("decode", (1, 9, 4))
    monkeypatch.delenv("FAKE_PEER_FAIL")
    monkeypatch.setenv("FAKE_PEER_GARBLE", "1")
    with pytest.raises(peer_tools.PeerError, match=r"could not read the output of `.*llama-bench .*-o json`"):
        engine.measure("prefill", (1, 9, 1))


# ---- the script --------------------------------------------------------------------------------------

def _script_env() -> dict:
    root = str(BENCH.parent)
    return dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p))


def test_a_forced_tier_refuses_a_native_peer(tmp_path):
    pytest.importorskip("llama_cpp")
    sys.path.insert(0, str(BENCH))
    import compare_llamacpp

    folder = fake_build(tmp_path / "build")
    _cmake_cache(folder, GGML_NATIVE="ON")
    with pytest.raises(SystemExit, match=r"not built for the avx2 tier .*GGML_NATIVE=ON.*-DGGML_AVX512=OFF"):
        compare_llamacpp.check_peer_tier("ik", folder, "avx2")
    assert compare_llamacpp.check_peer_tier("ik", folder, "native") == {"GGML_NATIVE": "ON"}
    with pytest.raises(SystemExit, match="already used"):
        compare_llamacpp.parse_peers([f"ik={folder}", f"ik={folder}"])


def test_one_round_end_to_end_with_a_fake_peer(tmp_path, default_model):
    pytest.importorskip("llama_cpp")
    folder = fake_build(tmp_path / "build")
    out = tmp_path / "cmp.json"
    done = subprocess.run(
        [sys.executable, str(BENCH / "compare_llamacpp.py"), "--peer", f"fake={folder}",
         "--rows", "prefill,decode,p3", "--prompt-tokens", "13", "--decode-tokens", "3",
         "--parallel-prompt", "5", "--parallel-new", "2", "--rounds", "1", "--threads", "1",
         "--output-json", str(out)],
        capture_output=True, text=True, env=_script_env(), timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    for row in ("prefill", "decode", "p3"):
        s = result["summary"][row]
        peer = s["peers"]["fake"]
        assert peer["best"] == "fake -rtr" and peer["repack"] is True  # the fake is twice as fast with -rtr
        assert s["fake -rtr"]["median"] == pytest.approx(2 * s["fake"]["median"], rel=0.02)
        assert peer["ratio"] == pytest.approx(s["perfxlm"]["median"] / s["fake -rtr"]["median"])
    assert result["summary"]["decode"]["fake"]["median"] == pytest.approx(5, rel=0.02)  # 3 steps / 0.6 s
    assert result["config"]["peers"]["fake"]["columns"] == ["fake", "fake -rtr"]
    assert result["config"]["peers"]["fake"]["build_commit"] == "fake0001"
    assert "| fake (best) | perfxlm / fake |" in done.stdout and " rtr | **" in done.stdout
    assert out.with_suffix(".png").stat().st_size > 0
    # Every peer call used llama.cpp's file and the same thread count.
    runs = [c for c in calls(folder) if "--help" not in c]
    assert len(runs) == 6 and all(c[c.index("-t") + 1] == "1" for c in runs)
    assert {c[c.index("-m") + 1] for c in runs} == {result["config"]["llamacpp"]["gguf"]}


def test_outputs_captured_from_an_ik_llama_cpp_build():
    """The same parsers on what ik_llama.cpp's tools printed (default model, tiny sizes), logs included."""
    test = peer_tools.parse_llama_bench_json((OUTPUTS / "ik_llama_bench_p32.json").read_text(), 32)
    assert test["avg_ns"] == 84423760
    text = (OUTPUTS / "ik_batched_bench_npl_1_3.txt").read_text()
    assert peer_tools.batched_bench_row(text, 32, 4, 1)["T_TG s"] == pytest.approx(0.114)
    assert peer_tools.batched_bench_row(text, 32, 4, 3)["T s"] == pytest.approx(0.342)


# ---- benchmarks/spec_decode.py --peer: a build's llama-spec-bench ---------------------------------------

def test_spec_bench_summary_rows_captured_from_an_ik_llama_cpp_build():
    draft = peer_tools.parse_spec_bench_jsonl((OUTPUTS / "spec_bench_draft.jsonl").read_text())
    plain = peer_tools.parse_spec_bench_jsonl((OUTPUTS / "spec_bench_plain.jsonl").read_text())
    assert draft["generated"] > 0 and draft["decode_tps"] > 0 and 0 < draft["acceptance_rate"] <= 1
    assert plain["acceptance_rate"] == 0.0 and plain["decode_tps"] > 0


@pytest.mark.parametrize("text, match", [("", "no summary row"), ('{"row_type": "attempt"}\n', "no summary row"),
                                         ('{"row_type": "summary", "successes": 0}\n', "no run succeeded")])
def test_spec_bench_output_without_a_result_is_an_error(text, match):
    with pytest.raises(ValueError, match=match):
        peer_tools.parse_spec_bench_jsonl(text)


def test_spec_type_follows_the_speculative_config():
    assert peer_tools.default_spec_type({"model": "d.gguf", "num_speculative_tokens": 4}) == "draft:n_max=4,p_min=0.0"
    assert (peer_tools.default_spec_type({"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_min": 2})
            == "ngram_simple:ngram_size_n=2,ngram_size_m=5")
    with pytest.raises(SystemExit, match="--peer-spec-type"):
        peer_tools.default_spec_type({"method": "mtp"})


def test_spec_bench_peer_runs_plain_then_speculative(tmp_path):
    """A fake llama-spec-bench that echoes its arguments into the summary: the speculative run gets the
    stage and the draft file, the plain one neither, both the same prompt file and token budget."""
    tools = tmp_path / "bin"
    tools.mkdir()
    exe = tools / peer_tools.SPEC_BENCH
    exe.write_text(f"#!{sys.executable}\n" + '''import json, sys
args = sys.argv[1:]
prompt = json.loads(open(args[args.index("--prompts") + 1]).readline())
spec = "--spec-type" in args
print(json.dumps({"row_type": "summary", "successes": 1, "generated": prompt["max_tokens"],
                  "decode_tps": 200.0 if spec else 100.0, "speculative": {"acceptance_rate": 0.5 if spec else 0.0},
                  "argv": args}))
''')
    exe.chmod(exe.stat().st_mode | stat.S_IEXEC)
    with pytest.raises(SystemExit, match="llama-spec-bench"):
        peer_tools.SpecBenchPeer.find("ik", tmp_path / "elsewhere", "t.gguf", 2, {"model": "d.gguf"}, None)
    peer = peer_tools.SpecBenchPeer.find("ik", tmp_path, "t.gguf", 2, {"model": "d.gguf", "num_speculative_tokens": 3},
                                         None)
    out = peer.run("Say hi.", 17)
    assert out["plain"] == {"generated": 17, "decode_tps": 100.0, "acceptance_rate": 0.0}
    assert out["spec"] == {"generated": 17, "decode_tps": 200.0, "acceptance_rate": 0.5}
    plain_cmd, spec_cmd = (peer.commands(Path("p.jsonl"), s) for s in (False, True))
    assert "--spec-type" not in plain_cmd and "-md" not in plain_cmd
    assert spec_cmd[-4:] == ["--spec-type", "draft:n_max=3,p_min=0.0", "-md", "d.gguf"]
