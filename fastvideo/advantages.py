"""Group-normalised advantages for GRPO (docs/algorithms.md §3) and best-vs-worst pairs for online DPO (§5), on the
already-gathered global batch.

The caller all-gathers rewards and prompt ids across ranks first (a prompt group may span ranks),
calls ``group_advantages`` on the full batch (every rank gets the same result), and keeps its slice.
Metrics are detached 0-d float32 tensors on the rewards' device (identical on every rank).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from fastvideo.options import opt

DANCE_GRPO_EPS = 1e-8  # DanceGRPO: (r - mean) / (unbiased group std + 1e-8)
FLOW_GRPO_EPS = 1e-4  # Flow-GRPO: (r - mean) / (population std + 1e-4); our default in both modes
DEFAULT_EPS = FLOW_GRPO_EPS


GROUP_STD_MODES = ("unbiased", "population")


def group_advantages(rewards: torch.Tensor, group_ids: torch.Tensor, *, global_std: bool = True,
                     adv_clip_max: float = 5.0, eps: float | None = None, group_std: str = "unbiased",
                     ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """``A = clamp((r - group mean) / (std + eps), ±adv_clip_max)`` per sample, and summary metrics.

    ``global_std=True`` (Flow-GRPO): std = population std of the whole batch.
    ``global_std=False`` (DanceGRPO): std = unbiased std of the sample's group (a group of one sample has std 0 and
    advantage 0); ``group_std="population"`` divides the group's squared deviations by n instead of n - 1, as the
    per-prompt statistics of Flow-GRPO and DiffusionNFT do (``np.std``, ddof 0; ignored with ``global_std``).
    ``eps`` defaults to 1e-4 in both modes: with DanceGRPO's 1e-8 a near-constant group (std ~1e-6, e.g. a saturated
    reward) turns float noise into advantages of ~±1 to ±adv_clip_max; pass
    ``DANCE_GRPO_EPS`` to reproduce it. ``group_ids`` are any integer ids (prompt ids);
    the result does not depend on the order of the samples. Computed in float64; advantages are
    returned in the rewards' float dtype (float32 for integer rewards). A non-finite reward marks a dropped sample
    (``--nonfinite_reward drop``): it gets advantage 0 and every statistic is computed as if it were absent.
    Metrics: reward_mean, reward_std (population), adv_abs_mean, adv_clip_frac (fraction clamped),
    num_groups, zero_std_group_frac (groups whose rewards are all equal: they carry no signal),
    low_std_group_frac (groups whose normalising std is below ``eps``: eps, not the rewards, sets their scale).
    """
    if rewards.ndim != 1 or group_ids.shape != rewards.shape:
        raise ValueError(f"rewards and group_ids must both be (N,), got {tuple(rewards.shape)} and "
                         f"{tuple(group_ids.shape)}")
    if rewards.numel() == 0:
        raise ValueError("group_advantages got an empty batch")
    if adv_clip_max <= 0:
        raise ValueError(f"adv_clip_max must be > 0, got {adv_clip_max}")
    if group_std not in GROUP_STD_MODES:
        raise ValueError(f"group_std must be one of {GROUP_STD_MODES}, got {group_std!r}")
    if eps is None:
        eps = DEFAULT_EPS
    if eps <= 0:
        raise ValueError(f"--adv_eps must be > 0, got {eps}")
    out_dtype = rewards.dtype if rewards.is_floating_point() else torch.float32
    raw = rewards.detach().to(torch.float64)
    valid = torch.isfinite(raw)
    if not valid.any():
        raise ValueError("group_advantages: every reward of the batch is non-finite (all samples dropped)")
    r = torch.where(valid, raw, 0.0)
    w = valid.to(torch.float64)
    _, inverse = torch.unique(group_ids.to(r.device), return_inverse=True)
    num_groups = int(inverse.max()) + 1
    counts = torch.zeros(num_groups, dtype=torch.float64, device=r.device).index_add_(0, inverse, w)
    sums = torch.zeros_like(counts).index_add_(0, inverse, r)
    group_mean = sums / counts.clamp(min=1)
    centered = (r - group_mean[inverse]) * w
    mean = r.sum() / w.sum()
    if global_std:
        std = ((r - mean).pow(2) * w).sum().div(w.sum()).sqrt()
        denom = std + eps
        norm_std = std.expand(num_groups)
    else:
        sq = torch.zeros_like(counts).index_add_(0, inverse, centered.pow(2))
        dof = counts - 1 if group_std == "unbiased" else counts
        norm_std = (sq / dof.clamp(min=1)).sqrt()
        denom = norm_std[inverse] + eps
    adv = centered / denom
    clipped = adv.clamp(-adv_clip_max, adv_clip_max)

    gmax = torch.full_like(counts, -torch.inf).scatter_reduce_(0, inverse, torch.where(valid, r, -torch.inf), "amax")
    gmin = torch.full_like(counts, torch.inf).scatter_reduce_(0, inverse, torch.where(valid, r, torch.inf), "amin")
    f32 = lambda x: torch.as_tensor(x, dtype=torch.float32, device=r.device).detach()  # noqa: E731
    metrics = {
        "reward_mean": f32(mean),
        "reward_std": f32(((r - mean).pow(2) * w).sum().div(w.sum()).sqrt()),
        "adv_abs_mean": f32(clipped.abs()[valid].mean()),
        "adv_clip_frac": f32((adv.abs() > adv_clip_max)[valid].double().mean()),
        "num_groups": f32(num_groups),
        "zero_std_group_frac": f32(((gmax == gmin) | (counts == 0)).double().mean()),
        "low_std_group_frac": f32((norm_std < eps).double().mean()),
    }
    return clipped.to(out_dtype), metrics


@dataclass
class Pairs:
    """One preference pair per prompt group: global sample indices of its best (``winner``) and worst (``loser``)
    sample (P,), the reward ``gap`` between them (P,), and ``keep`` (P,) bool: the pair is trained."""

    winner: torch.Tensor
    loser: torch.Tensor
    gap: torch.Tensor
    keep: torch.Tensor


def best_worst_pairs(rewards: torch.Tensor, num_generations: int, min_gap: float = 0.0) -> Pairs:
    """Pair the highest- with the lowest-reward sample of each group of the global batch ``rewards`` (P*G,), in
    [p0 g0..gG-1, p1 ...] order (docs/algorithms.md §5). A pair is kept when its gap is > 0 and >= ``min_gap`` (equal
    rewards carry no preference). Ties go to the first sample of the group. Non-finite rewards (dropped samples) are
    never picked; a group with fewer than two finite rewards keeps no pair."""
    G = int(num_generations)
    if rewards.ndim != 1 or rewards.numel() % G or G < 2:
        raise ValueError(f"rewards must be (P*G,) with G = num_generations >= 2, got {tuple(rewards.shape)} and G={G}")
    grouped = rewards.detach().to(torch.float64).view(-1, G)  # (P, G)
    valid = torch.isfinite(grouped)
    offsets = torch.arange(grouped.shape[0]) * G
    high = torch.where(valid, grouped, -torch.inf)
    low = torch.where(valid, grouped, torch.inf)
    best, worst = high.argmax(dim=1), low.argmin(dim=1)
    enough = valid.sum(dim=1) >= 2
    gap = torch.where(enough, high.max(dim=1).values - low.min(dim=1).values, 0.0)
    return Pairs(winner=offsets + best.cpu(), loser=offsets + worst.cpu(), gap=gap.to(torch.float32).cpu(),
                 keep=(enough & (gap > 0) & (gap >= min_gap)).cpu())


def share_pairs(num_pairs: int, rank: int, world_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's part of ``num_pairs`` pairs spread evenly over ranks: positions (m,) and loss weights (m,), with
    m = ceil(num_pairs / world_size) on every rank (FSDP needs the same number of forwards everywhere). A short rank
    is padded with position 0 at weight 0; real pairs weigh ``world_size / num_pairs``, so that FSDP's mean of the
    ranks' gradients is the mean over all pairs, whatever the world size."""
    if num_pairs < 1:
        return torch.zeros(0, dtype=torch.long), torch.zeros(0)
    m = -(-num_pairs // world_size)
    positions = torch.arange(rank * m, (rank + 1) * m)
    real = positions < num_pairs
    weights = real.float() * (world_size / num_pairs)
    return torch.where(real, positions, torch.zeros_like(positions)), weights


def nonzero_selection(adv_all: torch.Tensor, *, atol: float = 0.0) -> torch.Tensor:
    """Global positions (n,) LongTensor (CPU, increasing) of the samples of the gathered batch ``adv_all`` (N,) whose
    advantage is nonzero, ``|A| > atol``: Flow-GRPO trains only those (``scripts/train_sd3.py``: ``mask =
    advantages.abs().sum(dim=1) != 0``, i.e. ``atol = 0``). A group whose rewards are all equal has advantage exactly 0
    only when its mean is exact (binary or dyadic rewards); otherwise rounding leaves ~1e-13, which ``atol`` (e.g.
    1e-6) also drops. A dropped sample (non-finite reward: advantage 0) is never selected."""
    if adv_all.ndim != 1:
        raise ValueError(f"adv_all must be (N,), got {tuple(adv_all.shape)}")
    if not atol >= 0:
        raise ValueError(f"atol must be >= 0, got {atol}")
    return (adv_all.detach().cpu().abs() > atol).nonzero().flatten()


def shuffle_order(noise, step: int, num_samples: int, *, selected: torch.Tensor | None = None, epoch: int = 0,
                  purpose: str = "shuffle") -> torch.Tensor:
    """The step's global training order: a permutation (num_samples,) LongTensor (CPU) of the gathered batch's
    positions 0..N-1, keyed by ``(seed, step, purpose)`` and ``epoch`` (the pass over the rollout) on the
    ``NoiseSource`` ``noise``, so the same on every rank and for every world size (N = prompts x generations does not
    depend on it). With ``selected`` (positions, e.g. ``nonzero_selection``'s) it returns those positions only, in the
    permuted order. Flow-GRPO and DiffusionNFT shuffle before splitting into micro-batches (each rank its own samples,
    with an unkeyed ``torch.randperm``); here the order is global and ``share_samples`` cuts it into optimizer steps
    and ranks."""
    if num_samples < 0:
        raise ValueError(f"num_samples must be >= 0, got {num_samples}")
    perm = noise.randperm(int(num_samples), step=int(step), prompt_id=0, sample_index=int(epoch),
                          purpose=purpose).to("cpu", torch.long)
    if selected is None:
        return perm
    sel = torch.as_tensor(selected, dtype=torch.long).cpu().reshape(-1)
    if len(sel) and not (0 <= int(sel.min()) and int(sel.max()) < num_samples):
        raise ValueError(f"selected positions must be in [0, {num_samples}), got {sel.min()}..{sel.max()}")
    chosen = torch.zeros(int(num_samples), dtype=torch.bool)
    chosen[sel] = True
    return perm[chosen[perm]]


def share_samples(selected: torch.Tensor, rank: int, world_size: int, *, owners: torch.Tensor | None = None,
                  num_chunks: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """This rank's part of the ``selected`` global positions (n,), in training order, per optimizer step: a list of
    ``num_chunks`` ``(positions (m_c,), weights (m_c,))``, with m_c the same on every rank (FSDP needs the same number
    of forwards everywhere).

    The order is cut into ``num_chunks`` consecutive chunks (sizes differing by at most one: ``tensor_split``), one
    per optimizer step, whatever the world size. Each chunk is then spread over the ranks:

    - ``owners=None``: evenly, as ``share_pairs`` (m_c = ceil(n_c / world_size)); a rank gets samples it may not have
      rolled out (what they need must be gathered, as the DPO trainer gathers clean latents).
    - ``owners`` (N,) = the rank that holds each global sample (contiguous layout: ``torch.arange(N) // per_rank``):
      each rank trains its own samples of the chunk, m_c = the largest such count over ranks; no data moves.

    Padding entries repeat a valid position (``owners``: the rank's first own sample; else the chunk's first) at
    weight 0. Real samples weigh ``world_size / n_c``: FSDP averages the ranks' gradients, so a loss of
    ``sum(weights * per_sample_loss)`` per chunk is the mean over the chunk's samples (Flow-GRPO's normalisation:
    the mean over the kept samples), the same for every world size. A chunk with no sample is ``([], [])`` on every
    rank: skip its forwards and optimizer step. Positions are global; with contiguous ownership the rank's local index
    is ``position - rank * per_rank``.
    """
    if not (world_size >= 1 and 0 <= rank < world_size):
        raise ValueError(f"need 0 <= rank < world_size, got rank={rank}, world_size={world_size}")
    if num_chunks < 1:
        raise ValueError(f"num_chunks must be >= 1, got {num_chunks}")
    sel = torch.as_tensor(selected, dtype=torch.long).cpu().reshape(-1)
    pad = None
    if owners is not None:
        owners = torch.as_tensor(owners, dtype=torch.long).cpu().reshape(-1)
        if len(owners) and not (0 <= int(owners.min()) and int(owners.max()) < world_size):
            raise ValueError(f"owners must be ranks in [0, {world_size}), got {owners.min()}..{owners.max()}")
        if len(sel) and not (0 <= int(sel.min()) and int(sel.max()) < len(owners)):
            raise ValueError(f"selected positions must index owners (N={len(owners)}), got {sel.min()}..{sel.max()}")
        own = (owners == rank).nonzero().flatten()
        pad = own[0] if len(own) else None
    out = []
    for chunk in sel.tensor_split(num_chunks):
        n = len(chunk)
        if n == 0:
            out.append((torch.zeros(0, dtype=torch.long), torch.zeros(0)))
            continue
        if owners is None:
            m = -(-n // world_size)
            pos = torch.arange(rank * m, (rank + 1) * m)
            real = pos < n
            idx = chunk[torch.where(real, pos, torch.zeros_like(pos))]
        else:
            chunk_owner = owners[chunk]
            m = int(torch.bincount(chunk_owner, minlength=world_size).max())
            mine = chunk[chunk_owner == rank]
            real = torch.arange(m) < len(mine)
            if len(mine) < m and pad is None:
                raise ValueError(f"rank {rank} holds no sample to pad its share with (owners has none of it)")
            idx = torch.cat([mine, pad.expand(m - len(mine))]) if len(mine) < m else mine
        out.append((idx, real.float() * (world_size / n)))
    return out


@dataclass
class GroupOptions:
    num_generations: int = opt(12, "samples per prompt (group size G)")
    prompts_per_step: int = opt(2, "prompts per training step over all ranks (P); samples per step = P*G")


@dataclass
class AdvantageOptions:
    adv_clip_max: float = opt(5.0, "advantages (in reward-std units) are clamped to [-adv_clip_max, adv_clip_max]")
    global_std: bool = opt(False, "normalise advantages by the whole batch's reward std (Flow-GRPO) "
                                  "instead of each group's (DanceGRPO)")
    adv_eps: float = opt(1e-4, "added to the reward std before dividing (Flow-GRPO 1e-4); DanceGRPO's 1e-8 turns "
                               "near-constant groups into +-adv_clip_max noise (pass it only to reproduce DanceGRPO)")
    group_std: str = opt("unbiased", "the group std of per-group normalisation (--no-global_std): unbiased (n - 1: "
                                     "DanceGRPO, torch.std) | population (n: Flow-GRPO's and DiffusionNFT's per-prompt "
                                     "stat_tracking.py, np.std; the NFT default)", choices=GROUP_STD_MODES)
    shuffle_micro_batches: bool = opt(
        False, "shuffle the step's samples before cutting them into optimizer steps and micro-batches (Flow-GRPO, "
        "DiffusionNFT): a permutation of the gathered batch keyed by (seed, step), the same for every world size; "
        "each rank trains its own samples in that order, padded at loss weight 0 to the longest rank's count (GRPO, "
        "DiffusionNFT and AWM)")
