"""Training objectives as pure tensor functions returning ``(loss, metrics)`` (docs/algorithms.md §4-6).

``loss`` is a 0-d float32 tensor carrying the graph. ``metrics`` maps names to **detached 0-d float32
tensors** on the loss's device, so a caller can average them over micro-batches and all-reduce them
across ranks before calling ``.item()`` once per step (no host sync inside the loop).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch

NFT_DECAY_SCHEDULES = ("copy", "linear", "delayed", "awm")
AWM_ADVANTAGE_WEIGHTS = ("official", "flow_factory")  # awm_advantages' forms, named by source
AWM_OLD_KL = ("official", "flow_factory")  # the old-policy term: only beside a reference term, or on its own
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
              valid: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO-clipped GRPO loss ``mean(max(-A*ratio, -A*clamp(ratio, 1±clip_range)))`` with ``ratio = exp(lp - old)``.

    All inputs are (B,). Metrics: policy_loss, clipfrac (``|ratio-1| > clip_range``), approx_kl
    (``½ mean((lp-old)²)``), ratio_mean, ratio_std (population), ratio_min, ratio_max. ``valid`` (B,) bool: the rows
    clipfrac and approx_kl average (a padded micro-batch's real samples; None = all).
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
        "clipfrac": _mean(((r - 1.0).abs() > clip_range).float(), valid),
        "approx_kl": 0.5 * _mean((_d(lp) - old).pow(2), valid),
        "ratio_mean": r.mean(),
        "ratio_std": r.std(correction=0),
        "ratio_min": r.min(),
        "ratio_max": r.max(),
    }
    return loss, metrics


def _step_inputs(log_prob: torch.Tensor, old_log_prob: torch.Tensor, advantages: torch.Tensor, mean: torch.Tensor,
                 old_mean: torch.Tensor, std: torch.Tensor | float):
    """float32 ``(lp, old, adv, mean_dims((mean - old_mean)²) (B,), std (B,) or 0-d)``; only lp/mean keep graph."""
    lp = log_prob.to(torch.float32)
    old = old_log_prob.detach().to(torch.float32)
    adv = advantages.detach().to(torch.float32)
    drift = _mean_dims((mean.to(torch.float32) - old_mean.detach().to(torch.float32)).pow(2))
    return lp, old, adv, drift, _per_sample(std, lp).detach()


def _ratio_metrics(r: torch.Tensor) -> dict[str, torch.Tensor]:
    return {"ratio_mean": r.mean(), "ratio_std": r.std(correction=0), "ratio_min": r.min(), "ratio_max": r.max()}


def _reduce(x: torch.Tensor, weights: torch.Tensor | None) -> torch.Tensor:
    """A per-sample loss term (B,) over the micro-batch: its mean, or with ``weights`` (B,) the weighted sum
    ``sum(weights * x)`` (--shuffle_micro_batches: weights that make an optimizer step the mean over its samples on
    any world size, 0 for a rank's padding)."""
    return x.mean() if weights is None else (x * weights.to(device=x.device, dtype=x.dtype)).sum()


def _mean(x: torch.Tensor, valid: torch.Tensor | None) -> torch.Tensor:
    """Mean of the (B,) metric values ``x`` over the ``valid`` rows (all when None; 0 when none is valid): a padded
    micro-batch's metrics count its real samples only."""
    if valid is None:
        return x.mean()
    v = valid.to(device=x.device, dtype=x.dtype)
    return (x * v).sum() / v.sum().clamp(min=1.0)


def grpo_guard_loss(log_prob: torch.Tensor, old_log_prob: torch.Tensor, advantages: torch.Tensor, mean: torch.Tensor,
                    old_mean: torch.Tensor, std: torch.Tensor | float, sqrt_neg_dt: torch.Tensor | float,
                    clip_range: float, valid: torch.Tensor | None = None
                    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GRPO-Guard (arXiv 2510.22319): PPO-clipped GRPO on a re-centred, step-normalised ratio.

    Per sample ``i`` (``std_i`` = the std of ``x'`` given ``x`` = ``s·sqrt(-dt)``, i.e. the references'
    ``sqrt(-dt)·std_dev_t`` with ``std_dev_t`` the noise scale *without* sqrt(-dt)):

    - bias ``b_i = mean_dims((mean_i - old_mean_i)²) / (2·std_i²)`` (a mean over the latent dims, not a sum; it keeps
      the graph through ``mean``, as in both references)
    - ratio ``ρ_i = exp((lp_i - old_i + b_i) · std_i)``
    - ``loss = mean_i( max(-A_i·ρ_i, -A_i·clamp(ρ_i, 1±clip_range)) / sqrt_neg_dt_i² )`` (rescale after the max).

    Why: with ``x' = old_mean + std·ε`` the Gaussian log-ratio is ``mean(ε·Δ)/std - mean(Δ²)/(2std²)``
    (``Δ = mean - old_mean``): the second term biases every ratio below 1 (more so at small std), so PPO clips
    positive-advantage samples late and negative ones early. Adding ``b`` removes it and scaling by ``std`` leaves
    ``log ρ = mean_dims(ε·Δ)`` (unbiased, zero-mean under the rollout noise, comparable across steps); ``1/(-dt)``
    evens the per-step gradient magnitude. Defined for ``POLICY_LOSS_TABLE["guard"]``'s SDE types (flow_sde,
    dance_sde: a Gaussian step with the full log-density and std ∝ sqrt(-dt)); not for cps (its ``refusals``).
    ``std`` must be > 0.

    Inputs: ``log_prob``/``old_log_prob``/``advantages`` (B,); ``mean`` (B, ...) the current policy's step mean
    (carries the graph), ``old_mean`` (B, ...) the rollout policy's (detached); ``std``/``sqrt_neg_dt`` float, 0-d or
    (B,). Advantages are used as given (clamp them upstream, docs/algorithms.md §3; verl-omni clamps inside the loss).
    Recommended ``clip_range`` = 2e-6 (verl-omni docs/algo/grpo_guard.md and
    examples/grpoguard_trainer/qwen_image/run_qwen_image_ocr_lora.sh: ``clip_ratio=2e-6``), far below GRPO's 1e-4
    because ``log ρ`` is the log-ratio times ``std``.

    Sources: verl-omni verl_omni/trainer/diffusion/diffusion_algos.py ``GRPOGuardLoss.compute_loss`` (L467-567) and
    docs/algo/grpo_guard.md; Flow-Factory src/flow_factory/trainers/grpo.py ``GRPOGuardTrainer.optimize`` (L500-510,
    same ratio ``exp((lp-old)·c + mse/(2c))``, no 1/(-dt) rescale). verl-omni uses the batch means of std_dev_t and
    sqrt_dt (one shared step); here both are per sample, which is identical when the batch shares a step.

    Metrics: policy_loss (the rescaled loss), clipfrac (``|ρ-1| > clip_range``), ratio_mean/std/min/max (of ρ,
    population std), approx_kl (``½ mean((lp-old)²)`` of the plain log-ratio, comparable with ``grpo_loss``),
    guard_bias_mean (mean ``b``); clipfrac, approx_kl and guard_bias_mean average the ``valid`` rows (as grpo_loss).
    """
    if clip_range <= 0:
        raise ValueError(f"clip_range must be > 0 (GRPO-Guard's references: 1e-4 by default, 2e-6 in verl-omni's "
                         f"Qwen-Image script), got {clip_range}")
    lp, old, adv, drift, sd = _step_inputs(log_prob, old_log_prob, advantages, mean, old_mean, std)
    sqdt = _per_sample(sqrt_neg_dt, lp).detach()
    bias = drift / (2 * sd**2)
    ratio = torch.exp((lp - old + bias) * sd)
    unclipped = -adv * ratio
    clipped = -adv * torch.clamp(ratio, 1.0 - clip_range, 1.0 + clip_range)
    loss = (torch.maximum(unclipped, clipped) / sqdt**2).mean()
    r = _d(ratio)
    metrics = {
        "policy_loss": _d(loss),
        "clipfrac": _mean(((r - 1.0).abs() > clip_range).float(), valid),
        "approx_kl": 0.5 * _mean((_d(lp) - old).pow(2), valid),
        **_ratio_metrics(r),
        "guard_bias_mean": _mean(_d(bias), valid),
    }
    return loss, metrics


def flow_dppo_loss(log_prob: torch.Tensor, old_log_prob: torch.Tensor, advantages: torch.Tensor, mean: torch.Tensor,
                   old_mean: torch.Tensor, std: torch.Tensor | float, threshold: float = 1e-5,
                   valid: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Flow-DPPO (arXiv 2606.11025): an asymmetric divergence mask on ``-A·ρ`` instead of ratio clipping.

    ``ρ = exp(lp - old)``; ``D_i = mean_dims((mean_i - old_mean_i)²) / (2·std_i²)`` with ``std`` the std of ``x'``
    given ``x`` (verl-omni's ``std_dev_t·sqrt_dt`` with its default ``add_kl_coefficient=True``; a mean over the
    latent dims): the exact KL between the two steps' Gaussians (same std), per latent element. Sample ``i`` is masked
    (contributes exactly 0 to the loss and its gradient) when ``D_i >= threshold`` and it still moves away from the
    rollout policy: ``A_i > 0 and ρ_i > 1`` or ``A_i < 0 and ρ_i < 1``; corrective updates stay.
    ``loss = mean_i(keep_i · -A_i·ρ_i)`` (divided by B, masked samples included; no clipping; the mask is a
    detached boolean, so ``ρ`` keeps its gradient wherever kept).

    Why: the PPO ratio of one high-dimensional Gaussian step is a single noisy sample, a poor trust-region proxy;
    the flow model gives the step's divergence exactly, so the trust region is enforced on ``D`` itself.

    Defined for ``POLICY_LOSS_TABLE["dppo"]``'s SDE types: any Gaussian step with a known std shared by both
    policies (flow_sde, dance_sde, and cps: its constant-dropped log_prob rescales the log-ratio by a positive factor
    without changing its sign, so the ratio's side of 1 is the same). The trainer passes ``std`` as verl-omni divides
    by (``dppo_divergence_std``: the step's std for flow_sde, ``std·sqrt(-dt)`` for dance_sde and cps). The published
    runs used flow_sde. ``std`` must be > 0 (cps's last step, sigma' = 0, has std 0).

    Inputs as ``grpo_guard_loss``. ``threshold`` ε_D > 0: 1e-5 is both the reference default and the recommended
    value (verl-omni verl_omni/workers/config/diffusion/actor.py ``kl_mask_threshold: float = 1e-5``,
    docs/algo/flowdppo.md, examples/flowdppo_trainer/qwen_image/run_qwen_image_ocr_lora.sh; UniRL
    ``FlowDPPOConfig.kl_mask_threshold = 1e-5``). Advantages are used as given (the reference does not clamp them).

    Sources: verl-omni verl_omni/trainer/diffusion/diffusion_algos.py ``FlowDPPOLoss.compute_loss`` (L362-443; the
    mask is ``D >= threshold`` there and in UniRL, ``>`` in the docs: ``>=`` is used here) and docs/algo/flowdppo.md;
    UniRL unirl/algorithms/flowdppo.py ``_flowdppo_kl_adv_loss``.

    Metrics: policy_loss, ratio_mean/std/min/max (population std), approx_kl (``½ mean((lp-old)²)``),
    dppo_divergence_mean (mean ``D``), dppo_masked_frac (share of masked samples) and clipfrac (the same value, so a
    trainer logs one name for every policy loss); approx_kl and the dppo metrics average the ``valid`` rows (as
    grpo_loss).
    """
    if threshold <= 0:
        raise ValueError(f"threshold (Flow-DPPO's divergence bound ε_D) must be > 0 (1e-5 is the reference "
                         f"default), got {threshold}")
    lp, old, adv, drift, sd = _step_inputs(log_prob, old_log_prob, advantages, mean, old_mean, std)
    div = _d(drift) / (2 * sd**2)
    ratio = torch.exp(lp - old)
    r = _d(ratio)
    masked = (div >= threshold) & (((adv > 0) & (r > 1.0)) | ((adv < 0) & (r < 1.0)))
    loss = torch.where(masked, torch.zeros((), dtype=torch.float32, device=lp.device), -adv * ratio).mean()
    masked_frac = _mean(masked.float(), valid)
    metrics = {
        "policy_loss": _d(loss),
        "clipfrac": masked_frac.clone(),
        "approx_kl": 0.5 * _mean((_d(lp) - old).pow(2), valid),
        **_ratio_metrics(r),
        "dppo_divergence_mean": _mean(div, valid),
        "dppo_masked_frac": masked_frac,
    }
    return loss, metrics


# ------------------------------------------------------------------------------------------- GRPO's policy losses
@dataclass(frozen=True)
class StepTerms:
    """One replayed SDE step of a micro-batch, as GRPO's policy losses read it: the current and the rollout's
    log-probabilities and step means, the step's std and sqrt(-dt), the advantages, and the real rows of a padded
    micro-batch (``valid``; None: every row)."""

    log_prob: torch.Tensor
    old_log_prob: torch.Tensor
    advantages: torch.Tensor
    mean: torch.Tensor | None = None
    old_mean: torch.Tensor | None = None  # the rollout's step mean: kept only for a loss with ``needs_means``
    std: torch.Tensor | float | None = None
    sqrt_neg_dt: torch.Tensor | float | None = None
    valid: torch.Tensor | None = None


@dataclass(frozen=True)
class PolicyLoss:
    """A --policy_loss: how it computes the loss of one step from ``StepTerms`` and its flags, whether the rollout must
    keep each step's mean for it (``rollout(..., keep_means=True)``), the SDE types it is defined for (None: every
    one; the reason for each refused one, else a generic one) and the metrics it logs besides loss / clipfrac."""

    compute: Callable[[StepTerms, Any], tuple[torch.Tensor, dict[str, torch.Tensor]]]
    needs_means: bool = False
    needs_step_size: bool = False  # the step's sqrt(-dt) (GRPO-Guard's rescale)
    sde_types: tuple[str, ...] | None = None
    refusals: dict[str, str] = field(default_factory=dict)
    metrics: tuple[str, ...] = ()
    clip_range: float | None = None  # the reference's default --clip_range (None: the loss does not clip)
    clip_source: str = ""  # where that default comes from (printed when --clip_range is left unset)


def dppo_divergence_std(terms: StepTerms, sde_type: str) -> torch.Tensor | float:
    """The std Flow-DPPO's divergence D divides by, as verl-omni computes it: ``std_dev_t * sqrt(-dt)`` with its
    scheduler's ``std_dev_t`` (verl_omni/trainer/diffusion/diffusion_algos.py FlowDPPOLoss, ``sigma_t = std_dev_t *
    sqrt_dt``; pipelines/schedulers/flow_match_sde.py). For flow_sde that is the step's own std; dance_sde's and
    cps's ``std_dev_t`` already is their step's std (``eta·sqrt(sigma - sigma')``, ``sigma'·sin(a·π/2)``), so verl-omni
    divides by ``std·sqrt(-dt)`` there: D is ``1/(-dt)`` times the exact per-element KL (UniRL's FlowDPPO uses the
    flow_sde formula for every type)."""
    return terms.std if sde_type == "flow_sde" else terms.std * terms.sqrt_neg_dt


# GRPO's --policy_loss table; args: the trainer's flags (--clip_range, --dppo_threshold)
POLICY_LOSS_TABLE: dict[str, PolicyLoss] = {
    "clip": PolicyLoss(lambda t, args: grpo_loss(t.log_prob, t.old_log_prob, t.advantages, args.clip_range, t.valid),
                       clip_range=1e-4, clip_source="Flow-GRPO config/base.py train.clip_range; DanceGRPO --clip_range"),
    "guard": PolicyLoss(
        lambda t, args: grpo_guard_loss(t.log_prob, t.old_log_prob, t.advantages, t.mean, t.old_mean, t.std,
                                        t.sqrt_neg_dt, args.clip_range, t.valid),
        needs_means=True, needs_step_size=True, sde_types=("flow_sde", "dance_sde"), metrics=("guard_bias_mean",),
        clip_range=1e-4, clip_source="verl-omni diffusion_actor.yaml clip_ratio 0.0001 (its Qwen-Image OCR example "
                                     "script sets 2e-6); Flow-Factory training_args.py clip_range (-1e-4, 1e-4)",
        refusals={"cps": "GRPO-Guard needs the full Gaussian log-density log p = mean(-(x'-mean)²/(2·std²)) - log std "
                         "- ½log 2π of a step whose std is s·sqrt(-dt); cps's log_prob drops the 1/(2·std²) factor, so "
                         "the bias term does not cancel the -‖Δmean‖² drift of the log-ratio, and its std "
                         "(sigma'·sin(a·π/2)) is not s·sqrt(-dt), so the 1/(-dt) rescale has no meaning (both "
                         "references run GRPO-Guard on the Flow-GRPO SDE only)"}),
    "dppo": PolicyLoss(
        lambda t, args: flow_dppo_loss(t.log_prob, t.old_log_prob, t.advantages, t.mean, t.old_mean,
                                       dppo_divergence_std(t, args.sde_type), args.dppo_threshold, t.valid),
        needs_means=True, needs_step_size=True, sde_types=("flow_sde", "dance_sde", "cps"),
        metrics=("dppo_divergence_mean", "dppo_masked_frac")),
}
POLICY_LOSSES = tuple(POLICY_LOSS_TABLE)  # clip: grpo_loss, guard: grpo_guard_loss, dppo: flow_dppo_loss


def policy_loss_sde_refusal(loss: str, sde_type: str) -> str | None:
    """Why --policy_loss ``loss`` cannot train with ``sde_type``, or None when it can."""
    if loss not in POLICY_LOSS_TABLE:
        raise ValueError(f"unknown policy loss {loss!r}; choose one of {POLICY_LOSSES}")
    entry = POLICY_LOSS_TABLE[loss]
    if entry.sde_types is None or sde_type in entry.sde_types:
        return None
    return (f"--policy_loss {loss} does not support --sde_type {sde_type} (supported: {', '.join(entry.sde_types)}): "
            + entry.refusals.get(sde_type, "not a Gaussian SDE step with a known std"))


def first_update_check(first_ratios: torch.Tensor, clip_range: float) -> tuple[dict[str, torch.Tensor], str | None]:
    """On-policy check (docs/algorithms.md §4): at the first update after a rollout the policy is the rollout one, so every
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
            weights: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Flow-GRPO's KL to the reference policy: ``mean_B( mean_dims((mean - ref_mean)²) / (2 s²) )``.

    ``std_scale`` is ``s`` (float, 0-d or (B,)): the KL noise scale (``schedulers.sde_noise_scale``, by --kl_form).
    ``ref_mean`` is detached. ``weights`` (B,), if given, replaces the mean by ``sum(weights * per-sample KL)`` (a
    trainer training a weighted selection of samples, padding at weight 0). Metric: kl.
    """
    m = mean.to(torch.float32)
    ref = ref_mean.detach().to(torch.float32)
    s = torch.as_tensor(std_scale, dtype=torch.float32, device=m.device).detach().reshape(-1)
    per_sample = _mean_dims((m - ref).pow(2)) / (2 * s**2)
    loss = per_sample.mean() if weights is None else (weights.to(per_sample) * per_sample).sum()
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
             weights: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """DiffusionNFT's forward-process objective (docs/algorithms.md §6).

    ``v± `` mix the trainable ``v_theta`` with the old policy's ``v_old`` (detached) by ``beta``;
    ``x0± = x_t - t v±``; ``L± = mean_dims((x0± - x0)²) / w±`` with the stop-gradient adaptive weight
    ``w± = clamp(mean_dims|x0± - x0|, min=1e-5)``; ``policy = mean((r L⁺ + (1-r) L⁻)/beta) * adv_clip_max``
    with ``r = nft_optimality(A)``; ``loss = policy + kl_beta * mean((v_theta - v_ref)²)`` when ``v_ref``
    is given. ``t`` is a float, 0-d or (B,). ``keep`` (B,) bool: samples to train on (a dropped sample, e.g. of a
    non-finite reward, adds exactly 0 to the loss and its gradient; the batch mean still divides by B). ``weights``
    (B,): the batch means become weighted sums ``sum(weights * .)`` (``_reduce``; --shuffle_micro_batches).
    Metrics: policy_loss, kl_loss, optimality_mean, positive_loss, negative_loss, weight_pos, weight_neg (means over
    the batch; with ``weights``, over the rows with weight > 0 that ``keep`` keeps).
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
    policy = _reduce(mask((r * l_pos + (1 - r) * l_neg) / beta), weights) * adv_clip_max
    loss = policy
    kl = torch.zeros((), dtype=torch.float32, device=xt.device)
    if v_ref is not None:
        kl = _reduce(mask(_mean_dims((vt - v_ref.detach().to(torch.float32)).pow(2))), weights)
        loss = loss + kl_beta * kl
    # a weighted (shuffled, padded) micro-batch's metrics average its trained rows only; unweighted: every row
    real = None if weights is None else (weights > 0) & (True if keep is None else keep.to(weights.device))
    metrics = {
        "policy_loss": _d(policy),
        "kl_loss": _d(kl),
        "optimality_mean": _mean(r, real),
        "positive_loss": _mean(_d(l_pos), real),
        "negative_loss": _mean(_d(l_neg), real),
        "weight_pos": _mean(w_pos, real),
        "weight_neg": _mean(w_neg, real),
    }
    return loss, metrics


def velocity_deviation(v_theta: torch.Tensor, v_old: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor:
    """NFT's ``old_deviation`` metric ``mean((v_theta - v_old)²)``: over the whole micro-batch, or (``rows`` (B,) bool,
    a padded micro-batch) the mean of the per-sample means over those rows (``_mean``)."""
    dev = (v_theta.detach() - v_old).pow(2)
    return dev.mean() if rows is None else _mean(dev.flatten(1).mean(1), rows)


def nft_old_decay(step: int, schedule: str) -> float:
    """Decay ``d`` of the old-policy update ``old <- d*old + (1-d)*theta`` after training step ``step``.

    ``copy``: 0; ``linear``: ``min(0.001*step, 0.5)``; ``delayed``: 0 before step 75, then
    ``min(0.0075*(step-75), 0.999)``; ``awm``: ``min(0.001*step, 0.3)`` (AWM's KL-anchor policy:
    scxue/advantage_weighted_matching train_sd3_awm.py, kl_ema_decay_type "linear", kl_ema_decay 0.3).
    """
    if schedule == "copy":
        return 0.0
    if schedule == "linear":
        return min(0.001 * step, 0.5)
    if schedule == "delayed":
        return 0.0 if step < 75 else min(0.0075 * (step - 75), 0.999)
    if schedule == "awm":
        return min(0.001 * step, 0.3)
    raise ValueError(f"unknown old-policy decay schedule {schedule!r}; choose one of {NFT_DECAY_SCHEDULES}")


# ---- Advantage Weighted Matching (AWM; Xue et al., arXiv:2509.25050) -----------------------------------------------
AWM_WEIGHTINGS = ("uniform", "t", "t2", "huber", "ghuber")


def awm_log_prob(v: torch.Tensor, x0: torch.Tensor, eps: torch.Tensor, t: torch.Tensor | float, *,
                 weighting: str = "ghuber", ghuber_power: float = 0.25) -> torch.Tensor:
    """AWM's per-sample log-likelihood proxy ``-w(l, t)`` (B,) float32 of the velocity ``v`` predicted at
    ``x_t = (1-t) x0 + t eps``: ``l = mean_dims((v - (eps - x0))²)`` (the flow-matching loss) under ``weighting``:
    uniform ``l`` | t ``t l`` | t2 ``t² l`` | huber ``t (sqrt(l + 1e-10) - 1e-5)`` | ghuber
    ``t/p ((l + 1e-10)^p - 1e-10^p)`` with ``p = ghuber_power``. Only ``v`` keeps its graph. Source:
    scxue/advantage_weighted_matching scripts/train_sd3_awm.py ``compute_log_prob_awm`` (= X-GenGroup/Flow-Factory
    src/flow_factory/trainers/awm.py ``compute_weighted_log_prob``; both compute it in float64, we in float32)."""
    err = flow_matching_error(v, eps.detach().to(torch.float32) - x0.detach().to(torch.float32))  # (B,)
    tt = _per_sample(t, err).detach()
    if weighting == "uniform":
        w = err
    elif weighting == "t":
        w = tt * err
    elif weighting == "t2":
        w = tt.pow(2) * err
    elif weighting == "huber":
        w = tt * (torch.sqrt(err + 1e-10) - 1e-5)
    elif weighting == "ghuber":
        if ghuber_power <= 0:
            raise ValueError(f"ghuber_power must be > 0, got {ghuber_power}")
        w = tt / ghuber_power * ((err + 1e-10).pow(ghuber_power) - 1e-10 ** ghuber_power)
    else:
        raise ValueError(f"unknown AWM weighting {weighting!r}; choose one of {AWM_WEIGHTINGS}")
    return -w


def awm_advantages(advantages: torch.Tensor, adv_clip_max: float = 5.0, advantage_max: float = 1.0,
                   form: str = "official") -> torch.Tensor:
    """AWM's advantage weights (float32, detached, NaN -> 0). ``official``: ``clamp(A, ±adv_clip_max) / adv_clip_max
    * advantage_max``, as scxue/advantage_weighted_matching scripts/train_sd3_awm.py (config.train.adv_clip_max 5,
    config.train.advantage_max 1: weights in [-1, 1]); ``flow_factory``: ``clamp(A, ±adv_clip_max)``, no division, as
    X-GenGroup/Flow-Factory src/flow_factory/trainers/awm.py (adv_clip_range; its AWM examples 1.0). With
    ``adv_clip_max`` 1 the two agree; at 5 the official weight of |A| < 5 is 5x smaller."""
    if adv_clip_max <= 0:
        raise ValueError(f"adv_clip_max must be > 0, got {adv_clip_max}")
    if form not in AWM_ADVANTAGE_WEIGHTS:
        raise ValueError(f"--awm_advantage_weight must be one of {AWM_ADVANTAGE_WEIGHTS}, got {form!r}")
    a = torch.nan_to_num(advantages.detach().to(torch.float32), nan=0.0).clamp(-adv_clip_max, adv_clip_max)
    return a / adv_clip_max * advantage_max if form == "official" else a


def awm_loss(v_theta: torch.Tensor, x0: torch.Tensor, eps: torch.Tensor, t: torch.Tensor | float,
             advantages: torch.Tensor, *, old_log_prob: torch.Tensor | None = None, weighting: str = "ghuber",
             ghuber_power: float = 0.25, clip_range: float = 1.0, adv_clip_max: float = 5.0,
             advantage_max: float = 1.0, v_ref: torch.Tensor | None = None, kl_beta: float = 0.0,
             v_old: torch.Tensor | None = None, old_kl_beta: float = 0.0, keep: torch.Tensor | None = None,
             weights: torch.Tensor | None = None, advantage_weight: str = "official",
             old_kl: str = "flow_factory") -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Advantage Weighted Matching (Xue et al., arXiv:2509.25050): the flow-matching loss of the policy on its own
    samples ``x0``, weighted by their group advantages, in the PPO-clipped form of the published code.

    ``lp = awm_log_prob(v_theta, x0, eps, t)`` (B,); ``old`` = ``old_log_prob`` (detached) or, if None, ``lp``
    detached (the trained policy sampled the rollout: ratio == 1, and the gradient is exactly that of
    ``mean(a * w(l, t))``, the advantage-weighted matching loss: a positive advantage pulls ``v_theta`` towards the
    target ``eps - x0``, a negative one pushes it away); ``ratio = exp(lp - old)``; ``a = awm_advantages(A)``;
    ``policy = mean(max(-a ratio, -a clamp(ratio, 1 - clip_range, 1 + clip_range)))``;
    ``loss = policy + kl_beta mean(mean_dims((v_theta - v_ref)²)) + old_kl_beta mean(mean_dims((v_theta - v_old)²))``
    (each distance when its velocity is given; ``old_kl`` "official": the old-policy term only with ``kl_beta > 0``,
    as train_sd3_awm.py nests ema_beta's term in ``if beta > 0``; "flow_factory": on its own, as its ema_kl_beta).
    ``advantage_weight``: ``awm_advantages``'s form. ``t`` a float, 0-d or (B,); ``keep`` (B,) bool as in ``nft_loss`` (a
    dropped sample adds exactly 0; the batch mean still divides by B); ``weights`` (B,) as in ``nft_loss``.
    Sources: scxue/advantage_weighted_matching scripts/train_sd3_awm.py (loss_type "exp_first", config.train.advantage_max, clip_range, beta and ema_beta with
    kl_weight "Uniform"); X-GenGroup/Flow-Factory src/flow_factory/trainers/awm.py ``AWMTrainer.optimize`` (kl_beta,
    ema_kl_beta). Metrics (means over the kept samples): policy_loss, kl_loss, old_kl_loss, matching_loss (l),
    weighted_matching (w), ratio_mean, clipfrac (``|ratio-1| > clip_range``), approx_kl (``½ (lp-old)²``).
    """
    if clip_range <= 0:
        raise ValueError(f"clip_range must be > 0, got {clip_range}")
    kept = None if keep is None else keep.to(v_theta.device)

    def mask(x: torch.Tensor) -> torch.Tensor:  # a dropped sample's rows -> 0: exactly 0 in loss and gradient
        return x if kept is None else torch.where(kept.reshape(-1, *[1] * (x.ndim - 1)), x, 0.0)

    # masked before any arithmetic, so a dropped sample's non-finite latents or velocity (a NaN image) reach nothing
    vt, x0f, epsf = (mask(x.to(torch.float32)) for x in (v_theta, x0.detach(), eps.detach()))
    lp = awm_log_prob(vt, x0f, epsf, t, weighting=weighting, ghuber_power=ghuber_power)  # (B,)
    old = lp.detach() if old_log_prob is None else mask(old_log_prob.detach().to(torch.float32).reshape(lp.shape))
    a = awm_advantages(advantages, adv_clip_max, advantage_max, advantage_weight).to(lp.device)
    count = float(lp.shape[0]) if kept is None else kept.sum().clamp(min=1).to(torch.float32)

    def kept_mean(x: torch.Tensor) -> torch.Tensor:  # metrics: no boolean indexing (a host sync on a GPU)
        return mask(_d(x)).sum() / count

    ratio = torch.exp(lp - old)
    per_sample = torch.maximum(-a * ratio, -a * torch.clamp(ratio, 1.0 - clip_range, 1.0 + clip_range))
    policy = _reduce(mask(per_sample), weights)
    loss = policy
    distances = {}
    if old_kl not in AWM_OLD_KL:
        raise ValueError(f"--awm_old_kl must be one of {AWM_OLD_KL}, got {old_kl!r}")
    if old_kl == "official" and not kl_beta > 0:
        v_old = None  # the official code adds the EMA term only beside a reference term
    for name, v_other, weight in (("kl_loss", v_ref, kl_beta), ("old_kl_loss", v_old, old_kl_beta)):
        distances[name] = torch.zeros((), dtype=torch.float32, device=lp.device)
        if v_other is not None:
            distances[name] = _reduce(mask(_mean_dims((vt - mask(v_other.detach().to(torch.float32))).pow(2))),
                                      weights)
            loss = loss + weight * distances[name]
    r = _d(ratio)
    metrics = {
        "policy_loss": _d(policy),
        **{name: _d(value) for name, value in distances.items()},
        "matching_loss": kept_mean(flow_matching_error(_d(vt), epsf - x0f)),
        "weighted_matching": kept_mean(-lp),
        "ratio_mean": kept_mean(r),
        "clipfrac": kept_mean(((r - 1.0).abs() > clip_range).float()),
        "approx_kl": kept_mean(0.5 * (_d(lp) - old).pow(2)),
    }
    return loss, metrics
