"""Training objectives as pure tensor functions returning ``(loss, metrics)`` (REFERENCE §4-6).

``loss`` is a 0-d float32 tensor carrying the graph. ``metrics`` maps names to **detached 0-d float32
tensors** on the loss's device, so a caller can average them over micro-batches and all-reduce them
across ranks before calling ``.item()`` once per step (no host sync inside the loop).
"""
from __future__ import annotations

import torch

NFT_DECAY_SCHEDULES = ("copy", "linear", "delayed")
NFT_ADV_MODES = ("all", "positive_only", "negative_only", "binary")


def _mean_dims(x: torch.Tensor) -> torch.Tensor:
    return x.mean(dim=tuple(range(1, x.ndim))) if x.ndim > 1 else x


def _per_sample(x: torch.Tensor | float, ref: torch.Tensor) -> torch.Tensor:
    """A float, 0-d or (B,)/(B,1,..) tensor as float32 broadcastable against ``ref`` (B, ...)."""
    t = torch.as_tensor(x, dtype=torch.float32, device=ref.device)
    if t.numel() == 1:
        return t.reshape(())
    return t.reshape(ref.shape[0], *([1] * (ref.ndim - 1)))


def _d(x: torch.Tensor) -> torch.Tensor:
    return x.detach().to(torch.float32)


def grpo_loss(log_prob: torch.Tensor, old_log_prob: torch.Tensor, advantages: torch.Tensor, clip_range: float,
              ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO-clipped GRPO loss ``mean(max(-A*ratio, -A*clamp(ratio, 1±clip_range)))`` with ``ratio = exp(lp - old)``.

    All inputs are (B,). Metrics: policy_loss, clipfrac (``|ratio-1| > clip_range``), approx_kl
    (``½ mean((lp-old)²)``), ratio_mean, ratio_std (population), ratio_min, ratio_max.
    """
    if clip_range <= 0:
        raise ValueError(f"clip_range must be > 0, got {clip_range}")
    lp = log_prob.to(torch.float32)
    old = old_log_prob.detach().to(torch.float32)
    adv = advantages.detach().to(torch.float32)
    ratio = torch.exp(lp - old)
    unclipped = -adv * ratio
    clipped = -adv * torch.clamp(ratio, 1.0 - clip_range, 1.0 + clip_range)
    loss = torch.maximum(unclipped, clipped).mean()
    r = _d(ratio)
    metrics = {
        "policy_loss": _d(loss),
        "clipfrac": ((r - 1.0).abs() > clip_range).float().mean(),
        "approx_kl": 0.5 * (_d(lp) - old).pow(2).mean(),
        "ratio_mean": r.mean(),
        "ratio_std": r.std(correction=0),
        "ratio_min": r.min(),
        "ratio_max": r.max(),
    }
    return loss, metrics


def first_update_check(first_ratios: torch.Tensor, clip_range: float) -> tuple[dict[str, torch.Tensor], str | None]:
    """On-policy check (REFERENCE §4): at the first update after a rollout the policy is the rollout policy, so every
    ratio is 1 up to float noise. Returns the metrics ``ratio_first_update`` (mean), ``ratio_first_update_max_dev``
    (max |ratio - 1|) and ``clipfrac_first_update`` (share with |ratio - 1| > clip_range), and a warning when the
    deviation exceeds ``clip_range / 10`` or any sample is already clipped: a replay mismatch at the clip scale
    silently zeroes those samples' gradients (dtype, batch composition, dropout or timestep rounding differ).
    """
    dev = (_d(first_ratios) - 1.0).abs()
    metrics = {"ratio_first_update": _d(first_ratios).mean(), "ratio_first_update_max_dev": dev.max(),
               "clipfrac_first_update": (dev > clip_range).float().mean()}
    warning = None
    if float(metrics["ratio_first_update_max_dev"]) > clip_range / 10 or float(metrics["clipfrac_first_update"]) > 0:
        warning = (f"the ratio at the first update after the rollout is off by up to "
                   f"{float(metrics['ratio_first_update_max_dev']):.2e} (clip_range {clip_range:g}; "
                   f"{100 * float(metrics['clipfrac_first_update']):.1f}% of samples clipped before any update): the "
                   "replay does not match the rollout (dtype, batch composition, dropout or timestep rounding differ)")
    return metrics, warning


def kl_loss(mean: torch.Tensor, ref_mean: torch.Tensor, std_scale: torch.Tensor | float,
            ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Flow-GRPO's KL to the reference policy: ``mean_B( mean_dims((mean - ref_mean)²) / (2 s²) )``.

    ``std_scale`` is ``s`` (float, 0-d or (B,)): the noise scale without ``sqrt(-dt)``
    (``schedulers.sde_noise_scale``). ``ref_mean`` is detached. Metric: kl.
    """
    m = mean.to(torch.float32)
    ref = ref_mean.detach().to(torch.float32)
    s = torch.as_tensor(std_scale, dtype=torch.float32, device=m.device).detach().reshape(-1)
    per_sample = _mean_dims((m - ref).pow(2)) / (2 * s**2)
    loss = per_sample.mean()
    return loss, {"kl": _d(loss)}


def flow_matching_error(pred: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Per-sample velocity error ``mean_dims((v_hat - v*)²)`` (B,), float32 (Diffusion-DPO's ``err``)."""
    return _mean_dims((pred.to(torch.float32) - target.to(torch.float32)).pow(2))


def dpo_loss(err_w: torch.Tensor, err_l: torch.Tensor, ref_err_w: torch.Tensor, ref_err_l: torch.Tensor, *,
             beta: float, weights: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Diffusion-DPO: ``-logsigmoid(-½β((err_w - ref_w) - (err_l - ref_l)))`` per pair, averaged (all inputs (B,)).

    ``err_*`` are the policy's per-sample errors (``flow_matching_error``) on the winner/loser, ``ref_*``
    the reference's (detached). ``weights`` (B,), if given, replaces the mean by ``sum(weights * per-pair loss)``
    (a trainer spreading a step's pairs over ranks passes ``1 / pairs`` and 0 for padding). Metrics: ``dpo_metrics``
    of these pairs (padding included; a trainer with padding computes them over the real pairs).
    """
    if beta <= 0:
        raise ValueError(f"beta must be > 0 (2000 is a good FLUX default), got {beta}")
    ew, el = err_w.to(torch.float32), err_l.to(torch.float32)
    diff_w = ew - ref_err_w.detach().to(torch.float32)
    diff_l = el - ref_err_l.detach().to(torch.float32)
    per_pair = -torch.nn.functional.logsigmoid(-0.5 * beta * (diff_w - diff_l))
    loss = per_pair.mean() if weights is None else (weights.to(per_pair) * per_pair).sum()
    metrics = {"dpo_loss": _d(loss), **dpo_metrics(_d(diff_w), _d(diff_l), beta),
               "err_w": _d(ew).mean(), "err_l": _d(el).mean()}
    return loss, metrics


def dpo_pair_metrics(err_w: torch.Tensor, err_l: torch.Tensor, ref_err_w: torch.Tensor, ref_err_l: torch.Tensor,
                     beta: float) -> dict[str, torch.Tensor]:
    """A trainer's step metrics over all its pairs (gathered, padding removed; (N,) each): ``loss`` (the unweighted
    mean DPO loss), ``dpo_metrics``, and the policy's mean errors ``err_w`` / ``err_l``. NaN when N = 0."""
    diff_w, diff_l = err_w - ref_err_w, err_l - ref_err_l
    loss = -torch.nn.functional.logsigmoid(-0.5 * beta * (diff_w - diff_l)).mean()
    return {"loss": loss, **dpo_metrics(diff_w, diff_l, beta), "err_w": err_w.mean(), "err_l": err_l.mean()}


def dpo_metrics(diff_w: torch.Tensor, diff_l: torch.Tensor, beta: float) -> dict[str, torch.Tensor]:
    """Diffusion-DPO diagnostics from ``diff_w = err_w - ref_w`` and ``diff_l = err_l - ref_l`` (B,): implicit_acc
    (``mean(inside > 0)``), implicit_margin (``mean(inside)``: implicit reward of the winner minus the loser's),
    reward_chosen / reward_rejected (``-½β·diff``), err_diff_w, err_diff_l (their means)."""
    inside = -0.5 * beta * (diff_w - diff_l)
    return {
        "implicit_acc": (inside > 0).float().mean(),
        "implicit_margin": inside.mean(),
        "reward_chosen": (-0.5 * beta * diff_w).mean(),
        "reward_rejected": (-0.5 * beta * diff_l).mean(),
        "err_diff_w": diff_w.mean(),
        "err_diff_l": diff_l.mean(),
    }


def nft_optimality(advantages: torch.Tensor, adv_clip_max: float = 5.0) -> torch.Tensor:
    """DiffusionNFT's optimality probability ``r = clamp(clamp(A, ±c)/c/2 + ½, 0, 1)`` (float32)."""
    a = advantages.detach().to(torch.float32).clamp(-adv_clip_max, adv_clip_max)
    return (a / adv_clip_max / 2.0 + 0.5).clamp(0.0, 1.0)


def nft_advantages(advantages: torch.Tensor, mode: str, adv_clip_max: float = 5.0) -> torch.Tensor:
    """DiffusionNFT's ``--adv_mode`` on the (clipped) advantages before ``nft_optimality``: ``all`` keeps them,
    ``positive_only`` / ``negative_only`` clamp them to >= 0 / <= 0 (r >= 1/2 / r <= 1/2: only the positive / implicit
    negative target pulls), ``binary`` takes their sign (r in {1/2 - 1/(2c), 1/2, 1/2 + 1/(2c)}, as the published
    code does)."""
    a = advantages.detach().to(torch.float32).clamp(-adv_clip_max, adv_clip_max)
    if mode == "all":
        return a
    if mode == "positive_only":
        return a.clamp(min=0.0)
    if mode == "negative_only":
        return a.clamp(max=0.0)
    if mode == "binary":
        return torch.sign(a)
    raise ValueError(f"unknown --adv_mode {mode!r}; choose one of {NFT_ADV_MODES}")


def nft_loss(v_theta: torch.Tensor, v_old: torch.Tensor, x_t: torch.Tensor, x0: torch.Tensor,
             t: torch.Tensor | float, advantages: torch.Tensor, *, beta: float = 1.0, adv_clip_max: float = 5.0,
             v_ref: torch.Tensor | None = None, kl_beta: float = 0.0, keep: torch.Tensor | None = None,
             ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """DiffusionNFT's forward-process objective (REFERENCE §6).

    ``v± `` mix the trainable ``v_theta`` with the old policy's ``v_old`` (detached) by ``beta``;
    ``x0± = x_t - t v±``; ``L± = mean_dims((x0± - x0)²) / w±`` with the stop-gradient adaptive weight
    ``w± = clamp(mean_dims|x0± - x0|, min=1e-5)``; ``policy = mean((r L⁺ + (1-r) L⁻)/beta) * adv_clip_max``
    with ``r = nft_optimality(A)``; ``loss = policy + kl_beta * mean((v_theta - v_ref)²)`` when ``v_ref``
    is given. ``t`` is a float, 0-d or (B,). ``keep`` (B,) bool: samples to train on (a dropped sample, e.g. of a
    non-finite reward, adds exactly 0 to the loss and its gradient; the batch mean still divides by B).
    Metrics: policy_loss, kl_loss, optimality_mean, positive_loss, negative_loss, weight_pos, weight_neg (means over
    the batch).
    """
    if beta <= 0:
        raise ValueError(f"beta (the NFT mixing coefficient) must be > 0, got {beta}")
    vt = v_theta.to(torch.float32)
    vo = v_old.detach().to(torch.float32)
    xt = x_t.detach().to(torch.float32)
    x0f = x0.detach().to(torch.float32)
    tt = _per_sample(t, xt)
    r = nft_optimality(torch.nan_to_num(advantages.detach().float(), nan=0.0), adv_clip_max).to(xt.device)
    mask = (lambda x: x) if keep is None else (lambda x: torch.where(keep.to(x.device), x, 0.0))  # noqa: E731

    v_pos = beta * vt + (1 - beta) * vo
    v_neg = (1 + beta) * vo - beta * vt
    x0_pos = xt - tt * v_pos
    x0_neg = xt - tt * v_neg
    with torch.no_grad():
        w_pos = _mean_dims((x0_pos - x0f).abs()).clamp(min=1e-5)
        w_neg = _mean_dims((x0_neg - x0f).abs()).clamp(min=1e-5)
    l_pos = _mean_dims((x0_pos - x0f).pow(2)) / w_pos
    l_neg = _mean_dims((x0_neg - x0f).pow(2)) / w_neg
    policy = mask((r * l_pos + (1 - r) * l_neg) / beta).mean() * adv_clip_max
    loss = policy
    kl = torch.zeros((), dtype=torch.float32, device=xt.device)
    if v_ref is not None:
        kl = mask(_mean_dims((vt - v_ref.detach().to(torch.float32)).pow(2))).mean()
        loss = loss + kl_beta * kl
    metrics = {
        "policy_loss": _d(policy),
        "kl_loss": _d(kl),
        "optimality_mean": r.mean(),
        "positive_loss": _d(l_pos).mean(),
        "negative_loss": _d(l_neg).mean(),
        "weight_pos": w_pos.mean(),
        "weight_neg": w_neg.mean(),
    }
    return loss, metrics


def nft_old_decay(step: int, schedule: str) -> float:
    """Decay ``d`` of the old-policy update ``old <- d*old + (1-d)*theta`` after training step ``step``.

    ``copy``: 0; ``linear``: ``min(0.001*step, 0.5)``; ``delayed``: 0 before step 75, then
    ``min(0.0075*(step-75), 0.999)``.
    """
    if schedule == "copy":
        return 0.0
    if schedule == "linear":
        return min(0.001 * step, 0.5)
    if schedule == "delayed":
        return 0.0 if step < 75 else min(0.0075 * (step - 75), 0.999)
    raise ValueError(f"unknown old-policy decay schedule {schedule!r}; choose one of {NFT_DECAY_SCHEDULES}")
