"""Wan2.2-A14B's expert routing under FSDP2 on 2 ranks (gloo), the tiny two-expert preset with LoRA on both
experts; prints one JSON line (rank 0) of the largest differences.

Each rank holds its own samples, and the ranks disagree on the experts: in call 1 rank 0's samples are all above the
boundary (``transformer``) and rank 1's all below (``transformer_2``); in call 2 rank 0 mixes both and rank 1 has only
high-noise samples. Without the agreement each rank would gather only its own expert's blocks (the same shapes: the
all-gathers would pair one expert's shards with the other's). Each call's loss is backpropagated; the LoRA gradients
(FSDP's mean over the ranks) must equal the mean of the two ranks' gradients computed by hand on an unsharded copy,
and the sharded outputs must equal the unsharded ones.

    torchrun --nproc_per_node 2 tests/dist_scripts/experts_checks.py MODEL_DIR
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from torch.distributed.tensor import DTensor

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from fastvideo import distributed as D  # noqa: E402
from fastvideo import lora, models, parallel, weights  # noqa: E402

TIMESTEPS = {1: ([950.0, 940.0], [300.0, 200.0]), 2: ([990.0, 100.0], [880.0, 875.0])}  # call -> (rank 0, rank 1)


def adapted(model: torch.nn.Module) -> torch.nn.Module:
    """LoRA rank 4 on both experts, lora_B drawn from one seed (so the adapters change the output)."""
    lora.add_lora(model, rank=4, alpha=4, target_modules=["attn1.to_q", "attn1.to_v", "ffn.net.2"], init_seed=0)
    return model


def lora_b_values(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(7)
    return {n: torch.randn(p.shape, generator=generator) * 0.3
            for n, p in sorted(model.named_parameters()) if ".lora_B." in n}


def inputs(rank: int, call: int, geometry) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(100 * call + rank)
    t = torch.tensor(TIMESTEPS[call][rank])
    x = torch.randn(len(t), *geometry.latent_shape, generator=generator)
    text = torch.randn(len(t), 8, 32, generator=generator)
    return x, text, t


def full(grad: torch.Tensor) -> torch.Tensor:
    return (grad.full_tensor() if isinstance(grad, DTensor) else grad).detach().clone()


def main() -> None:
    model_dir = sys.argv[1]
    D.init_distributed("cpu")
    rank = D.get_rank()
    family = models.resolve("auto", model_dir)
    geometry = family.latent_geometry(model_dir, 64, 64, 5)

    reference = adapted(family.load_transformer(model_dir))
    values = lora_b_values(reference)
    init = lora.initial_adapter_weights(reference, 0)
    with torch.no_grad():
        for name, param in reference.named_parameters():
            if name in values:
                param.copy_(values[name])
    sharded = adapted(family.build_transformer(model_dir))
    sharded = parallel.shard_model(sharded)
    weights.load_safetensors_into(sharded, family.weight_folders(model_dir), skip=init.__contains__)
    weights.fill_local_shards(sharded, {**init, **{n: (lambda v=v: v) for n, v in values.items()}})
    family.prepare_for_device(sharded, "cpu")

    rows = {}
    for call in TIMESTEPS:
        sharded.zero_grad(set_to_none=True)
        x, text, t = inputs(rank, call, geometry)
        out = sharded(hidden_states=x, timestep=t, encoder_hidden_states=text)[0]
        out.square().mean().backward()
        got = {n: full(p.grad) for n, p in sorted(sharded.named_parameters()) if p.requires_grad}
        # by hand: both ranks' samples through the unsharded copy, each rank's loss on its own, gradients averaged
        expected: dict[str, torch.Tensor] = {}
        outs = []
        for r in (0, 1):
            reference.zero_grad(set_to_none=True)
            xr, textr, tr = inputs(r, call, geometry)
            o = reference(hidden_states=xr, timestep=tr, encoder_hidden_states=textr)[0]
            o.square().mean().backward()
            outs.append(o.detach())
            for n, p in reference.named_parameters():
                if p.requires_grad:
                    g = torch.zeros_like(p) if p.grad is None else p.grad
                    expected[n] = expected.get(n, 0) + g.detach() / 2
        names = sorted(expected)
        assert names == sorted(parallel.clean_name(n) for n in got), (names[:3], sorted(got)[:3])
        got = {parallel.clean_name(n): g for n, g in got.items()}
        both = {side: [n for n in names if n.startswith(side + ".")] for side in ("transformer", "transformer_2")}
        rows[f"call{call}"] = {
            "output_max_diff": float((out.detach() - outs[rank]).abs().max()),
            "grad_max_diff": max(float((got[n] - expected[n]).abs().max()) for n in names),
            "grad_max": max(float(expected[n].abs().max()) for n in names),
            "experts_with_grad": sorted(s for s, ns in both.items() if any(float(got[n].abs().max()) > 0 for n in ns)),
        }
    if rank == 0:
        print("EXPERTS_CHECKS " + json.dumps(rows), flush=True)
    D.cleanup()


if __name__ == "__main__":
    main()
