"""Ulysses sequence parallelism vs none, on dp x sp ranks (gloo), the tiny preset; prints a JSON line of the largest
differences (rank 0).

Rank r trains data-parallel replica ``r // sp`` (its own prompts and noise seed) three ways, every backward through
``training.Run.backward`` (the trainer's x --sp_size scaling, which this checks):
  * the reference: an unsharded model on this process alone, the full sequence (no FSDP, no SP); the per-replica
    gradients are gathered and averaged over the replicas by hand;
  * --sp_size 1: FSDP over all ranks, rank r holding replica r // sp's data (each replica on sp ranks);
  * --sp_size sp: FSDP over all ranks, one Ulysses group of sp ranks per replica.
Both sharded gradients must be the hand-assembled mean over replicas. Also an odd-length text forward (7 tokens):
refused under SP (padding it would add attended tokens), run with --sp_size 1; an 8-token one agrees with and without
SP.

    torchrun --nproc_per_node 2 tests/dist_scripts/sp_checks.py MODEL_DIR MANIFEST [SP_SIZE (default 2)]
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from torch.distributed.tensor import DTensor

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from fastvideo import distributed as D  # noqa: E402
from fastvideo import parallel, training, weights  # noqa: E402
from fastvideo.policy import Policy  # noqa: E402
from fastvideo.models import flux  # noqa: E402
from fastvideo.data import EmbeddingDataset  # noqa: E402
from fastvideo.losses import grpo_loss  # noqa: E402
from fastvideo.rollout import RolloutConfig, replay_log_prob, rollout  # noqa: E402
from fastvideo.seeding import NoiseSource  # noqa: E402

Grads = dict[str, torch.Tensor]


def build(model_dir: str, sp: int) -> torch.nn.Module:
    """The 12B path: meta build, shard (FSDP2 over all ranks; Ulysses over sp), load this rank's shards."""
    D.set_sequence_parallel(sp)
    model = parallel.shard_model(flux.build_transformer(model_dir), sp_size=sp)
    weights.load_safetensors_into(model, flux.transformer_folder(model_dir))
    flux.prepare_for_device(model, "cpu", attention_backend="native")
    return model


def build_unsharded(model_dir: str) -> torch.nn.Module:
    """The whole model on this process, no FSDP and no SP: the reference's per-replica gradient."""
    D.set_sequence_parallel(1)
    model = flux.load_transformer(model_dir)
    flux.prepare_for_device(model, "cpu", attention_backend="native")
    return model


def trainer(model: torch.nn.Module) -> training.Run:
    """A real ``training.Run`` around ``model`` (full fine-tune: gradients reduced on every backward, as
    --gradient_sync auto), for its ``backward``; ``dist`` is the current layout (its sp_size is the loss factor)."""
    policy = Policy(model=model, is_lora=False, frozen_ref=None, ema=None, config={})
    return training.Run(args=argparse.Namespace(), dist=D.info(), counts={}, config={}, resume_dir=None, noise=None,
                        amp_dtype=None, policy=policy, sync_every_backward=True)


def whole(grad: torch.Tensor) -> torch.Tensor:
    """A gradient as one plain tensor (FSDP2 keeps this rank's shard of a DTensor)."""
    return (grad.full_tensor() if isinstance(grad, DTensor) else grad).detach().clone()


def one_update(model: torch.nn.Module, model_dir: str, manifest: str, replica: int) -> dict:
    """Replica ``replica``'s update: rollout of 2 samples (its 2 prompts, its noise seed), replay of 2 timesteps with
    the clipped loss, each back-propagated by ``Run.backward`` (loss / 2: the mean of the timesteps); the whole
    gradients, and an odd-length text forward (7 tokens: refused under SP) beside an 8-token one."""
    run = trainer(model)
    vae = flux.load_vae(model_dir)
    geometry = flux.latent_geometry(model_dir, 64, 64)
    cfg = RolloutConfig(height=64, width=64, sampling_steps=4, eta=0.9, batch_size=2)
    batch = EmbeddingDataset(manifest).get_batch([2 * replica, 2 * replica + 1])
    model.eval()
    with torch.no_grad():
        traj = rollout(model, vae, batch, [0, 1], 1, cfg, NoiseSource(3 + replica), geometry, device="cpu")
    model.train()
    idx, advantages = torch.arange(2), torch.tensor([0.7, -0.3])
    losses = []
    for j in (1, 2):
        log_prob, _, _ = replay_log_prob(model, traj, idx, j, batch, cfg, geometry)
        loss, _ = grpo_loss(log_prob, traj.log_probs[idx, j], advantages, 0.2)
        run.backward(loss / 2, last_backward=j == 2)
        losses.append(loss.detach())
    grads = {n: whole(p.grad) for n, p in parallel.named_trainable_parameters(model)}
    with torch.no_grad():  # 7 text tokens: refused under SP (padding would be attended); 8 run
        x, embeds, pooled = traj.latents[:, 1], batch["prompt_embeds"][:, :7], batch["pooled_prompt_embeds"]
        try:
            flux.predict_velocity(model, x, 0.5, embeds, pooled, flux.image_ids(geometry), flux.text_ids(7),
                                  guidance=3.5)
            odd_refused = ""
        except ValueError as err:
            odd_refused = str(err)
        padded = flux.predict_velocity(model, x, 0.5, torch.nn.functional.pad(embeds, (0, 0, 0, 1)), pooled,
                                       flux.image_ids(geometry), flux.text_ids(8), guidance=3.5)
    return {"latents": traj.latents, "log_probs": traj.log_probs, "images": traj.images,
            "loss": torch.stack(losses), "grads": grads, "odd_refused": odd_refused, "padded": padded,
            "backends": sorted(flux.attention_backend_of(model))}


def mean_over_replicas(own: Grads, sp: int) -> tuple[Grads, list[Grads]]:
    """Every rank's own-replica gradient gathered; ``(their mean over the data-parallel replicas, one per replica)``
    (rank d * sp holds replica d's)."""
    replicas = D.all_gather_object(own)[::sp]
    return {k: torch.stack([g[k] for g in replicas]).mean(0) for k in own}, replicas


def max_diff(a: Grads, b: Grads) -> float:
    """The largest absolute difference over all gradients."""
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def main() -> None:
    model_dir, manifest = sys.argv[1], sys.argv[2]
    sp = int(sys.argv[3]) if len(sys.argv) > 3 else 2
    D.init_distributed("cpu")
    replica = D.info().rank // sp  # this rank's data-parallel replica under --sp_size sp: its data in every run
    ref = one_update(build_unsharded(model_dir), model_dir, manifest, replica)
    reference, replicas = mean_over_replicas(ref["grads"], sp)
    a = one_update(build(model_dir, 1), model_dir, manifest, replica)
    b = one_update(build(model_dir, sp), model_dir, manifest, replica)
    info = D.info()
    scale = max(float(g.abs().max()) for g in reference.values())
    out = {
        "rank": info.rank, "dp_rank": info.dp_rank, "sp_rank": info.sp_rank, "dp_size": info.dp_size,
        "sp_size": info.sp_size,
        "latents": float((a["latents"] - b["latents"]).abs().max()),
        "latents_scale": float(a["latents"].abs().max()),
        "log_probs": float((a["log_probs"] - b["log_probs"]).abs().max()),
        "images": float((a["images"] - b["images"]).abs().max()),
        "loss": float((a["loss"] - b["loss"]).abs().max()), "loss_scale": float(a["loss"].abs().max()),
        "loss_unsharded": float((ref["loss"] - b["loss"]).abs().max()),
        "grad_rel": max_diff(b["grads"], reference) / scale,  # --sp_size sp vs the hand-assembled mean
        "grad_rel_sp1": max_diff(a["grads"], reference) / scale,  # --sp_size 1 vs the same
        "replica_spread": max(max_diff(g, reference) for g in replicas) / scale,  # 0 with one replica
        "grad_scale": scale, "params": len(reference),
        "padded_sp1_vs_sp2": float((a["padded"] - b["padded"]).abs().max()),
        "odd_refused_sp1": a["odd_refused"], "odd_refused_sp2": b["odd_refused"],
        "backends": b["backends"],
    }
    rows = D.all_gather_object(out)
    if info.is_main:
        print("SP_CHECKS " + json.dumps(rows), flush=True)
    D.cleanup()


if __name__ == "__main__":
    main()
