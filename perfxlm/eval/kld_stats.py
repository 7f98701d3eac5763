"""KL-divergence statistics of a model against a base model, as llama.cpp's `llama-perplexity
--kl-divergence` reports them, so the two tools' figures line up line by line.

Per scored token t (the same positions perplexity scores) with the base's log-probabilities P and the
model's Q over the whole vocabulary:
- KLD = sum_v P(v) (log P(v) - log Q(v)), the divergence of the model from the base;
- the negative log-likelihoods of the actual next token under each, nll_Q and nll_base;
- Delta p = Q(actual) - P(actual), the change of the actual token's probability;
- whether the most likely token is the same under both.
Over all tokens (uncertainties are standard errors of means, carried through exp() to first order):
Mean PPL(Q) / PPL(base), the correlation of the two nlls, Mean ln(PPL(Q)/PPL(base)) = mean(nll_Q -
nll_base), Mean PPL(Q)/PPL(base) = exp of that, Mean PPL(Q)-PPL(base) (with the covariance of the two
means), the KLD's mean and percentiles, Delta p's mean, percentiles and RMS, and the same-top fraction.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import torch

# percentiles llama.cpp prints, highest first (besides the maximum and minimum)
KLD_PERCENTILES = (99.9, 99.0, 95.0, 90.0, 50.0, 10.0, 5.0, 1.0, 0.1)
DP_PERCENTILES = (99.9, 99.0, 95.0, 90.0, 75.0, 50.0, 25.0, 10.0, 5.0, 1.0, 0.1)


@dataclass
class TokenStats:
    """Per-token values of one batch of scored positions, float64 numpy arrays of equal length."""

    kld: np.ndarray
    nll_model: np.ndarray
    nll_base: np.ndarray
    delta_p: np.ndarray
    same_top: np.ndarray  # bool


def token_stats(base_logprobs: torch.Tensor, model_logprobs: torch.Tensor, targets: torch.Tensor) -> TokenStats:
    """base / model log-probabilities [T, V] and the actual next tokens [T]."""
    if base_logprobs.shape != model_logprobs.shape:
        raise ValueError(
            f"base log-probabilities {tuple(base_logprobs.shape)} and the model's {tuple(model_logprobs.shape)} "
            "differ in shape: the two models must share one vocabulary."
        )
    # float64 and normalized again: a float32 log_softmax over a large vocabulary can sum to 1 + 2e-5
    # (measured on a 49152-token head), which would put a -2e-5 floor under every KLD
    base = base_logprobs.double()
    base = base - base.logsumexp(dim=-1, keepdim=True)
    model = model_logprobs.double()
    model = model - model.logsumexp(dim=-1, keepdim=True)
    p = base.exp()
    kld = (p * (base - model)).sum(dim=-1)
    idx = targets.long().view(-1, 1)
    lp_base = base.gather(1, idx).squeeze(1)
    lp_model = model.gather(1, idx).squeeze(1)
    same = base.argmax(dim=-1) == model.argmax(dim=-1)
    as_np = lambda t: t.numpy()  # noqa: E731
    return TokenStats(
        kld=as_np(kld), nll_model=as_np(-lp_model), nll_base=as_np(-lp_base),
        delta_p=as_np(lp_model.exp() - lp_base.exp()), same_top=same.numpy(),
    )  # fmt: skip


@dataclass
class Estimate:
    value: float
    error: float  # standard error; NaN where undefined (fewer than two tokens)

    def show(self, fmt: str = "{:10.6f}") -> str:
        return f"{fmt.format(self.value)} ± {fmt.format(self.error)}"


@dataclass
class KldSummary:
    n_tokens: int
    ppl_model: Estimate
    ppl_base: Estimate
    correlation: float  # of the two nlls, 0..1
    ln_ppl_ratio: Estimate
    ppl_ratio: Estimate
    ppl_diff: Estimate
    kld_mean: Estimate
    kld_max: float
    kld_min: float
    kld_percentiles: dict[float, float]
    dp_mean: Estimate  # fractions (0.01 = 1 %)
    dp_max: float
    dp_min: float
    dp_percentiles: dict[float, float]
    dp_rms: Estimate
    same_top: Estimate  # fraction
    kld_values: np.ndarray = field(repr=False, default_factory=lambda: np.zeros(0))

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("kld_values")
        for key in ("kld_percentiles", "dp_percentiles"):
            d[key] = {f"{p:g}": v for p, v in d[key].items()}
        return _finite(d)

    def report(self) -> str:
        """llama.cpp's three summary blocks, in its words."""
        pct = lambda v: f"{100 * v:6.3f}%"  # noqa: E731
        lines = [
            "====== Perplexity statistics ======",
            f"Mean PPL(Q)                   : {self.ppl_model.show()}",
            f"Mean PPL(base)                : {self.ppl_base.show()}",
            f"Cor(ln(PPL(Q)), ln(PPL(base))): {100 * self.correlation:6.2f}%",
            f"Mean ln(PPL(Q)/PPL(base))     : {self.ln_ppl_ratio.show()}",
            f"Mean PPL(Q)/PPL(base)         : {self.ppl_ratio.show()}",
            f"Mean PPL(Q)-PPL(base)         : {self.ppl_diff.show()}",
            "",
            "====== KL divergence statistics ======",
            f"Mean    KLD: {self.kld_mean.show()}",
            f"Maximum KLD: {self.kld_max:10.6f}",
        ]
        lines += [f"{_label(p)}KLD: {v:10.6f}" for p, v in self.kld_percentiles.items()]
        lines += [
            f"Minimum KLD: {self.kld_min:10.6f}",
            "",
            "====== Token probability statistics ======",
            f"Mean    Δp: {100 * self.dp_mean.value:6.3f} ± {100 * self.dp_mean.error:5.3f} %",
            f"Maximum Δp: {pct(self.dp_max)}",
        ]
        lines += [f"{_label(p)}Δp: {pct(v)}" for p, v in self.dp_percentiles.items()]
        lines += [
            f"Minimum Δp: {pct(self.dp_min)}",
            f"RMS Δp    : {100 * self.dp_rms.value:6.3f} ± {100 * self.dp_rms.error:5.3f} %",
            f"Same top p: {100 * self.same_top.value:6.3f} ± {100 * self.same_top.error:5.3f} %",
        ]
        return "\n".join(lines)


def _label(p: float) -> str:
    """llama.cpp's left column: 'Median  ', '99.9%   ', ' 5.0%   '."""
    return "Median  " if p == 50.0 else f"{p:4.1f}%   "


def _finite(value: Any) -> Any:
    """JSON-safe: NaN and infinities become None, Estimates become {value, error}."""
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


class KldAccumulator:
    """Per-token statistics gathered window by window; `summary()` at the end."""

    def __init__(self) -> None:
        self.parts: list[TokenStats] = []

    def add(self, stats: TokenStats) -> None:
        self.parts.append(stats)

    @property
    def n_tokens(self) -> int:
        return sum(len(p.kld) for p in self.parts)

    def running(self) -> tuple[float, float, float]:
        """(PPL(Q), mean KLD, same-top fraction) so far: the per-window progress line."""
        nll = np.concatenate([p.nll_model for p in self.parts])
        kld = np.concatenate([p.kld for p in self.parts])
        same = np.concatenate([p.same_top for p in self.parts])
        return math.exp(nll.mean()), float(kld.mean()), float(same.mean())

    def summary(self) -> KldSummary:
        if not self.parts:
            raise ValueError("no token was scored: the KL divergence is undefined.")
        cat = lambda name: np.concatenate([getattr(p, name) for p in self.parts])  # noqa: E731
        return summarize(cat("kld"), cat("nll_model"), cat("nll_base"), cat("delta_p"), cat("same_top"))


def _mean(values: np.ndarray) -> Estimate:
    n = values.size
    mean = float(values.mean())
    if n < 2:
        return Estimate(mean, math.nan)
    var = float((values * values).mean() - mean * mean)
    return Estimate(mean, math.sqrt(max(var, 0.0) / (n - 1)))


def summarize(kld: np.ndarray, nll_q: np.ndarray, nll_b: np.ndarray, dp: np.ndarray, same: np.ndarray) -> KldSummary:
    n = kld.size
    denom = max(n - 1, 1)
    mq, mb = _mean(nll_q), _mean(nll_b)
    ppl_q, ppl_b = math.exp(mq.value), math.exp(mb.value)
    var_q, var_b = float(nll_q.var()), float(nll_b.var())
    cov = float(((nll_q - mq.value) * (nll_b - mb.value)).mean())
    corr = cov / math.sqrt(var_q * var_b) if var_q > 0 and var_b > 0 else math.nan
    ln_ratio = _mean(nll_q - nll_b)
    ratio = math.exp(ln_ratio.value)
    diff_var = (ppl_q**2 * var_q + ppl_b**2 * var_b - 2 * ppl_q * ppl_b * cov) / denom
    dp2 = _mean(dp * dp)
    rms = math.sqrt(dp2.value)
    frac = float(same.mean())
    return KldSummary(
        n_tokens=n,
        ppl_model=Estimate(ppl_q, ppl_q * mq.error),
        ppl_base=Estimate(ppl_b, ppl_b * mb.error),
        correlation=corr,
        ln_ppl_ratio=ln_ratio,
        ppl_ratio=Estimate(ratio, ratio * ln_ratio.error),
        ppl_diff=Estimate(ppl_q - ppl_b, math.sqrt(max(diff_var, 0.0)) if n > 1 else math.nan),
        kld_mean=_mean(kld),
        kld_max=float(kld.max()),
        kld_min=float(kld.min()),
        kld_percentiles={p: float(np.percentile(kld, p)) for p in KLD_PERCENTILES},
        dp_mean=_mean(dp),
        dp_max=float(dp.max()),
        dp_min=float(dp.min()),
        dp_percentiles={p: float(np.percentile(dp, p)) for p in DP_PERCENTILES},
        dp_rms=Estimate(rms, dp2.error / (2 * rms) if rms > 0 else math.nan),
        same_top=Estimate(frac, math.sqrt(frac * (1 - frac) / denom) if n > 1 else math.nan),
        kld_values=kld,
    )
