"""Peer engines built from llama.cpp-family source (ik_llama.cpp, another llama.cpp build), timed with their
own tools for benchmarks/compare_llamacpp.py --peer NAME=PATH.

A peer is a build folder (or its bin/) holding `llama-bench` and `llama-batched-bench`. Each row the
comparison measures maps to the tool that measures the same thing, on the same GGUF and thread count:

    prefill  llama-bench -p P -n 0 -r 1 -o json                      (P / the run's time)
    decode   llama-batched-bench -npp P -ntg N -npl 1                 (N / T_TG)
    pN       llama-batched-bench -npp P -ntg N -npl B                 (B x N / T, prefill included)

The tools make their own prompts (llama-bench random ids, llama-batched-bench token 0): their speed does
not depend on which ids they are. A build whose llama-bench knows `--run-time-repack` (ik_llama.cpp:
weight rows interleaved at load for its faster kernels) is also run with it, as a second column, and the
comparison reports the better of the two. Imports nothing heavy: parsing is tested on captured outputs.
"""

from __future__ import annotations

import json
import re
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

TOOLS = ("llama-bench", "llama-batched-bench")
REPACK_FLAG = "--run-time-repack"
# The same cmake option is spelled differently in some forks; a tier check looks under every spelling.
CMAKE_ALIASES = {"GGML_AVX_VNNI": ("GGML_AVX_VNNI", "GGML_AVXVNNI")}
_CMAKE_TRUE = {"ON", "1", "TRUE", "YES", "Y"}


class PeerError(RuntimeError):
    """A peer's tool is missing, failed, or printed something this module cannot read."""


# ---- what the user passed ----------------------------------------------------------------------------

def parse_peer_arg(item: str, taken: set[str]) -> tuple[str, Path]:
    """--peer NAME=PATH -> (NAME, PATH). Names must be new: they head the table's columns."""
    name, sep, path = item.partition("=")
    name, path = name.strip(), path.strip()
    if not sep or not name or not path:
        raise SystemExit(f"--peer {item!r}: expected NAME=PATH, e.g. ik_llama.cpp=~/.cache/perfxlm/peers/"
                         "ik_llama.cpp/build (a build folder holding llama-bench and llama-batched-bench)")
    if name in taken:
        raise SystemExit(f"--peer {item!r}: the name {name!r} is already used; give each peer its own name")
    return name, Path(path).expanduser()


def find_tools(name: str, folder: Path) -> dict[str, Path]:
    """The peer's binaries, in the folder or its bin/ (cmake puts them in build/bin)."""
    found = {}
    for tool in TOOLS:
        for candidate in (folder / tool, folder / "bin" / tool):
            if candidate.is_file():
                found[tool] = candidate
                break
        else:
            raise SystemExit(f"--peer {name}={folder}: no {tool} in {folder} or {folder / 'bin'}; build it "
                             f"with `cmake --build BUILD --target {' '.join(TOOLS)}`")
    return found


def build_options(tools_dir: Path) -> dict[str, str]:
    """GGML_* options of the build, from the CMakeCache.txt beside (or above) the binaries; {} if none."""
    for folder in (tools_dir, tools_dir.parent):
        cache = folder / "CMakeCache.txt"
        if cache.is_file():
            options = {}
            for line in cache.read_text(errors="replace").splitlines():
                m = re.match(r"(GGML_[A-Z0-9_]+):[A-Z]+=(.*)$", line)
                if m:
                    options[m.group(1)] = m.group(2).strip()
            return options
    return {}


def tier_mismatches(options: dict[str, str], cmake_args: str) -> list[str]:
    """How a build's GGML options differ from a tier's CMAKE_ARGS (benchmarks/isa_tiers.py); [] if none.
    An option the build does not have counts as off: without -march=native only options add ISA flags."""
    if not options:
        return ["no CMakeCache.txt beside the binaries or one folder up: the build's options are unknown"]
    wanted = dict(re.findall(r"-D(GGML_[A-Z0-9_]+)=(\S+)", cmake_args))
    out = []
    for key, value in wanted.items():
        spellings = CMAKE_ALIASES.get(key, (key,))
        have = next((options[k] for k in spellings if k in options), "OFF")
        if (have.upper() in _CMAKE_TRUE) != (value.upper() in _CMAKE_TRUE):
            out.append(f"{key}={have} (the tier needs {value})")
    return out


# ---- the tools' outputs ------------------------------------------------------------------------------

def parse_llama_bench_json(text: str, n_prompt: int, n_gen: int = 0) -> dict:
    """The test with these sizes from `llama-bench -o json` (a JSON list; anything printed around it is
    skipped). Returns the test's fields; avg_ns is its mean time."""
    start, end = text.find("["), text.rfind("]")
    if start < 0 or end < start:
        raise ValueError("no JSON list in llama-bench's output")
    tests = json.loads(text[start:end + 1])
    for test in tests:
        if int(test.get("n_prompt", -1)) == n_prompt and int(test.get("n_gen", -1)) == n_gen:
            if "avg_ns" not in test:
                raise ValueError("llama-bench's JSON test has no avg_ns")
            return test
    raise ValueError(f"no llama-bench test with n_prompt={n_prompt} n_gen={n_gen} among {len(tests)}")


def parse_batched_bench_table(text: str) -> list[dict[str, float]]:
    """The rows of llama-batched-bench's markdown table, keyed by its header (PP, TG, B, N_KV, T_PP s,
    S_PP t/s, T_TG s, S_TG t/s, T s, S t/s). Log lines around the table are skipped."""
    header, rows = None, []
    for line in text.splitlines():
        line = line.strip()
        if not line.startswith("|"):
            continue
        cells = [c.strip() for c in line.strip("|").split("|")]
        if "PP" in cells and "TG" in cells and "B" in cells:
            header = cells
        elif header and len(cells) == len(header) and re.fullmatch(r"-?\d+", cells[0] or "x"):
            try:
                rows.append({h: float(c) for h, c in zip(header, cells)})
            except ValueError:
                continue  # not a result row
    if header is None:
        raise ValueError("no PP | TG | B table in llama-batched-bench's output")
    return rows


def batched_bench_row(text: str, pp: int, tg: int, batch: int) -> dict[str, float]:
    for row in parse_batched_bench_table(text):
        if (row.get("PP"), row.get("TG"), row.get("B")) == (pp, tg, batch):
            if "T s" not in row or "T_TG s" not in row:
                raise ValueError("llama-batched-bench's table has no 'T s' / 'T_TG s' column")
            return row
    raise ValueError(f"no llama-batched-bench row with PP={pp} TG={tg} B={batch}")


# ---- running them ------------------------------------------------------------------------------------

def supports_repack(bench: Path) -> bool:
    """Whether this build's llama-bench has run-time repacking (ik_llama.cpp's -rtr)."""
    try:
        probe = subprocess.run([str(bench), "--help"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise PeerError(f"{bench} --help could not run: {exc}") from exc
    return REPACK_FLAG in probe.stdout + probe.stderr


@dataclass
class PeerEngine:
    """One column of the comparison: a peer build, plain or with run-time repacking."""

    peer: str  # the --peer NAME
    tools: dict[str, Path]
    gguf: str
    threads: int
    repack: bool
    n_batch: int = 2048  # the tools' defaults, the same as the in-process llama.cpp engine's
    n_ubatch: int = 512
    build_commit: str | None = None  # from llama-bench's JSON, once the prefill row has run

    @property
    def name(self) -> str:
        return f"{self.peer} -rtr" if self.repack else self.peer

    @property
    def desc(self) -> str:
        return f"{self.tools['llama-bench'].parent}, " + (
            "run-time repacking (-rtr)" if self.repack else "weights as loaded")

    def commands(self, row: str, spec: tuple[int, int, int]) -> list[str]:
        """The tool command line that measures `row`; spec is (batch, prompt tokens, new tokens)."""
        B, P, N = spec
        common = ["-m", self.gguf, "-t", str(self.threads),
                  "-b", str(self.n_batch), "-ub", str(self.n_ubatch)]
        if row == "prefill":
            cmd = [str(self.tools["llama-bench"]), *common, "-p", str(P), "-n", "0", "-r", "1", "-o", "json"]
            return cmd + (["-rtr", "1"] if self.repack else [])
        tg = N - 1 if row == "decode" else N  # decode: the steps after the prefill's token
        n_ctx = -(-B * (P + tg) // 256) * 256  # every sequence's cells (no unified cache), as llama.cpp's
        cmd = [str(self.tools["llama-batched-bench"]), *common, "-tb", str(self.threads), "-c", str(n_ctx),
               "-npp", str(P), "-ntg", str(tg), "-npl", str(B)]
        return cmd + (["-rtr"] if self.repack else [])

    def _run(self, cmd: list[str]) -> str:
        # A scratch working folder: some builds write a log file into the current folder.
        with tempfile.TemporaryDirectory(prefix="perfxlm-peer-") as cwd:
            try:
                done = subprocess.run(cmd, capture_output=True, text=True, cwd=cwd)
            except OSError as exc:
                raise PeerError(f"{self.name}: could not run {' '.join(cmd)}: {exc}") from exc
        if done.returncode != 0:
            tail = (done.stderr or done.stdout).strip().splitlines()[-8:]
            raise PeerError(f"{self.name}: `{' '.join(cmd)}` exited with {done.returncode}:\n  "
                            + "\n  ".join(tail))
        return done.stdout + "\n" + done.stderr

    def measure(self, row: str, spec: tuple[int, int, int], prompts=None) -> dict:
        """Seconds in the comparison's terms: total (prefill rows: the prompt; pN: end to end) and decode
        (the decode row's steps). prompts is ignored: the tools make their own."""
        B, P, N = spec
        cmd = self.commands(row, spec)
        text = self._run(cmd)
        try:
            if row == "prefill":
                test = parse_llama_bench_json(text, P)
                self.build_commit = test.get("build_commit")
                return {"total": float(test["avg_ns"]) / 1e9, "decode": 0.0}
            r = batched_bench_row(text, P, N - 1 if row == "decode" else N, B)
            return {"total": r["T s"], "decode": r["T_TG s"]}
        except (ValueError, KeyError, json.JSONDecodeError) as exc:
            raise PeerError(f"{self.name}: could not read the output of `{' '.join(cmd)}`: {exc}\n  "
                            + "\n  ".join(text.strip().splitlines()[-8:])) from exc

    def close(self) -> None:
        pass


def peer_engines(name: str, folder: Path, gguf: str, threads: int, repack: str) -> list[PeerEngine]:
    """The columns for one --peer: plain and/or -rtr (repack: both | on | off; both and on need a build
    with run-time repacking, both falls back to plain alone without it)."""
    tools = find_tools(name, folder)
    has_repack = supports_repack(tools["llama-bench"])
    if repack == "on" and not has_repack:
        raise SystemExit(f"--peer-repack on: {tools['llama-bench']} has no {REPACK_FLAG}")
    variants = {"off": [False], "on": [True], "both": [False, True] if has_repack else [False]}[repack]
    return [PeerEngine(name, tools, gguf, threads, v) for v in variants]


# ---- speculative decoding: llama-spec-bench ----------------------------------------------------------

SPEC_BENCH = "llama-spec-bench"


def default_spec_type(spec: dict) -> str:
    """The peer's --spec-type for a vLLM speculative_config: a draft file's `draft` stage with as many
    guesses, or for `ngram` its simple lookup (an n-gram of prompt_lookup_min tokens followed by as many
    guesses; the peer's lookup takes one n-gram size, not a range)."""
    k = int(spec.get("num_speculative_tokens", 5))
    if spec.get("model"):
        return f"draft:n_max={k},p_min=0.0"
    if spec.get("method") == "ngram":
        n = int(spec.get("prompt_lookup_min") or spec.get("prompt_lookup_max") or 2)
        return f"ngram_simple:ngram_size_n={n},ngram_size_m={k}"
    raise SystemExit(f"no peer speculation matches {spec!r}: give --peer-spec-type")


def parse_spec_bench_jsonl(text: str) -> dict:
    """llama-spec-bench --output-format jsonl -> {"generated", "decode_tps", "acceptance_rate"} from its
    summary row (acceptance 0.0 for a run without speculation)."""
    for line in text.splitlines():
        line = line.strip()
        if not line.startswith("{"):
            continue
        row = json.loads(line)
        if row.get("row_type") != "summary":
            continue
        if not row.get("successes"):
            raise ValueError(f"no run succeeded: {line[:300]}")
        spec = row.get("speculative") or {}
        return {"generated": int(row["generated"]), "decode_tps": float(row["decode_tps"]),
                "acceptance_rate": float(spec.get("acceptance_rate", 0.0))}
    raise ValueError("no summary row in the output")


@dataclass
class SpecBenchPeer:
    """A llama.cpp-family build's own speculative decoding (ik_llama.cpp's llama-spec-bench), on the same
    GGUF target and draft and the same user prompt (the model's chat template applied by the peer, --jinja):
    plain and speculative decode tok/s, greedy, for a given number of new tokens."""

    peer: str
    bench: Path
    gguf: str
    threads: int
    spec_type: str
    draft: str | None = None

    @classmethod
    def find(cls, name: str, folder: Path, gguf: str, threads: int, spec: dict,
             spec_type: str | None) -> SpecBenchPeer:
        for candidate in (folder / SPEC_BENCH, folder / "bin" / SPEC_BENCH):
            if candidate.is_file():
                return cls(name, candidate, gguf, threads, spec_type or default_spec_type(spec), spec.get("model"))
        raise SystemExit(f"--peer {name}={folder}: no {SPEC_BENCH} in {folder} or {folder / 'bin'}; build it with "
                         f"`cmake --build BUILD --target {SPEC_BENCH}` (ik_llama.cpp)")

    def commands(self, prompts: Path, speculative: bool) -> list[str]:
        cmd = [str(self.bench), "-m", self.gguf, "--prompts", str(prompts), "-t", str(self.threads), "--temp", "0",
               "--jinja", "-c", "4096", "--output-format", "jsonl"]
        if speculative:
            cmd += ["--spec-type", self.spec_type] + (["-md", self.draft] if self.draft else [])
        return cmd

    def run(self, user_text: str, n: int) -> dict[str, dict]:
        """{"plain": ..., "spec": ...} as parse_spec_bench_jsonl gives them, for at most n new tokens."""
        out = {}
        with tempfile.TemporaryDirectory(prefix="perfxlm-peer-") as cwd:
            prompts = Path(cwd) / "prompts.jsonl"
            prompts.write_text(json.dumps({"prompt": user_text, "max_tokens": n}) + "\n")
            for name, speculative in (("plain", False), ("spec", True)):
                cmd = self.commands(prompts, speculative)
                done = subprocess.run(cmd, capture_output=True, text=True, cwd=cwd)
                try:
                    if done.returncode != 0:
                        raise ValueError(f"exited with {done.returncode}")
                    out[name] = parse_spec_bench_jsonl(done.stdout)
                except (ValueError, KeyError, json.JSONDecodeError) as exc:
                    tail = (done.stderr or done.stdout).strip().splitlines()[-8:]
                    raise PeerError(f"{self.peer}: `{' '.join(cmd)}`: {exc}\n  " + "\n  ".join(tail)) from exc
        return out
