"""DPPO policy loss (binary TV / binary KL trust-region mask) and the GRPO baseline.

Everything works on per-token tensors of one shape (flat packed tokens or [B, T]):

* `new_logprobs`  log pi_theta(y_t | s_t) from the trainer forward (carries the gradient),
* `old_logprobs`  log mu(y_t | s_t) recorded by the *sampler* at sampling time, after
  temperature (never a trainer recomputation: the trust region is anchored on the policy
  that actually produced the data, DPPO paper Takeaway 2),
* `advantages`    the sequence advantage broadcast to every model token,
* `loss_mask`     1 on sampled tokens, 0 on prompt / tool / padding positions.

The DPPO loss per token is -A * r * M with r = exp(log pi - log mu) and a constant mask M.
There is no ratio cap, no truncated importance sampling and no PPO clip branch. The sum is
divided by the number of loss tokens of the *global* batch (`denominator`), so a
data-parallel caller passes the all-reduced count and the summed rank gradients equal the
single-process gradient.

Statistics are returned as sums (`LossStats`) rather than means so that several packed
micro-batches and several ranks can be combined exactly before `summarize` turns them into
the reference metric names.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

LOSS_FNS = ("dppo", "grpo")
DIVERGENCES = ("tv", "kl")

# Probabilities are formed from log-probs clamped to this range (exp(-30) ~ 1e-13).
LOGPROB_MIN = -30.0
# Binary KL clamps probabilities away from 0 and 1 so both log terms stay finite.
PROB_EPS = 1e-9


@dataclass
class LossConfig:
    loss_fn: str = "dppo"  # "dppo" | "grpo"
    divergence: str = "tv"  # DPPO only: "tv" (binary total variation) | "kl" (binary KL(mu || pi))
    delta: float = 0.1  # DPPO trust-region radius, the same in both directions
    clip_low: float = 0.2  # GRPO: ratio clipped to [1 - clip_low, 1 + clip_high]
    clip_high: float = 0.272

    def __post_init__(self) -> None:
        if self.loss_fn not in LOSS_FNS:
            raise ValueError(f"loss_fn must be one of {LOSS_FNS}, got {self.loss_fn!r}")
        if self.divergence not in DIVERGENCES:
            raise ValueError(f"divergence must be one of {DIVERGENCES}, got {self.divergence!r}")
        if not self.delta > 0:
            raise ValueError(f"delta must be > 0, got {self.delta}")
        if not (0 <= self.clip_low < 1 and self.clip_high >= 0):
            raise ValueError(f"need 0 <= clip_low < 1 and clip_high >= 0, got {self.clip_low}, {self.clip_high}")


def _probs(logprobs: torch.Tensor) -> torch.Tensor:
    return torch.exp(logprobs.clamp(LOGPROB_MIN, 0.0))


def binary_tv(new_logprobs: torch.Tensor, old_logprobs: torch.Tensor) -> torch.Tensor:
    """|mu - pi| of the sampled token: TV over the two bins {sampled, everything else}."""
    return (_probs(old_logprobs) - _probs(new_logprobs)).abs()


def binary_kl(new_logprobs: torch.Tensor, old_logprobs: torch.Tensor) -> torch.Tensor:
    """KL(mu || pi) over the two bins {sampled token, everything else}."""
    mu = _probs(old_logprobs).clamp(PROB_EPS, 1 - PROB_EPS)
    pi = _probs(new_logprobs).clamp(PROB_EPS, 1 - PROB_EPS)
    return mu * torch.log(mu / pi) + (1 - mu) * torch.log((1 - mu) / (1 - pi))


@torch.no_grad()
def dppo_mask(
    new_logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    delta: float = 0.1,
    divergence: str = "tv",
) -> torch.Tensor:
    """The DPPO trust-region mask M (float, 0/1, no gradient).

    A token is blocked only when the update would push it further away from mu *and* the
    divergence already exceeds delta: A > 0 with r > 1, or A < 0 with r < 1. Updates that
    move r back towards 1 and tokens with A == 0 are never blocked. Positions outside
    `loss_mask` (prompt, tool output, padding) are always 0.
    """
    if divergence not in DIVERGENCES:
        raise ValueError(f"divergence must be one of {DIVERGENCES}, got {divergence!r}")
    new = new_logprobs.detach()
    valid = loss_mask.bool()
    # Non-loss positions may hold anything (0, NaN sentinels): neutralise them first so a
    # NaN there can never leak into the mask through comparisons.
    old = torch.where(valid, old_logprobs, new)
    div = binary_tv(new, old) if divergence == "tv" else binary_kl(new, old)
    log_ratio = new - old  # r > 1  <=>  log r > 0 (same direction test as pi > mu)
    too_far = div > delta
    blocked = too_far & (((advantages > 0) & (log_ratio > 0)) | ((advantages < 0) & (log_ratio < 0)))
    return (valid & ~blocked).to(new_logprobs.dtype)


@dataclass
class LossStats:
    """Additive statistics of the policy loss over loss tokens (max_* combine by max)."""

    tokens: float = 0.0  # loss tokens (sampled tokens)
    kept: float = 0.0  # loss tokens whose gradient is not blocked by the mask / clip
    clipped: float = 0.0  # GRPO: tokens where the clipped branch is active
    loss_sum: float = 0.0  # sum of per-token losses
    ratio_sum: float = 0.0
    ratio_sq_sum: float = 0.0
    diff_sum: float = 0.0  # |log pi - log mu|
    diff_sq_sum: float = 0.0
    diff_max: float = 0.0
    reverse_kl_sum: float = 0.0  # mu * (log mu - log pi)

    def add(self, other: "LossStats") -> None:
        for f in fields(self):
            a, b = getattr(self, f.name), getattr(other, f.name)
            setattr(self, f.name, max(a, b) if f.name.endswith("_max") else a + b)

    def as_tensor(self) -> torch.Tensor:
        return torch.tensor([getattr(self, f.name) for f in fields(self)], dtype=torch.float64)

    @classmethod
    def from_tensor(cls, t: torch.Tensor) -> "LossStats":
        return cls(*[float(x) for x in t.tolist()])

    @staticmethod
    def max_fields() -> list[bool]:
        return [f.name.endswith("_max") for f in fields(LossStats)]

    def summarize(self, loss_fn: str = "dppo") -> dict[str, float]:
        n = max(self.tokens, 1.0)
        diff_mean = self.diff_sum / n
        ratio_mean = self.ratio_sum / n
        return {
            "debug/dppo_mask_frac_kept": self.kept / n,
            "debug/vllm_vs_local_logprob_diff_mean": diff_mean,
            "debug/vllm_vs_local_logprob_diff_max": self.diff_max,
            "debug/vllm_vs_local_logprob_diff_std": max(self.diff_sq_sum / n - diff_mean**2, 0.0) ** 0.5,
            "debug/vllm_local_reverse_kl": self.reverse_kl_sum / n,
            "val/ratio": ratio_mean,
            "val/ratio_var": max(self.ratio_sq_sum / n - ratio_mean**2, 0.0),
            "loss/policy_avg": self.loss_sum / n,
            # Always 0 under DPPO: there is no second (clipped) branch.
            "policy/clipfrac_avg": self.clipped / n if loss_fn == "grpo" else 0.0,
            "learner/loss_tokens": self.tokens,
        }


def policy_loss(
    new_logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    cfg: LossConfig | None = None,
    denominator: float | torch.Tensor | None = None,
) -> tuple[torch.Tensor, LossStats]:
    """Token-sum of the DPPO (or GRPO) loss divided by `denominator`.

    `denominator` defaults to the number of loss tokens here; a data-parallel caller passes
    the global count over all ranks and micro-batches. Returns the scalar loss and the
    statistics of this call.
    """
    cfg = cfg or LossConfig()
    if not (new_logprobs.shape == old_logprobs.shape == advantages.shape == loss_mask.shape):
        raise ValueError(
            "shape mismatch: new_logprobs "
            f"{tuple(new_logprobs.shape)}, old_logprobs {tuple(old_logprobs.shape)}, "
            f"advantages {tuple(advantages.shape)}, loss_mask {tuple(loss_mask.shape)}"
        )
    valid = loss_mask.bool()
    w = valid.to(new_logprobs.dtype)
    # Zero everything outside the loss tokens before exp so sentinels or NaNs there cannot
    # produce inf * 0 = NaN in the sum or its gradient.
    old = torch.where(valid, old_logprobs.to(new_logprobs.dtype), new_logprobs.detach())
    adv = torch.where(valid, advantages.to(new_logprobs.dtype), torch.zeros_like(new_logprobs))
    log_ratio = torch.where(valid, new_logprobs - old, torch.zeros_like(new_logprobs))
    ratio = torch.exp(log_ratio)  # no cap: gradient flows through r

    clipped = torch.zeros_like(w)
    if cfg.loss_fn == "dppo":
        mask = dppo_mask(new_logprobs, old, adv, w, cfg.delta, cfg.divergence)
        per_token = -adv * ratio * mask
        kept = mask
    else:
        # PPO clipped surrogate against the sampler log-probs (the paper's GRPO baseline).
        pg1 = -adv * ratio
        pg2 = -adv * ratio.clamp(1 - cfg.clip_low, 1 + cfg.clip_high)
        per_token = torch.maximum(pg1, pg2) * w
        with torch.no_grad():
            clipped = (pg2 > pg1).to(w.dtype) * w
        kept = w - clipped

    if denominator is None:
        denominator = w.sum().clamp_min(1.0)
    loss = per_token.sum() / denominator

    with torch.no_grad():
        r = ratio.detach() * w
        diff = (new_logprobs.detach() - old).abs() * w
        mu = _probs(old) * w
        stats = LossStats(
            tokens=float(w.sum()),
            kept=float(kept.sum()),
            clipped=float(clipped.sum()),
            loss_sum=float(per_token.detach().sum()),
            ratio_sum=float(r.sum()),
            ratio_sq_sum=float((r * r).sum()),
            diff_sum=float(diff.sum()),
            diff_sq_sum=float((diff * diff).sum()),
            diff_max=float(diff.max()) if diff.numel() else 0.0,
            reverse_kl_sum=float((mu * (old - new_logprobs.detach())).sum()),
        )
    return loss, stats
