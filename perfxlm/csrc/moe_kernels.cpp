// moe_experts: a mixture of experts' routed experts as one call, the ops of model/layers/moe.py's
// grouped_experts_torch in the same order (so both give the same bits) without a Python loop over
// experts. The (token, expert) pairs are sorted by expert once, so each expert's tokens form one
// contiguous group and its weights are read once per step however many tokens chose it; the results,
// times their routing weights, are added back in expert order (transformers' float32 sums).
//
// Two ways to run the groups:
// - few rows per expert (decode, and batched decode: every group within the GEMV's row limit and below
//   the int8 GEMM's): two parallel regions for the whole layer. The first runs gate|up and the
//   activation over tasks of (expert, run of intermediate columns); the second down, over runs of output
//   columns each looping over the active experts in expert order and adding into its own columns of the
//   output, or, with at least four active experts per thread, over experts (each expert's whole product
//   in one call), added back per token in expert order. A decode step of k experts is then 2 thread
//   hand-offs, not 2 k GEMV calls each parallel on its own (4 k hand-offs, with the activation and
//   routing-weight ops between). GEMV rows are computed independently of how a weight's rows are cut
//   (runs start at multiples of 32 rows: whole two-level scale runs, whole vector steps of the
//   activation; whole groups of 8 rows for a stack in row groups, QuantizedWeight's ROWS8 layout, whose
//   GEMV runs on the expert's groups), so the bits are those of the per-expert products. A row-group
//   gate|up with inter not a multiple of 8 (the up rows would not start a group) runs the loop below.
//   gpt-oss's interleaved gate/up rows
//   take it too (a run of intermediate columns is one run of 2 n rows, its biases alike); float32
//   stacks do not (rows_independent).
// - more rows: expert after expert, each product parallel over its own rows (a GEMM's work per expert is
//   large enough to share out), as the torch loop does: under int8 activation blocks from the plan's
//   GEMM row count each expert's rows go to the int8 GEMM (quant_gemm.cpp, through linear_q), not to a
//   float32 GEMM on dequantized slabs; an expert in row groups goes there as its matrix in that layout
//   (linear_q's layout 1: the GEMM reads the groups as its panels).
// An act-order stack (GPTQ: each expert's codes columns in its own input order) gathers each expert's
// rows into that order once (`ordered_by_expert`, `project`), as the torch loop's run_linear_q does.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/ThreadLocalState.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <tuple>
#include <vector>

#include "fused_project.h"

namespace {

using perfxlm_fused::project;

constexpr int64_t kActRowAlign = 64;  // activation.py's ROW_ALIGN
constexpr int64_t kRowRun = 32;  // weight rows a task's runs start at multiples of

// act(gate) * up over [T, 2 * inter]; code 3 is gpt-oss's clamped SwiGLU over interleaved gate/up columns:
// (clamp(up, -limit, limit) + 1) * g * sigmoid(alpha g), g = min(gate, limit), in ClampedSwiGLU's op order.
at::Tensor expert_activation(const at::Tensor& gate_up, int64_t inter, int64_t activation, double alpha, double limit) {
  if (activation != 3) return perfxlm_fused::mlp_activation(gate_up, inter, activation);
  at::Tensor gate = gate_up.slice(1, 0, c10::nullopt, 2).clamp_max(limit);
  const at::Tensor up = gate_up.slice(1, 1, c10::nullopt, 2).clamp(-limit, limit);
  // rows padded to whole vector steps, as the module's (activation.py's ROW_ALIGN says why)
  const int64_t d = gate.size(1), pad = (kActRowAlign - d % kActRowAlign) % kActRowAlign;
  if (pad) gate = at::constant_pad_nd(gate, {0, pad});
  return (up + 1) * (gate * at::sigmoid(gate * alpha)).narrow(1, 0, d);
}

// Rows [r0, r0 + n) (all: n < 0) of expert e out of a stack in row groups (QuantizedWeight.native_parts'
// eight parts: codes [E, G, K / 32, 8 B], scales [E, G, K / 32, 8], empty mins and levels, act_int8, an
// empty input order, the layout, the experts' out_features): the expert's groups [r0 / 8, ceil((r0 + n) /
// 8)) as a matrix in the same layout, its out_features n. A run must be whole groups (the last may end at
// out_features): the callers' runs start at multiples of 8 rows.
std::vector<at::Tensor> expert_groups(at::TensorList stack, int64_t e, int64_t r0, int64_t n) {
  const int64_t rows = *stack[7].const_data_ptr<int64_t>();
  std::vector<at::Tensor> parts(stack.begin(), stack.end());
  if (n < 0) r0 = 0, n = rows;
  TORCH_CHECK(r0 % 8 == 0 && ((r0 + n) % 8 == 0 || r0 + n == rows) && r0 + n <= rows,
              "moe_experts: rows [", r0, ", ", r0 + n, ") of a stack in row groups: whole groups of 8 only");
  const int64_t g0 = r0 / 8, g1 = (r0 + n + 7) / 8;
  parts[0] = stack[0].select(0, e).narrow(0, g0, g1 - g0);
  parts[1] = stack[1].select(0, e).narrow(0, g0, g1 - g0);
  if (n != rows) parts[7] = at::scalar_tensor(n, stack[7].options());
  return parts;
}

// Rows [r0, r0 + n) of expert e's weight parts, out of a stack's: [w [E, N, K]] or
// [codes, scales, mins, levels, act_int8] with the first three stacked (empty mins: centred codes), and
// an act-order stack's input orders [E, K] sixth (each expert its own: `project` gathers x by row e);
// a stack in row groups has eight (expert_groups).
std::vector<at::Tensor> expert_rows(at::TensorList stack, int64_t e, int64_t r0 = 0, int64_t n = -1) {
  if (stack.size() == 8) return expert_groups(stack, e, r0, n);
  std::vector<at::Tensor> parts;
  for (size_t i = 0; i < stack.size(); ++i) {
    if (i == 5) {
      parts.push_back(stack[i].select(0, e));
      continue;
    }
    if (i >= 3 || !stack[i].numel()) {
      parts.push_back(stack[i]);
      continue;
    }
    const at::Tensor w = stack[i].select(0, e);
    parts.push_back(n < 0 ? w : w.narrow(0, r0, n));
  }
  return parts;
}

c10::optional<at::Tensor> expert_bias(const c10::optional<at::Tensor>& bias, int64_t e, int64_t r0 = 0, int64_t n = -1) {
  if (!bias.has_value() || !bias->defined()) return c10::nullopt;
  const at::Tensor b = bias->select(0, e);
  return n < 0 ? b : b.narrow(0, r0, n);
}

// Whether `project` runs a stack's products row by row (kernels whose rows do not depend on how the weight
// is cut, nor on the threads running them) for groups of up to `rows` rows: quantized stacks within the
// GEMV's row limit and below the int8 GEMM's first row (`gemm_rows`: linear_q's rule; -1 none), bf16
// rows within the row kernel's. Never float32 stacks: torch's float32 GEMM (MKL) sums in orders that
// depend on its thread count and on how many rows the weight has, so a run of rows, or one thread's
// product, would not give the torch loop's bits. Nor packed panels.
bool rows_independent(at::TensorList stack, int64_t rows, int64_t max_rows, int64_t quant_max_rows,
                      int64_t gemm_rows) {
  if (stack.size() >= 5) {
    const int64_t gemv = quant_max_rows >= 0 ? quant_max_rows : max_rows;
    return rows <= gemv && (gemm_rows <= 0 || rows < gemm_rows);
  }
  const at::Tensor& w = stack[0];
  return w.dim() == 3 && w.scalar_type() == at::kBFloat16 && w.is_contiguous() && rows <= max_rows;
}

// Runs of `unit`-multiples of rows covering [0, total) so that about `tasks` of them exist (at least one
// unit each).
int64_t run_length(int64_t total, int64_t tasks, int64_t unit) {
  const int64_t per = (total + std::max<int64_t>(tasks, 1) - 1) / std::max<int64_t>(tasks, 1);
  return std::max(unit, (per + unit - 1) / unit * unit);
}

struct Group {
  int64_t expert, start, rows;  // the sorted pairs [start, start + rows) chose `expert`
};

// A stack's parts without an act-order stack's input orders.
at::TensorList base_parts(at::TensorList stack) { return stack.size() == 6 ? stack.slice(0, 5) : stack; }

// The sorted pairs' rows with each group's columns in its expert's input order (an act-order stack's sixth
// part), gathered once per expert for the column runs that then take base_parts(stack); `rows` as they are
// for any other stack.
at::Tensor ordered_by_expert(const at::Tensor& rows, const std::vector<Group>& groups, at::TensorList stack) {
  if (stack.size() != 6) return rows;
  at::Tensor out = at::empty_like(rows, at::MemoryFormat::Contiguous);
  for (const Group& g : groups)
    out.narrow(0, g.start, g.rows)
        .copy_(perfxlm_fused::take_columns(rows.narrow(0, g.start, g.rows), stack[5].select(0, g.expert)));
  return out;
}

// How a step's products run, the plan's choices (`project`'s arguments past the weight).
struct Products {
  int64_t max_rows;
  bool bf16_gemm, int8_blocks;
  int64_t quant_max_rows, quant_block_max_rows, gemm_rows;

  at::Tensor operator()(const at::Tensor& x, at::TensorList parts, int64_t n_out,
                        const c10::optional<at::Tensor>& bias) const {
    return project(x, parts, n_out, bias, max_rows, bf16_gemm, int8_blocks, quant_max_rows, quant_block_max_rows,
                   gemm_rows);
  }
};

// The experts' gated activation, its codes and constants.
struct Activation {
  int64_t code;
  double alpha, limit;

  bool interleaved() const { return code == 3; }  // gpt-oss: gate and up rows alternate in gate|up
  at::Tensor operator()(const at::Tensor& gate_up, int64_t inter) const {
    return expert_activation(gate_up, inter, code, alpha, limit);
  }
};

// The few-rows path (see the top of the file): h [P, inter] then out [T, hidden].
// An act-order stack's inputs are gathered once per expert here (ordered_by_expert), not per column run.
at::Tensor experts_by_columns(const at::Tensor& x_sorted, const at::Tensor& ws, const at::Tensor& token_of,
                              const std::vector<Group>& groups, int64_t num_tokens, at::TensorList up_stack,
                              const c10::optional<at::Tensor>& b_gate_up, at::TensorList down_stack,
                              const c10::optional<at::Tensor>& b_down, int64_t inter, const Activation& act,
                              const Products& product) {
  const at::Tensor xs = ordered_by_expert(x_sorted, groups, up_stack);
  const at::TensorList w_gate_up = base_parts(up_stack), w_down = base_parts(down_stack);
  const int64_t hidden = xs.size(1), pairs = xs.size(0), active = static_cast<int64_t>(groups.size());
  const int64_t threads = at::get_num_threads();
  // gate|up: a task is one expert's run of intermediate columns (its gate rows and the matching up rows),
  // about four tasks per thread over all experts
  const int64_t cols = run_length(inter, (4 * threads + active - 1) / active, kRowRun);
  const int64_t col_runs = (inter + cols - 1) / cols;
  at::Tensor h = at::empty({pairs, inter}, xs.options());
  // the caller's thread-local state (inference mode above all: writing into h and out, inference tensors
  // under it, is refused on a thread without it) on every thread of the regions
  const at::ThreadLocalState caller;
  at::parallel_for(0, active * col_runs, 1, [&](int64_t begin, int64_t end) {
    const at::ThreadLocalStateGuard same_state(caller);
    for (int64_t task = begin; task < end; ++task) {
      const Group& g = groups[task / col_runs];
      const int64_t j0 = task % col_runs * cols, n = std::min(cols, inter - j0);
      const at::Tensor x = xs.narrow(0, g.start, g.rows);
      if (act.interleaved()) {
        // columns [j0, j0 + n) are gate|up rows [2 j0, 2 j0 + 2 n): one run (starting on a multiple of 64)
        const at::Tensor both =
            product(x, expert_rows(w_gate_up, g.expert, 2 * j0, 2 * n), 2 * n, expert_bias(b_gate_up, g.expert, 2 * j0, 2 * n));
        // row by row, each row's run padded to whole vector steps (expert_activation): the torch loop's bits
        for (int64_t r = 0; r < g.rows; ++r)
          h.select(0, g.start + r).narrow(0, j0, n).copy_(act(both.narrow(0, r, 1), n).squeeze(0));
        continue;
      }
      if (n == inter) {
        // the task is the expert's whole gate|up: one product over its 2 inter rows (rows are computed
        // independently of how the weight is cut: the same bits as gate and up apart) rounds the
        // activations once and makes one call, not two and a concatenation per row
        const at::Tensor both = product(x, expert_rows(w_gate_up, g.expert), 2 * inter, expert_bias(b_gate_up, g.expert));
        for (int64_t r = 0; r < g.rows; ++r)
          h.select(0, g.start + r).copy_(act(both.narrow(0, r, 1), inter).squeeze(0));
        continue;
      }
      const at::Tensor gate = product(x, expert_rows(w_gate_up, g.expert, j0, n), n, expert_bias(b_gate_up, g.expert, j0, n));
      const at::Tensor up = product(x, expert_rows(w_gate_up, g.expert, inter + j0, n), n,
                                    expert_bias(b_gate_up, g.expert, inter + j0, n));
      // one row at a time: each row's elements take the vector and scalar steps of the whole row's op
      for (int64_t r = 0; r < g.rows; ++r) {
        const at::Tensor both = at::cat({gate.select(0, r), up.select(0, r)}).unsqueeze(0);
        h.select(0, g.start + r).narrow(0, j0, n).copy_(act(both, n).squeeze(0));
      }
    }
  });
  h = ordered_by_expert(h, groups, down_stack);
  const int64_t* tok = token_of.const_data_ptr<int64_t>();
  if (active >= 4 * threads) {
    // down, many experts (batched decode; a decode step's top-k on few threads): a task is one expert's
    // whole product, the threads' shares within a quarter of a task of each other, and each expert's rows
    // multiplied in one call (their activations rounded to int8 blocks once, not once per column run);
    // added back per token in expert order, the sums the column runs make
    at::Tensor out_sorted = at::empty({pairs, hidden}, xs.options());
    at::parallel_for(0, active, 1, [&](int64_t begin, int64_t end) {
      const at::ThreadLocalStateGuard same_state(caller);
      for (int64_t i = begin; i < end; ++i) {
        const Group& g = groups[i];
        out_sorted.narrow(0, g.start, g.rows)
            .copy_(product(h.narrow(0, g.start, g.rows), expert_rows(w_down, g.expert), hidden, expert_bias(b_down, g.expert))
                       .mul_(ws.narrow(0, g.start, g.rows)));
      }
    });
    return at::zeros({num_tokens, hidden}, xs.options()).index_add_(0, token_of, out_sorted);
  }
  // down, few experts: a task is a run of output columns over every active expert, in expert order
  const int64_t out_cols = run_length(hidden, 4 * threads, kRowRun);
  const int64_t out_runs = (hidden + out_cols - 1) / out_cols;
  at::Tensor out = at::zeros({num_tokens, hidden}, xs.options());
  at::parallel_for(0, out_runs, 1, [&](int64_t begin, int64_t end) {
    const at::ThreadLocalStateGuard same_state(caller);
    for (int64_t run = begin; run < end; ++run) {
      const int64_t c0 = run * out_cols, n = std::min(out_cols, hidden - c0);
      for (const Group& g : groups) {
        const at::Tensor o = product(h.narrow(0, g.start, g.rows), expert_rows(w_down, g.expert, c0, n), n,
                                     expert_bias(b_down, g.expert, c0, n))
                                 .mul_(ws.narrow(0, g.start, g.rows));
        for (int64_t r = 0; r < g.rows; ++r) out.select(0, tok[g.start + r]).narrow(0, c0, n).add_(o.select(0, r));
      }
    }
  });
  return out;
}

// check_ids: whether the ids come from the caller (checked to be in range: two reductions and two reads
// back per call), not from this file's own top-k.
at::Tensor experts(const at::Tensor& x, const at::Tensor& weights, const at::Tensor& expert_ids,
                   at::TensorList w_gate_up, const c10::optional<at::Tensor>& b_gate_up, at::TensorList w_down,
                   const c10::optional<at::Tensor>& b_down, int64_t num_experts, int64_t inter, int64_t activation,
                   double alpha, double limit, int64_t max_rows, bool bf16_gemm, bool int8_blocks,
                   int64_t quant_max_rows, int64_t quant_block_max_rows, int64_t gemm_rows, bool check_ids) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "moe_experts: x must be float32 [T, hidden]");
  TORCH_CHECK(expert_ids.dim() == 2 && expert_ids.size(0) == x.size(0) && expert_ids.scalar_type() == at::kLong &&
                  weights.sizes() == expert_ids.sizes(),
              "moe_experts: weights and expert_ids must be [T, top_k], the ids int64");
  for (const at::TensorList stack : {w_gate_up, w_down})
    TORCH_CHECK(stack.size() == 1 || stack.size() == 5 || stack.size() == 6 || stack.size() == 8,
                "moe_experts: a stack is [w] or [codes, scales, mins, levels, act_int8[, input orders[, layout, "
                "out_features]]]");
  TORCH_CHECK(w_gate_up[0].size(0) == num_experts && w_down[0].size(0) == num_experts, "moe_experts: stacks of ",
              num_experts, " experts expected");
  TORCH_CHECK(activation >= 0 && activation <= 3, "moe_experts: unknown activation code ", activation);
  const int64_t top_k = expert_ids.size(1), hidden = x.size(1);
  const at::Tensor flat = expert_ids.reshape(-1);
  if (check_ids && flat.numel()) {
    TORCH_CHECK(flat.min().item<int64_t>() >= 0 && flat.max().item<int64_t>() < num_experts,
                "moe_experts: expert ids must be in [0, ", num_experts, ")");
  }
  const at::Tensor order = at::argsort(flat, /*stable=*/true);
  const at::Tensor token_of = at::floor_divide(order, top_k);  // the token each sorted pair belongs to
  const at::Tensor counts = at::bincount(flat, {}, num_experts);
  const at::Tensor xs = x.index_select(0, token_of);
  const at::Tensor ws = weights.reshape(-1).index_select(0, order).to(x.scalar_type()).unsqueeze(1);
  const int64_t* count = counts.const_data_ptr<int64_t>();
  std::vector<Group> groups;
  int64_t most = 0;
  for (int64_t e = 0, start = 0; e < num_experts; start += count[e], ++e) {
    if (count[e]) groups.push_back({e, start, count[e]});
    most = std::max(most, count[e]);
  }
  const Activation act{activation, alpha, limit};
  const Products product{max_rows, bf16_gemm, int8_blocks, quant_max_rows, quant_block_max_rows, int8_blocks ? gemm_rows : -1};
  // gate|up in row groups splits into gate and up runs of whole groups only where inter is a multiple of 8
  // (the up rows start at inter); gpt-oss's interleaved runs start at multiples of 64 and end at 2 inter
  const bool whole_groups = w_gate_up.size() != 8 || act.interleaved() || inter % 8 == 0;
  if (whole_groups && rows_independent(w_gate_up, most, max_rows, quant_max_rows, product.gemm_rows) &&
      rows_independent(w_down, most, max_rows, quant_max_rows, product.gemm_rows)) {
    return experts_by_columns(xs, ws, token_of, groups, x.size(0), w_gate_up, b_gate_up, w_down, b_down, inter, act,
                              product);
  }
  at::Tensor out_sorted = at::empty_like(xs);
  for (const Group& g : groups) {
    const at::Tensor h = act(product(xs.narrow(0, g.start, g.rows), expert_rows(w_gate_up, g.expert), 2 * inter,
                                     expert_bias(b_gate_up, g.expert)),
                             inter);
    const at::Tensor o = product(h, expert_rows(w_down, g.expert), hidden, expert_bias(b_down, g.expert));
    out_sorted.narrow(0, g.start, g.rows).copy_(o * ws.narrow(0, g.start, g.rows));
  }
  return at::zeros_like(x).index_add_(0, token_of, out_sorted);
}

at::Tensor moe_experts(const at::Tensor& x, const at::Tensor& weights, const at::Tensor& expert_ids,
                       at::TensorList w_gate_up, const c10::optional<at::Tensor>& b_gate_up, at::TensorList w_down,
                       const c10::optional<at::Tensor>& b_down, int64_t num_experts, int64_t inter, int64_t activation,
                       double alpha, double limit, int64_t max_rows, bool bf16_gemm, bool int8_blocks,
                       int64_t quant_max_rows, int64_t quant_block_max_rows, int64_t gemm_rows) {
  return experts(x, weights, expert_ids, w_gate_up, b_gate_up, w_down, b_down, num_experts, inter, activation, alpha,
                 limit, max_rows, bf16_gemm, int8_blocks, quant_max_rows, quant_block_max_rows, gemm_rows, true);
}

// moe_routed_experts: a few-row step's router, softmax top-k routing and experts in one call. The router
// product is `project`'s ([w], float32 or bf16 rows or packed panels, within the row kernels' max_rows:
// the kernels the router's Linear runs at that many rows), then model/layers/moe.py's route() in the same
// ATen ops (float32 softmax, top-k, the renormalising division), then moe_experts: the same bits as the
// module path, without the Python between them (the router module, route's ops, experts_call's checks),
// which at batch 1 costs a sizeable share of the experts' own time.
at::Tensor moe_routed_experts(const at::Tensor& x, const at::Tensor& router_w, const c10::optional<at::Tensor>& router_b,
                              int64_t top_k, bool renormalize, at::TensorList w_gate_up,
                              const c10::optional<at::Tensor>& b_gate_up, at::TensorList w_down,
                              const c10::optional<at::Tensor>& b_down, int64_t num_experts, int64_t inter,
                              int64_t activation, double alpha, double limit, int64_t max_rows, bool bf16_gemm,
                              bool int8_blocks, int64_t quant_max_rows, int64_t quant_block_max_rows, int64_t gemm_rows) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.size(0) <= max_rows,
              "moe_routed_experts: x must be float32 [T, hidden], T within the row kernels' max_rows");
  TORCH_CHECK(router_w.dim() == 3 || router_w.scalar_type() == at::kFloat ||
                  (router_w.scalar_type() == at::kBFloat16 && router_w.is_contiguous()),
              "moe_routed_experts: the router weight must be float32, contiguous bf16 rows or bf16 panels");
  TORCH_CHECK(top_k > 0 && top_k <= num_experts, "moe_routed_experts: top_k must be in [1, ", num_experts, "]");
  const at::Tensor logits = project(x, at::TensorList(&router_w, 1), num_experts, router_b, max_rows, false, false, -1,
                                    -1, -1);
  const at::Tensor probs = at::softmax(logits, -1, at::kFloat);
  auto chosen = at::topk(probs, top_k, -1);
  at::Tensor weights = std::get<0>(chosen);
  if (renormalize) weights = weights / weights.sum(-1, /*keepdim=*/true);
  return experts(x, weights, std::get<1>(chosen), w_gate_up, b_gate_up, w_down, b_down, num_experts, inter,
                 activation, alpha, limit, max_rows, bf16_gemm, int8_blocks, quant_max_rows, quant_block_max_rows,
                 gemm_rows, false);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(perfxlm, m) {
  m.def(
      "moe_experts(Tensor x, Tensor weights, Tensor expert_ids, Tensor[] w_gate_up, Tensor? b_gate_up, Tensor[] w_down, "
      "Tensor? b_down, int num_experts, int inter, int activation, float alpha, float limit, int max_rows, "
      "bool bf16_gemm, bool int8_blocks, int quant_max_rows, int quant_block_max_rows, int gemm_rows=-1) -> Tensor");
  m.def(
      "moe_routed_experts(Tensor x, Tensor router_w, Tensor? router_b, int top_k, bool renormalize, Tensor[] w_gate_up, "
      "Tensor? b_gate_up, Tensor[] w_down, Tensor? b_down, int num_experts, int inter, int activation, float alpha, "
      "float limit, int max_rows, bool bf16_gemm, bool int8_blocks, int quant_max_rows, int quant_block_max_rows, "
      "int gemm_rows=-1) -> Tensor");
}

TORCH_LIBRARY_IMPL(perfxlm, CPU, m) {
  m.impl("moe_experts", &moe_experts);
  m.impl("moe_routed_experts", &moe_routed_experts);
}
