"""Ulysses sequence parallelism vs none, on 2 ranks (gloo), the tiny preset: the same batch of samples is rolled out,
replayed and back-propagated with --sp_size 1 (FSDP over both ranks, both holding the batch) and --sp_size 2 (one SP
group of both ranks); prints a JSON line of the largest differences (rank 0).

    torchrun --nproc_per_node 2 tests/dist_scripts/sp_checks.py MODEL_DIR MANIFEST
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from fastvideo import distributed as D  # noqa: E402
from fastvideo import flux, parallel, weights  # noqa: E402
from fastvideo.data import EmbeddingDataset  # noqa: E402
from fastvideo.losses import grpo_loss  # noqa: E402
from fastvideo.rollout import RolloutConfig, replay_log_prob, rollout  # noqa: E402
from fastvideo.seeding import NoiseSource  # noqa: E402


def build(model_dir: str, sp: int) -> torch.nn.Module:
    """The 12B path: meta build, shard (FSDP2 over both ranks; Ulysses over sp), load this rank's shards."""
    D.set_sequence_parallel(sp)
    model = parallel.shard_model(flux.build_transformer(model_dir), sp_size=sp)
    weights.load_safetensors_into(model, flux.transformer_folder(model_dir))
    flux.prepare_for_device(model, "cpu", attention_backend="native")
    return model


def one_update(model_dir: str, manifest: str, sp: int) -> dict:
    """Rollout of 2 samples, replay of 2 timesteps with the clipped loss, backward (x sp, as training.Run.backward);
    the whole gradients, and an odd-length text forward (7 tokens: padded to 8 under SP)."""
    model = build(model_dir, sp)
    vae = flux.load_vae(model_dir)
    geometry = flux.latent_geometry(model_dir, 64, 64)
    cfg = RolloutConfig(height=64, width=64, sampling_steps=4, eta=0.9, batch_size=2)
    batch = EmbeddingDataset(manifest).get_batch([0, 1])
    model.eval()
    with torch.no_grad():
        traj = rollout(model, vae, batch, [0, 1], 1, cfg, NoiseSource(3), geometry, device="cpu")
    model.train()
    idx, advantages = torch.arange(2), torch.tensor([0.7, -0.3])
    losses = []
    for j in (1, 2):
        log_prob, _, _ = replay_log_prob(model, traj, idx, j, batch, cfg, geometry)
        loss, _ = grpo_loss(log_prob, traj.log_probs[idx, j], advantages, 0.2)
        parallel.set_gradient_sync(model, True)
        (loss * sp / 2).backward()
        losses.append(loss.detach())
    grads = {n: p.grad.full_tensor().clone() for n, p in parallel.named_trainable_parameters(model)}
    with torch.no_grad():  # 7 text tokens: SP pads to 8 with zero embeddings and ids
        x = traj.latents[:, 1]
        args = (x, 0.5, batch["prompt_embeds"][:, :7], batch["pooled_prompt_embeds"], flux.image_ids(geometry),
                flux.text_ids(7))
        odd = flux.predict_velocity(model, *args, guidance=3.5)
        padded = flux.predict_velocity(model, x, 0.5, torch.nn.functional.pad(batch["prompt_embeds"][:, :7],
                                                                              (0, 0, 0, 1)),
                                       batch["pooled_prompt_embeds"], flux.image_ids(geometry), flux.text_ids(8),
                                       guidance=3.5)
    return {"latents": traj.latents, "log_probs": traj.log_probs, "images": traj.images,
            "loss": torch.stack(losses), "grads": grads, "odd": odd, "padded": padded,
            "backends": sorted(flux.attention_backend_of(model))}


def main() -> None:
    model_dir, manifest = sys.argv[1], sys.argv[2]
    D.init_distributed("cpu")
    a = one_update(model_dir, manifest, 1)
    b = one_update(model_dir, manifest, 2)
    info = D.info()
    scale = max(float(g.abs().max()) for g in a["grads"].values())
    out = {
        "rank": info.rank, "dp_rank": info.dp_rank, "sp_rank": info.sp_rank, "dp_size": info.dp_size,
        "latents": float((a["latents"] - b["latents"]).abs().max()),
        "latents_scale": float(a["latents"].abs().max()),
        "log_probs": float((a["log_probs"] - b["log_probs"]).abs().max()),
        "images": float((a["images"] - b["images"]).abs().max()),
        "loss": float((a["loss"] - b["loss"]).abs().max()), "loss_scale": float(a["loss"].abs().max()),
        "grad_rel": max(float((a["grads"][k] - b["grads"][k]).abs().max()) for k in a["grads"]) / scale,
        "grad_scale": scale, "params": len(a["grads"]),
        "odd_vs_padded_sp2": float((b["odd"] - b["padded"]).abs().max()),
        "padded_sp1_vs_sp2": float((a["padded"] - b["padded"]).abs().max()),
        "odd_sp1_vs_sp2": float((a["odd"] - b["odd"]).abs().max()),
        "backends": b["backends"],
    }
    rows = D.all_gather_object(out)
    if info.is_main:
        print("SP_CHECKS " + json.dumps(rows), flush=True)
    D.cleanup()


if __name__ == "__main__":
    main()
