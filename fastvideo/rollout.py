"""Batched trajectory sampling with per-step log-probs, the SDE window, and training replay.

``rollout`` runs the sampler for a rank's samples in micro-batches of ``cfg.batch_size`` (one transformer
call per micro-batch and step, never per sample) and records every latent. Randomness follows
docs/design.md principle 4, keyed by ``(step, prompt_id, sample_index, purpose)`` on the ``NoiseSource``:

- ``"init"``: initial noise (L, C); with ``init_same_noise`` every sample of a group uses sample_index 0.
- ``"sde"``: the SDE noise of all steps at once, (S, L, C), per sample.
- ``"window"``: the SDE window start, keyed by ``(step, prompt_id, 0)`` so a prompt group shares it.
- ``"timesteps"``: the per-sample permutation of ``select_trained_timesteps`` (DanceGRPO mode).
- ``"dpo_eps"`` / ``"dpo_sigma"``: the forward-process noise and logit-normal sigma of a DPO pair, keyed by
  ``(step, pair key, 0)``, so both images of a pair share them (``noised_velocity`` evaluates the model there).

So a sample's trajectory does not depend on the batch it was sampled in, the micro-batch size or the
world size (up to the kernels' batch-size dependence). The SDE maths runs in float32 even when the
transformer runs under ``torch.autocast``. ``eta == 0`` means a deterministic (ODE) rollout, with the Euler
step or, with ``solver="dpm2"``, DPM-Solver++(2M) (``schedulers.dpm2_step``, DiffusionNFT's old-policy sampler).
"""
from __future__ import annotations

import argparse
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch

from fastvideo import devices, flops, models
from fastvideo.losses import flow_matching_error
from fastvideo.options import need, note_default, opt
from fastvideo.schedulers import (ODE_SOLVERS, SDE_TYPES, dpm2_step, get_sigmas, ode_step, sde_noise_scale,
                                  sde_step_with_logprob)
from fastvideo.seeding import NoiseSource


LAST_STEP_MODES = ("sde", "ode")
WINDOW_SCHEDULES = ("random", "sliding", "sliding_hold", "progressive")
TIMESTEP_SELECTIONS = ("random", "first")
AWM_TIME_TYPES = ("discrete", "discrete_wo_init")  # AWM's time_type: strata from the first grid index or the second
AWM_STRATA = ("official", "flow_factory")  # the index span: int(S x fraction) or the timesteps >= 1000 (1 - fraction)


def default_window_range(sampling_steps: int) -> tuple[int, int]:
    """Steps an SDE window may cover by default: all but the last (sigma' = 0, like DanceGRPO's subset)."""
    return (0, max(1, sampling_steps - 1))


@dataclass
class RolloutConfig:
    """How to sample: image size, steps, SDE type/level, sigma shift, guidance, window, micro-batch size."""

    height: int
    width: int
    sampling_steps: int = 16
    sde_type: str = "flow_sde"
    eta: float = 0.9  # 0 = deterministic ODE sampling (no log-probs)
    shift: float | None = None  # None = FLUX dynamic shift (as FluxPipeline); a float = static shift
    guidance: float | None = 3.5  # FLUX.1-dev distilled guidance; ignored by models without it
    cfg_scale: float = 1.0  # true classifier-free guidance (1 = off): needs the batch's negative_<key> rows
    sde_window_size: int = 0  # 0 = every step stochastic
    sde_window_range: tuple[int, int] | None = None  # window in steps [lo, hi); default (0, S-1): not the last step
    sde_window_schedule: str = "random"  # random | sliding | progressive (window_position)
    sde_window_shift_interval: int = 1  # sliding/progressive: training steps per window position (MixGRPO's tau)
    sde_window_stride: int = 1  # sliding/progressive: steps the window moves per shift
    init_same_noise: bool = False
    decode_x0: bool = False  # decode the last predicted x0_hat (DanceGRPO) instead of the final latent
    batch_size: int = 8  # samples per transformer call
    decode_batch_size: int = 0  # latents per VAE decode call (0 = the whole micro-batch)
    # "sde": the last step (sigma' = 0) is stochastic like the others, though never trained (Flow-GRPO's code);
    # "ode": it is the deterministic Euler step, which lands exactly on that step's x0_hat, so the scored image
    # carries no noise the policy cannot influence (same image as decode_x0, DanceGRPO's choice)
    last_step: str = "sde"
    solver: str = "euler"  # ODE solver: "euler" or "dpm2" (DPM-Solver++(2M), deterministic: needs eta=0)
    # the model folder's scheduler/scheduler_config.json (models.read_scheduler_config): the family's sigma grid reads
    # its shift constants; None = the family's stock config
    scheduler: dict[str, Any] | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        """The one check of the sampler's settings (``validate_sampling`` runs it on the flags through ``from_args``);
        each message names the flag that sets the field."""
        S = self.sampling_steps
        need(S >= 1, f"--sampling_steps must be >= 1, got {S}")
        need(self.sde_type in SDE_TYPES, f"--sde_type must be one of {SDE_TYPES}, got {self.sde_type!r}")
        need(self.eta >= 0, f"--eta must be >= 0 (0 = ODE sampling), got {self.eta}")
        need(self.batch_size >= 1, f"--rollout_batch_size must be >= 1, got {self.batch_size}")
        need(self.cfg_scale >= 1, f"--cfg_scale must be >= 1 (1 = no classifier-free guidance), got {self.cfg_scale}")
        need(self.decode_batch_size >= 0,
             f"--decode_batch_size must be >= 0 (0 = the rollout micro-batch), got {self.decode_batch_size}")
        need(self.last_step in LAST_STEP_MODES, f"--last_step must be one of {LAST_STEP_MODES}, got {self.last_step!r}")
        need(self.solver in ODE_SOLVERS, f"--solver must be one of {ODE_SOLVERS}, got {self.solver!r}")
        need(not (self.solver == "dpm2" and self.eta != 0),
             f"--solver dpm2 is an ODE solver: it needs --eta 0 (deterministic sampling), got eta={self.eta}")
        need(0 <= self.sde_window_size <= S,
             f"--sde_window_size must be in [0, --sampling_steps={S}], got {self.sde_window_size}")
        if self.sde_window_range is None:
            self.sde_window_range = default_window_range(S)
        lo, hi = (int(v) for v in self.sde_window_range)
        self.sde_window_range = (lo, hi)
        need(not self.sde_window_size or (0 <= lo and hi <= S and hi - lo >= self.sde_window_size),
             f"--sde_window_range {lo} {hi} must satisfy 0 <= LO, HI <= --sampling_steps ({S}) and "
             f"HI - LO >= --sde_window_size ({self.sde_window_size})")
        need(not (self.sde_window_size and self.last_step == "ode" and hi == S),
             f"--sde_window_range {lo} {hi} includes the last step, which --last_step ode makes deterministic; end "
             f"the range at {S - 1} or pass --last_step sde")
        need(self.sde_window_schedule in WINDOW_SCHEDULES,
             f"--sde_window_schedule must be one of {WINDOW_SCHEDULES}, got {self.sde_window_schedule!r}")
        need(self.sde_window_shift_interval >= 1,
             f"--sde_window_shift_interval must be >= 1 (steps per window position), got "
             f"{self.sde_window_shift_interval}")
        need(self.sde_window_stride >= 1, f"--sde_window_stride must be >= 1, got {self.sde_window_stride}")

    @property
    def deterministic(self) -> bool:
        """True when no step is stochastic (eta == 0)."""
        return self.eta == 0

    @classmethod
    def from_args(cls, args: Any) -> "RolloutConfig":
        """The batched sampler's settings from a trainer's parsed sampling flags (every trainer that samples); the
        decode micro-batch is --decode_batch_size as ``launch.resolve_device_defaults`` resolved it (0 = one call per
        rollout micro-batch, the CPU's auto). --solver is DiffusionNFT's flag alone (the others sample with Euler)."""
        return cls(height=args.h, width=args.w, sampling_steps=args.sampling_steps, sde_type=args.sde_type,
                   eta=args.eta, shift=args.shift, guidance=args.guidance_scale, cfg_scale=args.cfg_scale,
                   sde_window_size=args.sde_window_size, sde_window_range=tuple(args.sde_window_range),
                   sde_window_schedule=args.sde_window_schedule,
                   sde_window_shift_interval=args.sde_window_shift_interval, sde_window_stride=args.sde_window_stride,
                   init_same_noise=args.init_same_noise, decode_x0=args.decode_x0, batch_size=args.rollout_batch_size,
                   decode_batch_size=args.decode_batch_size, last_step=args.last_step,
                   solver=getattr(args, "solver", "euler"),
                   scheduler=models.read_scheduler_config(args.pretrained_model_name_or_path))


@dataclass
class Trajectory:
    """One rollout of B samples over S steps (tensors on the rollout device, no grad).

    ``latents`` (B, S+1, L, C) float32: latents[:, 0] is the initial noise, latents[:, i+1] the result of
    step i (None when the rollout was asked to keep only the clean latents, as DiffusionNFT needs).
    ``log_probs`` (B, S) float32: log p(latents[:, i+1] | latents[:, i]), 0 where the step was an
    ODE step. ``stochastic`` (B, S) bool. ``sigmas`` (S+1,) float32. ``images`` (B, 3, H, W) in [0, 1]
    decoded from ``clean_latents`` (B, L, C): the final latent, or the last x0_hat with ``decode_x0``.
    ``timings``: seconds spent sampling ("sample") and decoding ("decode").
    """

    latents: torch.Tensor | None
    log_probs: torch.Tensor
    sigmas: torch.Tensor
    stochastic: torch.Tensor
    images: torch.Tensor
    clean_latents: torch.Tensor
    prompt_ids: torch.Tensor
    sample_indices: torch.Tensor
    step: int
    sde_type: str
    eta: float
    sde_window_size: int
    timings: dict[str, float] = field(default_factory=dict)
    stochastic_cpu: torch.Tensor | None = None  # ``stochastic`` on the CPU: read by host-side checks without a sync
    means: torch.Tensor | None = None  # (B, S, L, C) float32: the rollout policy's SDE mean of each stochastic step
    # (0 elsewhere), kept with rollout(..., keep_means=True) for the losses that compare it (GRPO-Guard, Flow-DPPO)

    def __post_init__(self) -> None:
        if self.stochastic_cpu is None:
            self.stochastic_cpu = self.stochastic.cpu()

    def __len__(self) -> int:
        return self.clean_latents.shape[0]

    @property
    def sigma_max(self) -> torch.Tensor:
        """The sigma used in place of 1 in flow_sde's noise-scale denominator: ``sigmas[1]`` (0-d, on the device:
        reading it as a number would be a host sync in the replay loop)."""
        return self.sigmas[1]


    def noise_scale(self, j: int | torch.Tensor, kl_form: str = "per_unit_time") -> torch.Tensor:
        """KL noise scale ``s`` (docs/algorithms.md §4; ``kl_form`` as ``schedulers.sde_noise_scale``) of step ``j``
        (int -> 0-d, (b,) LongTensor -> (b,)) for ``losses.kl_loss``."""
        j = _step_index(j, self.sigmas.device)
        return sde_noise_scale(self.sigmas[j], self.sigmas[j + 1], sde_type=self.sde_type, eta=self.eta,
                               sigma_max=self.sigma_max, kl_form=kl_form)

    def sqrt_neg_dt(self, j: int | torch.Tensor) -> torch.Tensor:
        """``sqrt(sigma_j - sigma_{j+1})`` of step ``j`` (0-d or (b,), float32 on the device; GRPO-Guard's rescale)."""
        j = _step_index(j, self.sigmas.device)
        return (self.sigmas[j] - self.sigmas[j + 1]).to(torch.float32).sqrt()


def _step_index(j: int | torch.Tensor, device: torch.device) -> int | torch.Tensor:
    """A step index as an int, or as a long tensor on ``device`` (0-d or (b,); never read back: no host sync)."""
    return int(j) if not torch.is_tensor(j) else devices.to_device(j.to(torch.long), device)


def window_position(cfg: RolloutConfig, step: int) -> int:
    """The start of the moving SDE window at training step ``step`` (>= 1), shared by every sample of the step; a pure
    function of the step, so a resumed run continues the schedule exactly.

    ``sliding`` / ``sliding_hold`` (MixGRPO): the full-window starts in ``[lo, hi)`` are ``lo, lo + s, ..., lo +
    (n-1)s`` with ``n = (hi - W - lo) // s + 1`` (stride ``s``, window ``W``); position ``k = (step - 1) //
    shift_interval``; ``sliding`` takes ``k mod n`` (MixGRPO's ``GRPOTrainingStates`` with ``roll_back``, which its
    FLUX script sets), ``sliding_hold`` ``min(k, n - 1)``. Unlike MixGRPO, a window never runs past ``hi`` (its last
    positions are cut short). ``progressive`` (verl-omni ``_maybe_make_progressive_window``): ``min(lo + (step //
    shift_interval) * W, hi - W)``: it moves by the window size, counts from its first global step 1 (so step 1 is
    already one move on when ``shift_interval`` is 1), and stays at ``hi - W``."""
    lo, hi = cfg.sde_window_range
    W, s = cfg.sde_window_size, cfg.sde_window_stride
    if cfg.sde_window_schedule == "progressive":
        return min(lo + (max(0, int(step)) // cfg.sde_window_shift_interval) * W, hi - W)
    positions = (hi - W - lo) // s + 1
    shifts = (int(step) - 1) // cfg.sde_window_shift_interval
    k = shifts % positions if cfg.sde_window_schedule == "sliding" else min(shifts, positions - 1)
    return lo + k * s


def window_starts(cfg: RolloutConfig, noise: NoiseSource, step: int, prompt_ids: list[int]) -> list[int]:
    """SDE window start per sample: ``random``: drawn once per prompt group (sample_index 0, purpose "window");
    ``sliding`` / ``progressive``: ``window_position`` of the step for every sample."""
    if cfg.sde_window_schedule != "random":
        return [window_position(cfg, step)] * len(prompt_ids)
    lo, hi = cfg.sde_window_range
    return [noise.randint(lo, hi - cfg.sde_window_size + 1, step=step, prompt_id=p, sample_index=0,
                          purpose="window") for p in prompt_ids]


def stochastic_mask(cfg: RolloutConfig, noise: NoiseSource, step: int, prompt_ids: list[int]) -> torch.Tensor:
    """(B, S) bool: which steps are SDE steps (all, a per-group window, or none when eta == 0)."""
    B, S = len(prompt_ids), cfg.sampling_steps
    if cfg.deterministic:
        return torch.zeros(B, S, dtype=torch.bool)
    if cfg.sde_window_size == 0:
        mask = torch.ones(B, S, dtype=torch.bool)
        if cfg.last_step == "ode":
            mask[:, S - 1] = False
        return mask
    starts = torch.tensor(window_starts(cfg, noise, step, prompt_ids)).view(B, 1)
    steps = torch.arange(S).view(1, S)
    return (steps >= starts) & (steps < starts + cfg.sde_window_size)


def rollout_sigmas(family: Any, cfg: RolloutConfig, image_seq_len: int) -> torch.Tensor:
    """The (S+1,) float32 CPU sigma grid of a rollout: DanceGRPO's static grid with --shift, else the family's stock
    pipeline schedule with the model folder's scheduler config (FLUX.1: the resolution-dependent dynamic shift)."""
    if cfg.shift is not None:
        return get_sigmas(cfg.sampling_steps, shift=cfg.shift)
    return family.sigmas(cfg.sampling_steps, image_seq_len, cfg.scheduler)


def batch_cond(family: Any, batch: dict, cfg_scale: float) -> dict[str, torch.Tensor]:
    """The embeddings a velocity call takes from ``batch``: the family's ``embedding_keys`` and, with
    ``cfg_scale > 1``, the ``negative_<key>`` rows of its text keys (``EmbeddingDataset.use(family, negative=True)``;
    an edit family's ``condition_keys`` serve both branches)."""
    keys = list(family.embedding_keys)
    if cfg_scale > 1:
        text = [k for k in keys if k not in family.condition_keys]
        missing = [k for k in text if f"negative_{k}" not in batch]
        if missing:
            raise ValueError(f"--cfg_scale {cfg_scale} needs the negative prompt's embeddings in the batch (missing "
                             f"negative_{missing[0]}): preprocess with --negative_prompt and open the dataset with "
                             "dataset.use(family, negative=True)")
        keys += [f"negative_{k}" for k in text]
    return {k: batch[k] for k in keys}


def guided_velocity(family: Any, transformer: torch.nn.Module, x: torch.Tensor, sigma: torch.Tensor,
                    cond: dict[str, torch.Tensor], shared: dict[str, Any], cfg_scale: float = 1.0) -> torch.Tensor:
    """The velocity (b, L, C) float32 every sampler, replay and loss evaluates: the model's, or with ``cfg_scale > 1``
    true classifier-free guidance (``family.combine_guidance``) from ONE batched forward of 2b rows (conditional,
    then the ``negative_<key>`` rows of ``cond``; an edit's source rows in both halves, as FluxKontextPipeline's two
    calls), as Flow-GRPO's SD3 sampler and training forward do. ``sigma``: 0-d or (b,) on the device. Call it under
    the caller's autocast."""
    keys = family.embedding_keys
    if cfg_scale == 1:
        return family.predict_velocity(transformer, x, sigma, {k: cond[k] for k in keys}, shared).float()
    both = {k: torch.cat([cond[k], cond[k if k in family.condition_keys else f"negative_{k}"]]) for k in keys}
    sigma2 = sigma if sigma.ndim == 0 else torch.cat([sigma, sigma])
    v = family.predict_velocity(transformer, torch.cat([x, x]), sigma2, both, shared).float()
    v_cond, v_uncond = v.chunk(2)
    return family.combine_guidance(v_cond, v_uncond, cfg_scale)


@torch.no_grad()
@flops.phase("rollout")  # its transformer forwards count as the step's rollout FLOPs
def rollout(transformer: torch.nn.Module, vae: torch.nn.Module, batch: dict, sample_indices: list[int], step: int,
            cfg: RolloutConfig, noise: NoiseSource, geometry: Any, *,
            device: torch.device | str, autocast_dtype: torch.dtype | None = None,
            keep_latents: bool = True, keep_means: bool = False,
            on_decoded: Callable[[slice, torch.Tensor], None] | None = None) -> Trajectory:
    """Sample ``len(sample_indices)`` trajectories for ``batch`` (EmbeddingDataset.get_batch) with log-probs, then
    decode. ``geometry``: the model family's latent geometry. ``keep_latents=False`` records only the clean latents
    (no (B, S+1, L, C) trajectory buffer); ``keep_means=True`` also records each stochastic step's mean
    (``Trajectory.means``, (B, S, L, C)). ``on_decoded(mb, images)`` is called after each micro-batch's decode with
    its positions in the batch and its images (b, 3, H, W) float32 (--reward_overlap scores them while the next
    micro-batch samples); it must not block on the device."""
    device = torch.device(device)
    family = models.family_of(transformer)
    ids = batch["prompt_ids"]
    prompt_ids = [int(p) for p in (ids.tolist() if torch.is_tensor(ids) else ids)]
    sample_indices = [int(s) for s in sample_indices]
    B, S = len(prompt_ids), cfg.sampling_steps
    if len(sample_indices) != B:
        raise ValueError(f"got {len(sample_indices)} sample_indices for a batch of {B} prompts; pass one per sample")
    if (geometry.height, geometry.width) != (cfg.height, cfg.width):
        raise ValueError(f"geometry is {geometry.height}x{geometry.width} but cfg asks for {cfg.height}x{cfg.width}; "
                         "build both from the same --h/--w")
    L, C = geometry.seq_len, geometry.packed_channels
    sigmas = rollout_sigmas(family, cfg, L)  # (S+1,) CPU
    sigma_list = sigmas.tolist()  # python floats: the dpm2 bookkeeping and x0_hat, no device values read

    init_indices = [0] * B if cfg.init_same_noise else sample_indices
    x_init = noise.batch_randn((L, C), step=step, prompt_ids=prompt_ids, sample_indices=init_indices,
                               purpose="init")  # (B, L, C) on the noise device
    stochastic = stochastic_mask(cfg, noise, step, prompt_ids)  # (B, S) CPU
    sde_noise = None
    if bool(stochastic.any()):
        sde_noise = noise.batch_randn((S, L, C), step=step, prompt_ids=prompt_ids, sample_indices=sample_indices,
                                      purpose="sde")  # (B, S, L, C)

    # Everything the step loop reads is on the device before it starts (pinned, non-blocking copies): the loop
    # launches kernels only, with no host sync and no blocking copy (docs/design.md principle 9).
    sigmas_dev = devices.to_device(sigmas, device)  # (S+1,): sigma and sigma' of step i are sigmas_dev[i], [i+1]
    cond_all = batch_cond(family, batch, cfg.cfg_scale)  # (B, ...) each, where the batch lives
    shared = family.conditioning(geometry, cond_all, cfg.guidance, device)  # position ids, guidance: on the device
    latents = torch.empty(B, S + 1, L, C, dtype=torch.float32, device=device) if keep_latents else None
    log_probs = torch.zeros(B, S, dtype=torch.float32, device=device)
    means = torch.zeros(B, S, L, C, dtype=torch.float32, device=device) if keep_means else None
    clean = torch.empty(B, L, C, dtype=torch.float32, device=device)
    stochastic_dev = devices.to_device(stochastic, device)
    images = []
    t_sample = t_decode = 0.0
    for start in range(0, B, cfg.batch_size):
        mb = slice(start, min(start + cfg.batch_size, B))
        t0 = time.perf_counter()
        x = devices.to_device(x_init[mb], device).float()  # (b, L, C)
        noise_mb = None if sde_noise is None else devices.to_device(sde_noise[mb], device)  # (b, S, L, C)
        if latents is not None:
            latents[mb, 0] = x
        cond = {k: devices.to_device(v[mb], device) for k, v in cond_all.items()}
        prev_x0 = prev_sigma = None  # dpm2: the previous step's x0_hat and sigma (first step first order)
        for i in range(S):
            sigma, sigma_next = sigmas_dev[i], sigmas_dev[i + 1]  # 0-d device tensors
            with devices.autocast(device, autocast_dtype):
                v = guided_velocity(family, transformer, x, sigma, cond, shared, cfg.cfg_scale)
            if cfg.solver == "dpm2":
                x_next, prev_x0 = dpm2_step(v, x, sigma, sigma_next, prev_x0=prev_x0, sigma_prev=prev_sigma)
                prev_sigma = sigma
            else:
                x_next = ode_step(v, x, sigma, sigma_next)
            if noise_mb is not None and bool(stochastic[mb, i].any()):  # stochastic is on the CPU: no sync
                x_sde, lp, mean, _ = sde_step_with_logprob(v, x, sigma, sigma_next, sde_type=cfg.sde_type,
                                                           eta=cfg.eta, noise=noise_mb[:, i], sigma_max=sigmas_dev[1])
                st = stochastic_dev[mb, i]
                x_next = torch.where(st.view(-1, 1, 1), x_sde, x_next)
                log_probs[mb, i] = torch.where(st, lp, torch.zeros_like(lp))
                if means is not None:
                    means[mb, i] = torch.where(st.view(-1, 1, 1), mean, 0.0)
            if i == S - 1:
                clean[mb] = x - sigma_list[i] * v if cfg.decode_x0 else x_next
            if latents is not None:
                latents[mb, i + 1] = x_next
            x = x_next
        devices.synchronize(device)  # for the phase timings: once per micro-batch, after its sampling loop
        t1 = time.perf_counter()
        images.append(family.decode(vae, clean[mb], geometry, micro_batch=cfg.decode_batch_size or None).float())
        devices.synchronize(device)
        t_sample += t1 - t0
        t_decode += time.perf_counter() - t1
        if on_decoded is not None:
            on_decoded(mb, images[-1])
    return Trajectory(
        latents=latents, log_probs=log_probs, sigmas=sigmas_dev, stochastic=stochastic_dev,
        images=torch.cat(images), clean_latents=clean,
        prompt_ids=torch.tensor(prompt_ids, dtype=torch.long), sample_indices=torch.tensor(sample_indices),
        step=int(step), sde_type=cfg.sde_type, eta=float(cfg.eta), sde_window_size=cfg.sde_window_size,
        timings={"sample": t_sample, "decode": t_decode}, stochastic_cpu=stochastic, means=means)


def select_trained_timesteps(traj: Trajectory, prompt_ids: list[int], sample_indices: list[int], step: int,
                             noise: NoiseSource, *, timestep_fraction: float = 1.0,
                             selection: str = "random") -> torch.Tensor:
    """(B, K) LongTensor (CPU) of the steps to train per sample; column k is the k-th replay for every sample.

    Window mode (``sde_window_size > 0``): the window's W steps in increasing order (K = W,
    ``timestep_fraction`` and ``selection`` are ignored). Full-SDE mode, ``selection="random"``: DanceGRPO's random
    subset: the first ``K = int((S-1) * timestep_fraction)`` entries of a per-sample permutation of steps 0..S-2
    (``NoiseSource`` purpose "timesteps" keyed by ``(step, prompt_id, sample_index)``); the last
    step is never trained. ``selection="first"``: Flow-GRPO's ``for j in range(num_train_timesteps)`` with
    ``num_train_timesteps = int(S * timestep_fraction)``: steps 0..K-1 in order for every sample, counted over all S
    steps (so fraction 1 includes the last step, sigma' = 0; Flow-GRPO's 0.99 leaves it out); a chosen step that was
    not stochastic (``last_step="ode"``) is an error. Different samples of a column may be at different steps:
    ``replay_log_prob`` takes a per-sample ``j``.
    """
    if selection not in TIMESTEP_SELECTIONS:
        raise ValueError(f"selection must be 'random' (DanceGRPO) or 'first' (Flow-GRPO), got {selection!r}")
    B, S = traj.log_probs.shape
    if len(prompt_ids) != B or len(sample_indices) != B:
        raise ValueError(f"need one prompt id and sample index per trajectory sample ({B}), got "
                         f"{len(prompt_ids)} and {len(sample_indices)}")
    stochastic = traj.stochastic_cpu
    if not bool(stochastic.any()):
        raise ValueError("the rollout has no stochastic step (eta=0): nothing to train with log-prob ratios; "
                         "set eta > 0")
    if traj.sde_window_size > 0:
        steps = torch.arange(S).expand(B, S)
        return steps[stochastic].view(B, traj.sde_window_size)
    if not 0 < timestep_fraction <= 1:
        raise ValueError(f"timestep_fraction must be in (0, 1], got {timestep_fraction}")
    if selection == "first":
        K = int(S * timestep_fraction)
        if K < 1:
            raise ValueError(f"timestep_fraction {timestep_fraction} x sampling_steps {S} trains no timestep; "
                             "raise one of them")
        if not bool(stochastic[:, :K].all()):
            raise ValueError(f"selection 'first' trains steps 0..{K - 1}, but some of them were ODE steps in the "
                             f"rollout (last_step='ode' makes step {S - 1} deterministic): use a timestep_fraction "
                             f"with int({S} x fraction) <= {S - 1} (Flow-GRPO's 0.99) or last_step='sde'")
        return torch.arange(K).expand(B, K).clone()
    K = int((S - 1) * timestep_fraction)
    if K < 1:
        raise ValueError(f"timestep_fraction {timestep_fraction} x (sampling_steps - 1 = {S - 1}) trains no "
                         "timestep; raise one of them")
    perms = [noise.randperm(S - 1, step=step, prompt_id=p, sample_index=s, purpose="timesteps")[:K]
             for p, s in zip(prompt_ids, sample_indices)]
    return torch.stack(perms).to(torch.long)


def replay_log_prob(transformer: torch.nn.Module, traj: Trajectory, idx: torch.Tensor, j: int | torch.Tensor,
                    batch: dict, cfg: RolloutConfig, geometry: Any, *,
                    autocast_dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Recompute step ``j`` (int, or (b,) per sample) for samples ``idx`` with the current policy, with grad.

    ``idx``/``j`` on the CPU are checked against the rollout's stochastic steps (host data) and copied non-blocking;
    on the device they are used as they are (the trainers' replay loop: no host sync, no blocking copy).

    Evaluates the recorded ``latents[idx, j+1]`` under the policy's Gaussian step from ``latents[idx, j]``;
    returns ``(log_prob (b,), prev_sample_mean (b, L, C), std (b,))`` in float32. The SDE type and eta
    are the ones recorded in ``traj``; ``cfg`` supplies the guidance. ``batch`` is the dict the rollout
    used (same sample order). ``traj.noise_scale(j)`` gives the KL noise scale for ``losses.kl_loss``.
    """
    if traj.latents is None:
        raise ValueError("replay_log_prob needs the trajectory: sample with rollout(..., keep_latents=True)")
    dev = traj.latents.device
    idx, j = torch.as_tensor(idx, dtype=torch.long), torch.as_tensor(j, dtype=torch.long)
    if idx.device.type == "cpu" and j.device.type == "cpu" and not bool(traj.stochastic_cpu[idx, j].all()):
        raise ValueError("replay_log_prob asked for a step that was not stochastic in the rollout (an ODE step "
                         "has no log-prob); pick steps with select_trained_timesteps")
    idx, jj = devices.to_device(idx, dev), devices.to_device(j, dev)  # pinned, non-blocking: no host sync
    x = traj.latents[idx, jj]  # (b, L, C)
    x_next = traj.latents[idx, jj + 1]
    sigma, sigma_next = traj.sigmas[jj], traj.sigmas[jj + 1]  # 0-d or (b,), on the device
    family = models.family_of(transformer)
    idx_b = devices.to_device(idx, batch[family.embedding_keys[0]].device)
    cond = {k: devices.to_device(v[idx_b], dev) for k, v in batch_cond(family, batch, cfg.cfg_scale).items()}
    shared = family.conditioning(geometry, cond, cfg.guidance, dev)
    with devices.autocast(dev, autocast_dtype):
        v = guided_velocity(family, transformer, x, sigma, cond, shared, cfg.cfg_scale)
    _, log_prob, mean, std = sde_step_with_logprob(v, x, sigma, sigma_next, sde_type=traj.sde_type, eta=traj.eta,
                                                   prev_sample=x_next, sigma_max=traj.sigma_max)
    return log_prob, mean, std


def noised_velocity(transformer: torch.nn.Module, x0: torch.Tensor, noise: torch.Tensor, sigma: torch.Tensor,
                    batch: dict, geometry: Any, *, guidance: float | None,
                    autocast_dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The forward process and the model on it: ``x_σ = (1-σ)·x0 + σ·ε`` for packed clean latents ``x0`` (b, L, C),
    noise ``ε`` (b, L, C) and ``sigma`` (b,); returns ``(v_hat, v* = ε - x0)``, both (b, L, C) float32.
    ``batch`` holds the b rows' embeddings (the family's ``embedding_keys``) on the model's device."""
    noise = devices.to_device(noise, x0.device)  # one non-blocking copy of CPU-drawn noise
    x_t = forward_noise(x0, noise, sigma)
    v = model_velocity(transformer, x_t, sigma, batch, geometry, guidance=guidance, autocast_dtype=autocast_dtype)
    return v, noise.to(torch.float32) - x0.float()


def pair_noise(noise: NoiseSource, shape: tuple[int, ...], step: int, pair_keys: list[int],
               draws: list[int] | None = None, purpose: str = "dpo") -> tuple[torch.Tensor, torch.Tensor]:
    """Forward-process draws shared by the two images of a pair (docs/algorithms.md §5): ``ε`` (m, *shape) and the
    logit-normal ``σ = sigmoid(u), u ~ N(0, 1)`` (m,), keyed by ``(step, pair key, draw index)`` (``draws``: one index
    per entry, default 0): the same whatever rank or micro-batch trains the pair."""
    draws = [0] * len(pair_keys) if draws is None else draws
    eps = noise.batch_randn(shape, step=step, prompt_ids=pair_keys, sample_indices=draws, purpose=f"{purpose}_eps")
    u = noise.batch_randn((), step=step, prompt_ids=pair_keys, sample_indices=draws, purpose=f"{purpose}_sigma")
    return eps, torch.sigmoid(u)


def pair_errors(transformer: torch.nn.Module, x0_w: torch.Tensor, x0_l: torch.Tensor, eps: torch.Tensor,
                sigma: torch.Tensor, batch: dict, geometry: Any, *, guidance: float | None,
                autocast_dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Flow-matching errors ``mean((v_hat - (ε - x0))²)`` (b,) of the winners ``x0_w`` and losers ``x0_l`` (b, L, C),
    both noised with the pair's own ``eps`` (b, L, C) and ``sigma`` (b,), in one model call of 2b rows. ``batch``:
    the b pairs' prompt embeddings on the model's device."""
    b = x0_w.shape[0]
    twice = lambda t: torch.cat([t, t])  # noqa: E731  (winners, then losers: the same draws)
    cond = {k: twice(batch[k]) for k in models.family_of(transformer).embedding_keys}
    err = flow_matching_error(*noised_velocity(transformer, torch.cat([x0_w, x0_l]), twice(eps), twice(sigma), cond,
                                               geometry, guidance=guidance, autocast_dtype=autocast_dtype))
    return err[:b], err[b:]


def forward_noise(x0: torch.Tensor, noise: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
    """The rectified-flow forward process ``x_σ = (1-σ)·x0 + σ·ε`` in float32 for packed latents (b, L, C) and a
    per-sample ``sigma`` (b,)."""
    s = devices.to_device(sigma, x0.device).to(torch.float32).view(-1, 1, 1)
    return (1 - s) * x0.float() + s * devices.to_device(noise, x0.device).to(torch.float32)


def model_velocity(transformer: torch.nn.Module, x_t: torch.Tensor, sigma: torch.Tensor, batch: dict,
                   geometry: Any, *, guidance: float | None, autocast_dtype: torch.dtype | None = None,
                   cfg_scale: float = 1.0) -> torch.Tensor:
    """The model's velocity (b, L, C) float32 at latents ``x_t`` (b, L, C) and per-sample ``sigma`` (b,); ``batch``
    holds the b rows' embeddings (the family's ``embedding_keys``, and ``negative_<key>`` with ``cfg_scale > 1``:
    the guided velocity, ``guided_velocity``) on the model's device."""
    dev = x_t.device
    family = models.family_of(transformer)
    cond = batch_cond(family, batch, cfg_scale)
    shared = family.conditioning(geometry, cond, guidance, dev)
    sigma = devices.to_device(sigma, dev).to(torch.float32).view(-1)
    with devices.autocast(dev, autocast_dtype):
        return guided_velocity(family, transformer, x_t, sigma, cond, shared, cfg_scale)


def nft_timesteps(noise: NoiseSource, step: int, prompt_ids: list[int], sample_indices: list[int],
                  sampling_steps: int, timestep_fraction: float) -> torch.Tensor:
    """(B, K) LongTensor (CPU): indices into the sampling grid's S sigmas (never the final 0) that DiffusionNFT trains
    per sample: the first ``K = int(S * timestep_fraction)`` of a per-sample permutation (purpose "nft_timesteps",
    keyed by ``(step, prompt_id, sample_index)``: independent of batch layout and world size)."""
    K = int(sampling_steps * timestep_fraction)
    if K < 1:
        raise ValueError(f"timestep_fraction {timestep_fraction} x sampling_steps {sampling_steps} trains no "
                         "timestep; raise one of them")
    perms = [noise.randperm(sampling_steps, step=step, prompt_id=p, sample_index=s, purpose="nft_timesteps")[:K]
             for p, s in zip(prompt_ids, sample_indices)]
    return torch.stack(perms).to(torch.long)


def awm_index_span(sampling_steps: int, timestep_fraction: float, time_type: str = "discrete",
                   strata: str = "official", sigmas: torch.Tensor | None = None) -> tuple[int, int]:
    """``(start, end)``: the sampling-grid indices AWM's strata cut, ``linspace(start, end, K+1)``.

    ``official`` (scxue/advantage_weighted_matching scripts/train_sd3_awm.py, time_type "discrete" /
    "discrete_wo_init"): ``[0 or 1, int(S * timestep_fraction)]``. ``flow_factory`` (X-GenGroup/Flow-Factory
    src/flow_factory/utils/noise_schedule.py ``TimeSampler.discrete``): the indices whose scheduler timestep
    ``1000 * sigma`` (float32) lies in ``[1000 (1 - fraction) - 1e-3, 1000 + 1e-3]``, from the first (or the one after
    it) to the last of them; ``sigmas`` is the rollout's (S+1,) grid."""
    if time_type not in AWM_TIME_TYPES:
        raise ValueError(f"--awm_time_type must be one of {AWM_TIME_TYPES}, got {time_type!r}")
    skip = int(time_type == "discrete_wo_init")
    if strata == "official":
        return skip, int(sampling_steps * timestep_fraction)
    if strata != "flow_factory":
        raise ValueError(f"--awm_strata must be one of {AWM_STRATA}, got {strata!r}")
    if sigmas is None:
        raise ValueError("--awm_strata flow_factory selects by the grid's timesteps: pass the rollout's sigmas")
    ts = sigmas[:sampling_steps].to(torch.float32) * 1000.0  # FlowMatchEulerDiscreteScheduler.timesteps
    valid = torch.nonzero((ts >= 1000.0 * (1.0 - timestep_fraction) - 1e-3) & (ts <= 1000.0 + 1e-3)).flatten()
    if valid.numel() == 0:
        raise ValueError(f"--timestep_fraction {timestep_fraction} keeps no grid timestep: raise it")
    return int(valid.min()) + skip, int(valid.max())


def awm_timesteps(noise: NoiseSource, step: int, prompt_ids: list[int], sample_indices: list[int],
                  sampling_steps: int, timestep_fraction: float, num_timesteps: int = 0, *,
                  time_type: str = "discrete", strata: str = "official",
                  sigmas: torch.Tensor | None = None) -> torch.Tensor:
    """(B, K) LongTensor (CPU): indices into the sampling grid that AWM trains per sample, its stratified "discrete"
    draw: the span ``awm_index_span`` cut at ``linspace(start, end, K+1).long()`` into ``K`` strata, one index
    ``lower + long(u * (upper - lower))`` from each (noisiest first), as both references compute it; ``K =
    num_timesteps``, 0 = the whole span. The references draw ``u`` once per micro-batch; ours per sample (purpose
    "awm_timesteps", keyed by ``(step, prompt_id, sample_index)``: independent of batch layout and world size)."""
    start, end = awm_index_span(sampling_steps, timestep_fraction, time_type, strata, sigmas)
    K = num_timesteps or end - start
    if not 1 <= K <= end - start:
        raise ValueError(f"AWM trains {K} timesteps from the grid indices [{start}, {end}) (--awm_time_type "
                         f"{time_type}, --awm_strata {strata}, --sampling_steps {sampling_steps} x "
                         f"--timestep_fraction {timestep_fraction}): need 1 <= K <= {end - start}")
    bounds = torch.linspace(start, end, K + 1).long()
    lower, width = bounds[:-1], bounds[1:] - bounds[:-1]  # (K,) each >= 1 as K <= end - start
    draws = [noise.rand((K,), step=step, prompt_id=p, sample_index=s, purpose="awm_timesteps")
             for p, s in zip(prompt_ids, sample_indices)]
    return torch.stack([lower + (u * width).long() for u in draws]).to(torch.long)


DEFAULT_ETA = {"flow_sde": 0.9, "dance_sde": 0.3, "cps": 0.8}


@dataclass
class SamplingOptions:
    h: int | None = opt(None, "image height in pixels; unset: the family pipeline's default (1024 for FLUX.1, SD3.5, "
                              "Qwen-Image, FLUX.2), printed at start-up")
    w: int | None = opt(None, "image width in pixels; unset: the family pipeline's default, printed at start-up")
    num_frames: int | None = opt(None, "frames per video (Wan: 4k + 1); unset: the video family's pipeline default "
                                       "(Wan 81), printed at start-up; image families take none")
    fps: int | None = opt(None, "frame rate of the videos written (MP4); unset: the video family's default (Wan 16)")
    sampling_steps: int | None = opt(None, "denoising steps per rollout (S); unset: the family pipeline's default "
                                           "(FLUX.1 and SD3.5 28, Qwen-Image and FLUX.2 50), printed at start-up")
    sde_type: str = opt("flow_sde", "stochastic sampler: flow_sde (Flow-GRPO) | dance_sde (DanceGRPO) | cps",
                        choices=SDE_TYPES)
    eta: float | None = opt(None, "SDE noise level (default by --sde_type: flow_sde 0.9, dance_sde 0.3, cps 0.8)")
    shift: float | None = opt(None, "static sigma shift (DanceGRPO: 3); unset = FLUX dynamic shift like FluxPipeline")
    guidance_scale: float | None = opt(None, "distilled guidance value fed to the model (ignored by models without "
                                             "it); unset: the family's pipeline default (FLUX.1-dev 3.5, FLUX.2-dev "
                                             "4.0), printed at start-up")
    cfg_scale: float | None = opt(None, "true classifier-free guidance scale, 1 = off; unset: the family pipeline's "
                                "default (FLUX.1 and distilled FLUX.2 1, SD3.5 7, Qwen-Image and FLUX.2 base 4), printed "
                                "at start-up. > 1 samples, replays and evaluates with the guided velocity v_u + s(v_c - v_u) from "
                                "one batched forward of prompt + negative prompt (Flow-GRPO trains SD3.5-M with 4.5; "
                                "GRPO's ratios are those of the guided step); DPO's and NFT's losses stay on the "
                                "conditional velocity (their papers train CFG-free). Needs embeddings preprocessed "
                                "with --negative_prompt")
    sde_window_size: int = opt(0, "noise only on this many consecutive steps (0 = every step is stochastic)")
    sde_window_range: tuple[int, int] | None = opt(
        None, "two step indices LO HI: the window lies in steps [LO, HI) (default: 0 S-1, never the last step)",
        nargs=2, type=int)
    sde_window_schedule: str = opt(
        "random", "where the --sde_window_size window lies at each training step: random = a keyed draw per prompt "
        "group and step (Flow-GRPO-Fast) | sliding = MixGRPO's sliding window (arXiv 2507.21802): every sample of a "
        "step shares it; it starts at LO of --sde_window_range, moves by --sde_window_stride every "
        "--sde_window_shift_interval steps and rolls back to LO after the last full position (MixGRPO's --roll_back) "
        "| sliding_hold = the same, but it stays at the last full position | progressive = verl-omni's: start "
        "min(LO + (step // --sde_window_shift_interval) x W, HI - W), moving by the window size W",
        choices=WINDOW_SCHEDULES)
    sde_window_shift_interval: int = opt(
        25, "--sde_window_schedule sliding|sliding_hold|progressive: training steps the window stays at one position "
        "(MixGRPO's shift interval tau, iters_per_group: 25 in its FLUX script; verl-omni's iters_per_group)")
    sde_window_stride: int = opt(
        1, "--sde_window_schedule sliding|sliding_hold: steps the window moves at each shift (MixGRPO's stride, "
        "prog_overlap_step: 1 in its FLUX script; = --sde_window_size for non-overlapping positions)")
    init_same_noise: bool = opt(False, "share the initial noise within a prompt group")
    decode_x0: bool = opt(False, "score the last predicted clean latent x0_hat (DanceGRPO) instead of the final latent")
    rollout_batch_size: int = opt(8, "samples per transformer call during rollout (per rank)")
    decode_batch_size: int = opt(0, "latents per VAE decode call (the VAE decodes in the compute dtype); 0 = auto: on "
                                    "a GPU/NPU the largest batch whose planned decode peak is <= 4 GiB (at most "
                                    "--rollout_batch_size; 2 at 1024^2 in bf16), on the CPU a whole rollout "
                                    "micro-batch; lower it when the decode, not the transformer, runs out of memory "
                                    "(the images do not change)")
    last_step: str = opt(
        "sde", "the last sampling step (sigma' = 0), never trained: sde = stochastic like the others (Flow-GRPO's "
        "code; chosen by measurement on the demo, see docs/reproducing.md) | ode = the deterministic Euler step, "
        "which is exactly its x0_hat, so the scored image carries no noise the policy cannot influence (the image "
        "DanceGRPO scores, as --decode_x0 does)", choices=LAST_STEP_MODES)


def changed_flags(args: argparse.Namespace, keys: Sequence[str], defaults: dict[str, Any]) -> list[str]:
    """Those of ``keys`` whose value differs from ``defaults``, counting the values validation resolves an unset flag
    to (--eta 0 of a deterministic sampler, the default --sde_window_range) as unset: a run's config.json, which holds
    resolved values, passes validation again."""
    def resolved_default(key: str) -> bool:
        value = getattr(args, key)
        if key == "eta":
            return value == 0.0
        if key == "sde_window_range":
            return value is not None and tuple(value) == default_window_range(args.sampling_steps)
        return False

    return [k for k in keys if getattr(args, k) != defaults[k] and not resolved_default(k)]


# --guidance_scale of a family whose model takes no guidance input: never read; the value earlier runs recorded, so
# their checkpoints still resume (guidance_scale is a resume key)
UNUSED_GUIDANCE = 3.5


# the trainers' sampler flags a family's stock pipeline has a default for (flag -> SamplerDefaults field)
FAMILY_SAMPLER_FLAGS = {"h": "height", "w": "width", "sampling_steps": "steps", "cfg_scale": "cfg_scale",
                        "guidance_scale": "guidance"}
VIDEO_SAMPLER_FLAGS = {"num_frames": "num_frames", "fps": "fps"}  # a video family's too


def fill_family_sampling(args: argparse.Namespace) -> None:
    """Unset sampler flags -> the model folder's pipeline defaults (``ModelFamily.sampler_defaults``: size, steps,
    CFG scale, distilled guidance; the shift comes from the folder's scheduler config), said at start-up
    (``options.note_default``); a family without a guidance input gets ``UNUSED_GUIDANCE``."""
    if all(getattr(args, flag) is not None for flag in FAMILY_SAMPLER_FLAGS) and getattr(args, "num_frames", 1):
        return
    family = models.family_for(args)
    flags = {**FAMILY_SAMPLER_FLAGS, **VIDEO_SAMPLER_FLAGS} if family.video else FAMILY_SAMPLER_FLAGS
    filled = family.sampler_defaults(args.pretrained_model_name_or_path).fill(args, flags,
                                                                              unused_guidance=UNUSED_GUIDANCE)
    if filled:
        note_default(f"{' '.join(filled)}: the {family.name} pipeline's defaults (flags or a recipe set them)")


def validate_sampling(args: argparse.Namespace) -> None:
    """Sampler flags: what only the flags can say (the trainers' step minimum, sizes, a range or schedule set without
    a window), the defaults resolved (--eta per --sde_type, the window range), then ``RolloutConfig``'s own check,
    through the one builder the trainers use."""
    fill_family_sampling(args)
    need(args.sampling_steps >= 2, f"--sampling_steps must be >= 2, got {args.sampling_steps}")
    need(args.h > 0 and args.w > 0, f"--h/--w must be positive, got {args.h}x{args.w}")
    if args.eta is None:
        args.eta = DEFAULT_ETA[args.sde_type]
    need(args.shift is None or args.shift > 0, f"--shift must be > 0, got {args.shift}")
    need(args.sde_window_size > 0 or not changed_flags(args, ("sde_window_range",), {"sde_window_range": None}),
         "--sde_window_range does nothing without --sde_window_size (every step is stochastic); set "
         "--sde_window_size W or drop --sde_window_range")
    if args.sde_window_range is None:
        args.sde_window_range = default_window_range(args.sampling_steps)
    schedule = args.sde_window_schedule
    need(schedule == "random" or args.sde_window_size > 0,
         f"--sde_window_schedule {schedule} moves the SDE window: set --sde_window_size W (MixGRPO: 4 of 25 steps) "
         "or use --sde_window_schedule random")
    need(schedule != "progressive" or args.sde_window_stride == 1,
         f"--sde_window_stride {args.sde_window_stride} does nothing with --sde_window_schedule progressive (verl-omni "
         "moves the window by its size): drop it, or use sliding / sliding_hold, which move by the stride")
    cfg = RolloutConfig.from_args(args)
    if cfg.shift is None:  # a scheduler config the family's grid cannot reproduce: refused here, before loading
        rollout_sigmas(models.family_for(args), cfg, image_seq_len=4096)