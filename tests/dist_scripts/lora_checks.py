"""torchrun checks for fastvideo.lora under FSDP: gathered adapter weights, reference policy, sharded export.

Run alone: torchrun --nproc_per_node 2 tests/dist_scripts/lora_checks.py MODEL_DIR WORK_DIR
"""
from __future__ import annotations

import sys
from pathlib import Path

from sharding_common import Checks, forward, load_transformer, local_slice, loss_of, make_batch, randomize_lora_b

import torch
from torch.testing import assert_close

from fastvideo import distributed
from fastvideo.lora import add_lora, disable_adapters, lora_state_dict, save_lora_for_diffusers
from fastvideo.parallel import clip_grad_norm, shard_model

LORA_RANK, LORA_ALPHA = 4, 8


def lora_model(model_dir):
    model = load_transformer(model_dir)
    add_lora(model, rank=LORA_RANK, alpha=LORA_ALPHA, init_seed=0)
    randomize_lora_b(model)
    return model


def check_lora_under_fsdp(model_dir, work_dir: Path, version: int) -> None:
    rank, world = distributed.get_rank(), distributed.get_world_size()
    batch = make_batch(load_transformer(model_dir).config, batch_size=4)
    local = local_slice(batch, rank, world)
    base = load_transformer(model_dir)
    ref = lora_model(model_dir)
    with torch.no_grad():
        base_out, ref_out = forward(base, local), forward(ref, local)
    expected_sd = lora_state_dict(ref)  # unsharded reference (rank 0 gets it)

    model = shard_model(lora_model(model_dir), fsdp_version=version, sharding_strategy="full")
    flags = [p.requires_grad for p in model.parameters()]
    with torch.no_grad():
        with disable_adapters(model):
            disabled_out = forward(model, local)
        enabled_out = forward(model, local)
    assert_close(disabled_out, base_out, atol=1e-6, rtol=1e-6)  # reference policy == base model
    assert_close(enabled_out, ref_out, atol=1e-6, rtol=1e-6)
    assert (enabled_out - base_out).abs().max() > 1e-3, "the adapter must change the output"
    assert [p.requires_grad for p in model.parameters()] == flags, "disable_adapters must not touch requires_grad"

    # a training step after using the reference still produces the adapter gradients of one process on the whole
    # batch. Compared through the collective norm: FSDP1 leaves grad None where a rank holds no shard, so no rank
    # can check its own gradients alone.
    loss_of(model, local).backward()
    loss_of(ref, batch).backward()
    ref_norm = torch.cat([p.grad.flatten() for p in ref.parameters() if p.grad is not None]).norm()
    assert ref_norm > 1e-3, "lora_B != 0: lora_A and lora_B both get gradients"
    assert_close(torch.tensor(clip_grad_norm(model, float("inf"))), ref_norm, atol=0, rtol=1e-5)

    sd = lora_state_dict(model)
    if rank == 0:
        assert set(sd) == set(expected_sd) and sd, set(sd) ^ set(expected_sd)
        assert all(k.endswith(("lora_A.weight", "lora_B.weight")) for k in sd)
        for k in sd:
            assert torch.equal(sd[k], expected_sd[k]), k
    else:
        assert sd == {}
    out = save_lora_for_diffusers(model, work_dir / f"lora-fsdp{version}")
    distributed.barrier()
    if rank == 0:
        from safetensors.torch import load_file

        saved = load_file(out / "pytorch_lora_weights.safetensors")
        assert set(saved) == {f"transformer.{k}" for k in expected_sd}
        for k, v in expected_sd.items():
            assert torch.equal(saved[f"transformer.{k}"], v)


def run(checks: Checks, model_dir: str, work_dir: Path) -> None:
    for version in (2, 1):
        checks.run(f"lora/lora-under-fsdp{version}", check_lora_under_fsdp, model_dir, work_dir, version)


if __name__ == "__main__":
    distributed.init_distributed("cpu")
    c = Checks()
    run(c, sys.argv[1], Path(sys.argv[2]))
    c.finish()
