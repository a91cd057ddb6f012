"""Pretrain a tiny Wan on the toy world in time (``fastvideo.toyworld.motion``): a ``WanPipeline`` folder (a video VAE
and a WanTransformer3DModel trained here, the tiny UMT5 text encoder of ``wan_presets`` built from its seed) that the
stock pipeline loads and that follows motion prompts partially, so that RL on the training prompts has something to
raise on the held-out ones.

Phases (each seeded from ``(seed, "toyworld-video", phase)``; the whole run is a pure function of its config and the
thread count):

1. **Videos**: ``num_videos`` renders of training prompts (the held-out combinations are never seen).
2. **VAE**: an ``AutoencoderKLWan`` (2x in time, 4x in space: ``scale_factor_temporal`` / ``_spatial`` in its config,
   which the family and the pipeline read) trained as an auto-encoder with the objects' pixels weighted up
   (``object_mask``); its ``latents_mean`` / ``latents_std`` are set to the latents' per-channel statistics, as Wan's
   are.
3. **Text**: the tiny UMT5's embeddings of every prompt at ``text_len`` tokens (``Wan.encode_prompts``).
4. **Transformer**: rectified flow matching through the Wan adapter's own ``predict_velocity`` (logit-normal sigma,
   the empty prompt for ``cond_dropout`` of the videos: true CFG), AdamW with warm-up and cosine decay, EMA.
5. **Eval**: ODE samples of train and held-out prompts scored by the motion verifier (``eval.json``).

``python -m fastvideo.toyworld pretrain-video --out DIR`` runs it (~17 minutes on 2 cores); the default config's
weights ship in ``SHIPPED`` and ``build-video`` (``build_from_shipped``) writes the folder from them in seconds.
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

from fastvideo import tiny
from fastvideo.models import wan, wan_presets
from fastvideo.seeding import derive_seed
from fastvideo.toyworld import motion, scenes
from fastvideo.toyworld.pretrain import (EVAL_FILE, INFO_FILE, _log, _lr_at, cpu_fingerprint, ema_step,
                                         weights_digest)

PRESET = "toyworld-video"
SHIPPED = Path(__file__).parent / "weights_video"  # the default config's output (vae/, transformer/, the JSON files)


@dataclass(frozen=True)
class VideoPretrainConfig:
    """Everything that determines the pretrained video model (saved in ``toyworld.json``)."""

    seed: int = 0
    size: int = 32  # frame side in px
    frames: int = 5  # frames per video: 2k + 1 (the VAE compresses time 2x after the first frame)
    text_len: int = 16  # UMT5 tokens (the longest motion prompt has 14 with the end token)
    num_videos: int = 8192
    vae_base_dim: int = 16
    latent_channels: int = 8
    vae_steps: int = 2000
    vae_batch: int = 8
    vae_lr: float = 2e-3
    vae_kl: float = 1e-6
    # the objects cover ~1/5 of a frame: their pixels and a 1 px ring around them weigh 1 + this in the VAE's MSE, so
    # the reconstruction spends its capacity on the edges the verifier's shape check reads (unweighted, 600 steps left
    # the colours washed out: the verifier's colour check passed 1% of reconstructed ground truth)
    vae_object_weight: float = 20.0
    steps: int = 6000
    batch: int = 32
    lr: float = 2e-3
    warmup: int = 200
    ema_decay: float = 0.999
    cond_dropout: float = 0.1
    heads: int = 6
    head_dim: int = 16
    ffn_dim: int = 256
    layers: int = 6
    sample_steps: int = 8
    sample_shift: float = 1.0  # the folder's flow_shift: the trainers sample the same grid
    eval_prompts: int = 64  # per split

    def __post_init__(self) -> None:
        if self.size % 8 or not 32 <= self.size <= 64:
            raise ValueError(f"size must be a multiple of 8 in [32, 64], got {self.size}")
        if self.frames < 3 or (self.frames - 1) % 2:
            raise ValueError(f"frames must be 2k + 1 >= 3 (the VAE halves time after the first frame), got "
                             f"{self.frames}")
        for name in ("num_videos", "vae_steps", "vae_batch", "steps", "batch", "heads", "layers", "ffn_dim",
                     "text_len", "sample_steps", "eval_prompts", "latent_channels", "vae_base_dim"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not 0 <= self.cond_dropout < 1:
            raise ValueError(f"cond_dropout must be in [0, 1), got {self.cond_dropout}")
        if self.vae_object_weight < 0:
            raise ValueError(f"vae_object_weight must be >= 0 (0: plain MSE), got {self.vae_object_weight}")
        if self.head_dim < 8 or self.head_dim % 2:
            raise ValueError(f"head_dim must be even and >= 8 (Wan's rotary embedding splits it over time, height "
                             f"and width), got {self.head_dim}")


def _gen(cfg: VideoPretrainConfig, phase: str) -> torch.Generator:
    g = torch.Generator()
    g.manual_seed(derive_seed(cfg.seed, "toyworld-video", phase))
    return g


def build_vae(cfg: VideoPretrainConfig):
    """An ``AutoencoderKLWan`` 4x in space (two downsamplings), 2x in time, ``latent_channels`` channels."""
    from diffusers import AutoencoderKLWan  # heavy

    torch.manual_seed(derive_seed(cfg.seed, "toyworld-video", "vae-init"))
    c = cfg.latent_channels
    return AutoencoderKLWan(base_dim=cfg.vae_base_dim, z_dim=c, dim_mult=[1, 2, 2], num_res_blocks=1, attn_scales=[],
                            temperal_downsample=[False, True], dropout=0.0,
                            latents_mean=[0.0] * c, latents_std=[1.0] * c,
                            scale_factor_spatial=4, scale_factor_temporal=2)


def build_transformer(cfg: VideoPretrainConfig):
    """A WanTransformer3DModel for the VAE's latents and the tiny UMT5's width."""
    from diffusers import WanTransformer3DModel  # heavy

    torch.manual_seed(derive_seed(cfg.seed, "toyworld-video", "transformer-init"))
    return WanTransformer3DModel(
        patch_size=wan.PATCH, num_attention_heads=cfg.heads, attention_head_dim=cfg.head_dim,
        in_channels=cfg.latent_channels, out_channels=cfg.latent_channels, text_dim=wan_presets.TINY.text_dim,
        freq_dim=32, ffn_dim=cfg.ffn_dim, num_layers=cfg.layers, cross_attn_norm=True,
        qk_norm="rms_norm_across_heads", eps=1e-6, rope_max_seq_len=1024)


def render_videos(cfg: VideoPretrainConfig) -> tuple[list[str], torch.Tensor]:
    """(prompts, videos (N, F, 3, size, size)): training prompts drawn with replacement, each its own seed."""
    train, _ = motion.split_motion_prompts()
    idx = torch.randint(len(train), (cfg.num_videos,), generator=_gen(cfg, "videos"))
    prompts = [train[i] for i in idx.tolist()]
    seeds = [derive_seed(cfg.seed, "toyworld-video-scene", i) for i in range(cfg.num_videos)]
    return prompts, motion.render_videos(prompts, cfg.size, cfg.frames, seeds)


def object_mask(x: torch.Tensor) -> torch.Tensor:
    """(B, 1, F, H, W) 1.0 on the pixels of videos ``x`` (B, 3, F, H, W) in [-1, 1] that are not background, grown by
    one pixel in space (the blurred edge the shape check reads), else 0.0."""
    background = torch.tensor(scenes.BACKGROUND, dtype=x.dtype).div(127.5).sub(1).view(1, 3, 1, 1, 1)
    mask = ((x - background).abs().sum(1, keepdim=True) > 0.05).to(x.dtype)
    return torch.nn.functional.max_pool3d(mask, (1, 3, 3), 1, (0, 1, 1))


def train_vae(cfg: VideoPretrainConfig, videos: torch.Tensor, log: Callable[[str], None] | None = None):
    """Auto-encoder training on ``videos`` (N, F, 3, H, W); returns the VAE with its latent statistics set."""
    vae = build_vae(cfg).train()
    opt = torch.optim.AdamW(vae.parameters(), lr=cfg.vae_lr, weight_decay=0.0)
    g = _gen(cfg, "vae")
    for step in range(cfg.vae_steps):
        for group in opt.param_groups:
            group["lr"] = cfg.vae_lr * 0.5 * (1 + math.cos(math.pi * step / cfg.vae_steps))
        x = videos[torch.randint(len(videos), (cfg.vae_batch,), generator=g)].permute(0, 2, 1, 3, 4) * 2 - 1
        dist = vae.encode(x).latent_dist
        z = dist.mean + dist.std * torch.randn(dist.mean.shape, generator=g)
        weight = 1 + cfg.vae_object_weight * object_mask(x)
        err = (vae.decode(z).sample - x).square() * weight
        loss = err.mean() / weight.mean() + cfg.vae_kl * dist.kl().mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if step % 100 == 0 or step == cfg.vae_steps - 1:
            _log(f"vae step {step:5d} loss {loss.item():.5f}", log)
    vae.eval().requires_grad_(False)
    with torch.no_grad():
        z = torch.cat([vae.encode(c.permute(0, 2, 1, 3, 4) * 2 - 1).latent_dist.mode() for c in videos[:512].split(64)])
    vae.register_to_config(latents_mean=[round(float(v), 6) for v in z.mean(dim=(0, 2, 3, 4))],
                           latents_std=[round(float(v), 6) for v in z.std(dim=(0, 2, 3, 4))])
    return vae


def train_transformer(cfg: VideoPretrainConfig, latents: torch.Tensor, embeds: torch.Tensor, null: torch.Tensor,
                      geometry: wan.VideoGeometry, log: Callable[[str], None] | None = None):
    """Flow matching on packed clean latents (N, L, C) with per-video text (N, T, D) through the adapter's
    ``predict_velocity``; returns the EMA."""
    family = wan.Wan()
    model = tag_wan(build_transformer(cfg).train(), family)
    ema = tag_wan(build_transformer(cfg).eval().requires_grad_(False), family)
    ema.load_state_dict(model.state_dict())
    params = list(model.parameters())
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=0.0, betas=(0.9, 0.99))
    g = _gen(cfg, "transformer")
    shared = family.conditioning(geometry, {}, None, torch.device("cpu"))
    t0 = time.perf_counter()
    for step in range(cfg.steps):
        for group in opt.param_groups:
            group["lr"] = _lr_at(cfg, step)
        idx = torch.randint(len(latents), (cfg.batch,), generator=g)
        x0 = latents[idx]
        eps = torch.randn(x0.shape, generator=g)
        sigma = torch.sigmoid(torch.randn(cfg.batch, generator=g))
        xt = (1 - sigma[:, None, None]) * x0 + sigma[:, None, None] * eps
        drop = torch.rand(cfg.batch, generator=g) < cfg.cond_dropout
        text = torch.where(drop[:, None, None], null, embeds[idx])
        v = family.predict_velocity(model, xt, sigma, {"prompt_embeds": text}, shared)
        loss = torch.nn.functional.mse_loss(v, eps - x0)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        ema_step(ema, model, step, cfg.ema_decay)
        if step % 500 == 0 or step == cfg.steps - 1:
            _log(f"transformer step {step:5d} loss {loss.item():.4f} ({time.perf_counter() - t0:.0f} s)", log)
    return ema


def tag_wan(model: torch.nn.Module, family: wan.Wan) -> torch.nn.Module:
    from fastvideo.models.base import tag

    return tag(model, family)


@torch.no_grad()
def sample(transformer, vae, embeds: torch.Tensor, geometry: wan.VideoGeometry, noise: torch.Tensor,
           cfg: VideoPretrainConfig, batch: int = 64) -> torch.Tensor:
    """Euler ODE videos (B, F, 3, H, W) in [0, 1] from noise (B, L, C), the trainers' deterministic sampler."""
    family = wan.Wan()
    sigmas = family.sigmas(cfg.sample_steps, geometry.seq_len, {"flow_shift": cfg.sample_shift,
                                                                "num_train_timesteps": wan.NUM_TRAIN_TIMESTEPS,
                                                                "use_flow_sigmas": True})
    shared = family.conditioning(geometry, {}, None, torch.device("cpu"))
    out = []
    for sl in torch.arange(len(noise)).split(batch):
        x = noise[sl].clone()
        for i in range(cfg.sample_steps):
            v = family.predict_velocity(transformer, x, sigmas[i], {"prompt_embeds": embeds[sl]}, shared)
            x = x + (sigmas[i + 1] - sigmas[i]) * v
        out.append(family.decode(vae, x, geometry, micro_batch=len(sl)))
    return torch.cat(out)


def evaluate(transformer, vae, encoders, cfg: VideoPretrainConfig, geometry: wan.VideoGeometry
             ) -> dict[str, dict[str, float]]:
    """Mean motion-verifier scores of ODE samples of ``eval_prompts`` train and held-out prompts (fixed noise)."""
    family, result = wan.Wan(), {}
    for split, prompts in zip(("train", "heldout"), motion.split_motion_prompts()):
        g = _gen(cfg, f"eval-{split}")
        chosen = [prompts[i] for i in torch.randperm(len(prompts), generator=g)[:cfg.eval_prompts].tolist()]
        embeds = family.encode_prompts(encoders, chosen, cfg.text_len)[0]["prompt_embeds"].float()
        noise = torch.randn((len(chosen), *geometry.packed_shape), generator=g)
        scores = motion.score_videos(sample(transformer, vae, embeds, geometry, noise, cfg), chosen)
        result[split] = {k: round(float(np.mean(v)), 4) for k, v in scores.items()}
    return result


def write_text_side(folder: Path, flow_shift: float) -> None:
    """The tiny UMT5 of ``wan-tiny`` (seed 0) and its tokenizer, a UniPC scheduler at ``flow_shift`` and
    model_index.json into ``folder``: everything of the pipeline folder that is not trained here."""
    from diffusers import UniPCMultistepScheduler  # heavy

    with torch.random.fork_rng(devices=[]):
        parts = wan_presets._components(wan_presets.TINY, 0)
    parts["text_encoder"].save_pretrained(folder / "text_encoder", safe_serialization=True)
    tiny.save_t5_tokenizer(folder / "tokenizer")
    UniPCMultistepScheduler(**{**wan_presets.UNIPC_CONFIG, "flow_shift": flow_shift}).save_pretrained(
        folder / "scheduler")
    (folder / "model_index.json").write_text(json.dumps(wan_presets._model_index(), indent=2, sort_keys=True) + "\n")


def build_from_shipped(out_dir: str | Path) -> Path:
    """Write the toy Wan folder from the weights shipped in ``SHIPPED`` (what ``pretrain`` with the default config
    produced), in seconds instead of the pretraining's minutes."""
    if not (SHIPPED / "transformer" / "config.json").is_file():
        raise FileNotFoundError(f"no shipped toy-world video weights in {SHIPPED}: reinstall the package, or run "
                                "python -m fastvideo.toyworld pretrain-video --out DIR")
    shift = json.loads((SHIPPED / INFO_FILE).read_text())["config"]["sample_shift"]

    def write(tmp: Path) -> None:
        write_text_side(tmp, shift)
        for name in ("vae", "transformer"):
            shutil.copytree(SHIPPED / name, tmp / name)
        for name in (INFO_FILE, EVAL_FILE):
            shutil.copy(SHIPPED / name, tmp / name)

    return tiny._write_atomically(out_dir, write)


def pretrain(out_dir: str | Path, cfg: VideoPretrainConfig = VideoPretrainConfig(),
             log: Callable[[str], None] | None = print) -> Path:
    """Every phase; writes a ``WanPipeline`` folder to ``out_dir`` (atomically) with ``toyworld.json`` (config,
    threads, CPU, timings, digests, the trainers' recommended flags) and ``eval.json``; returns its path."""
    t_start, timings = time.perf_counter(), {}

    def write(tmp: Path) -> None:
        t = time.perf_counter()
        write_text_side(tmp, cfg.sample_shift)
        family = wan.Wan()
        encoders = family.load_text_encoders(tmp)
        prompts, videos = render_videos(cfg)
        timings["videos"] = time.perf_counter() - t
        _log(f"rendered {len(prompts)} videos in {timings['videos']:.1f} s", log)
        t = time.perf_counter()
        vae = train_vae(cfg, videos, log)
        timings["vae"] = time.perf_counter() - t
        geometry = family.latent_geometry(vae, cfg.size, cfg.size, cfg.frames)
        latents = torch.cat([family.encode(vae, c, geometry, micro_batch=64) for c in videos.split(256)])
        del videos
        t = time.perf_counter()
        distinct = sorted(set(prompts))
        table = dict(zip(distinct, family.encode_prompts(encoders, distinct, cfg.text_len)[0]["prompt_embeds"]))
        embeds = torch.stack([table[p] for p in prompts]).float()
        null = family.encode_prompts(encoders, [""], cfg.text_len)[0]["prompt_embeds"].float()
        timings["text"] = time.perf_counter() - t
        t = time.perf_counter()
        transformer = train_transformer(cfg, latents, embeds, null, geometry, log)
        timings["transformer"] = time.perf_counter() - t
        vae.save_pretrained(tmp / "vae", safe_serialization=True)
        transformer.save_pretrained(tmp / "transformer", safe_serialization=True)
        t = time.perf_counter()
        result = evaluate(transformer, vae, encoders, cfg, geometry)
        timings["eval"] = time.perf_counter() - t
        timings["total"] = time.perf_counter() - t_start
        _log(f"eval: {json.dumps(result)}", log)
        info = {"preset": PRESET, "family": wan.Wan.name, "config": dataclasses.asdict(cfg),
                "threads": torch.get_num_threads(), "cpu": cpu_fingerprint(),
                "timings_s": {k: round(v, 1) for k, v in timings.items()},
                "digests": {"vae": weights_digest(vae), "transformer": weights_digest(transformer)},
                "recommended": {"h": cfg.size, "w": cfg.size, "num_frames": cfg.frames,
                                "max_sequence_length": cfg.text_len, "sampling_steps": cfg.sample_steps}}
        (tmp / INFO_FILE).write_text(json.dumps(info, indent=2, sort_keys=True) + "\n")
        (tmp / EVAL_FILE).write_text(json.dumps(result, indent=2, sort_keys=True) + "\n")

    return tiny._write_atomically(out_dir, write)
