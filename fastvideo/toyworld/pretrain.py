"""Pretrain a toy FLUX on toy-world scenes: a FLUX-layout folder (VAE + transformer trained here, the tiny text
encoders and tokenizers of ``fastvideo.tiny``) that stock ``FluxPipeline`` loads and that follows prompts partially.

Phases (each seeded from ``(seed, "toyworld-pretrain", phase)``, so a run is a pure function of its config and the
thread count):

1. **Scenes**: ``num_scenes`` renders of training prompts (the held-out combinations are never seen).
2. **VAE**: an AutoencoderKL of the tiny preset's shape trained as an auto-encoder (MSE + a tiny KL); its
   ``shift_factor`` / ``scaling_factor`` are set to the latents' mean and 1 / std, as FLUX's are.
3. **Text**: T5 sequence and CLIP pooled embeddings of every prompt, at ``text_len`` T5 tokens (the trainers'
   embeddings must use the same ``--max_sequence_length``; ``toyworld.json`` records it).
4. **Transformer**: rectified flow matching (x_sigma = (1 - sigma) x0 + sigma eps, target eps - x0, logit-normal
   sigma), AdamW with warm-up and cosine decay, EMA of the weights (the EMA is what is saved).
5. **Eval**: ODE samples of train and held-out prompts scored by the toy-world verifier (``eval.json``).
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from fastvideo.models import flux
from fastvideo.schedulers import get_sigmas
from fastvideo.seeding import derive_seed
from fastvideo.tiny import PRESETS, _write_atomically, build_tiny_flux
from fastvideo.toyworld import scenes, verify

INFO_FILE = "toyworld.json"


def cpu_fingerprint() -> str:
    """The CPU model and the kernels torch picks on it (``/proc/cpuinfo``'s model name, torch's CPU capability): the
    float32 sums of pretraining are bit-reproducible only where both match (recorded in toyworld.json)."""
    model = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{model} / {torch.backends.cpu.get_cpu_capability()}"
EVAL_FILE = "eval.json"
PREFIX_STEPS = 300  # transformer steps whose EMA digest toyworld.json records (what the slow test re-runs)
TINY_PRESET = "tiny"
SHIPPED = Path(__file__).parent / "weights"  # the default config's output (vae/, transformer/, the two JSON files)


@dataclass(frozen=True)
class PretrainConfig:
    """Everything that determines the pretrained weights (saved in ``toyworld.json``)."""

    seed: int = 0
    size: int = 32  # image side in px
    text_len: int = 16  # T5 tokens (the longest toy-world prompt has 13)
    num_scenes: int = 16384  # rendered training scenes
    layout: str = "tidy"  # scenes.LAYOUT_STYLES: how the training scenes are laid out
    vae_channels: tuple[int, ...] = (8, 16, 16)  # AutoencoderKL block widths: scale factor 2 ** (len - 1)
    latent_channels: int = 4
    vae_steps: int = 800
    vae_batch: int = 32
    vae_lr: float = 2e-3
    vae_kl: float = 1e-6
    steps: int = 6000  # transformer optimizer steps
    batch: int = 32
    lr: float = 2e-3
    warmup: int = 200
    weight_decay: float = 0.0
    ema_decay: float = 0.999
    cond_dropout: float = 0.1  # share of training scenes whose text is replaced by the empty prompt's (enables CFG)
    constant_pooled: bool = False  # the CLIP text encoder's pooled output is the same for every prompt (write_text_side)
    heads: int = 8
    head_dim: int = 16
    double_layers: int = 2
    single_layers: int = 4
    autocast_bf16: bool = False  # transformer forward/backward under bf16 autocast (fp32 master weights)
    sample_steps: int = 8  # ODE steps used by the eval (and recommended to the trainers)
    sample_shift: float = 1.0  # static sigma shift used by the eval (and recommended)
    eval_prompts: int = 256  # per split

    def __post_init__(self) -> None:
        if not scenes.MIN_IMAGE_SIZE <= self.size <= scenes.MAX_IMAGE_SIZE or self.size % 8:
            raise ValueError(f"size must be a multiple of 8 in [{scenes.MIN_IMAGE_SIZE}, {scenes.MAX_IMAGE_SIZE}], "
                             f"got {self.size}")
        if not 0 <= self.cond_dropout < 1:
            raise ValueError(f"cond_dropout must be in [0, 1), got {self.cond_dropout}")
        for name in ("num_scenes", "vae_batch", "batch", "heads", "head_dim", "text_len", "sample_steps"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        object.__setattr__(self, "vae_channels", tuple(int(c) for c in self.vae_channels))
        if self.size % (2 ** len(self.vae_channels)):
            raise ValueError(f"size {self.size} must be a multiple of 2 x the VAE scale factor "
                             f"({2 ** len(self.vae_channels)} for vae_channels {self.vae_channels})")
        if self.layout not in scenes.LAYOUT_STYLES:
            raise ValueError(f"layout must be one of {scenes.LAYOUT_STYLES}, got {self.layout!r}")
        if self.head_dim % 4 or self.head_dim < 8:
            raise ValueError(f"head_dim must be a multiple of 4 and >= 8 (RoPE axes), got {self.head_dim}")


def weights_digest(module: torch.nn.Module) -> str:
    """sha256 of a module's state dict (names, dtypes, shapes and bytes in name order): equal digests, equal weights."""
    h = hashlib.sha256()
    for name, value in sorted(module.state_dict().items()):
        t = value.detach().cpu().contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def _gen(cfg: PretrainConfig, phase: str) -> torch.Generator:
    g = torch.Generator()
    g.manual_seed(derive_seed(cfg.seed, "toyworld-pretrain", phase))
    return g


def _log(msg: str, log: Callable[[str], None] | None) -> None:
    if log is not None:
        log(msg)


# ----------------------------------------------------------------------------------------------- phases
def render_scenes(cfg: PretrainConfig) -> tuple[list[str], torch.Tensor]:
    """(prompts, images (N, 3, size, size) in [0, 1]): ``num_scenes`` training prompts drawn with replacement,
    each rendered with its own layout seed."""
    train, _ = scenes.split_prompts()
    idx = torch.randint(len(train), (cfg.num_scenes,), generator=_gen(cfg, "scenes"))
    prompts = [train[i] for i in idx.tolist()]
    seeds = [derive_seed(cfg.seed, "toyworld-scene", i) for i in range(cfg.num_scenes)]
    return prompts, scenes.render_batch(prompts, cfg.size, seeds, cfg.layout)


def build_vae(cfg: PretrainConfig):
    """An AutoencoderKL of ``vae_channels`` / ``latent_channels`` (the tiny preset's block layout), freshly
    initialised."""
    from diffusers import AutoencoderKL  # heavy

    p = PRESETS[TINY_PRESET]
    torch.manual_seed(derive_seed(cfg.seed, "toyworld-pretrain", "vae-init"))
    n = len(cfg.vae_channels)
    return AutoencoderKL(
        in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * n,
        up_block_types=("UpDecoderBlock2D",) * n, block_out_channels=tuple(cfg.vae_channels),
        layers_per_block=p.vae_layers_per_block, act_fn="silu", latent_channels=cfg.latent_channels,
        norm_num_groups=p.vae_norm_num_groups, sample_size=cfg.size, scaling_factor=1.0, shift_factor=0.0,
        use_quant_conv=False, use_post_quant_conv=False)


def train_vae(cfg: PretrainConfig, images: torch.Tensor, log: Callable[[str], None] | None = None):
    """Auto-encoder training of ``build_vae`` on ``images``; sets shift/scale from the latents' statistics."""
    vae = build_vae(cfg).train()
    opt = torch.optim.AdamW(vae.parameters(), lr=cfg.vae_lr, weight_decay=0.0)
    g = _gen(cfg, "vae")
    x_all = images * 2 - 1
    for step in range(cfg.vae_steps):
        lr = cfg.vae_lr * 0.5 * (1 + math.cos(math.pi * step / cfg.vae_steps))
        for group in opt.param_groups:
            group["lr"] = lr
        x = x_all[torch.randint(len(x_all), (cfg.vae_batch,), generator=g)]
        dist = vae.encode(x).latent_dist
        z = dist.mean + dist.std * torch.randn(dist.mean.shape, generator=g)
        recon = vae.decode(z).sample
        loss = torch.nn.functional.mse_loss(recon, x) + cfg.vae_kl * dist.kl().mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if step % 100 == 0 or step == cfg.vae_steps - 1:
            _log(f"vae step {step:5d} loss {loss.item():.5f}", log)
    vae.eval().requires_grad_(False)
    with torch.no_grad():
        z = torch.cat([vae.encode(c).latent_dist.mode() for c in x_all[:2048].split(256)])
    shift, std = float(z.mean()), float(z.std())
    vae.register_to_config(shift_factor=round(shift, 6), scaling_factor=round(1.0 / std, 6))
    return vae


def build_transformer(cfg: PretrainConfig):
    """A FLUX-architecture transformer for the tiny preset's latents and text encoders (no guidance embedding)."""
    from diffusers import FluxTransformer2DModel  # heavy

    p = PRESETS[TINY_PRESET]
    rope = 2 * (cfg.head_dim // 8)  # RoPE axes (index, row, column), each even: (4, 6, 6) for head_dim 16
    rest = cfg.head_dim - rope
    axes = (rope, 2 * (rest // 4), rest - 2 * (rest // 4))
    torch.manual_seed(derive_seed(cfg.seed, "toyworld-pretrain", "transformer-init"))
    return FluxTransformer2DModel(
        patch_size=1, in_channels=4 * cfg.latent_channels, num_layers=cfg.double_layers,
        num_single_layers=cfg.single_layers, attention_head_dim=cfg.head_dim, num_attention_heads=cfg.heads,
        joint_attention_dim=p.t5_d_model, pooled_projection_dim=p.clip_hidden_size, guidance_embeds=False,
        axes_dims_rope=axes)


def encode_text(encoders: flux.TextEncoders, prompts: list[str], text_len: int) -> dict[str, torch.Tensor]:
    """{prompt: (T5 (T, D), pooled (Dp,))} for the distinct prompts, as float32 CPU tensors."""
    distinct = sorted(set(prompts))
    with torch.no_grad():
        embeds, pooled, cut = flux.encode_prompts(encoders, distinct, max_sequence_length=text_len)
    if any(cut):
        raise ValueError(f"text_len {text_len} cuts toy-world prompts; raise it to at least 13")
    return {p: (e.float(), q.float()) for p, e, q in zip(distinct, embeds, pooled)}


def _lr_at(cfg: PretrainConfig, step: int) -> float:
    """Linear warm-up over ``cfg.warmup`` steps, then cosine decay to 10% at ``cfg.steps`` (any config with ``lr``,
    ``warmup`` and ``steps``: the video pretraining's too)."""
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    frac = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
    return cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))


@torch.no_grad()
def ema_step(ema: torch.nn.Module, model: torch.nn.Module, step: int, decay: float) -> None:
    """The EMA of ``model``'s weights after optimizer step ``step`` (0-based), with the decay warmed up as
    ``min(decay, (1 + step) / (10 + step))`` so the first steps are not averaged with the random init."""
    d = min(decay, (1 + step) / (10 + step))
    for pe, pm in zip(ema.parameters(), model.parameters()):
        pe.lerp_(pm, 1 - d)


def train_transformer(cfg: PretrainConfig, latents: torch.Tensor, embeds: torch.Tensor, pooled: torch.Tensor,
                      geometry: flux.LatentGeometry, log: Callable[[str], None] | None = None,
                      null_text: tuple[torch.Tensor, torch.Tensor] | None = None, stop_after: int | None = None,
                      digests: dict[str, str] | None = None,
                      progress: Callable[[int, torch.nn.Module], None] | None = None, progress_every: int = 0):
    """Flow matching on packed clean latents (N, L, C) with per-scene text (N, T, D) / (N, Dp); returns the EMA.
    With ``cfg.cond_dropout`` > 0 that share of each batch (seeded) trains on ``null_text`` (the empty prompt's T5 /
    pooled embeddings), so the model also predicts unconditionally (true CFG with the empty negative prompt).
    ``stop_after``: return after that many steps (the schedule is still ``cfg.steps`` long: a prefix of the run);
    ``digests``: filled with the EMA's ``weights_digest`` after ``PREFIX_STEPS`` steps (``transformer_prefix``);
    ``progress(step, ema)`` every ``progress_every`` steps (an evaluation: it must not touch this function's random
    streams, and it does not change the weights)."""
    model = build_transformer(cfg).train()
    ema = build_transformer(cfg).eval().requires_grad_(False)
    ema.load_state_dict(model.state_dict())
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.99))
    g = _gen(cfg, "transformer")
    img_ids = flux.image_ids(geometry)
    txt_ids = flux.text_ids(embeds.shape[1])
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=cfg.autocast_bf16)
    t0 = time.perf_counter()
    for step in range(cfg.steps if stop_after is None else min(stop_after, cfg.steps)):
        for group in opt.param_groups:
            group["lr"] = _lr_at(cfg, step)
        idx = torch.randint(len(latents), (cfg.batch,), generator=g)
        x0 = latents[idx]
        eps = torch.randn(x0.shape, generator=g)
        sigma = torch.sigmoid(torch.randn(cfg.batch, generator=g))
        s = sigma[:, None, None]
        xt = (1 - s) * x0 + s * eps
        text, vec = embeds[idx], pooled[idx]
        if cfg.cond_dropout > 0:  # drawn only then: runs without it keep their random stream
            drop = torch.rand(cfg.batch, generator=g) < cfg.cond_dropout
            text = torch.where(drop[:, None, None], null_text[0], text)
            vec = torch.where(drop[:, None], null_text[1], vec)
        with autocast:
            v = flux.predict_velocity(model, xt, sigma, text, vec, img_ids, txt_ids, guidance=None)
        loss = torch.nn.functional.mse_loss(v.float(), eps - x0)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        ema_step(ema, model, step, cfg.ema_decay)
        if digests is not None and step + 1 == PREFIX_STEPS:
            digests["transformer_prefix"] = weights_digest(ema)
        if progress is not None and progress_every and (step + 1) % progress_every == 0 and step + 1 < cfg.steps:
            progress(step + 1, ema)
        if step % 250 == 0 or step == cfg.steps - 1:
            _log(f"transformer step {step:5d} loss {loss.item():.4f} ({time.perf_counter() - t0:.0f} s)", log)
    return ema


@torch.no_grad()
def sample(transformer, vae, embeds: torch.Tensor, pooled: torch.Tensor, geometry: flux.LatentGeometry,
           noise: torch.Tensor, steps: int, shift: float, batch: int = 64) -> torch.Tensor:
    """Euler ODE samples (B, 3, H, W) in [0, 1] from initial noise (B, L, C) (the trainers' deterministic sampler)."""
    sigmas = get_sigmas(steps, shift=shift, image_seq_len=geometry.seq_len).tolist()
    img_ids = flux.image_ids(geometry)
    txt_ids = flux.text_ids(embeds.shape[1])
    out = []
    for sl in torch.arange(len(noise)).split(batch):
        x = noise[sl].clone()
        for s, s_next in zip(sigmas[:-1], sigmas[1:]):
            v = flux.predict_velocity(transformer, x, s, embeds[sl], pooled[sl], img_ids, txt_ids, guidance=None)
            x = x + (s_next - s) * v
        out.append(flux.decode(vae, x, geometry))
    return torch.cat(out)


def evaluate(transformer, vae, encoders: flux.TextEncoders, cfg: PretrainConfig, geometry: flux.LatentGeometry,
             num_prompts: int | None = None) -> dict[str, dict[str, float]]:
    """Mean verifier scores of ODE samples for ``num_prompts`` train and held-out prompts (fixed choice and noise)."""
    n = num_prompts or cfg.eval_prompts
    result = {}
    for split, prompts in zip(("train", "heldout"), scenes.split_prompts()):
        g = _gen(cfg, f"eval-{split}")
        chosen = [prompts[i] for i in torch.randperm(len(prompts), generator=g)[:n].tolist()]
        text = encode_text(encoders, chosen, cfg.text_len)
        embeds = torch.stack([text[p][0] for p in chosen])
        pooled = torch.stack([text[p][1] for p in chosen])
        noise = torch.randn((len(chosen), geometry.seq_len, geometry.packed_channels), generator=g)
        images = sample(transformer, vae, embeds, pooled, geometry, noise, cfg.sample_steps, cfg.sample_shift)
        scores = verify.score_batch(images, chosen)
        result[split] = {k: round(float(np.mean(v)), 4) for k, v in scores.items()}
    return result


# ----------------------------------------------------------------------------------------------- the whole run
def write_text_side(folder: Path, constant_pooled: bool = False) -> None:
    """Put the tiny preset's text encoders, tokenizers, scheduler and model_index.json (seed 0) into ``folder``.
    ``constant_pooled``: zero the CLIP encoder's final layer-norm scale, so its pooled output (FLUX's global text
    vector) is the same for every prompt and the transformer reads the prompt only through the T5 tokens, whose
    colour and shape features are linearly separable also for held-out pairs (the pooled vector's are not)."""
    base = folder / ".tiny-base"
    build_tiny_flux(base, TINY_PRESET, seed=0)
    for name in ("text_encoder", "text_encoder_2", "tokenizer", "tokenizer_2", "scheduler", "model_index.json"):
        (base / name).rename(folder / name)
    shutil.rmtree(base)
    if constant_pooled:
        from transformers import CLIPTextModel  # heavy

        clip = CLIPTextModel.from_pretrained(folder / "text_encoder")
        with torch.no_grad():
            clip.final_layer_norm.weight.zero_()  # transformers 5: CLIPTextModel holds the text transformer itself
        clip.save_pretrained(folder / "text_encoder", safe_serialization=True)


def build_from_shipped(out_dir: str | Path) -> Path:
    """Write the toy FLUX folder from the weights shipped in ``SHIPPED`` (what ``pretrain`` with the default config
    produced; ``tests/test_toyworld_pretrain.py`` checks that it still does), in seconds instead of minutes."""
    if not (SHIPPED / "transformer" / "config.json").is_file():
        raise FileNotFoundError(f"no shipped toy-world weights in {SHIPPED}: reinstall the package, or run "
                                "python -m fastvideo.toyworld pretrain --out DIR")

    constant_pooled = json.loads((SHIPPED / INFO_FILE).read_text())["config"].get("constant_pooled", False)

    def write(tmp: Path) -> None:
        write_text_side(tmp, constant_pooled)
        for name in ("vae", "transformer"):
            shutil.copytree(SHIPPED / name, tmp / name)
        for name in (INFO_FILE, EVAL_FILE):
            shutil.copy(SHIPPED / name, tmp / name)

    return _write_atomically(out_dir, write)


def _train_models(folder: Path, cfg: PretrainConfig, log: Callable[[str], None] | None, timings: dict[str, float],
                  digests: dict[str, str], stop_after: int | None = None, eval_every: int = 0):
    """Phases 1-4 with ``folder``'s text side (written here): (vae, transformer EMA, encoders, geometry); fills
    ``timings`` and ``digests`` (``vae``, ``transformer_prefix``); ``stop_after``: the transformer's first steps only;
    ``eval_every``: log ``evaluate`` of the EMA on 128 prompts per split every that many steps (weights unchanged)."""
    t = time.perf_counter()
    write_text_side(folder, cfg.constant_pooled)
    encoders = flux.load_text_encoders(folder)
    prompts, images = render_scenes(cfg)
    timings["scenes"] = time.perf_counter() - t
    _log(f"rendered {len(prompts)} scenes in {timings['scenes']:.1f} s", log)

    t = time.perf_counter()
    vae = train_vae(cfg, images, log)
    digests["vae"] = weights_digest(vae)
    timings["vae"] = time.perf_counter() - t
    geometry = flux.latent_geometry(vae, cfg.size, cfg.size)
    with torch.no_grad():
        latents = flux.encode(vae, images, geometry, micro_batch=256)
    del images

    t = time.perf_counter()
    text = encode_text(encoders, prompts + [""] * (cfg.cond_dropout > 0), cfg.text_len)
    embeds = torch.stack([text[p][0] for p in prompts])
    pooled = torch.stack([text[p][1] for p in prompts])
    timings["text"] = time.perf_counter() - t

    t = time.perf_counter()
    def progress(step: int, ema: torch.nn.Module) -> None:
        _log(f"eval at step {step}: {json.dumps(evaluate(ema, vae, encoders, cfg, geometry, num_prompts=128))}", log)

    transformer = train_transformer(cfg, latents, embeds, pooled, geometry, log, null_text=text.get(""),
                                    stop_after=stop_after, digests=digests, progress=progress,
                                    progress_every=eval_every)
    timings["transformer"] = time.perf_counter() - t
    return vae, transformer, encoders, geometry


def pretrain_prefix(cfg: PretrainConfig = PretrainConfig(), log: Callable[[str], None] | None = None):
    """(digests, vae): the ``digests`` a whole ``pretrain`` records (the finished VAE; the transformer EMA after
    ``PREFIX_STEPS`` steps) and the VAE, from a run stopped there: the check that pretraining still reproduces, in
    minutes instead of the whole run's time (bit for bit only with the same CPU kernels and thread count)."""
    digests: dict[str, str] = {}
    with tempfile.TemporaryDirectory() as tmp:
        vae, _, _, _ = _train_models(Path(tmp), cfg, log, {}, digests, stop_after=PREFIX_STEPS)
    return digests, vae


def pretrain(out_dir: str | Path, cfg: PretrainConfig = PretrainConfig(),
             log: Callable[[str], None] | None = print, eval_every: int = 0) -> Path:
    """Run every phase and write a FluxPipeline folder to ``out_dir`` (atomically); returns its path. toyworld.json
    records the config, thread count, CPU, timings, the trainers' sampling settings and the ``digests`` that
    ``pretrain_prefix`` re-makes. ``eval_every``: also log a 128-prompt evaluation every that many transformer steps
    (the weights do not change)."""
    t_start = time.perf_counter()
    timings: dict[str, float] = {}

    def write(tmp: Path) -> None:
        digests: dict[str, str] = {}
        vae, transformer, encoders, geometry = _train_models(tmp, cfg, log, timings, digests, eval_every=eval_every)
        vae.save_pretrained(tmp / "vae", safe_serialization=True)
        transformer.save_pretrained(tmp / "transformer", safe_serialization=True)
        t = time.perf_counter()
        result = evaluate(transformer, vae, encoders, cfg, geometry)
        timings["eval"] = time.perf_counter() - t
        timings["total"] = time.perf_counter() - t_start
        _log(f"eval: {json.dumps(result)}", log)
        info = {"config": dataclasses.asdict(cfg), "threads": torch.get_num_threads(), "cpu": cpu_fingerprint(),
                "timings_s": {k: round(v, 1) for k, v in timings.items()}, "digests": digests,
                "recommended": {"h": cfg.size, "w": cfg.size, "max_sequence_length": cfg.text_len,
                                "sampling_steps": cfg.sample_steps, "shift": cfg.sample_shift}}
        (tmp / INFO_FILE).write_text(json.dumps(info, indent=2, sort_keys=True) + "\n")
        (tmp / EVAL_FILE).write_text(json.dumps(result, indent=2, sort_keys=True) + "\n")

    return _write_atomically(out_dir, write)
