"""Stands in for a peer build's llama-bench and llama-batched-bench (named after the one it plays): prints
what they print for the sizes asked, in their formats, with made-up times (-rtr: twice as fast). Writes its
command line to calls.log beside itself so a test can check what was run. FAKE_PEER_FAIL=1 makes it exit
1 as a tool that cannot load the model does; FAKE_PEER_GARBLE=1 prints no result; FAKE_PEER_NO_RTR=1
plays a build without run-time repacking (mainline llama.cpp)."""

import json
import os
import sys
from pathlib import Path

here = Path(sys.argv[0])
tool, args = here.name, sys.argv[1:]
with open(here.parent / "calls.log", "a") as log:
    log.write(json.dumps([tool, *args]) + "\n")

if "--help" in args:
    rtr = tool == "llama-bench" and not os.environ.get("FAKE_PEER_NO_RTR")
    print("usage: ...\n  -rtr, --run-time-repack <0|1>       (default: 0)" if rtr else "usage: ...")
    sys.exit(0)
if os.environ.get("FAKE_PEER_FAIL"):
    print(f"{tool}: error: unable to load model", file=sys.stderr)
    sys.exit(1)
if os.environ.get("FAKE_PEER_GARBLE"):
    print("nothing to see")
    sys.exit(0)


def value(flag: str) -> str:
    return args[args.index(flag) + 1]


speed = 2.0 if "-rtr" in args else 1.0
print("llama_model_loader: loaded meta data", file=sys.stderr)
if tool == "llama-bench":
    p = int(value("-p"))
    ns = int(p * 1e6 / speed)
    print(json.dumps([{"build_commit": "fake0001", "n_prompt": p, "n_gen": int(value("-n")), "avg_ns": ns,
                       "avg_ts": p * 1e9 / ns, "samples_ns": [ns]}], indent=2))
else:
    pp, tg, b = int(value("-npp")), int(value("-ntg")), int(value("-npl"))
    t_pp, t_tg = b * pp * 1e-2 / speed, tg * 0.2 / speed  # large enough for the table's 3 decimals
    heads = ["T_PP s", "S_PP t/s", "T_TG s", "S_TG t/s", "T s", "S t/s"]
    print(f"|{'PP':>6s} | {'TG':>6s} | {'B':>4s} | {'N_KV':>6s} | " + "".join(f"{h:>8s} | " for h in heads),
          file=sys.stderr)
    print("|-------|--------|------|--------|" + "----------|" * 6, file=sys.stderr)
    n_kv, t = b * (pp + tg), t_pp + t_tg
    print(f"|{pp:6d} | {tg:6d} | {b:4d} | {n_kv:6d} | {t_pp:8.3f} | {b * pp / t_pp:8.2f} | {t_tg:8.3f} | "
          f"{b * tg / t_tg:8.2f} | {t:8.3f} | {n_kv / t:8.2f} |", file=sys.stderr)
