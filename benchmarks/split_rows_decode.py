"""End-to-end decode on a GGUF file whose fused projections mix formats (a Q4_K_M file's Q6_K v beside Q4_K q
and k): the split weights (perfxlm/quant/split_rows.py) against the widened one weight they replace, switched
round by round in one process (the same loaded model; the fused decode layer re-reads its weights), medians.

    python benchmarks/split_rows_decode.py FILE.gguf [ROUNDS]

Prints tokens per CPU-second of the process for each form (128-token prompt, 33 new tokens, 2 threads) and
whether both gave the same greedy tokens."""
import gc, statistics, sys, time
import torch
torch.set_num_threads(2)
from perfxlm import LLM, SamplingParams
from perfxlm.model.fused_decode import FusedDecode
from perfxlm.model.layers.linear_methods.base import LinearPlan
from perfxlm.quant.layout_choice import chosen_layout
from perfxlm.quant.layouts import CodeLayout
from perfxlm.quant.split_rows import SplitRows
llm = LLM(sys.argv[1], dtype="float32", kv_cache_gib=0.25, enable_prefix_caching=False)
model = next(o.model for o in gc.get_objects() if type(o).__name__ == "ModelRunner")
plan = LinearPlan(torch.float32, torch.float32, quantized_format="gguf")
mods = [m for m in model.modules() if isinstance(getattr(m, "weight", None), SplitRows)]
forms = {"split": [m.weight for m in mods], "widened": []}
for m in mods:
    j = m.weight.joined(); j.use_activations(m.weight.activations)
    forms["widened"].append(chosen_layout(j, [CodeLayout.ROWS8, CodeLayout.ROWS8_K]))
fused = [v for m in model.modules() for v in vars(m).values() if isinstance(v, FusedDecode)]
def use(name):
    for m, w in zip(mods, forms[name]):
        m.weight = w
        m.bind_linear_method(plan)
    for f in fused:
        f.args = None
params = SamplingParams(temperature=0, max_tokens=33, ignore_eos=True)
prompt = {"prompt_token_ids": list(range(100, 228))}
res = {"split": [], "widened": []}
toks = {}
rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 4
for r in range(2 * rounds):
    name = ("split", "widened")[(r + (r // 2)) % 2]
    use(name)
    c0 = time.process_time()
    o = llm.generate([prompt], params, use_tqdm=False)[0]
    mt = o.metrics
    res[name].append(33 / (time.process_time() - c0))  # tokens per CPU-second of the process (prefill included)
    toks.setdefault(name, list(o.outputs[0].token_ids))
for k, v in res.items():
    print(k, "tok per CPU-s rounds", [round(x, 2) for x in v], "median", round(statistics.median(v), 2))
print("ratio split/widened", round(statistics.median(res["split"]) / statistics.median(res["widened"]), 3),
      "same tokens", toks["split"] == toks["widened"], "fused steps", sum(f.steps for f in fused))
