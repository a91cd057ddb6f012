"""Which prompts each training step samples, and which of their samples each rank holds: ``GroupSampler``, a pure
function of (seed, step), so every rank and every resume draws the same groups."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from fastvideo.seeding import generator


@dataclass(frozen=True)
class StepSamples:
    """The samples of one training step: this rank's (prompt id, sample index) pairs and the step's groups."""

    step: int
    epoch: int
    group_prompt_ids: list[int]  # all P prompts of the step, in group order
    prompt_ids: list[int]  # this rank's share of the global [p0 g0..gG-1, p1 g0.., ...] order
    sample_indices: list[int]  # 0..G-1 index of each sample inside its prompt group


class GroupSampler:
    """Draws ``prompts_per_step`` prompts per step, each repeated ``num_generations`` times.

    A pure function of (seed, step): epoch ``e`` is a permutation of all prompt ids seeded by
    (seed, e); step ``s`` takes the next ``prompts_per_step`` entries of it (an incomplete tail is
    dropped, so a step never repeats a prompt). The global sample order is
    [p0 g0..gG-1, p1 g0..gG-1, ...] and rank r takes the r-th contiguous slice (a group may span ranks).
    """

    def __init__(self, num_prompts: int, prompts_per_step: int, num_generations: int, *, seed: int,
                 rank: int = 0, world_size: int = 1):
        if num_prompts < 1:
            raise ValueError(f"the dataset has {num_prompts} prompts; preprocess a prompt file with at least one")
        if prompts_per_step < 1 or num_generations < 1:
            raise ValueError(f"prompts per step ({prompts_per_step}) and --num_generations ({num_generations}) "
                             "must be >= 1")
        if prompts_per_step > num_prompts:
            raise ValueError(f"{prompts_per_step} prompts per step but the dataset has only {num_prompts} prompts; "
                             "use fewer prompts per step or more prompts")
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not in [0, world_size={world_size})")
        total = prompts_per_step * num_generations
        if total % world_size:
            raise ValueError(f"prompts_per_step*num_generations = {prompts_per_step}*{num_generations} = {total} "
                             f"samples per step is not divisible by the world size {world_size}; change the "
                             "batch size or --num_generations so every rank gets the same number of samples")
        self.num_prompts = int(num_prompts)
        self.prompts_per_step = int(prompts_per_step)
        self.num_generations = int(num_generations)
        self.seed = int(seed)
        self.rank = int(rank)
        self.world_size = int(world_size)
        self.samples_per_rank = total // world_size
        self.steps_per_epoch = self.num_prompts // self.prompts_per_step
        self.step = 0  # the next step .next() returns
        self._perm_cache: tuple[int, list[int]] | None = None

    def _permutation(self, epoch: int) -> list[int]:
        if self._perm_cache is None or self._perm_cache[0] != epoch:
            perm = torch.randperm(self.num_prompts, generator=generator(self.seed, "group_sampler", epoch))
            self._perm_cache = (epoch, perm.tolist())
        return self._perm_cache[1]

    def samples_for_step(self, step: int) -> StepSamples:
        """This rank's samples of ``step`` (does not move the position)."""
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        epoch, k = divmod(int(step), self.steps_per_epoch)
        P, G = self.prompts_per_step, self.num_generations
        groups = self._permutation(epoch)[k * P:(k + 1) * P]
        lo = self.rank * self.samples_per_rank
        flat = range(lo, lo + self.samples_per_rank)  # positions in the global [P*G] order
        return StepSamples(step=int(step), epoch=epoch, group_prompt_ids=list(groups),
                           prompt_ids=[groups[j // G] for j in flat], sample_indices=[j % G for j in flat])

    def next(self) -> StepSamples:
        """Samples of the current step, then advance."""
        out = self.samples_for_step(self.step)
        self.step += 1
        return out

    def state_dict(self) -> dict[str, int]:
        """Position (next step) plus the settings it is only meaningful with."""
        return {"step": self.step, "seed": self.seed, "num_prompts": self.num_prompts,
                "prompts_per_step": self.prompts_per_step, "num_generations": self.num_generations}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Restore the position; refuse a state saved with other seed/dataset/batch settings."""
        for key in ("seed", "num_prompts", "prompts_per_step", "num_generations"):
            if key in state and int(state[key]) != getattr(self, key):
                raise ValueError(f"checkpoint's sampler was saved with {key}={state[key]} but this run has "
                                 f"{key}={getattr(self, key)}; resume with the same settings or start a new "
                                 "--output_dir")
        self.step = int(state["step"])
