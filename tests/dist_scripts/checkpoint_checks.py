"""torchrun checks for fastvideo.checkpoint: resume is bit-identical, EMA stays sharded and exact, DCP reshards.

Run alone: torchrun --nproc_per_node 2 tests/dist_scripts/checkpoint_checks.py MODEL_DIR WORK_DIR
"""
from __future__ import annotations

import sys
from pathlib import Path

from sharding_common import Checks, load_transformer, local_slice, loss_of, make_batch, randomize_lora_b

import torch
from torch.testing import assert_close

from fastvideo import distributed
from fastvideo.ema import EMA
from fastvideo.checkpoint import checkpoint_path, latest_checkpoint, load_checkpoint, save_checkpoint
from fastvideo.lora import add_lora
from fastvideo.parallel import clip_grad_norm, full_state_dict, shard_model

EMA_DECAY = 0.9


def build(model_dir, lora: bool, version: int | None, perturb: int | None = None, **shard_kwargs):
    """Model (+LoRA), optionally with trainable weights perturbed (a 'fresh' run that loading must overwrite)."""
    model = load_transformer(model_dir)
    if lora:
        add_lora(model, rank=4, alpha=8, init_seed=0)
        randomize_lora_b(model)
    if perturb is not None:
        g = torch.Generator().manual_seed(perturb)
        with torch.no_grad():
            for _, p in sorted(model.named_parameters()):
                if p.requires_grad:
                    p.add_(torch.randn(p.shape, generator=g) * 0.1)
    if version is not None:
        model = shard_model(model, fsdp_version=version, **{"sharding_strategy": "full", **shard_kwargs})
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    ema = EMA(model, EMA_DECAY)
    return model, opt, sched, ema


def step(model, opt, sched, ema, index: int, sharded: bool) -> None:
    batch = make_batch(model.config if hasattr(model, "config") else model.module.config, seed=100 + index)
    if sharded:
        batch = local_slice(batch, distributed.get_rank(), distributed.get_world_size())
    loss_of(model, batch).backward()
    clip_grad_norm(model, 0.5)
    opt.step()
    sched.step()
    opt.zero_grad(set_to_none=True)
    ema.update()


def local_tensors(model) -> list[torch.Tensor]:
    from torch.distributed.tensor import DTensor

    return [(p._local_tensor if isinstance(p, DTensor) else p).detach().clone() for p in model.parameters()]


def optim_tensors(opt) -> list[torch.Tensor]:
    from torch.distributed.tensor import DTensor

    out = []
    for group in opt.param_groups:
        for p in group["params"]:
            for key in sorted(opt.state[p]):
                t = opt.state[p][key]
                out.append((t._local_tensor if isinstance(t, DTensor) else t).detach().clone())
    return out


def ema_full(model, ema) -> dict[str, torch.Tensor]:
    with ema.swap_into(model):
        return full_state_dict(model, trainable_only=True)


def assert_all_equal(a, b, what: str) -> None:
    assert len(a) == len(b), f"{what}: {len(a)} vs {len(b)} tensors"
    for i, (x, y) in enumerate(zip(a, b)):
        assert torch.equal(x, y), f"{what}[{i}] differs by {(x.float() - y.float()).abs().max().item()}"


def check_resume(model_dir, work_dir: Path, version: int, lora: bool, **shard_kwargs) -> None:
    """2 steps straight == 1 step + save + load into a fresh sharded model/optimizer + 1 step, bit for bit."""
    rank = distributed.get_rank()
    out = work_dir / f"resume-v{version}-{'lora' if lora else 'full'}-{len(shard_kwargs)}"
    model, opt, sched, ema = build(model_dir, lora, version, **shard_kwargs)
    step(model, opt, sched, ema, 0, True)
    step(model, opt, sched, ema, 1, True)
    straight_params, straight_ema = full_state_dict(model), ema_full(model, ema)

    model, opt, sched, ema = build(model_dir, lora, version, **shard_kwargs)
    step(model, opt, sched, ema, 0, True)
    saved_params, saved_optim, saved_ema = local_tensors(model), optim_tensors(opt), [t.clone() for t in ema.shadow]
    saved_rng = torch.get_rng_state()
    path = save_checkpoint(checkpoint_path(out, 1), model=model, optimizer=opt, lr_scheduler=sched, ema=ema,
                           extra={"step": 1, "rank": rank, "rng": saved_rng})
    assert latest_checkpoint(out) == path
    del model, opt, sched, ema

    model, opt, sched, ema = build(model_dir, lora, version, perturb=7, **shard_kwargs)
    differs = any(not torch.equal(a, b) for a, b in zip(local_tensors(model), saved_params))
    assert any(distributed.all_gather_object(differs)), "the fresh model must differ before loading"
    torch.rand(100)  # move the global RNG on: the state loaded must be this rank's saved one, not the current one
    assert not torch.equal(torch.get_rng_state(), saved_rng)
    extra = load_checkpoint(path, model=model, optimizer=opt, lr_scheduler=sched, ema=ema)
    assert extra["step"] == 1 and extra["rank"] == rank and torch.equal(extra["rng"], saved_rng), extra
    assert_all_equal(local_tensors(model), saved_params, "params after load")
    assert_all_equal(optim_tensors(opt), saved_optim, "optimizer state after load")
    assert_all_equal(ema.shadow, saved_ema, "EMA after load")
    assert sched.last_epoch == 1 and ema.num_updates == 1
    step(model, opt, sched, ema, 1, True)
    resumed_params, resumed_ema = full_state_dict(model), ema_full(model, ema)
    if rank == 0:
        assert set(resumed_params) == set(straight_params)
        assert_all_equal([resumed_params[k] for k in sorted(straight_params)],
                         [straight_params[k] for k in sorted(straight_params)], "params after resume")
        assert_all_equal([resumed_ema[k] for k in sorted(straight_ema)],
                         [straight_ema[k] for k in sorted(straight_ema)], "EMA after resume")


# One AdamW step moves a weight by up to lr = 1e-3. The sharded run's gradient is the mean of 2 ranks' half-batch
# gradients, the reference's the whole batch's: reduction order differs by ~1e-7 relative, and Adam's normalised update
# of a near-zero gradient element turns that into up to ~2e-6 (measured 2.25e-6 on 1 of 6144 elements on one CPU;
# other CPUs' kernels round differently). An EMA that skipped an update or used another decay is off by the EMA's own
# movement, which the check requires to be at least 10x the tolerance.
EMA_ATOL = 1e-5


def check_ema_matches_unsharded(model_dir, version: int) -> None:
    """The sharded EMA after 2 steps equals an EMA of an unsharded model trained on the whole batch (to 1% of an
    AdamW step), and that EMA moved from the initial weights by far more than the tolerance."""
    model, opt, sched, ema = build(model_dir, False, version)
    ref, ref_opt, ref_sched, ref_ema = build(model_dir, False, None)
    initial = {k: v.detach().clone() for k, v in ref.state_dict().items()}
    for i in range(2):
        step(model, opt, sched, ema, i, True)
        step(ref, ref_opt, ref_sched, ref_ema, i, False)
    sharded = ema_full(model, ema)
    with ref_ema.swap_into(ref):
        expected = {k: v.detach().clone() for k, v in ref.state_dict().items()}
    after_swap = full_state_dict(model)
    if distributed.is_main_process():
        assert set(sharded) == set(expected)
        moved = max((expected[k] - initial[k]).abs().max().item() for k in expected)
        assert moved > 10 * EMA_ATOL, f"the EMA moved only {moved:.3g}: the check could not tell a wrong EMA"
        for k in expected:
            assert_close(sharded[k], expected[k], atol=EMA_ATOL, rtol=1e-5, msg=lambda m, k=k: f"{k}: {m}")
        # swap_into restored the live weights
        assert not all(torch.equal(after_swap[k], sharded[k]) for k in sharded)


def check_cross_version_load(model_dir, work_dir: Path) -> None:
    """An FSDP2 checkpoint loads into an FSDP1 model (and rank 0 keeps its weights for a world-size-1 load)."""
    out = work_dir / "cross"
    model, opt, sched, ema = build(model_dir, True, 2)
    step(model, opt, sched, ema, 0, True)
    path = save_checkpoint(checkpoint_path(out, 1), model=model, optimizer=opt, lr_scheduler=sched, ema=ema,
                           extra={"step": 1})
    expected, expected_ema = full_state_dict(model), ema_full(model, ema)
    if distributed.is_main_process():
        torch.save({"params": expected, "ema": expected_ema}, work_dir / "cross_expected.pt")
    model1, opt1, sched1, ema1 = build(model_dir, True, 1, perturb=3)
    load_checkpoint(path, model=model1, optimizer=opt1, lr_scheduler=sched1, ema=ema1)
    got, got_ema = full_state_dict(model1), ema_full(model1, ema1)
    if distributed.is_main_process():
        for k in expected:
            assert torch.equal(got[k], expected[k]), k
        for k in expected_ema:
            assert torch.equal(got_ema[k], expected_ema[k]), k


def run(checks: Checks, model_dir: str, work_dir: Path) -> None:
    for version in (2, 1):
        for lora in (False, True):
            checks.run(f"checkpoint/resume-bit-identical-fsdp{version}-{'lora' if lora else 'full'}", check_resume,
                       model_dir, work_dir, version, lora)
        checks.run(f"checkpoint/ema-sharded-equals-unsharded-fsdp{version}", check_ema_matches_unsharded,
                   model_dir, version)
    checks.run("checkpoint/resume-bit-identical-fsdp2-lora-shard_grad_op-offload", check_resume, model_dir, work_dir,
               2, True, sharding_strategy="shard_grad_op", cpu_offload=True)
    checks.run("checkpoint/load-fsdp2-checkpoint-into-fsdp1", check_cross_version_load, model_dir, work_dir)


if __name__ == "__main__":
    distributed.init_distributed("cpu")
    c = Checks()
    run(c, sys.argv[1], Path(sys.argv[2]))
    c.finish()
