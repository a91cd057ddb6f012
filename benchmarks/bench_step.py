"""A whole GRPO step, ours vs the reference trainer's structure: per-phase time, speedup, MFU, peak memory.

    python benchmarks/bench_step.py                     # bench preset, 2 ranks on this CPU, fp32 and bf16 autocast
    python benchmarks/bench_step.py --smoke             # tiny preset, a minute: what CI runs
    python benchmarks/bench_step.py --model flux-dev-shape --num_layers 2 --device cuda --nproc 8   # real widths
    python benchmarks/bench_step.py --loops ours --reward_delay_ms 50 --rollout_batch_size 2   # --reward_overlap

One torchrun of this file (``--worker``) runs, per dtype, both loops on the same model, data and settings, one after
the other, each from the same initial weights and seed:

- **ours**: ``train_grpo_flux.train`` itself, with the given batch sizes (one rollout and one replay micro-batch per
  rank by default), its sharded EMA (a local lerp) and its sharded checkpoint;
- **reference**: the same trainer with the structure of the reference FLUX GRPO trainer: batch-1 rollout, batch-1
  VAE decode, batch-1 reward, batch-1 training with a gradient reduce-scatter after every backward, and after every
  optimizer step the whole model gathered to rank 0 for an fp32 EMA kept there; its checkpoint gathers the model to
  rank 0 and ``torch.save``s it.

Time is attributed to phases by wrapping the package functions each phase calls (a phase entered inside another
pauses it): rollout (sampling), decode, reward, train (replay forward/backward, FSDP's all-gathers and reduce-scatters,
optimizer), communication (explicit collectives: reward/metric gathers, the reference's EMA gather), ema, checkpoint
(measured once, at the last step, and charged at 1/--checkpoint_interval per step), other (advantages, logging);
each the mean over the timed steps and the ranks. MFU =
model FLOPs (``fastvideo.flops``: 1 forward per sample and sampling step; 3 forwards per sample and trained timestep)
÷ the phase's time ÷ the summed peak of one large ``torch.mm`` in the dtype used, measured on every rank at once in
this run.

``--model flux-dev-shape --num_layers K`` instead builds a transformer with FLUX.1-dev's real widths (3072 hidden,
24 heads, 4096 text dim) and K double + 2K single blocks from the flux-dev-config folder
(``fastvideo.tiny.write_flux_dev_config``), FLUX.1-dev's VAE config and random text embeddings of its widths; all
weights are seeded random values made in memory (no weight files; see ``random_weights``), so accelerator runs see
the real kernel sizes. ``--check`` (on with ``--smoke``) also gathers the first update's gradients of both loops,
with the reference fed ours' trajectory, and reports their difference (the comparison is fair only if they agree).

``--reward_delay_ms D`` measures scoring overlapped with sampling: the reward becomes a real reward server
(``python -m fastvideo.rewards.serve --reward REWARD --delay_ms D``, started here, on the CPU) reached as
``remote:URL`` with one image per request and one request in flight per rank, so a rank's scoring takes about D ms
per image, as when a busy server's throughput bounds it; the loop **overlap** (ours with --reward_overlap: each
rollout micro-batch scored while the next samples) then runs after ours (sequential scoring) on the same settings,
and the summary reports the step-time saving of overlap vs sequential. The rollout needs several micro-batches per
rank for that (--rollout_batch_size, default then a quarter of a rank's samples).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

PHASES = ("rollout", "decode", "reward", "train", "communication", "ema", "checkpoint", "other")
LOOPS = ("reference", "ours", "overlap")  # overlap: ours with --reward_overlap (--reward_delay_ms)
DTYPES = {"fp32": None, "bf16": torch.bfloat16}
FLUX_DEV_SHAPE = "flux-dev-shape"


# ----------------------------------------------------------------------------------------------- timing by phase
class PhaseClock:
    """Exclusive wall time per phase, synchronised with the device: a phase entered inside another pauses it."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.totals: dict[str, float] = defaultdict(float)
        self.stack: list[list[Any]] = []
        self.boundaries: list[tuple[float, dict[str, float]]] = []

    def _now(self) -> float:
        from fastvideo import devices

        devices.synchronize(self.device)
        return time.perf_counter()

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        now = self._now()
        if self.stack:
            self.totals[self.stack[-1][0]] += now - self.stack[-1][1]
        self.stack.append([name, now])
        try:
            yield
        finally:
            now = self._now()
            done, since = self.stack.pop()
            self.totals[done] += now - since
            if self.stack:
                self.stack[-1][1] = now

    def current(self) -> str | None:
        return self.stack[-1][0] if self.stack else None

    def mark_step(self) -> None:
        """A step boundary: the wall-clock time and the phase totals so far."""
        self.boundaries.append((self._now(), dict(self.totals)))

    def steps(self) -> list[dict[str, float]]:
        """Per step between boundaries: ``wall`` and each phase's seconds (``other`` = the unattributed rest)."""
        out = []
        for (t0, before), (t1, after) in zip(self.boundaries, self.boundaries[1:]):
            row = {p: after.get(p, 0.0) - before.get(p, 0.0) for p in PHASES if p != "other"}
            row["other"] = max(0.0, (t1 - t0) - sum(row.values()))
            row["wall"] = t1 - t0
            out.append(row)
        return out


@contextlib.contextmanager
def patched(owner: Any, name: str, make: Callable[[Callable], Callable]) -> Iterator[None]:
    """``owner.name`` replaced by ``make(original)`` inside the block."""
    original = getattr(owner, name)
    setattr(owner, name, make(original))
    try:
        yield
    finally:
        setattr(owner, name, original)


def timed(clock: PhaseClock, phase: str, unless: tuple[str, ...] = ()) -> Callable[[Callable], Callable]:
    """A wrapper maker: calls run as ``phase`` (left in the current phase when that is one of ``unless``)."""
    def make(fn: Callable) -> Callable:
        def wrapper(*a, **k):
            if clock.current() in unless:
                return fn(*a, **k)
            with clock.phase(phase):
                return fn(*a, **k)
        return wrapper
    return make


# ------------------------------------------------------------------------------- flux-dev-shape: weights in memory
def random_tensor_makers(model: torch.nn.Module, seed: int, skip: Callable[[str], bool] = lambda name: False
                         ) -> dict[str, Callable[[], torch.Tensor]]:
    """``name -> fn() -> full tensor`` for every parameter and buffer of ``model`` (plain or sharded) not ``skip``-ped:
    seeded per name, so every rank makes the same values whatever it holds: 1-D norm scales 1, other 1-D tensors
    (biases) 0, matrices N(0, 0.02²) (finite activations at any depth tried; the values do not change the timing)."""
    import zlib

    from fastvideo.weights import local_pieces

    def maker(name: str, shape: tuple[int, ...]) -> Callable[[], torch.Tensor]:
        def make() -> torch.Tensor:
            if len(shape) == 1:
                return torch.ones(shape) if "norm" in name and name.endswith(".weight") else torch.zeros(shape)
            g = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
            return torch.randn(shape, generator=g).mul_(0.02)
        return make

    return {p.name: maker(p.name, p.shape) for p in local_pieces(model) if not skip(p.name)}


@contextlib.contextmanager
def random_weights(seed: int = 0) -> Iterator[None]:
    """The flux-dev-shape model has configs but no weight files: inside the block the package's loaders give seeded
    random values instead: the transformer's shards (``weights.load_safetensors_into``), the VAE (built from its
    config) and the text encoders' outputs (random T5/CLIP embeddings of the config's widths, seeded per prompt)."""
    import zlib

    from fastvideo import weights
    from fastvideo.models import flux

    def load_shards(fn):
        def wrapper(model, folder, skip=lambda name: False):
            weights.fill_local_shards(model, random_tensor_makers(model, seed, skip))
            return 0
        return wrapper

    def load_vae(fn):
        def wrapper(path, dtype=torch.float32, device="cpu"):
            from diffusers import AutoencoderKL

            config = AutoencoderKL.load_config(flux.check_model_folder(path, ("vae",)) / "vae", local_files_only=True)
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(seed)
                vae = AutoencoderKL.from_config(config).to(dtype)
            return vae.to(device).eval().requires_grad_(False)
        return wrapper

    def load_text_encoders(fn):
        def wrapper(path, dtype=torch.float32, device="cpu"):
            config = flux.build_transformer(path).config
            return {"dims": (config.joint_attention_dim, config.pooled_projection_dim), "dtype": dtype}
        return wrapper

    def encode_prompts(fn):
        def wrapper(encoders, prompts, max_sequence_length=512):
            (dim, pooled_dim), dtype = encoders["dims"], encoders["dtype"]
            gens = [torch.Generator().manual_seed(seed + zlib.crc32(p.encode())) for p in prompts]
            embeds = torch.stack([torch.randn(max_sequence_length, dim, generator=g) for g in gens]).to(dtype)
            pooled = torch.stack([torch.randn(pooled_dim, generator=g) for g in gens]).to(dtype)
            return embeds, pooled, [False] * len(prompts)
        return wrapper

    with contextlib.ExitStack() as stack:
        for owner, name, make in ((weights, "load_safetensors_into", load_shards), (flux, "load_vae", load_vae),
                                  (flux, "load_text_encoders", load_text_encoders),
                                  (flux, "encode_prompts", encode_prompts)):
            stack.enter_context(patched(owner, name, make))
        yield


def write_flux_dev_shape(out: Path, num_layers: int) -> Path:
    """The flux-dev-config folder (FLUX.1-dev's configs, no weights) with K double and 2K single blocks."""
    from fastvideo.tiny import write_flux_dev_config

    folder = write_flux_dev_config(out)
    config_file = folder / "transformer" / "config.json"
    config = json.loads(config_file.read_text())
    config.update(num_layers=num_layers, num_single_layers=2 * num_layers)
    config_file.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return folder


# ------------------------------------------------------------------------------------------------ one measured run
def _full_gradients(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every trainable parameter's whole gradient on every rank (a collective), float32 CPU."""
    from torch.distributed.tensor import DTensor
    from fastvideo.parallel import named_trainable_parameters

    out = {}
    for name, p in named_trainable_parameters(model):
        g = p.grad
        if g is None:
            continue
        out[name] = (g.full_tensor() if isinstance(g, DTensor) else g).detach().float().cpu()
    return out


def run_loop(loop: str, train_args: argparse.Namespace, device: torch.device, check: dict | None) -> dict:
    """Run the GRPO trainer as ``loop`` ("ours" or "reference") with every phase timed; returns this rank's
    per-step phase seconds, the checkpoint's seconds, peak memory, the run's metrics and (``check``) the first
    update's gradients and trajectory."""
    import train_grpo_flux
    from fastvideo import devices, parallel, training
    from fastvideo import distributed as D
    from fastvideo.ema import EMA

    clock = PhaseClock(device)
    found: dict[str, Any] = {"checkpoint_s": 0.0}
    reference = loop == "reference"
    ema_full: dict[str, torch.Tensor] = {}

    def rollout_wrapper(fn):
        def wrapper(*a, **k):
            with clock.phase("rollout"):
                traj = fn(*a, **k)
            decode = traj.timings.get("decode", 0.0)  # measured inside, synchronised: moved to its own phase
            clock.totals["rollout"] -= decode
            clock.totals["decode"] += decode
            if check is not None and traj.step == 1:
                if reference and "traj" in check:  # train on ours' samples: the comparison is of the training
                    check["rollout_diff"] = _trajectory_diff(traj, check["traj"])
                    traj = check["traj"]
                elif loop == "ours":
                    check["traj"] = traj
            return traj
        return wrapper

    def optimizer_wrapper(fn):
        def wrapper(run, *a, **k):
            if check is not None and "grads_" + loop not in check:
                with clock.phase("other"):
                    check["grads_" + loop] = _full_gradients(run.policy.model)
            norm = fn(run, *a, **k)
            if reference:  # the reference's EMA: the whole model gathered to rank 0 after every optimizer step
                with clock.phase("communication"):
                    full = parallel.full_state_dict(run.policy.model)
                with clock.phase("ema"), torch.no_grad():
                    for name, value in full.items():
                        if name not in ema_full:
                            ema_full[name] = value.float().clone()
                        else:
                            ema_full[name].lerp_(value.float(), 1 - 0.995)
            return norm
        return wrapper

    def save_wrapper(fn):
        def wrapper(args, step, policy, *a, **k):
            t0 = clock._now()
            with clock.phase("checkpoint"):
                if reference:  # the whole model to rank 0, one torch.save there
                    full = parallel.full_state_dict(policy.model)
                    path = Path(args.output_dir) / "checkpoints" / f"step-{step}.pt"
                    if D.is_main_process():
                        path.parent.mkdir(parents=True, exist_ok=True)
                        torch.save(full, path)
                    D.barrier()
                else:
                    path = fn(args, step, policy, *a, **k)
            found["checkpoint_s"] = clock._now() - t0
            return path
        return wrapper

    def resume_wrapper(fn):
        def wrapper(*a, **k):
            out = fn(*a, **k)
            clock.mark_step()
            return out
        return wrapper

    def end_step_wrapper(fn):
        def wrapper(run, step, metrics, *a, **k):
            found.setdefault("metrics", []).append({k: float(v) for k, v in metrics.items()
                                                    if isinstance(v, (int, float, torch.Tensor)) and
                                                    (not torch.is_tensor(v) or v.numel() == 1)})
            last = fn(run, step, metrics, *a, **k)
            clock.mark_step()
            return last
        return wrapper

    comm = timed(clock, "communication", unless=("checkpoint", "communication"))
    devices.reset_peak_memory(device)
    D.barrier()
    with contextlib.ExitStack() as stack:
        for owner, name, make in (
                (train_grpo_flux, "rollout", rollout_wrapper),
                (training.Run, "score_rollout", timed(clock, "reward")),  # both paths' wait for the rewards
                (train_grpo_flux, "update_policy", timed(clock, "train")),
                (training.Run, "optimizer_step", optimizer_wrapper),
                (EMA, "update", timed(clock, "ema")),
                (training, "save_state", save_wrapper),
                (training, "export_final", lambda fn: (lambda *a, **k: None)),  # not part of a step
                (training, "write_plots", lambda fn: (lambda out: "not written (benchmark)")),
                (training.Run, "resume", resume_wrapper),
                (training.Run, "end_step", end_step_wrapper),
                *[(D, f, comm) for f in ("all_gather_tensor", "all_gather_object", "all_reduce_sum",
                                         "all_reduce_max", "barrier")]):
            stack.enter_context(patched(owner, name, make))
        train_grpo_flux.train(train_args)
    peak = devices.max_memory_allocated_gb(device)
    return {"steps": clock.steps(), "checkpoint_s": found["checkpoint_s"], "peak_memory_gb": peak,
            "metrics": found.get("metrics", [])}


def _trajectory_diff(a: Any, b: Any) -> dict[str, float]:
    """Largest differences between two rollouts of the same samples (batch-size effects of the kernels)."""
    return {"latents_max_abs": float((a.latents - b.latents).abs().max()),
            "log_probs_max_abs": float((a.log_probs - b.log_probs).abs().max())}


# ----------------------------------------------------------------------------------------------------- the worker
def trainer_argv(cfg: dict, loop: str, dtype: str, out: Path) -> list[str]:
    """The train_grpo_flux.py flags of one loop: the same model, data and settings; the loop's batch structure."""
    steps = cfg["warmup"] + cfg["steps"]
    per_rank = cfg["num_generations"] * cfg["prompts_per_step"] // cfg["world_size"]
    if loop in ("ours", "overlap"):
        batch = ["--rollout_batch_size", str(cfg["rollout_batch_size"] or per_rank),
                 "--train_batch_size", str(cfg["train_batch_size"] or per_rank), "--use_ema",
                 *(["--compile"] if cfg["compile"] else []), *(["--reward_overlap"] if loop == "overlap" else [])]
    else:
        batch = ["--rollout_batch_size", "1", "--train_batch_size", "1", "--reward_batch_size", "1"]
    if cfg["reward"].startswith("remote:"):  # --reward_delay_ms: one image per request, one request at a time
        batch += ["--remote_batch_size", "1", "--remote_max_concurrency", "1"]
    return [
        "--pretrained_model_name_or_path", cfg["model_dir"], "--data_json_path", cfg["manifest"],
        "--output_dir", str(out), "--device", cfg["device"], "--mixed_precision", dtype,
        "--reward", cfg["reward"], "--h", str(cfg["h"]), "--w", str(cfg["w"]),
        "--sampling_steps", str(cfg["sampling_steps"]), "--num_generations", str(cfg["num_generations"]),
        "--prompts_per_step", str(cfg["prompts_per_step"]), "--timestep_fraction", str(cfg["timestep_fraction"]),
        "--max_train_steps", str(steps), "--checkpointing_steps", str(steps), "--learning_rate", "1e-5",
        "--seed", "0", "--sample_every", "0", "--no-progress_bar", "--gradient_sync", "backward",
        "--lora_rank", str(cfg["lora_rank"]), *batch]


def worker(cfg_path: str) -> None:
    """One torchrun: the peak matmul rate per dtype (all ranks at once), then per dtype both loops."""
    from fastvideo import distributed as D
    from fastvideo import flops
    from fastvideo.objectives import parse_grpo_args

    cfg = json.loads(Path(cfg_path).read_text())
    D.init_distributed(cfg["device"])
    dist = D.info()
    device = dist.device
    peaks = {}
    for name in cfg["dtypes"]:
        D.barrier()
        peaks[name] = sum(D.all_gather_object(flops.peak_matmul_flops(device, DTYPES[name] or torch.float32)))
    results: dict[str, dict] = {}
    for name in cfg["dtypes"]:
        check = {} if cfg["check"] else None
        order = ["ours", "reference"] + [loop for loop in cfg["loops"] if loop == "overlap"] if check is not None \
            else cfg["loops"]
        for loop in order:
            out = Path(cfg["work_dir"]) / f"run-{loop}-{name}"
            args = parse_grpo_args(trainer_argv(cfg, loop, name, out))
            stubs = random_weights(0) if cfg["model"] == FLUX_DEV_SHAPE else contextlib.nullcontext()
            with D.fail_fast(), stubs:
                res = run_loop(loop, args, device, check)
            res["per_rank"] = D.all_gather_object({"steps": res.pop("steps"), "peak_memory_gb": res["peak_memory_gb"],
                                                   "checkpoint_s": res["checkpoint_s"]})
            results.setdefault(name, {})[loop] = res
        if check is not None:
            results[name]["check"] = _compare_check(check)
    if dist.is_main:
        Path(cfg["worker_out"]).write_text(json.dumps({"peak_flops": peaks, "results": results,
                                                       "device_name": _device_name(device)}, indent=1))
    D.barrier()  # the results are written before any rank tears the process group down
    D.cleanup()


def _compare_check(check: dict) -> dict[str, float]:
    """How far the reference's first-update gradients are from ours (same samples, same weights)."""
    a, b = check["grads_ours"], check["grads_reference"]
    scale = max(float(g.abs().max()) for g in a.values())
    diff = max(float((a[k] - b[k]).abs().max()) for k in a)
    return {"grad_max_abs": scale, "grad_max_abs_diff": diff, "grad_rel_diff": diff / scale if scale else 0.0,
            "params_compared": len(a), **{f"rollout_{k}": v for k, v in check.get("rollout_diff", {}).items()}}


def _device_name(device: torch.device) -> str:
    from fastvideo import devices

    name = devices.device_name(device)
    return f"{name}, {torch.get_num_threads()} thread(s) per rank" if device.type == "cpu" else name


# ------------------------------------------------------------------------------------------------- the summary
def summarize(cfg: dict, worker_out: dict, model_config: dict, text_tokens: int, image_tokens: int) -> dict:
    """Per dtype and loop: mean phase seconds over the timed steps (max over ranks, checkpoint amortised), samples/s,
    fractions, MFU; and the headline numbers of the primary dtype."""
    from fastvideo.models import flux

    world = cfg["world_size"]
    samples = cfg["num_generations"] * cfg["prompts_per_step"]
    trained = max(1, int((cfg["sampling_steps"] - 1) * cfg["timestep_fraction"]))
    fwd = flux.transformer_flops(model_config, image_tokens, text_tokens, 1)
    flops_rollout = samples * cfg["sampling_steps"] * fwd
    flops_train = samples * trained * 3 * fwd
    out: dict[str, Any] = {"config": {k: v for k, v in cfg.items() if k not in ("work_dir", "worker_out")},
                           "device": worker_out["device_name"], "world_size": world,
                           "peak_flops": worker_out["peak_flops"],
                           "flops_per_step": {"rollout": flops_rollout, "train": flops_train,
                                              "forward_per_sample": fwd}, "results": {}}
    for dtype, loops in worker_out["results"].items():
        peak = worker_out["peak_flops"][dtype]
        res: dict[str, Any] = {}
        for loop in LOOPS:
            if loop not in loops:
                continue
            ranks = loops[loop]["per_rank"]
            timed_steps = [s for r in ranks for s in r["steps"][cfg["warmup"]:]]  # every rank's timed steps
            logged = loops[loop]["metrics"][cfg["warmup"]:] or [{}]  # rank 0's metrics of the timed steps
            mean = {p: sum(s[p] for s in timed_steps) / len(timed_steps) for p in (*PHASES, "wall")}
            ckpt = sum(r["checkpoint_s"] for r in ranks) / len(ranks)
            # the save measured in the last timed step, charged at 1/--checkpoint_interval per step instead
            wall = mean.pop("wall") - mean["checkpoint"] + ckpt / cfg["checkpoint_interval"]
            phases = {**mean, "checkpoint": ckpt / cfg["checkpoint_interval"]}
            phases["other"] = max(0.0, wall - sum(v for p, v in phases.items() if p != "other"))
            res[loop] = {
                "step_seconds": wall, "samples_per_second": samples / wall,
                "images_per_device_second": samples / wall / world,
                "phase_seconds": phases, "phase_fractions": {p: phases[p] / wall for p in PHASES},
                "checkpoint_seconds": ckpt,
                "mfu_rollout": flops_rollout / phases["rollout"] / peak if phases["rollout"] else 0.0,
                "mfu_train": flops_train / phases["train"] / peak if phases["train"] else 0.0,
                "peak_memory_gb_per_rank": [r["peak_memory_gb"] for r in ranks],
                "reward_mean_first_step": loops[loop]["metrics"][0].get("reward_mean") if loops[loop]["metrics"]
                else None,
                # the step's wait for its rewards after the rollout, and the reward's own seconds (rank 0's metrics)
                **{f"{name}_seconds": sum(m.get(f"time_{name}", 0.0) for m in logged) / len(logged)
                   for name in ("reward", "reward_busy")},
            }
        if "ours" in res and "reference" in res:
            ours_rate, reference_rate = res["ours"]["samples_per_second"], res["reference"]["samples_per_second"]
            res["step_speedup_vs_reference"] = ours_rate / reference_rate
        if "ours" in res and "overlap" in res:  # --reward_delay_ms: the same step, scored sequentially / overlapped
            res["overlap_step_saving"] = 1 - res["overlap"]["step_seconds"] / res["ours"]["step_seconds"]
        if "check" in loops:
            res["check"] = loops["check"]
        out["results"][dtype] = res
    primary = "bf16" if "bf16" in out["results"] else next(iter(out["results"]))
    head = out["results"][primary]
    ours = head.get("ours", head.get("reference"))
    out.update({"primary_dtype": primary, "step_speedup_vs_reference": head.get("step_speedup_vs_reference"),
                "overlap_step_saving": head.get("overlap_step_saving"),
                "images_per_device_second": ours["images_per_device_second"], "mfu_rollout": ours["mfu_rollout"],
                "mfu_train": ours["mfu_train"], "peak_memory_gb_per_rank": ours["peak_memory_gb_per_rank"],
                "phase_fractions": {loop: head[loop]["phase_fractions"] for loop in LOOPS if loop in head}})
    return out


def table(summary: dict) -> str:
    """The summary as a plain-text table (one block per dtype)."""
    cfg = summary["config"]
    model = (f"{FLUX_DEV_SHAPE} K={cfg['num_layers']}" if cfg.get("model") == FLUX_DEV_SHAPE
             else f"{cfg['preset']} preset")
    lines = [f"model: {model}, {cfg['h']}x{cfg['w']}, {cfg['sampling_steps']} sampling steps"
             + (f", LoRA rank {cfg['lora_rank']}" if cfg.get("lora_rank") else ", full fine-tune"),
             f"device: {summary['device']}, {summary['world_size']} rank(s); peak matmul "
             + ", ".join(f"{k} {v / 1e12:.2f} TFLOP/s" for k, v in summary["peak_flops"].items())]
    for dtype, res in summary["results"].items():
        loops = [loop for loop in LOOPS if loop in res]
        lines.append(f"\n{dtype}:" + (f"  step_speedup_vs_reference = {res['step_speedup_vs_reference']:.2f}x"
                                      if "step_speedup_vs_reference" in res else ""))
        lines.append(f"  {'':24}" + "".join(f"{loop:>14}" for loop in loops))
        rows = [("step seconds", lambda r: f"{r['step_seconds']:.3f}"),
                ("samples / s", lambda r: f"{r['samples_per_second']:.3f}"),
                ("images / device-second", lambda r: f"{r['images_per_device_second']:.3f}"),
                *[(f"  {p} fraction", (lambda p: lambda r: f"{r['phase_fractions'][p]:.3f}")(p)) for p in PHASES],
                ("mfu_rollout", lambda r: f"{r['mfu_rollout']:.3f}"), ("mfu_train", lambda r: f"{r['mfu_train']:.3f}"),
                ("peak memory GB / rank", lambda r: f"{max(r['peak_memory_gb_per_rank']):.2f}"),
                ("reward wait s / step", lambda r: f"{r['reward_seconds']:.3f}"),
                ("reward busy s / step", lambda r: f"{r['reward_busy_seconds']:.3f}")]
        for label, fmt in rows:
            lines.append(f"  {label:24}" + "".join(f"{fmt(res[loop]):>14}" for loop in loops))
        if "overlap_step_saving" in res:
            lines.append(f"  overlap vs sequential scoring ({cfg['reward_delay_ms']:g} ms per image at the reward "
                         f"server): step {res['ours']['step_seconds']:.3f} -> {res['overlap']['step_seconds']:.3f} s, "
                         f"overlap_step_saving = {res['overlap_step_saving']:.1%}")
        if "check" in res:
            c = res["check"]
            lines.append(f"  check: first-update gradients ours vs reference, max |diff| = {c['grad_max_abs_diff']:.3g}"
                         f" ({c['grad_rel_diff']:.2g} of max |grad|)")
    if summary.get("profile_rollout_forward"):
        lines.append(f"\none rollout forward ({summary['primary_dtype']}, one process), top operators by self time:")
        lines += [f"  {row['op']:<52}{row['self_ms']:9.1f} ms {row['share']:7.1%}"
                  for row in summary["profile_rollout_forward"]]
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------ the orchestrator
def prepare(cfg: dict, tmp: Path) -> tuple[dict, int, int]:
    """The model folder and the embeddings of the benchmark prompts; returns (transformer config, T, L)."""
    from fastvideo.models import flux
    from fastvideo.data import open_prompt_store, write_prompt_store
    from fastvideo.tiny import build_tiny_flux

    shape = cfg["model"] == FLUX_DEV_SHAPE
    if shape:
        model_dir = write_flux_dev_shape(tmp / "model", cfg["num_layers"])
    else:
        model_dir = build_tiny_flux(tmp / "model", preset=cfg["preset"], seed=0)
    prompts = tmp / "prompts.txt"
    prompts.write_text("".join(f"a benchmark prompt, number {i}\n" for i in range(max(8, cfg["prompts_per_step"]))))
    writer = open_prompt_store(prompts, model_dir, tmp / "embeddings", max_sequence_length=cfg["max_sequence_length"])
    with random_weights(0) if shape else contextlib.nullcontext():  # no text encoders: random embeddings
        write_prompt_store(writer, device=torch.device("cpu"))
    cfg.update(model_dir=str(model_dir), manifest=str(tmp / "embeddings" / "manifest.json"))
    config = dict(flux.build_transformer(model_dir).config)
    geometry = flux.latent_geometry(model_dir, cfg["h"], cfg["w"])
    return config, cfg["max_sequence_length"], geometry.seq_len


def profile_forward(cfg: dict, dtype: str, top: int = 8) -> list[dict]:
    """Where one rollout forward's time goes (this process, the model at ours' rollout batch, no grad, ``dtype``):
    the ``top`` operators by self time with their share, from ``torch.profiler`` (what explains the MFU)."""
    from torch.profiler import ProfilerActivity, profile

    from fastvideo import devices
    from fastvideo.models import flux

    device = torch.device(cfg["device"])
    if cfg["model"] == FLUX_DEV_SHAPE:  # weights in memory, as in the worker
        from fastvideo.weights import fill_local_shards

        model = flux.build_transformer(cfg["model_dir"]).to_empty(device=device)
        fill_local_shards(model, random_tensor_makers(model, 0))
        flux.prepare_for_device(model, device)
    else:
        model = flux.load_transformer(cfg["model_dir"], device=device)
    model = model.eval().requires_grad_(False)
    geometry = flux.latent_geometry(cfg["model_dir"], cfg["h"], cfg["w"])
    b = cfg["rollout_batch_size"] or cfg["num_generations"] * cfg["prompts_per_step"] // cfg["world_size"]
    T = cfg["max_sequence_length"]
    x = torch.randn(b, geometry.seq_len, geometry.packed_channels, device=device)
    embeds = torch.randn(b, T, model.config.joint_attention_dim, device=device)
    pooled = torch.randn(b, model.config.pooled_projection_dim, device=device)

    def forward() -> None:
        with torch.no_grad(), devices.autocast(device, DTYPES[dtype]):
            flux.predict_velocity(model, x, 0.5, embeds, pooled, flux.image_ids(geometry, device),
                                  flux.text_ids(T, device), guidance=3.5)

    forward()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        forward()
    events = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    total = sum(e.self_cpu_time_total for e in events)
    return [{"op": e.key, "self_ms": e.self_cpu_time_total / 1e3, "share": e.self_cpu_time_total / total}
            for e in events[:top]]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--smoke", action="store_true", help="tiny preset, 2 sampling steps, 1 timed step, --check (CI)")
    p.add_argument("--preset", default="bench", choices=("tiny", "bench"), help="tiny model preset (CPU)")
    p.add_argument("--model", default="preset", choices=("preset", FLUX_DEV_SHAPE),
                   help=f"preset: the --preset tiny model; {FLUX_DEV_SHAPE}: FLUX.1-dev's widths with --num_layers "
                        "double and 2x that many single blocks, random weights made in memory (accelerators)")
    p.add_argument("--num_layers", type=int, default=2,
                   help=f"{FLUX_DEV_SHAPE}: K double + 2K single blocks (FLUX.1-dev has 19 + 38; ~0.69B params per K)")
    p.add_argument("--lora_rank", type=int, default=0, help="train LoRA adapters of this rank (0 = full fine-tune)")
    p.add_argument("--nproc", type=int, default=2, help="ranks (torchrun --nproc_per_node)")
    p.add_argument("--device", default="cpu", help="cpu | cuda | npu")
    p.add_argument("--dtypes", default="fp32,bf16", help="comma-separated: fp32 (full precision), bf16 (autocast)")
    p.add_argument("--loops", default="reference,ours", help="which loops to run")
    p.add_argument("--steps", type=int, default=3, help="timed GRPO steps per loop")
    p.add_argument("--warmup", type=int, default=1, help="untimed GRPO steps first")
    p.add_argument("--h", type=int, default=None, help="image height (default: the preset's; 720 for flux-dev-shape)")
    p.add_argument("--w", type=int, default=None, help="image width (default: the preset's; 720 for flux-dev-shape)")
    p.add_argument("--sampling_steps", type=int, default=8)
    p.add_argument("--num_generations", type=int, default=8,
                   help="images per prompt (8 per rank with 2 ranks: the trainer's default rollout micro-batch)")
    p.add_argument("--prompts_per_step", type=int, default=2, help="prompts per step over all ranks")
    p.add_argument("--timestep_fraction", type=float, default=0.5, help="trained fraction of the S-1 SDE steps")
    p.add_argument("--max_sequence_length", type=int, default=64, help="T5 tokens per prompt")
    p.add_argument("--rollout_batch_size", type=int, default=0, help="ours: samples per rollout call (0 = all)")
    p.add_argument("--train_batch_size", type=int, default=0, help="ours: samples per replay micro-batch (0 = all)")
    p.add_argument("--reward", default="jpeg_compressibility", help="reward spec (no model files needed)")
    p.add_argument("--reward_delay_ms", type=float, default=0.0,
                   help="score through a reward server serving --reward that waits this many ms per request, one "
                        "image per request (about D ms per image and rank), and add the loop 'overlap' (ours with "
                        "--reward_overlap) to report the step-time saving of overlapped vs sequential scoring "
                        "(0 = the reward in-process, no overlap loop)")
    p.add_argument("--checkpoint_interval", type=int, default=20, help="steps per checkpoint (amortises its cost)")
    p.add_argument("--compile", action="store_true", help="ours: torch.compile the transformer blocks (--compile)")
    p.add_argument("--profile", action="store_true", help="also profile one rollout forward (top operators)")
    p.add_argument("--check", action="store_true", help="compare the first update's gradients of both loops")
    p.add_argument("--out", default="outputs/bench_step.json", help="where the JSON goes")
    args = p.parse_args(argv)
    if args.smoke:
        args.model, args.preset, args.sampling_steps, args.steps, args.check = "preset", "tiny", 3, 1, True
        args.max_sequence_length = min(args.max_sequence_length, 16)
    return args


@contextlib.contextmanager
def reward_server(cfg: dict) -> Iterator[str | None]:
    """With ``reward_delay_ms``: ``python -m fastvideo.rewards.serve`` serving ``cfg["reward"]`` on the CPU with that
    ``--delay_ms`` per request, for the run's duration; yields its URL (None without a delay: no server)."""
    if not cfg["reward_delay_ms"]:
        yield None
        return
    from fastvideo.rewards.serve import launch

    with launch(["--reward", cfg["reward"], "--device", "cpu", "--delay_ms", str(cfg["reward_delay_ms"])]) as server:
        yield server.url


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    if args.worker:
        worker(args.worker)
        return {}
    from fastvideo.tiny import PRESETS

    preset = PRESETS[args.preset]
    if args.model == FLUX_DEV_SHAPE and args.num_layers < 1:
        raise ValueError(f"--num_layers must be >= 1 (K double + 2K single blocks), got {args.num_layers}")
    default_h, default_w = (720, 720) if args.model == FLUX_DEV_SHAPE else (preset.height, preset.width)
    dtypes = [d for d in args.dtypes.split(",") if d]
    bad = [d for d in dtypes if d not in DTYPES] + [loop for loop in args.loops.split(",") if loop not in LOOPS]
    if bad:
        raise ValueError(f"unknown --dtypes/--loops entries {bad}; use {sorted(DTYPES)} and {list(LOOPS)}")
    if (args.num_generations * args.prompts_per_step) % args.nproc:
        raise ValueError("--num_generations x --prompts_per_step must divide by --nproc")
    loops = args.loops.split(",")
    if args.reward_delay_ms < 0:
        raise ValueError(f"--reward_delay_ms must be >= 0 (0 = no reward server), got {args.reward_delay_ms}")
    if args.reward_delay_ms:
        loops = [loop for loop in loops if loop != "overlap"] + ["ours"] * ("ours" not in loops) + ["overlap"]
        per_rank = args.num_generations * args.prompts_per_step // args.nproc
        args.rollout_batch_size = args.rollout_batch_size or max(1, per_rank // 4)
        if args.rollout_batch_size >= per_rank:
            raise ValueError(f"--reward_delay_ms compares overlapped with sequential scoring, which needs 2 or more "
                             f"rollout micro-batches per rank: pass --rollout_batch_size below {per_rank}")
    cfg = {"model": args.model, "num_layers": args.num_layers, "lora_rank": args.lora_rank,
           "preset": args.preset, "device": args.device, "world_size": args.nproc, "dtypes": dtypes,
           "loops": loops, "steps": args.steps, "warmup": args.warmup,
           "h": args.h or default_h, "w": args.w or default_w, "sampling_steps": args.sampling_steps,
           "num_generations": args.num_generations, "prompts_per_step": args.prompts_per_step,
           "timestep_fraction": args.timestep_fraction, "max_sequence_length": args.max_sequence_length,
           "rollout_batch_size": args.rollout_batch_size, "train_batch_size": args.train_batch_size,
           "reward": args.reward, "reward_delay_ms": args.reward_delay_ms,
           "checkpoint_interval": args.checkpoint_interval, "check": args.check,
           "compile": args.compile}
    with tempfile.TemporaryDirectory(prefix="bench_step-") as tmp_name:
        tmp = Path(tmp_name)
        model_config, T, L = prepare(cfg, tmp)
        cfg.update(work_dir=str(tmp), worker_out=str(tmp / "worker.json"))
        (tmp / "cfg.json").write_text(json.dumps(cfg))
        env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 2)
                                                                                            // args.nproc)))}
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(args.nproc),
               str(Path(__file__).resolve()), "--worker", str(tmp / "cfg.json")]
        with reward_server(cfg) as url:  # --reward_delay_ms: --reward behind a server, reached as remote:URL
            if url is not None:
                (tmp / "cfg.json").write_text(json.dumps({**cfg, "reward": f"remote:{url}"}))
            proc = subprocess.run(cmd, env=env, cwd=str(ROOT))
        if not (tmp / "worker.json").is_file():
            raise RuntimeError(f"the benchmark's torchrun failed (exit status {proc.returncode}); see its output above")
        if proc.returncode:  # a crash while tearing down after every result was written
            print(f"warning: torchrun exited with {proc.returncode} after writing the results", flush=True)
        summary = summarize(cfg, json.loads((tmp / "worker.json").read_text()), model_config, T, L)
        if args.profile:
            torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
            summary["profile_rollout_forward"] = profile_forward(cfg, summary["primary_dtype"])
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(summary, indent=1) + "\n")
    print(table(summary))
    print(f"\nwritten: {out}")
    return summary


if __name__ == "__main__":
    main()
