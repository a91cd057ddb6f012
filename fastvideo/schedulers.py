"""Sigma schedules and one reverse step of the flow-matching sampler, with its log-probability.

docs/algorithms.md §1-2. Sampling runs from sigma=1 (noise) to sigma=0 (image); ``dt = sigma_next - sigma < 0``.
One function serves sampling (``prev_sample=None``) and training replay (``prev_sample`` given: only
evaluates). All step arithmetic is float32 whatever the input dtype (bf16 inputs are upcast), because
the PPO ratio depends on log-prob differences that bf16 cannot resolve.

``sigma``/``sigma_next`` may be python floats, 0-d tensors or per-sample ``(B,)`` tensors (different
samples of one batch may sit at different timesteps, e.g. DanceGRPO's per-sample timestep order).
"""
from __future__ import annotations

import math

import numpy as np
import torch

SDE_TYPES = ("flow_sde", "dance_sde", "cps")
ODE_SOLVERS = ("euler", "dpm2")  # deterministic rollout solvers: ode_step, dpm2_step

Sigma = float | torch.Tensor


def flux_mu(image_seq_len: int, base_seq_len: int = 256, max_seq_len: int = 4096,
            base_shift: float = 0.5, max_shift: float = 1.15) -> float:
    """FLUX's resolution-dependent shift ``mu``: linear in the packed image sequence length (FluxPipeline.calculate_shift)."""
    m = (max_shift - base_shift) / (max_seq_len - base_seq_len)
    b = base_shift - m * base_seq_len
    return image_seq_len * m + b


def time_shift(mu: float, t, sigma: float = 1.0):
    """Exponential time shift ``e^mu / (e^mu + (1/t - 1)^sigma)`` (works on numpy arrays and tensors)."""
    return math.exp(mu) / (math.exp(mu) + (1 / t - 1) ** sigma)


def static_shift(t: torch.Tensor, shift: float) -> torch.Tensor:
    """SD3/DanceGRPO static shift ``shift*t / (1 + (shift-1)*t)``."""
    return (shift * t) / (1 + (shift - 1) * t)


def get_sigmas(num_steps: int, *, shift: float | None = None, image_seq_len: int | None = None,
               base_seq_len: int = 256, max_seq_len: int = 4096, base_shift: float = 0.5,
               max_shift: float = 1.15) -> torch.Tensor:
    """The (S+1,) float32 sigma grid from 1 to 0: static ``shift`` (DanceGRPO) or, if ``shift`` is None, FLUX's dynamic shift.

    The dynamic schedule reproduces ``FluxPipeline`` + ``FlowMatchEulerDiscreteScheduler`` bit for bit:
    ``linspace(1, 1/S, S)`` cast to float32, time-shifted in float32 with ``mu = flux_mu(image_seq_len)``,
    then a final 0 appended. The static schedule shifts ``linspace(1, 0, S+1)`` in float32.
    """
    if int(num_steps) < 1:
        raise ValueError(f"num_steps must be >= 1, got {num_steps}")
    num_steps = int(num_steps)
    if shift is not None:
        if shift <= 0:
            raise ValueError(f"shift must be > 0 (1 = no shift; DanceGRPO uses 3), got {shift}")
        t = torch.linspace(1, 0, num_steps + 1, dtype=torch.float32)
        return static_shift(t, float(shift))
    if image_seq_len is None:
        raise ValueError("get_sigmas needs either shift=<float> (static shift) or image_seq_len=<packed latent "
                         "tokens, e.g. flux.latent_geometry(...).seq_len> (FLUX dynamic shift)")
    mu = flux_mu(image_seq_len, base_seq_len, max_seq_len, base_shift, max_shift)
    # Same numpy float32 arithmetic as FluxPipeline -> FlowMatchEulerDiscreteScheduler.set_timesteps.
    t = np.linspace(1.0, 1 / num_steps, num_steps).astype(np.float32)
    sigmas = time_shift(mu, t, 1.0)
    sigmas = torch.from_numpy(np.asarray(sigmas)).to(torch.float32)
    return torch.cat([sigmas, torch.zeros(1, dtype=torch.float32)])


def _sigma_tensor(sigma: Sigma, sample: torch.Tensor, name: str,
                  dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``sigma`` as ``dtype`` (float32) on ``sample``'s device: 0-d, or (B, 1, ..., 1) for a per-sample (B,) tensor."""
    if not torch.is_tensor(sigma):
        return torch.tensor(float(sigma), dtype=dtype, device=sample.device)
    s = sigma.to(device=sample.device, dtype=dtype)
    if s.ndim == 0:
        return s
    if s.ndim != 1 or s.shape[0] != sample.shape[0]:
        raise ValueError(f"{name} must be a float, a 0-d tensor or a (B,) tensor with B={sample.shape[0]}, "
                         f"got shape {tuple(s.shape)}")
    return s.view(-1, *([1] * (sample.ndim - 1)))


def _per_sample(x: torch.Tensor, batch: int) -> torch.Tensor:
    """A 0-d or (B,1,..,1) tensor as a (B,) tensor."""
    return x.reshape(-1).expand(batch) if x.numel() == 1 else x.reshape(batch)


def _mean_dims(x: torch.Tensor) -> torch.Tensor:
    return x.mean(dim=tuple(range(1, x.ndim)))


def _check_sde(sde_type: str, eta: float) -> None:
    if sde_type not in SDE_TYPES:
        raise ValueError(f"sde_type must be one of {SDE_TYPES}, got {sde_type!r}")
    if not eta > 0:
        raise ValueError(f"eta must be > 0 for an SDE step, got {eta}; use ode_step (or eta=0 in the rollout) "
                         "for deterministic sampling")


def _flow_sde_scale(sigma: torch.Tensor, eta: float, sigma_max: Sigma | None) -> torch.Tensor:
    """Flow-GRPO's ``s = a*sqrt(sigma / (1 - sigma~))`` with sigma~ = sigma_max where sigma == 1."""
    at_one = sigma == 1
    if sigma_max is None:
        if bool(at_one.any()):
            raise ValueError("flow_sde at sigma=1 needs sigma_max (pass sigma_max=sigmas[1], the schedule's "
                             "second sigma) to avoid dividing by zero")
        denom_sigma = sigma
    else:
        sm = torch.as_tensor(sigma_max, dtype=torch.float32, device=sigma.device)
        denom_sigma = torch.where(at_one, sm, sigma)
    return torch.sqrt(sigma / (1 - denom_sigma)) * eta


KL_FORMS = ("per_unit_time", "reference")


def sde_noise_scale(sigma: Sigma, sigma_next: Sigma, *, sde_type: str = "flow_sde", eta: float,
                    sigma_max: Sigma | None = None, kl_form: str = "per_unit_time") -> torch.Tensor:
    """The noise scale ``s`` the KL of docs/algorithms.md §4 divides by, ``mean_dims((mu - mu_ref)²) / (2 s²)``
    (float32, 0-d or (B,)).

    ``kl_form="per_unit_time"`` (default): ``s = std / sqrt(sigma - sigma_next)``: flow_sde: Flow-GRPO's ``s`` (std
    without sqrt(-dt)); dance_sde: ``eta``; cps: ``std / sqrt(-dt)``. ``kl_form="reference"``: the ``std_dev_t``
    that Flow-GRPO's and verl-omni's step functions return and their KL divides by: flow_sde the same ``s``;
    dance_sde and cps the step's full std, ``eta*sqrt(sigma - sigma_next)`` and ``sigma_next*sin(eta*pi/2)`` (bit for
    bit ``sde_step_with_logprob``'s std): their KL is the per-unit-time one divided by ``sigma - sigma_next``.
    """
    _check_sde(sde_type, eta)
    if kl_form not in KL_FORMS:
        raise ValueError(f"kl_form must be one of {KL_FORMS}, got {kl_form!r}")
    sig = torch.as_tensor(sigma, dtype=torch.float32)
    sig_next = torch.as_tensor(sigma_next, dtype=torch.float32, device=sig.device)
    sig, sig_next = torch.broadcast_tensors(sig, sig_next)
    if sde_type == "flow_sde":
        return _flow_sde_scale(sig, eta, sigma_max)
    if kl_form == "reference":
        if sde_type == "dance_sde":
            return eta * torch.sqrt(sig - sig_next)
        return sig_next * math.sin(eta * math.pi / 2)
    if sde_type == "dance_sde":
        return torch.full_like(sig, float(eta))
    return sig_next * math.sin(eta * math.pi / 2) / torch.sqrt(sig - sig_next)


def sde_step_with_logprob(model_output: torch.Tensor, sample: torch.Tensor, sigma: Sigma, sigma_next: Sigma, *,
                          sde_type: str = "flow_sde", eta: float, prev_sample: torch.Tensor | None = None,
                          noise: torch.Tensor | None = None, sigma_max: Sigma | None = None,
                          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One stochastic reverse step ``x -> x'`` and ``log p(x' | x)`` (docs/algorithms.md §2.1-2.3), in float32.

    Returns ``(prev_sample, log_prob (B,), prev_sample_mean, std (B,))`` where ``std`` is the standard
    deviation of ``x'`` given ``x``. ``prev_sample=None`` samples ``x' = mean + std*noise`` (``noise`` as
    given, else ``torch.randn``); a given ``prev_sample`` is only evaluated (it is detached: the gradient
    flows through the mean). ``log_prob`` is averaged over all non-batch dims; for ``cps`` it drops the
    constants (``-mean((x'-mean)^2)``). ``sigma_max`` replaces sigma=1 in flow_sde's noise-scale
    denominator (pass ``sigmas[1]``).
    """
    _check_sde(sde_type, eta)
    v = model_output.to(torch.float32)
    x = sample.to(torch.float32)
    batch = x.shape[0]
    sig = _sigma_tensor(sigma, x, "sigma")
    sig_next = _sigma_tensor(sigma_next, x, "sigma_next")
    dt = sig_next - sig

    if sde_type == "flow_sde":
        s = _flow_sde_scale(sig, eta, sigma_max)
        mean = x * (1 + s**2 / (2 * sig) * dt) + v * (1 + s**2 * (1 - sig) / (2 * sig)) * dt
        std = s * torch.sqrt(-dt)
    elif sde_type == "dance_sde":
        x0 = x - sig * v
        score = -(x - x0 * (1 - sig)) / sig**2
        mean = x + dt * v
        mean = mean + (-0.5 * eta**2 * score) * dt
        std = eta * torch.sqrt(sig - sig_next)
    else:  # cps
        std = sig_next * math.sin(eta * math.pi / 2)
        x0 = x - sig * v
        x1 = x + v * (1 - sig)
        mean = x0 * (1 - sig_next) + x1 * torch.sqrt(sig_next**2 - std**2)

    if prev_sample is None:
        if noise is None:
            noise = torch.randn_like(mean)
        prev_sample = mean + std * noise.to(device=mean.device, dtype=torch.float32)
    else:
        prev_sample = prev_sample.to(torch.float32)

    diff = prev_sample.detach() - mean
    if sde_type == "cps":
        log_prob = -(diff**2)
    else:
        log_prob = -(diff**2) / (2 * std**2) - torch.log(std) - 0.5 * math.log(2 * math.pi)
    return prev_sample, _mean_dims(log_prob), mean, _per_sample(std, batch)




def training_sigma_table(shift: float = 3.0, num_train_timesteps: int = 1000) -> torch.Tensor:
    """(N,) float32: ``FlowMatchEulerDiscreteScheduler(num_train_timesteps=N, shift=shift).sigmas`` as constructed
    (no ``set_timesteps``): ``t = linspace(1, N, N)[::-1] / N`` (1 down to 1/N, no final 0), statically shifted in
    float32 (``shift=1``: unshifted, which is also what a scheduler with ``use_dynamic_shifting`` holds). SD3/SD3.5:
    shift 3."""
    n = int(num_train_timesteps)
    if n < 1 or not shift > 0:
        raise ValueError(f"need num_train_timesteps >= 1 and shift > 0, got {num_train_timesteps} and {shift}")
    t = torch.from_numpy(np.linspace(1, n, n, dtype=np.float32)[::-1].copy()) / n
    return t if shift == 1 else static_shift(t, float(shift))


def table_sigma(u: torch.Tensor, *, shift: float = 3.0, num_train_timesteps: int = 1000) -> torch.Tensor:
    """Flow-GRPO's SD3 DPO sigma (``scripts/train_sd3_dpo.py``) for ``u`` in (0, 1) (any shape): the index
    ``(u * N).long()`` (float32, truncated; clamped to N-1 where float32 rounds u to 1) into
    ``training_sigma_table(shift, N)``, so sigma = shift(1 - floor(N*u)/N): a logit-normal u gives a shifted,
    discretised sigma whose unshifted time is about 1 - u."""
    table = training_sigma_table(shift, num_train_timesteps)
    idx = (u.to(torch.float32) * int(num_train_timesteps)).long().clamp(0, int(num_train_timesteps) - 1)
    return table.to(u.device)[idx]


def ode_step(model_output: torch.Tensor, sample: torch.Tensor, sigma: Sigma, sigma_next: Sigma) -> torch.Tensor:
    """Euler step ``x + (sigma_next - sigma)*v`` in float32: bitwise ``FlowMatchEulerDiscreteScheduler.step`` for float32 inputs."""
    x = sample.to(torch.float32)
    dt = _sigma_tensor(sigma_next, x, "sigma_next") - _sigma_tensor(sigma, x, "sigma")
    return x + dt * model_output.to(torch.float32)


def _half_log_snr(sigma: torch.Tensor) -> torch.Tensor:
    """``lambda(sigma) = log(alpha / sigma)`` with ``alpha = 1 - sigma`` (-inf at sigma = 1), in the input's dtype."""
    return torch.log1p(-sigma) - torch.log(sigma)


def dpm2_step(model_output: torch.Tensor, sample: torch.Tensor, sigma: Sigma, sigma_next: Sigma, *,
              prev_x0: torch.Tensor | None = None, sigma_prev: Sigma | None = None,
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """One DPM-Solver++(2M) step (multistep, x0-parametrised, deterministic); returns ``(x_next, x0_hat)`` in float32.

    With ``x0_hat = x - sigma*v``, ``alpha = 1 - sigma``, ``lambda = log(alpha/sigma)``, ``h = lambda' - lambda``:
    ``x' = (sigma'/sigma)*x + alpha'*(1 - e^-h)*D``, and ``alpha'*(1 - e^-h) = 1 - sigma'/sigma`` for flow matching.
    First order (``D = x0_hat``, the Euler step up to rounding) when ``prev_x0`` is None, at ``sigma' = 0`` (returns
    ``x0_hat`` exactly) and where ``sigma_prev == 1`` (lambda = -inf: the r -> inf limit of the formula below).
    Second order otherwise: ``r = (lambda - lambda(sigma_prev)) / h``,
    ``D = (1 + 1/(2r))*x0_hat - 1/(2r)*prev_x0``, where ``prev_x0`` is the previous step's ``x0_hat`` at
    ``sigma_prev``. Pass this step's ``x0_hat`` and ``sigma`` as ``prev_x0``/``sigma_prev`` to the next step.
    Coefficients are computed in float64.
    """
    v = model_output.to(torch.float32)
    x = sample.to(torch.float32)
    sig = _sigma_tensor(sigma, x, "sigma", torch.float64)
    sig_next = _sigma_tensor(sigma_next, x, "sigma_next", torch.float64)
    x0_hat = x - sig.to(torch.float32) * v
    ratio = sig_next / sig
    d = x0_hat
    if prev_x0 is not None:
        if sigma_prev is None:
            raise ValueError("dpm2_step: prev_x0 needs sigma_prev (the sigma at which prev_x0 was predicted)")
        sig_prev = _sigma_tensor(sigma_prev, x, "sigma_prev", torch.float64)
        second = (sig_prev < 1) & (sig_next > 0)  # where the two-step formula is defined
        # computed everywhere and masked (no data-dependent branch: no host sync); c_prev = 0 keeps D = x0_hat exactly
        safe = lambda s, fill: torch.where(second, s, torch.full_like(s, fill))  # noqa: E731 (no inf/nan)
        lam = _half_log_snr(safe(sig, 0.5))
        h = _half_log_snr(safe(sig_next, 0.25)) - lam
        h_prev = lam - _half_log_snr(safe(sig_prev, 0.75))
        c_prev = torch.where(second, h / (2 * h_prev), torch.zeros_like(h))  # 1/(2r)
        c_prev = c_prev.to(torch.float32)
        d = torch.where(second, (1 + c_prev) * x0_hat - c_prev * prev_x0.to(torch.float32), x0_hat)
    x_next = ratio.to(torch.float32) * x + (1 - ratio).to(torch.float32) * d
    x_next = torch.where(sig_next == 0, x0_hat, x_next)
    return x_next, x0_hat
