"""torchrun check: shard_model (FSDP2/FSDP1, every strategy) trains like a single process.

Run alone: torchrun --nproc_per_node 2 tests/dist_scripts/parallel_checks.py MODEL_DIR
For each configuration: forward/backward on this rank's half of a global batch, clip_grad_norm, one AdamW step;
the output, the returned norm and the full parameters after the step must match an unsharded reference run on
the whole batch in this process.
"""
from __future__ import annotations

import sys

from sharding_common import Checks, load_transformer, local_slice, loss_of, make_batch, randomize_lora_b, forward

import torch
from torch.testing import assert_close

from fastvideo import distributed
from fastvideo.lora import add_lora
from fastvideo.parallel import (autocast, clean_name, clip_grad_norm, fsdp_version_of, full_state_dict, shard_model,
                                unwrap_config)

MAX_NORM = 0.05  # small enough that clipping is active

CONFIGS = [
    dict(version=2, strategy="full", lora=False),
    dict(version=2, strategy="full", lora=True),
    dict(version=2, strategy="shard_grad_op", lora=False, gc=True),
    dict(version=2, strategy="hybrid_full", lora=True, offload=True, hs=1),  # 2 replicas of 1 shard
    dict(version=2, strategy="no_shard", lora=False),
    dict(version=2, strategy="full", lora=True, gc=True, offload=True),
    dict(version=2, strategy="full", lora=False, mp="bf16"),
    dict(version=2, strategy="shard_grad_op", lora=True, mp="bf16", gc=True),
    dict(version=1, strategy="full", lora=False),
    dict(version=1, strategy="full", lora=True, gc=True),
    dict(version=1, strategy="shard_grad_op", lora=True),
    dict(version=1, strategy="hybrid_full", lora=False, gc=True, hs=1),  # -> NO_SHARD
    dict(version=1, strategy="hybrid_full", lora=True, hs=2),  # (1, 2) device mesh
    dict(version=1, strategy="no_shard", lora=False),
    dict(version=1, strategy="full", lora=False, mp="bf16", offload=True),
]


def build(model_dir, lora: bool):
    torch.manual_seed(0)
    model = load_transformer(model_dir)
    if lora:
        add_lora(model, rank=4, alpha=8, init_seed=0)
        randomize_lora_b(model)
    return model


def full_grads(model) -> dict[str, torch.Tensor]:
    """Every trainable parameter's full gradient (test-only gather; FSDP1 via summon_full_params)."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.tensor import DTensor

    if fsdp_version_of(model) == 1:
        with FSDP.summon_full_params(model, with_grads=True, writeback=False):
            return {clean_name(n): p.grad.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    return {clean_name(n): (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).detach().clone()
            for n, p in model.named_parameters() if p.requires_grad}


def make_optimizer(model):
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3, weight_decay=0.01)


def train_step(model, opt, batch, mp):
    """forward/backward under autocast, clip, one AdamW step; returns (norm, clipped grads)."""
    with autocast(mp, "cpu"):
        loss = loss_of(model, batch)
    loss.backward()
    norm = clip_grad_norm(model, MAX_NORM)
    grads = full_grads(model)
    opt.step()
    return norm, grads


def reference(model_dir, lora, mp, batch):
    model = build(model_dir, lora)
    opt = make_optimizer(model)
    with torch.no_grad(), autocast(mp, "cpu"):
        out = forward(model, batch).float()
    norm, grads = train_step(model, opt, batch, mp)
    return out, norm, grads, {k: v.detach().clone() for k, v in model.state_dict().items()}


def check_config(model_dir, refs, batch, *, version, strategy, lora, mp="fp32", offload=False, gc=False, hs=None):
    """Shard with these options, train one step on this rank's half batch, compare with the reference."""
    rank, world = distributed.get_rank(), distributed.get_world_size()
    ref_out, ref_norm, ref_grads, ref_params = refs[(lora, mp)]
    model = shard_model(build(model_dir, lora), fsdp_version=version, sharding_strategy=strategy,
                        mixed_precision=mp, cpu_offload=offload, gradient_checkpointing=gc,
                        hybrid_shard_size=hs)
    opt = make_optimizer(model)  # right after shard_model, as documented
    assert fsdp_version_of(model) == version
    assert unwrap_config(model).in_channels == ref_out.shape[-1]
    local = local_slice(batch, rank, world)
    n = local["hidden_states"].shape[0]
    bf16 = mp == "bf16"
    with torch.no_grad(), autocast(mp, "cpu"):
        out = forward(model, local).float()
    assert_close(out, ref_out[rank * n:(rank + 1) * n], **(dict(atol=2e-2, rtol=2e-2) if bf16 else {}))
    norm, grads = train_step(model, opt, local, mp)
    assert_close(torch.tensor(norm), torch.tensor(ref_norm), atol=0, rtol=2e-2 if bf16 else 1e-5)
    assert set(grads) == set(ref_grads), set(grads) ^ set(ref_grads)
    for k in ref_grads:  # clipped gradients (Adam's first step alone would hide a gradient scale error)
        assert_close(grads[k], ref_grads[k], **(dict(atol=1e-3, rtol=5e-2) if bf16 else dict(atol=1e-7, rtol=1e-4)),
                     msg=lambda m, k=k: f"grad {k}: {m}")
    sd = full_state_dict(model)
    trainable = full_state_dict(model, trainable_only=True)
    if rank != 0:
        assert sd == {} and trainable == {}, "non-zero ranks must get {}"
        return
    assert set(sd) == set(ref_params), set(sd) ^ set(ref_params)
    assert all(t.device.type == "cpu" and t.dtype == torch.float32 for t in sd.values())
    # Adam's first step is ~lr * grad / (|grad| + eps): float noise in near-zero gradients moves it by up to lr
    # (bf16 noise can flip signs). The gradients themselves were compared tightly above.
    ptol = dict(atol=2.1e-3, rtol=0) if bf16 else dict(atol=1e-5, rtol=1e-5)
    for k in ref_params:
        assert_close(sd[k], ref_params[k], **ptol, msg=lambda m, k=k: f"{k}: {m}")
    expected = {k for k in ref_params if "lora_" in k} if lora else set(ref_params)
    assert set(trainable) == expected


def check_fsdp1_no_shard_lora_rejected(model_dir):
    try:
        shard_model(build(model_dir, True), fsdp_version=1, sharding_strategy="no_shard")
    except ValueError as err:
        assert "--fsdp_version 2" in str(err)
    else:
        raise AssertionError("FSDP1 no_shard with frozen params must raise")


def check_clip_after_nograd_forward(model_dir, refs, batch):
    """FSDP2 shard_grad_op: a no-grad forward between backward and clipping must not hide the gradients."""
    rank, world = distributed.get_rank(), distributed.get_world_size()
    _, ref_norm, _, _ = refs[(False, "fp32")]
    model = shard_model(build(model_dir, False), sharding_strategy="shard_grad_op")
    local = local_slice(batch, rank, world)
    loss_of(model, local).backward()
    with torch.no_grad():
        forward(model, local)  # e.g. a reference pass; leaves unsharded, grad-less params registered
    assert_close(torch.tensor(clip_grad_norm(model, MAX_NORM)), torch.tensor(ref_norm), atol=0, rtol=1e-5)


def run(checks: Checks, model_dir: str) -> None:
    """Every configuration (names start with ``parallel/``)."""
    batch = make_batch(load_transformer(model_dir).config, batch_size=4)
    refs = {(lora, mp): reference(model_dir, lora, mp, batch) for lora in (False, True) for mp in ("fp32", "bf16")}
    for cfg in CONFIGS:
        name = "parallel/fsdp{version}-{strategy}-{mode}".format(mode="lora" if cfg["lora"] else "full", **cfg)
        name += "".join(f"-{k}" for k in ("gc", "offload") if cfg.get(k)) + (f"-{cfg['mp']}" if "mp" in cfg else "")
        checks.run(name, check_config, model_dir, refs, batch, **cfg)
    checks.run("parallel/fsdp1-no_shard-lora-rejected", check_fsdp1_no_shard_lora_rejected, model_dir)
    checks.run("parallel/fsdp2-clip-after-nograd-forward", check_clip_after_nograd_forward, model_dir, refs, batch)


if __name__ == "__main__":
    distributed.init_distributed("cpu")
    c = Checks()
    run(c, sys.argv[1])
    c.finish()
