"""Cluster hygiene on 2 gloo ranks under a collective timeout of seconds (the --dist_timeout_minutes path): rank 0's
slow file work -- the final export, a checkpoint deletion, a re-saved step's swap -- must not trip the timeout, and
every transformer sharded with one layout shares one DeviceMesh.

    torchrun --nproc_per_node 2 cluster_checks.py MODEL_DIR WORK_DIR TIMEOUT_S SLOW_S [collective | disk_full]

Rank 0's writes and deletions each sleep SLOW_S (> TIMEOUT_S) first. ``collective`` swaps ``store_barrier`` for a
collective barrier (the code before): that run must fail with the timeout. ``disk_full``: rank 0's export raises
after its sleep, which must end rank 1 too, with rank 0's message. Each rank prints ``cluster ok RANK``.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from sharding_common import load_transformer, loss_of, make_batch  # first: puts the repo on sys.path

from fastvideo import checkpoint, launch, parallel, resume, weights
from fastvideo.policy import Policy, export_final
from fastvideo import distributed as D


def slowly(fn, seconds: float):
    """``fn`` that first sleeps ``seconds`` on rank 0 (a multi-GB write or delete on a slow file system)."""
    def wrapper(*args, **kwargs):
        if D.is_main_process():
            time.sleep(seconds)
        return fn(*args, **kwargs)
    return wrapper


def check_meshes(model_dir: str) -> torch.nn.Module:
    """Policy and frozen reference sharded alike get the same mesh; other layouts get their own, each once."""
    policy = parallel.shard_model(load_transformer(model_dir))
    reference = parallel.shard_model(load_transformer(model_dir).requires_grad_(False).eval())
    mesh_of = lambda model: next(model.parameters()).device_mesh  # noqa: E731
    assert mesh_of(policy) is mesh_of(reference) is D.device_mesh(), "one DeviceMesh per layout"
    hybrid = D.device_mesh((1, 2), ("replicate", "shard"))
    assert hybrid is D.device_mesh((1, 2), ("replicate", "shard")) and hybrid is not D.device_mesh()
    assert D.sequence_parallel_mesh() is D.sequence_parallel_mesh()
    return policy


def body(args: argparse.Namespace) -> None:
    from diffusers import FluxTransformer2DModel

    model = check_meshes(args.pretrained_model_name_or_path)
    policy = Policy(model=model, is_lora=False, frozen_ref=None, ema=None,
                             config=dict(parallel.unwrap_config(model)))
    final = export_final(args, policy)  # rank 0 writes slowly; rank 1 waits past the timeout
    if D.is_main_process():
        dtypes = {record.dtype for record in weights.safetensors_index(final).values()}
        assert dtypes == {torch.bfloat16}, dtypes
        assert json.loads((final / "training_args.json").read_text())["exported_dtype"] == "bf16"
        assert FluxTransformer2DModel.from_pretrained(final, local_files_only=True) is not None
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    batch = make_batch(model.config, batch_size=2)
    loss_of(model, batch).backward()
    optimizer.step()
    for step in (1, 2, 2):  # step 2 deletes step-1 (limit 1); its re-save swaps and deletes the old step-2
        resume.save_state(args, step, policy, optimizer, None, extra={"step": step})
    names = sorted(p.name for p in (Path(args.output_dir) / "checkpoints").iterdir())
    assert names == ["step-2"], names


if __name__ == "__main__":
    model_dir, work_dir, timeout_s, slow_s = sys.argv[1], Path(sys.argv[2]), float(sys.argv[3]), float(sys.argv[4])
    mode = sys.argv[5] if len(sys.argv) > 5 else "store"
    if mode == "collective":
        D.store_barrier = lambda name, **kwargs: D.barrier()
    from diffusers import ModelMixin

    def disk_full(*args, **kwargs):
        raise OSError(28, "No space left on device (test)")

    ModelMixin.save_pretrained = slowly(disk_full if mode == "disk_full" else ModelMixin.save_pretrained, slow_s)
    checkpoint.shutil.rmtree = slowly(checkpoint.shutil.rmtree, slow_s)
    args = argparse.Namespace(deterministic=False, device="cpu", use_cpu_offload=False,
                              dist_timeout_minutes=timeout_s / 60, pretrained_model_name_or_path=model_dir,
                              output_dir=str(work_dir), export_dtype="bf16", checkpoints_total_limit=1)
    rank = D.launch_env()[0]
    launch.launch(args, body)
    assert not D._MESHES, "cleanup forgets the meshes"
    print(f"cluster ok {rank}", flush=True)
