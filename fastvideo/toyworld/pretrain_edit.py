"""Pretrain a toy FLUX.1-Kontext on the toy edit world: a ``FluxKontextPipeline`` folder whose VAE, text side and
initial transformer are the shipped toy FLUX's (it already draws the toy world's scenes), fine-tuned here to edit.

Phases (each seeded from ``(seed, "toyworld-pretrain-edit", phase)``: a run is a pure function of its config and
the thread count):

1. **Base**: the toy FLUX folder from the shipped weights, its ``model_index.json`` made Kontext's.
2. **Examples**: ``num_examples`` training edits (``edit_world.examples("train", ...)``; the held-out (edit, object)
   combinations are never seen), their sources and ground-truth targets encoded by the toy VAE.
3. **Decoder**: the VAE's decoder fine-tuned on those images with an object-weighted loss (the encoder, and so the
   latent space the toy FLUX learned, unchanged): the toy FLUX's VAE gives back the shapes of only 0.62 of
   ground-truth edits at 32 px (the verifier reads blurred 7-8 px shapes as others), which caps any edit model;
   after 800 steps, 0.99.
4. **Text**: the instructions' T5 and pooled CLIP embeddings at ``text_len`` tokens.
5. **Transformer**: rectified flow matching on the target tokens with the source tokens appended (``FluxKontext``'s
   velocity: ids ``[1, row, col]``), from the toy FLUX's weights; AdamW with warm-up and cosine decay, an EMA (saved).
6. **Eval**: ODE edits of ``eval_examples`` train and held-out examples scored by the edit verifier (``eval.json``).
"""
from __future__ import annotations

import dataclasses
import json
import math
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from fastvideo import models
from fastvideo.models import flux
from fastvideo.schedulers import get_sigmas
from fastvideo.seeding import derive_seed
from fastvideo.tiny import _write_atomically
from fastvideo.toyworld import edit_world, scenes
from fastvideo.toyworld.pretrain import EVAL_FILE, INFO_FILE, SHIPPED, _lr_at, cpu_fingerprint, ema_step, encode_text
from fastvideo.toyworld.pretrain import build_from_shipped as build_toy_flux

SHIPPED_EDIT = Path(__file__).parent / "weights_edit"  # the default config's vae/, transformer/ and JSON files


@dataclass(frozen=True)
class EditPretrainConfig:
    """Everything that determines the pretrained edit weights (saved in ``toyworld.json``)."""

    seed: int = 0
    size: int = 32  # image side in px (the toy FLUX's)
    text_len: int = 16  # T5 tokens (the longest instruction has 13)
    num_examples: int = 8192  # training edits
    vae_steps: int = 800  # decoder fine-tuning steps (0: the toy FLUX's decoder)
    vae_batch: int = 32
    vae_lr: float = 1e-3
    vae_object_weight: float = 10.0  # extra loss weight on object pixels and their 1-px ring
    steps: int = 6000  # transformer optimizer steps (the loss still falls at 3000: held-out strict 0.30 there)
    batch: int = 32
    lr: float = 1e-3
    warmup: int = 100
    weight_decay: float = 0.0
    ema_decay: float = 0.999
    sample_steps: int = 8  # ODE steps of the eval (and recommended to the trainers)
    sample_shift: float = 1.0
    eval_examples: int = 256  # per split

    def __post_init__(self) -> None:
        for name in ("num_examples", "steps", "batch", "text_len", "sample_steps", "eval_examples", "vae_batch"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.vae_steps < 0 or self.vae_object_weight < 0:
            raise ValueError(f"vae_steps and vae_object_weight must be >= 0, got {self.vae_steps}, "
                             f"{self.vae_object_weight}")
        base = json.loads((SHIPPED / INFO_FILE).read_text())["config"]["size"] if (SHIPPED / INFO_FILE).is_file() else 32
        if self.size != base:
            raise ValueError(f"size must be the shipped toy FLUX's ({base} px): its VAE and transformer start here")


def _gen(cfg: EditPretrainConfig, phase: str) -> torch.Generator:
    return torch.Generator().manual_seed(derive_seed(cfg.seed, "toyworld-pretrain-edit", phase))


def _log(msg: str, log: Callable[[str], None] | None) -> None:
    if log is not None:
        log(msg)


def kontext_folder(out_dir: str | Path) -> Path:
    """The shipped toy FLUX as a ``FluxKontextPipeline`` folder (the starting point; the transformer is replaced by
    the edit model's when there is one)."""
    from fastvideo.models.flux_kontext import _kontext_index

    def write(tmp: Path) -> None:
        build_toy_flux(tmp)
        _kontext_index(tmp)

    return _write_atomically(out_dir, write)


def build_from_shipped(out_dir: str | Path) -> Path:
    """Write the toy Kontext folder from the weights shipped in ``SHIPPED_EDIT`` (the edit model's VAE and
    transformer, the toy FLUX's text side), in seconds."""
    if not (SHIPPED_EDIT / "transformer" / "config.json").is_file():
        raise FileNotFoundError(f"no shipped toy edit weights in {SHIPPED_EDIT}: reinstall the package, or run "
                                "python -m fastvideo.toyworld pretrain-edit --out DIR")
    folder = kontext_folder(out_dir)
    for part in ("vae", "transformer"):
        shutil.rmtree(folder / part)
        shutil.copytree(SHIPPED_EDIT / part, folder / part)
    for name in (INFO_FILE, EVAL_FILE):
        shutil.copy(SHIPPED_EDIT / name, folder / name)
    return folder


def _batch_tensors(examples: list[edit_world.EditExample]) -> tuple[torch.Tensor, torch.Tensor]:
    """(sources, targets) (N, 3, size, size) in [0, 1]."""
    pairs = [e.images() for e in examples]
    to = lambda a: torch.from_numpy(np.stack(a)).permute(0, 3, 1, 2).float() / 255  # noqa: E731
    return to([p[0] for p in pairs]), to([p[1] for p in pairs])


def _cond(text: dict, instructions: list[str], source_latents: torch.Tensor) -> dict[str, torch.Tensor]:
    return {"prompt_embeds": torch.stack([text[p][0] for p in instructions]),
            "pooled_prompt_embeds": torch.stack([text[p][1] for p in instructions]), "image_latents": source_latents}


def object_mask(x: torch.Tensor) -> torch.Tensor:
    """(B, 1, H, W) 1.0 on the pixels of images ``x`` (B, 3, H, W) in [-1, 1] that are not background, grown by one
    pixel (the blurred edge the shape check reads), else 0.0."""
    background = torch.tensor(scenes.BACKGROUND, dtype=x.dtype).div(127.5).sub(1).view(1, 3, 1, 1)
    mask = ((x - background).abs().sum(1, keepdim=True) > 0.05).to(x.dtype)
    return torch.nn.functional.max_pool2d(mask, 3, 1, 1)


def tune_decoder(cfg: EditPretrainConfig, vae: torch.nn.Module, images: torch.Tensor,
                 log: Callable[[str], None] | None = None) -> torch.nn.Module:
    """The VAE with its decoder fine-tuned on ``images`` (N, 3, H, W) in [0, 1] (posterior samples of the frozen
    encoder, MSE weighted 1 + ``vae_object_weight`` on objects, cosine learning rate); eval mode, frozen."""
    vae.requires_grad_(False).eval()
    vae.decoder.requires_grad_(True).train()
    params = list(vae.decoder.parameters())
    opt = torch.optim.AdamW(params, lr=cfg.vae_lr, weight_decay=0.0)
    g = _gen(cfg, "decoder")
    for step in range(cfg.vae_steps):
        for group in opt.param_groups:
            group["lr"] = cfg.vae_lr * 0.5 * (1 + math.cos(math.pi * step / cfg.vae_steps))
        x = images[torch.randint(len(images), (cfg.vae_batch,), generator=g)] * 2 - 1
        with torch.no_grad():
            dist = vae.encode(x).latent_dist
            z = dist.mean + dist.std * torch.randn(dist.mean.shape, generator=g)
        weight = 1 + cfg.vae_object_weight * object_mask(x)
        loss = ((vae.decode(z).sample - x).square() * weight).mean() / weight.mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if step % 200 == 0 or step == cfg.vae_steps - 1:
            _log(f"decoder step {step:4d} loss {loss.item():.5f}", log)
    return vae.eval().requires_grad_(False)


def train_transformer(cfg: EditPretrainConfig, model: torch.nn.Module, family, geometry, text: dict,
                      instructions: list[str], sources: torch.Tensor, targets: torch.Tensor,
                      log: Callable[[str], None] | None = None) -> torch.nn.Module:
    """Flow matching of the target latents (N, L, C) given each source's latents (N, Ls, C) and instruction; returns
    the EMA (what is saved)."""
    ema = type(model).from_config(model.config).eval().requires_grad_(False)
    ema.load_state_dict(model.state_dict())
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.99))
    g = _gen(cfg, "transformer")
    shared = family.conditioning(geometry, _cond(text, instructions[:1], sources[:1]), None, torch.device("cpu"))
    t0 = time.perf_counter()
    for step in range(cfg.steps):
        for group in opt.param_groups:
            group["lr"] = _lr_at(cfg, step)
        idx = torch.randint(len(targets), (cfg.batch,), generator=g)
        x0 = targets[idx]
        eps = torch.randn(x0.shape, generator=g)
        sigma = torch.sigmoid(torch.randn(cfg.batch, generator=g))
        xt = (1 - sigma[:, None, None]) * x0 + sigma[:, None, None] * eps
        v = family.predict_velocity(model, xt, sigma, _cond(text, [instructions[i] for i in idx], sources[idx]), shared)
        loss = torch.nn.functional.mse_loss(v.float(), eps - x0)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        ema_step(ema, model, step, cfg.ema_decay)
        if step % 250 == 0 or step == cfg.steps - 1:
            _log(f"edit transformer step {step:5d} loss {loss.item():.4f} ({time.perf_counter() - t0:.0f} s)", log)
    return ema


@torch.no_grad()
def edit(transformer, vae, family, geometry, cond: dict[str, torch.Tensor], noise: torch.Tensor, steps: int,
         shift: float, batch: int = 64) -> torch.Tensor:
    """Euler ODE edits (B, 3, H, W) in [0, 1] from initial noise (B, L, C) (the trainers' deterministic sampler)."""
    sigmas = get_sigmas(steps, shift=shift, image_seq_len=geometry.seq_len).tolist()
    shared = family.conditioning(geometry, cond, None, torch.device("cpu"))
    out = []
    for sl in torch.arange(len(noise)).split(batch):
        x, part = noise[sl].clone(), {k: v[sl] for k, v in cond.items()}
        for s, s_next in zip(sigmas[:-1], sigmas[1:]):
            x = x + (s_next - s) * family.predict_velocity(transformer, x, torch.tensor(s), part, shared)
        out.append(flux.decode(vae, x, geometry))
    return torch.cat(out)


def evaluate(transformer, vae, encoders, family, geometry, cfg: EditPretrainConfig,
             num_examples: int | None = None) -> dict[str, dict[str, float]]:
    """Mean edit-verifier scores of ODE edits of ``num_examples`` train and held-out examples (fixed examples and
    noise, seeded apart from the training data)."""
    n = num_examples or cfg.eval_examples
    result = {}
    for split in ("train", "heldout"):
        chosen = edit_world.examples(split, n, cfg.size, seed=derive_seed(cfg.seed, "toyworld-pretrain-edit", "eval"))
        sources, _ = _batch_tensors(chosen)
        instructions = [e.instruction for e in chosen]
        text = encode_text(encoders, instructions, cfg.text_len)
        cond = _cond(text, instructions, flux.encode(vae, sources, geometry.condition))
        noise = torch.randn((n, geometry.seq_len, geometry.packed_channels), generator=_gen(cfg, f"eval-{split}"))
        images = edit(transformer, vae, family, geometry, cond, noise, cfg.sample_steps, cfg.sample_shift)
        scores = edit_world.score_edits(images, instructions, sources)
        result[split] = {k: round(float(np.mean(v)), 4) for k, v in scores.items()}
    return result


def pretrain(out_dir: str | Path, cfg: EditPretrainConfig = EditPretrainConfig(),
             log: Callable[[str], None] | None = print) -> Path:
    """Run every phase and write a FluxKontextPipeline folder to ``out_dir`` (atomically); returns its path.
    toyworld.json records the config, thread count, CPU, timings and the trainers' sampling settings."""
    t_start = time.perf_counter()
    timings: dict[str, float] = {}

    def write(tmp: Path) -> None:
        kontext_folder(tmp)
        family = models.resolve("flux-kontext")
        vae = family.load_vae(tmp)
        encoders = family.load_text_encoders(tmp)
        geometry = models.geometry_for(family, vae, cfg.size, cfg.size, condition=(cfg.size, cfg.size))
        t = time.perf_counter()
        train = edit_world.examples("train", cfg.num_examples, cfg.size, cfg.seed)
        sources, targets = _batch_tensors(train)
        with torch.no_grad():
            source_latents = flux.encode(vae, sources, geometry.condition, micro_batch=256)
            target_latents = flux.encode(vae, targets, geometry, micro_batch=256)
        instructions = [e.instruction for e in train]
        text = encode_text(encoders, instructions, cfg.text_len)
        timings["examples"] = time.perf_counter() - t
        _log(f"{len(train)} training edits encoded in {timings['examples']:.1f} s", log)
        t = time.perf_counter()
        vae = tune_decoder(cfg, vae, torch.cat([sources, targets]), log)
        shutil.rmtree(tmp / "vae")
        vae.save_pretrained(tmp / "vae", safe_serialization=True)
        timings["decoder"] = time.perf_counter() - t
        t = time.perf_counter()
        model = family.load_transformer(tmp)
        ema = train_transformer(cfg, model, family, geometry, text, instructions, source_latents, target_latents, log)
        timings["transformer"] = time.perf_counter() - t
        shutil.rmtree(tmp / "transformer")
        ema.save_pretrained(tmp / "transformer", safe_serialization=True)
        t = time.perf_counter()
        result = evaluate(ema, vae, encoders, family, geometry, cfg)
        timings["eval"] = time.perf_counter() - t
        timings["total"] = time.perf_counter() - t_start
        _log(f"eval: {json.dumps(result)}", log)
        info = {"config": dataclasses.asdict(cfg), "threads": torch.get_num_threads(), "cpu": cpu_fingerprint(),
                "timings_s": {k: round(v, 1) for k, v in timings.items()}, "base": "the shipped toy FLUX",
                "recommended": {"h": cfg.size, "w": cfg.size, "max_sequence_length": cfg.text_len,
                                "sampling_steps": cfg.sample_steps, "shift": cfg.sample_shift}}
        (tmp / INFO_FILE).write_text(json.dumps(info, indent=2, sort_keys=True) + "\n")
        (tmp / EVAL_FILE).write_text(json.dumps(result, indent=2, sort_keys=True) + "\n")

    return _write_atomically(out_dir, write)
