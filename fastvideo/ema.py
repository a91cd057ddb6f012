"""Sharded weight copies that follow the trained weights: the EMA (``--use_ema``), the updated DPO reference and
DiffusionNFT's old policy are each an ``EMA`` over the local shards of the trainable parameters (no communication),
saved in a checkpoint as a shadow and swapped into the model for an export or a reference pass."""
from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch
from torch import nn

from fastvideo.parallel import named_trainable_parameters, reshard


def local_shard(t: torch.Tensor) -> torch.Tensor:
    """The local shard of a DTensor (an alias, under no_grad), or the tensor itself."""
    from torch.distributed.tensor import DTensor  # heavy

    return t._local_tensor if isinstance(t, DTensor) else t


class EMA:
    """Exponential moving average of the trainable parameters, kept sharded like the model.

    Holds a copy of this rank's shards of the trainable parameters (FSDP2 DTensor shards, FSDP1 flat-param
    views, or whole tensors for a plain module) — no gather, ever, during training. Create it after
    ``shard_model`` (and after loading the initial weights); call ``update()`` after each ``optimizer.step()``.

        ema = EMA(model, decay=0.995)       # warm-up: the decay of update t is min(0.995, (1 + t) / (10 + t))
        ...optimizer.step(); ema.update()
        with ema.swap_into(model):        # evaluate / export the EMA weights
            sd = full_state_dict(model)

    ``state_dict()`` / ``load_state_dict()`` hold local shards, so they round-trip only with the same sharding;
    ``save_checkpoint(..., ema=ema)`` stores the EMA resharding-safely (DCP) and is what trainers use.
    """

    def __init__(self, model: nn.Module, decay: float, warmup: bool = True,
                 shadow: list[torch.Tensor] | None = None) -> None:
        """``shadow``: tensors, one per trainable parameter's local shard, to hold the average in place of fresh
        clones (aliases of another sharded copy, e.g. DiffusionNFT's old policy); default: clones of the shards."""
        if not 0.0 <= decay < 1.0:
            raise ValueError(f"--ema_decay must be in [0, 1), got {decay}")
        named = named_trainable_parameters(model)
        if not named:
            raise ValueError("EMA: the model has no trainable parameters")
        self.decay = float(decay)
        self.warmup = bool(warmup)
        self.names = [n for n, _ in named]
        self._params = [p for _, p in named]
        reshard(model)
        with torch.no_grad():
            self.shadow = [local_shard(p).detach().clone() for p in self._params] if shadow is None else list(shadow)
        self.num_updates = 0
        self._locals()  # the shadow must match the local shards (checks the shapes)

    def _locals(self) -> list[torch.Tensor]:
        locals_ = [local_shard(p).detach() for p in self._params]
        for name, loc, sh in zip(self.names, locals_, self.shadow):
            if loc.shape != sh.shape:
                raise RuntimeError(f"EMA: parameter {name} is not in its sharded state ({tuple(loc.shape)} vs "
                                   f"{tuple(sh.shape)}); call update()/swap_into() after optimizer.step(), not "
                                   "between forward and backward")
        return locals_

    def current_decay(self) -> float:
        """The decay the next ``update()`` uses: with warm-up ``min(decay, (1 + t) / (10 + t))`` for the t-th update
        (t = 0, 1, ...; Flow-GRPO's and diffusers' EMAModel schedule), so early updates follow the trained weights
        instead of keeping ~decay^t of the base; without warm-up the constant ``decay``."""
        t = self.num_updates
        return min(self.decay, (1 + t) / (10 + t)) if self.warmup else self.decay

    @torch.no_grad()
    def update(self, decay: float | None = None) -> None:
        """``shadow = d * shadow + (1 - d) * param`` for every local shard (one fused foreach op), with
        ``d = current_decay()`` unless ``decay`` is given."""
        d = self.current_decay() if decay is None else float(decay)
        torch._foreach_lerp_(self.shadow, self._locals(), 1.0 - d)
        self.num_updates += 1

    @torch.no_grad()
    def capture(self) -> None:
        """Set the EMA to the model's current trainable weights."""
        torch._foreach_copy_(self.shadow, self._locals())

    @contextmanager
    def swap_into(self, model: nn.Module) -> Iterator[nn.Module]:
        """Temporarily load the EMA weights into ``model`` (the model the EMA was built on); restored on exit."""
        reshard(model)
        ids = {id(p) for _, p in named_trainable_parameters(model)}
        if any(id(p) not in ids for p in self._params):
            raise ValueError("EMA.swap_into: this EMA was built on a different model (or before shard_model)")
        with torch.no_grad():
            locals_ = self._locals()
            backup = [t.clone() for t in locals_]
            torch._foreach_copy_(locals_, self.shadow)
        try:
            yield model
        finally:
            reshard(model)
            with torch.no_grad():
                torch._foreach_copy_(self._locals(), backup)

    def counters(self) -> dict:
        """The EMA's scalars (decay, number of updates), stored by save_checkpoint next to the DCP weights."""
        return {"decay": self.decay, "num_updates": self.num_updates}

    def load_counters(self, counters: dict | None) -> None:
        """Restore ``counters()`` (the decay stays the one this EMA was built with)."""
        if counters:
            self.num_updates = int(counters["num_updates"])

    def state_dict(self) -> dict:
        """``{"decay", "num_updates", "shadow": {name: local shard}}`` (valid for the same sharding only)."""
        return {**self.counters(), "shadow": dict(zip(self.names, self.shadow))}

    @torch.no_grad()
    def load_state_dict(self, state: dict) -> None:
        """Inverse of ``state_dict`` (same model, same sharding)."""
        missing = set(self.names) - set(state["shadow"])
        if missing:
            raise ValueError(f"EMA state is missing {len(missing)} parameters, e.g. {sorted(missing)[:3]}")
        for name, sh in zip(self.names, self.shadow):
            sh.copy_(local_shard(state["shadow"][name]))
        self.load_counters(state)
