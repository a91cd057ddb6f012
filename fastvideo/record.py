"""Record a run's inputs and intermediate results, and replay them, to prove a port faithful (CUDA vs NPU, old vs new
code): ``--record_dir DIR`` writes what a trainer drew and computed; ``--replay_dir DIR`` makes another run take the
recorded random draws (and, with ``--replay_images``, the recorded images) instead; ``python -m fastvideo.compare``
then tells where two recordings part.

A recording (``FORMAT`` 1), written by every rank for its own samples, so it does not depend on the world size::

    DIR/manifest.json                          versions, device, compute dtype, world size, every flag (rank 0)
    DIR/steps.jsonl                            the step's logged metrics, one line per step (rank 0)
    DIR/samples-rank{r}.jsonl                  per sample: step, prompt id, sample index, prompt, every reward component
    DIR/updates-rank{r}.jsonl                  per update: step, micro-batch, trained-timestep slot, loss; grad norms
    DIR/step-{N:06d}/draws-rank{r}.safetensors every random tensor drawn at step N, named kind|purpose|p<id>|s<index>
    DIR/step-{N:06d}/tensors-rank{r}.safetensors  old log-probs (B, S) with their prompt ids / sample indices, and the
                                               trainer's per-update trace (``trace/<name>``)
    DIR/step-{N:06d}/images/p{id:06d}-s{index:03d}.png   decoded images, 8-bit

Random draws are keyed exactly like ``seeding.NoiseSource`` keys them (docs/design.md principle 4), so a recording made on
2 ranks replays on 1, and a draw is looked up by what it is for, never by position.
"""
from __future__ import annotations

import argparse
import importlib.metadata as md
import json
import platform
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from fastvideo import devices
from fastvideo import distributed as D
from fastvideo.logging import plain_value, truncate_jsonl
from fastvideo.options import opt
from fastvideo.seeding import NoiseSource

FORMAT = 1
# Flags that decide which random draws a step makes and their shapes: a replay must share them with the recording.
# (Data and pair files may sit at other paths on the other machine: what they hold is checked through the draws' keys.)
REPLAY_KEYS = ("algorithm", "seed", "num_generations", "prompts_per_step", "sampling_steps", "h", "w", "eta",
               "sde_window_size", "sde_window_range", "sde_window_schedule", "sde_window_shift_interval",
               "sde_window_stride", "init_same_noise", "timestep_fraction", "timesteps_per_pair", "num_frames")
# Draw-deciding flags added later, with the value every earlier recording had (absent from its manifest).
LATER_REPLAY_KEYS = {"sde_window_schedule": "random", "sde_window_shift_interval": 25, "sde_window_stride": 1,
                     "num_frames": None}


def step_dir(root: Path, step: int) -> Path:
    return Path(root) / f"step-{int(step):06d}"


def image_name(prompt_id: int, sample_index: int) -> str:
    """The file name of one sample's image: keyed like its noise, so it does not depend on the rank that made it."""
    return f"p{int(prompt_id):06d}-s{int(sample_index):03d}.png"


def draw_key(kind: str, purpose: str, prompt_id: int, sample_index: int) -> str:
    return f"{kind}|{purpose}|p{int(prompt_id)}|s{int(sample_index)}"


def save_png(image: torch.Tensor, path: Path) -> None:
    """One (3, H, W) image in [0, 1] as an 8-bit PNG (rounded to nearest, like torchvision's save_image)."""
    from PIL import Image  # heavy

    array = image.detach().float().cpu().clamp(0, 1).mul(255).add(0.5).floor().to(torch.uint8)
    Image.fromarray(array.permute(1, 2, 0).numpy()).save(path)


def load_image(path: Path) -> torch.Tensor:
    """An image file (PNG, JPEG, ...) as RGB (3, H, W) float32 in [0, 1]."""
    from PIL import Image  # heavy

    with Image.open(path) as img:
        array = np.asarray(img.convert("RGB"), dtype=np.uint8)
    return torch.from_numpy(array.copy()).permute(2, 0, 1).float() / 255.0


def read_jsonl(path: Path) -> list[dict]:
    """The complete lines of a JSONL file (a torn last line, from a killed process, is skipped)."""
    rows = []
    for line in Path(path).read_text(errors="replace").splitlines():
        try:
            rows.append(json.loads(line))
        except ValueError:
            continue
    return rows


def _append_jsonl(path: Path, rows: Sequence[dict]) -> None:
    if rows:
        with open(path, "a") as f:
            f.write("".join(json.dumps(r, allow_nan=True) + "\n" for r in rows))


def environment(device: torch.device, compute_dtype: torch.dtype | None) -> dict:
    """What a recording says about where it was made: library versions, git commit, device and compute dtype."""
    versions = {"python": platform.python_version(), "torch": torch.__version__}
    for dist_name in ("diffusers", "transformers", "peft", "open_clip_torch", "torch_npu", "safetensors", "numpy"):
        try:
            versions[dist_name] = md.version(dist_name)
        except md.PackageNotFoundError:
            pass
    name = platform.processor() or platform.machine()
    module = devices.device_module(device)
    if module is not None and hasattr(module, "get_device_name"):
        try:
            name = module.get_device_name(device)
        except Exception:  # noqa: BLE001 - a name is informative only
            pass
    if device.type == "cuda":
        versions["cuda"] = torch.version.cuda
    commit = dirty = None
    here = Path(__file__).resolve().parent
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=here, text=True, capture_output=True,
                                timeout=10).stdout.strip() or None
        if commit:  # uncommitted edits to tracked files: the commit alone does not name the code that ran
            dirty = bool(subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=here, text=True,
                                        capture_output=True, timeout=10).stdout.strip())
    except (OSError, subprocess.SubprocessError):
        pass
    return {"versions": versions, "git_commit": commit, "git_dirty": dirty, "host": platform.node(),
            "device": {"type": device.type, "name": name},
            "compute_dtype": str(compute_dtype or torch.float32).replace("torch.", "")}


# ------------------------------------------------------------------------------------------------------- recording
class Recorder:
    """Collects one rank's draws, samples, updates and step metrics, and writes them at the end of each recorded
    step (every ``--record_every`` steps, and step 1); see the module docstring for the layout."""

    def __init__(self, root: str | Path, rank: int, every: int = 1):
        self.root, self.rank, self.every = Path(root), int(rank), int(every)
        self.draws: dict[int, dict[str, torch.Tensor]] = {}
        self.tensors: dict[int, dict[str, torch.Tensor]] = {}
        self.samples: list[dict] = []

    def records(self, step: int) -> bool:
        return step == 1 or step % self.every == 0

    def start(self, manifest: dict, resume_step: int) -> None:
        """Create the folder (rank 0 writes the manifest); when it continues its own recording (a resumed or
        restarted run), forget what was recorded after ``resume_step`` so the recording reads as one uninterrupted
        run. Collective-free: every rank's later writes follow collectives of model loading."""
        self.root.mkdir(parents=True, exist_ok=True)
        if self.rank == 0:
            for folder in self.root.glob("step-*"):
                if folder.is_dir() and int(folder.name.split("-")[1]) > resume_step:
                    shutil.rmtree(folder)
            (self.root / "manifest.json").write_text(json.dumps(manifest, indent=2, default=str) + "\n")
        for name in (f"samples-rank{self.rank}.jsonl", f"updates-rank{self.rank}.jsonl") + (
                ("steps.jsonl",) if self.rank == 0 else ()):
            if (self.root / name).exists():
                truncate_jsonl(self.root / name, resume_step)

    def add_draw(self, step: int, key: str, value: torch.Tensor) -> None:
        if self.records(step):
            self.draws.setdefault(int(step), {}).setdefault(key, value.detach().cpu().contiguous().clone())

    def add_samples(self, step: int, prompt_ids: Sequence[int], sample_indices: Sequence[int],
                    prompts: Sequence[str], images: torch.Tensor, rewards: dict[str, torch.Tensor],
                    log_probs: torch.Tensor | None) -> None:
        """This rank's samples of a step: images (B, 3, H, W) in [0, 1] (videos (B, F, 3, H, W): each one PNG of its
        frames stacked top to bottom, lossless), its slice of every reward component, and the rollout's log-probs
        (B, S) when it had SDE steps."""
        if not self.records(step):
            return
        folder = step_dir(self.root, step) / "images"
        folder.mkdir(parents=True, exist_ok=True)
        for i, (p, s) in enumerate(zip(prompt_ids, sample_indices)):
            save_png(images[i] if images.ndim == 4 else images[i].transpose(0, 1).flatten(1, 2),
                     folder / image_name(p, s))
            self.samples.append({"step": int(step), "prompt_id": int(p), "sample_index": int(s), "prompt": prompts[i],
                                 "rewards": {k: float(v[i]) for k, v in rewards.items()},
                                 "image": f"{folder.parent.name}/images/{image_name(p, s)}"})
        if log_probs is not None:
            self.tensors.setdefault(int(step), {}).update({
                "old_log_probs": log_probs.detach().float().cpu(),
                "prompt_ids": torch.as_tensor(list(prompt_ids), dtype=torch.long),
                "sample_indices": torch.as_tensor(list(sample_indices), dtype=torch.long)})

    def end_step(self, step: int, metrics: dict[str, Any], trace: dict[str, torch.Tensor] | None,
                 grad_norms: Sequence[float]) -> None:
        """Write the step: its draws and tensors (safetensors), samples, per-update losses and grad norms (JSONL), the
        metrics (rank 0). Draws of other steps made during it (none in the trainers) are written with their step."""
        if not self.records(step):
            self.draws.pop(int(step), None)
            return
        for trace_name, value in (trace or {}).items():
            self.tensors.setdefault(int(step), {})[f"trace/{trace_name}"] = value.detach().float().cpu().contiguous()
        for kind, store in (("draws", self.draws), ("tensors", self.tensors)):
            for s in sorted(store):
                folder = step_dir(self.root, s)
                folder.mkdir(parents=True, exist_ok=True)
                save_file(store[s], str(folder / f"{kind}-rank{self.rank}.safetensors"))
            store.clear()
        _append_jsonl(self.root / f"samples-rank{self.rank}.jsonl", self.samples)
        self.samples = []
        updates = []
        losses = (trace or {}).get("loss")
        if losses is not None:
            table = losses.detach().float().cpu().reshape(losses.shape[0], -1)  # (micro-batches, trained timesteps)
            updates += [{"step": int(step), "micro_batch": mb, "timestep_slot": k, "loss": float(v)}
                        for mb, row in enumerate(table.tolist()) for k, v in enumerate(row)]
        updates += [{"step": int(step), "optimizer_step": i, "grad_norm": float(g)} for i, g in enumerate(grad_norms)]
        _append_jsonl(self.root / f"updates-rank{self.rank}.jsonl", updates)
        if self.rank == 0:
            row = {"step": int(step), **{k: plain_value(v) for k, v in metrics.items()}}
            _append_jsonl(self.root / "steps.jsonl", [row])


class RecordingNoise(NoiseSource):
    """A NoiseSource that also hands every draw to a ``Recorder`` under its key (the values are unchanged)."""

    def __init__(self, base: NoiseSource, recorder: Recorder):
        super().__init__(base.seed, base.device)
        self.recorder = recorder

    def _keep(self, kind: str, step: int, prompt_id: int, sample_index: int, purpose: str,
              value: torch.Tensor) -> torch.Tensor:
        self.recorder.add_draw(step, draw_key(kind, purpose, prompt_id, sample_index), value)
        return value

    def randn(self, shape, *, step, prompt_id, sample_index, purpose, out_device=None, dtype=torch.float32):
        x = super().randn(shape, step=step, prompt_id=prompt_id, sample_index=sample_index, purpose=purpose)
        self._keep("randn", step, prompt_id, sample_index, purpose, x)
        return x.to(device=out_device or self.device, dtype=dtype)

    def rand(self, shape, *, step, prompt_id, sample_index, purpose):
        x = super().rand(shape, step=step, prompt_id=prompt_id, sample_index=sample_index, purpose=purpose)
        return self._keep("rand", step, prompt_id, sample_index, purpose, x)

    def randint(self, low, high, *, step, prompt_id, sample_index, purpose):
        value = super().randint(low, high, step=step, prompt_id=prompt_id, sample_index=sample_index, purpose=purpose)
        self._keep(f"randint{low}_{high}", step, prompt_id, sample_index, purpose, torch.tensor(value))
        return value

    def randperm(self, n, *, step, prompt_id, sample_index, purpose):
        x = super().randperm(n, step=step, prompt_id=prompt_id, sample_index=sample_index, purpose=purpose)
        return self._keep("randperm", step, prompt_id, sample_index, purpose, x)


# ------------------------------------------------------------------------------------------------------- replay
class Replay:
    """Serves a recording's draws by key (and its images, with ``--replay_images``), checking keys, shapes and counts:
    every error says what differs and which flags decide it."""

    HINT = ("a replay needs the recorded run's data manifest and the flags that decide the draws (" +
            ", ".join(f"--{k}" for k in REPLAY_KEYS[1:]) + ")")

    def __init__(self, root: str | Path, images: bool = False):
        self.root, self.use_images = Path(root), images
        self.manifest = json.loads((self.root / "manifest.json").read_text())
        self._index: dict[int, dict[str, Path]] = {}
        self.used: dict[int, set[str]] = {}

    def recorded_steps(self) -> list[int]:
        return recorded_steps(self.root)

    def _keys(self, step: int) -> dict[str, Path]:
        """key -> the file holding it, over every rank's draws of ``step`` (read from the headers only)."""
        if step not in self._index:
            index: dict[str, Path] = {}
            for path in sorted(step_dir(self.root, step).glob("draws-rank*.safetensors")):
                with safe_open(str(path), "pt") as f:
                    for key in f.keys():
                        index.setdefault(key, path)
            if not index:
                raise ValueError(f"--replay_dir {self.root} has no draws for step {step} (recorded steps: "
                                 f"{_ranges(self.recorded_steps())}); replay only steps that were recorded (record "
                                 "with --record_every 1, or lower --max_train_steps)")
            self._index[step] = index
        return self._index[step]

    def draw(self, kind: str, step: int, prompt_id: int, sample_index: int, purpose: str,
             shape: Sequence[int]) -> torch.Tensor:
        """The recorded draw for this key (ValueError when it is missing or has another shape)."""
        key = draw_key(kind, purpose, prompt_id, sample_index)
        keys = self._keys(step)
        if key not in keys:
            prompts = sorted({int(k.split("|")[2][1:]) for k in keys})
            raise ValueError(f"replay: step {step} asks for draw {key!r} with shape {tuple(shape)}, which --replay_dir "
                             f"{self.root} does not hold (its prompts at this step: {prompts[:12]}); {self.HINT}")
        with safe_open(str(keys[key]), "pt") as f:
            value = f.get_tensor(key)
        if tuple(value.shape) != tuple(shape):
            raise ValueError(f"replay: step {step}, draw {key!r}: the recording has shape {tuple(value.shape)} but "
                             f"this run asks for {tuple(shape)}; {self.HINT}")
        self.used.setdefault(step, set()).add(key)
        return value

    def check_step(self, step: int) -> None:
        """After a step (a collective: every rank calls it): the ranks together used every recorded draw of the step,
        else ValueError on every rank naming what was left over."""
        used = set().union(*D.all_gather_object(sorted(self.used.pop(step, set()))))
        recorded = set(self._keys(step))
        self._index.pop(step, None)
        unused = sorted(recorded - used)
        if unused:
            raise ValueError(f"replay: step {step} used {len(used)} of the {len(recorded)} draws recorded in "
                             f"{self.root} (not used: {unused[:4]}{' ...' if len(unused) > 4 else ''}); {self.HINT}")

    def images(self, step: int, prompt_ids: Sequence[int], sample_indices: Sequence[int],
               like: torch.Tensor) -> torch.Tensor:
        """The recorded images of these samples, shaped, typed and placed like ``like`` (B, 3, H, W)."""
        folder = step_dir(self.root, step) / "images"
        out = []
        for p, s in zip(prompt_ids, sample_indices):
            path = folder / image_name(p, s)
            if not path.is_file():
                raise ValueError(f"--replay_images: {path} is missing (the recording has no image of prompt {p}, "
                                 f"sample {s} at step {step}); {self.HINT}")
            image = load_image(path)
            if like.ndim == 5:  # a video's frames, stacked top to bottom (add_samples)
                frames, height = like.shape[1], like.shape[3]
                if image.shape[1] != frames * height:
                    raise ValueError(f"--replay_images: {path} holds {image.shape[1]} rows, not {frames} frames of "
                                     f"{height}; replay with the recording's --num_frames/--h/--w")
                image = image.view(3, frames, height, image.shape[2]).transpose(0, 1)
            out.append(image)
        images = torch.stack(out)
        if images.shape[1:] != like.shape[1:]:
            raise ValueError(f"--replay_images: the recorded images are {tuple(images.shape[1:])} but this run decodes "
                             f"{tuple(like.shape[1:])}; replay with the recording's --h/--w")
        return images.to(device=like.device, dtype=like.dtype)


class ReplayNoise(NoiseSource):
    """A NoiseSource that returns a recording's draws instead of drawing (same keys, same shapes, same dtypes)."""

    def __init__(self, base: NoiseSource, replay: Replay, recorder: Recorder | None = None):
        super().__init__(base.seed, base.device)
        self.replay, self.recorder = replay, recorder

    def _take(self, kind: str, step: int, prompt_id: int, sample_index: int, purpose: str,
              shape: Sequence[int]) -> torch.Tensor:
        value = self.replay.draw(kind, step, prompt_id, sample_index, purpose, shape)
        if self.recorder is not None:  # a replay may record itself, for compare
            self.recorder.add_draw(step, draw_key(kind, purpose, prompt_id, sample_index), value)
        return value.to(self.device)

    def randn(self, shape, *, step, prompt_id, sample_index, purpose, out_device=None, dtype=torch.float32):
        x = self._take("randn", step, prompt_id, sample_index, purpose, tuple(shape))
        return x.to(device=out_device or self.device, dtype=dtype)

    def rand(self, shape, *, step, prompt_id, sample_index, purpose):
        return self._take("rand", step, prompt_id, sample_index, purpose, tuple(shape))

    def randint(self, low, high, *, step, prompt_id, sample_index, purpose):
        return int(self._take(f"randint{low}_{high}", step, prompt_id, sample_index, purpose, ()))

    def randperm(self, n, *, step, prompt_id, sample_index, purpose):
        return self._take("randperm", step, prompt_id, sample_index, purpose, (n,))


def recorded_steps(root: Path) -> list[int]:
    """The steps of a recording that hold random draws."""
    return sorted(int(p.name.split("-")[1]) for p in Path(root).glob("step-*")
                  if any(p.glob("draws-rank*.safetensors")))


def _ranges(steps: Sequence[int]) -> str:
    return ", ".join(str(s) for s in steps[:8]) + (" ..." if len(steps) > 8 else "") if steps else "none"


# ------------------------------------------------------------------------------------------------------- set-up
def check_replay(replay_dir: str | Path, config: dict, first_step: int, last_step: int) -> None:
    """Before any model loads (on every rank): --replay_dir is a recording of this algorithm with the same
    draw-deciding flags (``REPLAY_KEYS``) and holds every step this run will take."""
    root = Path(replay_dir)
    if not (root / "manifest.json").is_file():
        raise FileNotFoundError(f"--replay_dir {root}: no manifest.json; pass a folder written by a run with "
                                "--record_dir")
    manifest = json.loads((root / "manifest.json").read_text())
    if manifest.get("format") != FORMAT:
        raise ValueError(f"--replay_dir {root} is a recording of format {manifest.get('format')}, this code reads "
                         f"format {FORMAT}; record again with this version")
    flags = manifest.get("flags", {})
    later = LATER_REPLAY_KEYS  # flags added after a recording was made read as their earlier value
    diffs = [f"--{k}: recorded {flags.get(k, later.get(k))!r} vs now {config.get(k, later.get(k))!r}"
             for k in REPLAY_KEYS if json.dumps(flags.get(k, later.get(k)), default=str)
             != json.dumps(config.get(k, later.get(k)), default=str)]
    if diffs:
        raise ValueError(f"--replay_dir {root} was recorded with other flags that decide the draws ({'; '.join(diffs)})"
                         "; use the recorded values (a replay may change the model, device, dtype or code, not what "
                         "is drawn)")
    recorded = set(recorded_steps(root))
    missing = [s for s in range(first_step, last_step + 1) if s not in recorded]
    if missing:
        have = sorted(recorded)
        raise ValueError(f"--replay_dir {root} has no draws for step(s) {_ranges(missing)} of this run (recorded: "
                         f"{_ranges(have)}); pass --max_train_steps {max([s for s in have if s < missing[0]] or [0])} "
                         "or record every step (--record_every 1)")


def check_record_dir(record_dir: str | Path, replay_dir: str | None, fingerprint: str | None) -> None:
    """--record_dir is empty, or holds this run's own recording (same config fingerprint: a resumed or restarted
    run continues it); never another run's, and never the --replay_dir."""
    root = Path(record_dir)
    if replay_dir is not None and root.resolve() == Path(replay_dir).resolve():
        raise ValueError(f"--record_dir and --replay_dir are the same folder ({root}); record the replay elsewhere")
    if root.is_file():
        raise ValueError(f"--record_dir {root} is a file; pass a folder")
    if not root.exists() or not any(root.iterdir()):
        return
    manifest = root / "manifest.json"
    own = manifest.is_file() and fingerprint is not None and \
        json.loads(manifest.read_text()).get("config_fingerprint") == fingerprint
    if not own:
        raise ValueError(f"--record_dir {root} is not empty and not this run's recording (its flags differ); choose "
                         "an empty folder")


def open_alignment(args: argparse.Namespace, config: dict, dist: D.DistInfo, noise: NoiseSource,
                   compute_dtype: torch.dtype | None, start_step: int, fingerprint: str | None = None
                   ) -> tuple[NoiseSource, Recorder | None, Replay | None]:
    """Set up --record_dir / --replay_dir (checked first, on every rank, before any model loads): returns the noise
    source the run draws from (recording or replaying), the recorder and the replay (None when off).
    ``fingerprint``: the run's config fingerprint (``resume.run_identity``), kept in the manifest so that a resumed
    or restarted run continues its own recording."""
    recorder = replay = None
    if args.replay_dir is not None:
        check_replay(args.replay_dir, config, start_step + 1, args.max_train_steps)
        replay = Replay(args.replay_dir, images=args.replay_images)
    if args.record_dir is not None:
        check_record_dir(args.record_dir, args.replay_dir, fingerprint)
        D.barrier()  # every rank has looked at the folder before rank 0 writes into it
        recorder = Recorder(args.record_dir, dist.rank, args.record_every)
        manifest = {"format": FORMAT, "algorithm": config.get("algorithm"),
                    "created": time.strftime("%Y-%m-%dT%H:%M:%S"),
                    "world_size": dist.world_size, "record_every": args.record_every,
                    "config_fingerprint": fingerprint, "replayed_from": args.replay_dir,
                    **environment(dist.device, compute_dtype),
                    "noise_device": str(noise.device), "flags": config}
        recorder.start(manifest, start_step)
    if replay is not None:
        return ReplayNoise(noise, replay, recorder), recorder, replay
    if recorder is not None:
        return RecordingNoise(noise, recorder), recorder, None
    return noise, None, None


__all__: list[str] = ["FORMAT", "REPLAY_KEYS", "Recorder", "RecordingNoise", "Replay", "ReplayNoise", "check_replay",
                      "check_record_dir", "environment", "image_name", "load_image", "open_alignment", "read_jsonl",
                      "save_png", "step_dir"]


@dataclass
class AlignmentOptions:
    record_dir: str | None = opt(
        None, "write what the run draws and computes, per step and rank, to this empty folder: every random draw by "
        "key and old log-probs (safetensors), decoded images (PNG), per-sample rewards, per-update losses and grad "
        "norms (JSONL), a manifest (versions, device, dtype, flags); for `python -m fastvideo.compare`. Draws take "
        "~4*S*L*C bytes per sample and step (8 MB at 720x720, 16 steps)")
    record_every: int = opt(1, "with --record_dir: record step 1 and every N-th step (a replay needs every step)")
    replay_dir: str | None = opt(
        None, "a --record_dir of another run (another device, dtype or code version): take its random draws instead of "
        "drawing them; keys, shapes and counts are checked every step")
    replay_images: bool = opt(False, "with --replay_dir: score the recorded images instead of this run's decoded ones "
                                     "(isolates the reward stage; the images are the recording's 8-bit PNGs)")
