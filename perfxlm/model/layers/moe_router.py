"""DeepSeek's expert routers: scores from float32 logits, experts chosen within the best groups, weights
scaled by `routed_scaling_factor`.

- V2 (`softmax`): softmax scores; `greedy` takes the top k of all experts, `group_limited_greedy` only of
  the `topk_group` groups whose best expert scores highest. Weights are the scores, not renormalised.
- V3 (`sigmoid`, noaux_tc): sigmoid scores plus a learned per-expert bias (`e_score_correction_bias`)
  choose the experts (groups ranked by the sum of their two best), but the weights are the unbiased scores,
  renormalised with `norm_topk_prob`.
The choice of groups and experts is what transformers computes; a token's pairs are summed in expert
order afterwards (moe.grouped_experts), so the order top-k returns them in does not matter.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

SCORINGS = ("softmax", "sigmoid")
TOPK_METHODS = ("greedy", "group_limited_greedy", "noaux_tc")


def _mask_to_groups(
    scores: torch.Tensor, group_scores: torch.Tensor, topk_group: int, fill: float
) -> torch.Tensor:
    """scores [T, E] with the experts outside each token's `topk_group` best groups set to `fill`."""
    num_tokens, num_groups = group_scores.shape
    chosen = torch.topk(group_scores, k=topk_group, dim=-1)[1]
    keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, chosen, True)
    keep = keep.unsqueeze(-1).expand(-1, -1, scores.shape[1] // num_groups).reshape(num_tokens, -1)
    return scores.masked_fill(~keep, fill)


# Rows up to which routing runs one row at a time (a decode batch, a speculative step's verification rows);
# past it, once over the whole chunk (a prefill).
ROW_BY_ROW = 32


class GroupedTopKRouter(nn.Module):
    def __init__(
        self,
        hidden_size: int,
        num_experts: int,
        top_k: int,
        scoring: str,
        topk_method: str,
        num_groups: int | None,
        topk_group: int | None,
        renormalize: bool,
        routed_scaling_factor: float,
    ) -> None:
        super().__init__()
        if scoring not in SCORINGS:
            supported = ", ".join(SCORINGS)
            raise ValueError(f"expert scoring {scoring!r} is not supported (supported: {supported}).")
        if topk_method not in TOPK_METHODS:
            supported = ", ".join(TOPK_METHODS)
            raise ValueError(f"topk_method {topk_method!r} is not supported (supported: {supported}).")
        grouped = topk_method != "greedy"
        groups_fit = bool(num_groups) and not num_experts % num_groups and 0 < (topk_group or 0) <= num_groups
        if grouped and not groups_fit:
            raise ValueError(
                f"grouped routing needs n_group dividing the {num_experts} experts and 0 < topk_group <= "
                f"n_group (got n_group={num_groups}, topk_group={topk_group})."
            )
        if not 0 < top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok ({top_k}) must be in [1, {num_experts}].")
        self.top_k, self.scoring, self.grouped = top_k, scoring, grouped
        self.num_groups, self.topk_group = num_groups, topk_group
        self.renormalize, self.routed_scaling_factor = renormalize, routed_scaling_factor
        # float32 whatever the model's dtype, as transformers keeps it: routing is a discrete choice
        weight = torch.empty(num_experts, hidden_size, dtype=torch.float32)
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.e_score_correction_bias = (
            nn.Parameter(torch.zeros(num_experts, dtype=torch.float32), requires_grad=False)
            if scoring == "sigmoid" else None
        )  # fmt: skip

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[T, hidden] -> (weights [T, k] float32, expert ids [T, k] int64).

        A few rows are routed one at a time: torch's float32 GEMM sums in an order that depends on how many
        rows it multiplies, and its elementwise sigmoid / softmax take vector steps or scalar ones by where
        an element falls in the flat tensor, so a speculative step's verification rows would weigh the
        experts a few ulps off the one-row decode steps they stand for (and could route a near tie apart)."""
        if 1 < x.shape[0] <= ROW_BY_ROW:
            parts = [self._route(row) for row in x.split(1)]
            return torch.cat([w for w, _ in parts]), torch.cat([i for _, i in parts])
        return self._route(x)

    def _route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = F.linear(x.float(), self.weight.float())
        if self.scoring == "softmax":
            scores = logits.softmax(dim=-1)
            if self.grouped:
                group_best = scores.view(scores.shape[0], self.num_groups, -1).max(dim=-1).values
                scores = _mask_to_groups(scores, group_best, self.topk_group, 0.0)
            weights, ids = torch.topk(scores, k=self.top_k, dim=-1)
        else:
            scores = logits.sigmoid()
            choice = scores + self.e_score_correction_bias
            if self.grouped:
                group_best = choice.view(choice.shape[0], self.num_groups, -1).topk(2, dim=-1)[0].sum(dim=-1)
                choice = _mask_to_groups(choice, group_best, self.topk_group, float("-inf"))
            ids = torch.topk(choice, k=self.top_k, dim=-1)[1]
            weights = scores.gather(1, ids)
        if self.renormalize:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * self.routed_scaling_factor, ids
