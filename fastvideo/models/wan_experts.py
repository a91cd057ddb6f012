"""Wan2.2-T2V-A14B's two experts as one trainable module: ``transformer`` (high noise) serves the timesteps at or
above the pipeline's boundary (``boundary_ratio * 1000``), ``transformer_2`` (low noise) those below, as
``WanPipeline.__call__`` picks ``current_model`` per step.

Why one module: the rest of the project trains "the transformer" (LoRA, FSDP, EMA, checkpoints, exports), and both
experts are trained together (LoRA on both) or one of them is (a full fine-tune of either). Routing is per sample:
a training batch may mix timesteps of both sides (DPO's, NFT's and AWM's random times, GRPO's windows).

Routing under FSDP: every rank must run the same expert forwards in the same order, or the per-block all-gathers of
one expert meet the other expert's on another rank (the same shapes: silently mixed weights, or a hang). So each
call first agrees across ranks (``distributed.all_reduce_max_``) on which experts any rank needs; a rank without rows
for an agreed expert runs it on one of its rows and adds the result times zero (its gradients are zero, so FSDP's
reduce-scatter matches and the averaged gradient is right). With one expert trained (``--train_experts``), a call
that only the frozen one serves runs the trained one on its stand-in row too, so the loss keeps a graph (zero
gradients) on every rank. A rollout step (one sigma on every rank) needs one expert
everywhere: no extra forward. The agreement costs one tiny all-reduce and one host sync per call (the rows of each
expert must be known on the host to split the batch); the pretend-CUDA harness exempts this one site from the
sampling and replay loops' sync budgets, and nothing else (``tests/fake_cuda.py``). Against a 14B forward of
seconds, a sync that waits for the previous step's kernels costs the launch latency of the next (milliseconds).

Imported only when an A14B folder loads (it imports diffusers)."""
from __future__ import annotations

from typing import Any

import torch
from diffusers.configuration_utils import FrozenDict
from diffusers.loaders.peft import PeftAdapterMixin
from torch import nn

from fastvideo import distributed
from fastvideo.devices import to_device

class WanExperts(nn.Module, PeftAdapterMixin):
    """``transformer`` (t >= ``boundary_timestep``) and ``transformer_2`` (below) behind one ``forward`` with the
    transformer's keyword interface; ``config`` is the high-noise expert's (both share the architecture) plus
    ``_boundary_timestep``; diffusers' ``PeftAdapterMixin`` gives it ``add_adapter`` & co. (it works on any module).
    See the module docstring for the routing."""

    _supports_gradient_checkpointing = True

    def __init__(self, transformer: nn.Module, transformer_2: nn.Module, boundary_timestep: float) -> None:
        super().__init__()
        if dict(_public(transformer.config)) != dict(_public(transformer_2.config)):
            raise ValueError("the two Wan2.2 experts have different configs (transformer/ and transformer_2/): "
                             "pass an unmodified Wan2.2-T2V-A14B-Diffusers folder")
        self.transformer = transformer
        self.transformer_2 = transformer_2
        self.boundary_timestep = float(boundary_timestep)
        self._no_split_modules = list(getattr(transformer, "_no_split_modules", None) or [])

    @property
    def config(self) -> Any:
        return FrozenDict({**self.transformer.config, "_boundary_timestep": self.boundary_timestep})

    def experts(self) -> tuple[nn.Module, nn.Module]:
        return self.transformer, self.transformer_2

    def train_only(self, which: str) -> None:
        """Freeze the expert not trained (``--train_experts high|low``): a full fine-tune of one expert."""
        if which not in ("high", "low"):
            raise ValueError(f"--train_experts {which}: pass high (transformer) or low (transformer_2)")
        (self.transformer_2 if which == "high" else self.transformer).requires_grad_(False)

    # ------------------------------------------------------------------ what the project calls on "the transformer"
    def enable_gradient_checkpointing(self) -> None:
        for expert in self.experts():
            expert.enable_gradient_checkpointing()

    def disable_gradient_checkpointing(self) -> None:
        for expert in self.experts():
            expert.disable_gradient_checkpointing()

    def enable_parallelism(self, **kwargs: Any) -> None:
        for expert in self.experts():
            expert.enable_parallelism(**kwargs)

    def set_attention_backend(self, backend: str) -> None:
        for expert in self.experts():
            expert.set_attention_backend(backend)

    # --------------------------------------------------------------------------------------------------- forward
    def forward(self, hidden_states: torch.Tensor, timestep: torch.Tensor, encoder_hidden_states: torch.Tensor,
                return_dict: bool = False, **kwargs: Any) -> tuple[torch.Tensor]:
        if timestep.ndim != 1:
            raise ValueError(f"WanExperts routes a timestep per sample, shape (B,); got {tuple(timestep.shape)}")
        if timestep.is_meta:  # the planner's trace: both experts hold the same activations
            return self.transformer(hidden_states=hidden_states, timestep=timestep,
                                    encoder_hidden_states=encoder_hidden_states, return_dict=False, **kwargs)
        high = timestep >= self.boundary_timestep
        wanted = torch.stack([high.any(), (~high).any()]).to(torch.int32)
        wanted = distributed.all_reduce_max_(wanted)  # the experts any rank runs: every rank runs them too
        host = torch.cat([wanted, high.to(torch.int32)]).cpu().tolist()  # the one host sync (module docstring)
        needed, high = [bool(v) for v in host[:2]], [bool(v) for v in host[2:]]
        rows = ([i for i, h in enumerate(high) if h], [i for i, h in enumerate(high) if not h])
        if torch.is_grad_enabled():  # (no-grad calls, e.g. the rollout's, skip the parameter scan)
            trainable = [any(p.requires_grad for p in e.parameters()) for e in self.experts()]
            if any(trainable) and not any(n and t for n, t in zip(needed, trainable)):
                # --train_experts: a call only the frozen expert serves would give a loss without a graph (every
                # rank alike: ``needed`` is agreed); the trained expert joins on its stand-in row, zero gradients
                needed[trainable.index(True)] = True
        outputs, order, zero = [], [], None
        for expert, mine, need in zip(self.experts(), rows, needed):
            if not need:
                continue
            take = mine or [0]  # no rows of mine: one stand-in row, so every rank runs the same FSDP units
            index = None if take == list(range(len(high))) else to_device(torch.tensor(take), hidden_states.device)

            def pick(x: torch.Tensor) -> torch.Tensor:
                return x if index is None else x.index_select(0, index)

            out = expert(hidden_states=pick(hidden_states), timestep=pick(timestep),
                         encoder_hidden_states=pick(encoder_hidden_states), return_dict=False, **kwargs)[0]
            if mine:
                outputs.append(out)
                order += mine
            else:
                zero = out.sum() * 0 if zero is None else zero + out.sum() * 0
        out = outputs[0] if len(outputs) == 1 else torch.cat(outputs)
        if order != sorted(order):
            inverse = torch.empty(len(order), dtype=torch.long)
            inverse[torch.tensor(order)] = torch.arange(len(order))
            out = out.index_select(0, to_device(inverse, out.device))
        if zero is not None:
            out = out + zero.to(out.dtype)
        return (out,)


def _public(config: Any) -> dict:
    return {k: v for k, v in dict(config).items() if not k.startswith("_")}
