"""Test helpers: run a script under torchrun with the current interpreter on a free port."""
from __future__ import annotations

import argparse
import importlib.util
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import suite_rules

if TYPE_CHECKING:
    from fastvideo.training import Run

REPO = Path(__file__).resolve().parents[1]
# metrics that depend on the machine's speed or memory, not on the computation (left out when runs are compared)
TIMING_KEYS = ("time_", "samples_per_s", "peak_memory_gb", "memory_baseline_gb", "tflops_", "mfu")


def load_script(path: Path, name: str, register: bool = False):
    """A top-level script (sample.py, preprocess_embeddings.py, a benchmark) loaded as module ``name``, to call its
    ``main`` in this process; ``register``: put it in sys.modules first (dataclasses defined in it look it up)."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    if register:
        sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_torchrun(args: list[str], nproc: int = 2, timeout: float = 600, env: dict | None = None,
                 cwd: Path | None = None) -> subprocess.CompletedProcess:
    """`torchrun --nproc_per_node nproc args...` on CPU/gloo; raises with the output if it fails. A job whose rank was
    killed by a signal inside gloo's TCP transport (``suite_rules.crash_signature``) runs once more, with
    ``FLAKY: <test> <first crash report>`` in the run's summary; a second crash, or any other, fails."""
    # PYTHONFAULTHANDLER: a rank that dies by a signal (a native abort in gloo, a segfault) prints its Python stack
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
                "PYTHONFAULTHANDLER": "1", **(env or {})}
    for attempt in (1, 2):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
               "--master_addr", "127.0.0.1", "--master_port", str(free_port()), *args]
        proc = subprocess.run(cmd, cwd=cwd or REPO, env=full_env, capture_output=True, text=True, timeout=timeout)
        if proc.returncode == 0:
            return proc
        output = proc.stdout + "\n" + proc.stderr
        if attempt == 1 and suite_rules.crash_signature(output) == "gloo-transport":
            suite_rules.note_flaky(suite_rules.crash_report(output))
            continue
        break
    raise AssertionError(f"torchrun failed ({proc.returncode}): {' '.join(cmd)}\n"
                         f"--- stdout ---\n{proc.stdout[-6000:]}\n--- stderr ---\n{stderr_excerpt(proc.stderr)}")


# One torchrun job runs several trainer invocations ([[script, [args...]], ...]) one after another in the same ranks
# and process group (each run's cleanup leaves the group for the next; a group destroyed and created again per run hung
# at the fifth in a trial): one start-up (imports, rendezvous) instead of one per run.
IN_ONE_JOB = '''
import json, runpy, sys
import torch.distributed as dist
sys.path.insert(0, {repo!r})

destroy = dist.destroy_process_group
dist.destroy_process_group = lambda group=None: None  # fastvideo.distributed.cleanup: keep the group for the next run
for script, args in json.loads(sys.argv[1]):
    sys.argv = [script, *args]
    runpy.run_path(script, run_name="__main__")
if dist.is_initialized():  # one rank runs without a process group
    destroy()
'''


def run_in_one_job(runs: list[tuple[str, list[str]]], work_dir: Path, nproc: int = 2,
                   timeout: float = 600) -> subprocess.CompletedProcess:
    """``runs`` (trainer script, its arguments) in one ``torchrun`` job of ``nproc`` ranks, in order (the driver is
    written to ``work_dir``); raises as ``run_torchrun`` does if the job fails."""
    import json

    driver = work_dir / "in_one_job.py"
    driver.write_text(IN_ONE_JOB.format(repo=str(REPO)))
    return run_torchrun([str(driver), json.dumps([[script, list(args)] for script, args in runs])], nproc=nproc,
                        timeout=timeout)


# Trainer runs that tests of several modules read, made together: a module declares each at import
# (``shared_run``), and the session fixture ``shared_runs`` (tests/conftest.py) makes every declared run of a rank count
# in one ``run_in_one_job`` job the first time one of them is asked for (one start-up, ~15 s, instead of one per run).
# Only the collected modules' runs are declared, so a module run alone makes only its own.
SHARED_RUNS: dict[str, tuple[int, Callable[[dict, Path], list[str]]]] = {}


def shared_run(key: str, nproc: int, args: Callable[[dict, Path], list[str]]) -> None:
    """Declare the run ``key`` of ``nproc`` ranks: ``args(inputs, out)`` is its script and arguments, writing to
    ``out``, from the session's inputs ``{"model": tiny FLUX.1, "data": its 16-prompt manifest, "hps": the tiny HPS
    reward's flags}``; ``shared_runs(key)`` returns ``out`` once it ran (read-only to tests)."""
    if key in SHARED_RUNS and SHARED_RUNS[key][0] != nproc:
        raise ValueError(f"shared run {key!r} is declared twice with different rank counts")
    SHARED_RUNS[key] = (nproc, args)


def stderr_excerpt(stderr: str, head: int = 3000, tail: int = 6000) -> str:
    """A failed run's stderr: its end, plus the first native crash report (``Fatal Python error``: a rank's
    fatal-signal stack, ``terminate called``: a C++ abort) or else its start. The rank that failed first printed its
    error long before the other ranks' tracebacks that fill the end."""
    if len(stderr) <= head + tail:
        return stderr
    starts = [i for i in (stderr.find(m) for m in suite_rules.CRASH_MARKERS) if 0 <= i < len(stderr) - tail]
    at = min(starts, default=0)
    return f"{stderr[at:at + head]}\n[...]\n{stderr[-tail:]}"


def make_embeddings(model_dir: Path, out: Path, num_prompts: int, *extra: str, prompt_file: Path | None = None) -> Path:
    """Embeddings of the first ``num_prompts`` prompts of ``prompt_file`` (default assets/prompts.txt) for
    ``model_dir``; returns the manifest."""
    prompts = out / "prompts.txt"
    lines = (prompt_file or REPO / "assets" / "prompts.txt").read_text().splitlines()[:num_prompts]
    prompts.write_text("\n".join(lines) + "\n")
    subprocess.run([sys.executable, str(REPO / "preprocess_embeddings.py"), "--model_path", str(model_dir),
                    "--prompt_file", str(prompts), "--output_dir", str(out / "emb"), "--device", "cpu", *extra],
                   check=True, cwd=REPO, capture_output=True)
    return out / "emb" / "manifest.json"


def toy_data_dir(toy_world: dict[str, Path], root: Path) -> Path:
    """A launchers' DATA_DIR (``root/data``) made of links to the session's toy world, as the launchers would build it
    (toy-flux, toyworld-prompts, toyworld-train, toyworld-heldout with every held-out prompt): nothing rebuilt, and a
    launcher that finds it complete writes nothing there. A test that writes into a DATA_DIR uses its own."""
    data = root / "data"
    data.mkdir(parents=True)
    (data / "toy-flux").symlink_to(toy_world["model"])
    (data / "toyworld-prompts").symlink_to(toy_world["prompts"])
    (data / "toyworld-train").symlink_to(toy_world["train"].parent)
    (data / "toyworld-heldout").symlink_to(toy_world["heldout_all"].parent)
    return data


def assert_lora_changes_pipeline(model_dir: Path, lora_dir: Path) -> None:
    """A trained LoRA export loads into a stock diffusers FluxPipeline and changes its output."""
    import torch
    from diffusers import FluxPipeline

    pipe = FluxPipeline.from_pretrained(model_dir, local_files_only=True)
    kwargs = dict(prompt="a red cube on a table", height=64, width=64, num_inference_steps=3, output_type="pt",
                  max_sequence_length=32)
    base = pipe(generator=torch.Generator().manual_seed(0), **kwargs).images
    pipe.load_lora_weights(lora_dir)
    tuned = pipe(generator=torch.Generator().manual_seed(0), **kwargs).images
    assert torch.isfinite(tuned).all()
    assert (tuned - base).abs().max() > 1e-4, "the trained LoRA does not change the pipeline's output"


def random_lora(family, folder: Path, seed: int = 2, scale: float = 0.2):
    """The family's transformer from ``folder`` with a rank-4 LoRA whose B matrices are seeded noise x ``scale``
    (lora_B starts at zero: an adapter with an effect for export tests)."""
    import torch

    from fastvideo.lora import add_lora

    model = add_lora(family.load_transformer(folder), rank=4, alpha=8,
                     target_modules=list(family.lora_target_modules), init_seed=0)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".lora_B." in name:
                param.copy_(torch.randn(param.shape, generator=generator) * scale)
    return model


def validate_flags(tmp_path: Path, parse, validate, *flags: str, world: int = 1) -> dict:
    """``validate(parse([...model and data flags, *flags]), world)`` with a stub model folder and manifest (flag checks
    need no real files); returns the batch arithmetic."""
    model = tmp_path / "model"
    model.mkdir(exist_ok=True)
    (model / "model_index.json").write_text("{}")
    data = tmp_path / "manifest.json"
    data.write_text("{}")
    return validate(parse(["--pretrained_model_name_or_path", str(model), "--data_json_path", str(data), *flags]),
                    world)


def build_run(args: argparse.Namespace, validate: Callable[[argparse.Namespace, int], dict[str, int]],
              **build: bool) -> Run:
    """A trainer's ``Run`` as ``training.start_run`` + ``Run.load_models`` leave it, in this process and without
    files, memory plan, VAE or reward (flags validated for the data-parallel size, device defaults resolved, the policy
    by ``build_policy(**build)``, optimizer, a 10-step LR schedule): for tests that call an ``update_policy`` directly;
    the caller sets ``vae`` / ``geometry`` / ``reward_fn`` as it needs them."""
    from fastvideo import devices, distributed, launch, parallel, policy, training
    from fastvideo.seeding import NoiseSource

    dist = distributed.set_sequence_parallel(args.sp_size)
    counts = launch.with_sp_counts(validate(args, dist.dp_size), dist.sp_size)
    launch.resolve_device_defaults(args, dist.device.type)
    run = training.Run(args=args, dist=dist, counts=counts, config={}, resume_dir=None,
                       noise=NoiseSource(args.seed, device=args.noise_device),
                       amp_dtype=devices.compute_dtype(args.mixed_precision, dist.device))
    run.policy = policy.build_policy(args, dist.device, **build)
    run.sync_every_backward = parallel.resolve_gradient_sync(args.gradient_sync, run.policy.is_lora) == "backward"
    run.optimizer = policy.build_optimizer(run.policy, args)
    run.lr_scheduler = policy.build_lr_scheduler(run.optimizer, args, 10)
    return run


def child_pids(pid: int) -> list[int]:
    """Process ids whose parent is ``pid`` (Linux /proc): torchrun's ranks, to signal them as Slurm would."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            found.append(int(stat.parent.name))
    return found


def stop_with_sigterm(args: list[str], out: Path, max_steps: int, target: str = "ranks", nproc: int = 2) -> int:
    """Run ``torchrun args`` (``out``: its --output_dir, ``max_steps``: its --max_train_steps), SIGTERM every rank (as
    Slurm does) or, ``target`` "torchrun", torchrun (which forwards it) once step 1 is logged, and check the stop the
    README promises: exit 0 (1 when torchrun was signalled), one checkpoint message, a checkpoint of the step it
    stopped after, that many metrics rows, no export; returns that step (2 or more: step 1 was already logged)."""
    import signal
    import tempfile
    import time

    from fastvideo.checkpoint import checkpoint_step
    from fastvideo.logging import read_metrics

    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_addr", "127.0.0.1",
           "--master_port", str(free_port()), *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "120"}
    metrics = out / "metrics.jsonl"
    with tempfile.TemporaryFile("w+") as log:  # a file, not a pipe: a full pipe would block the ranks while we wait
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, text=True)
        try:
            deadline = time.monotonic() + 600
            while not metrics.is_file() or not metrics.read_text().strip():
                assert proc.poll() is None and time.monotonic() < deadline, "no step logged"
                time.sleep(0.05)
            ranks = child_pids(proc.pid)  # step 1 is logged: the ranks are in step 2 (or later on a slow machine)
            assert len(ranks) == nproc, ranks
            for pid in ranks if target == "ranks" else [proc.pid]:
                os.kill(pid, signal.SIGTERM)
            proc.wait(timeout=300)
        finally:
            proc.kill()
            log.seek(0)
            output = log.read()
    assert proc.returncode == (0 if target == "ranks" else 1), output[-3000:]
    stopped = max(checkpoint_step(p) for p in (out / "checkpoints").iterdir())
    assert 2 <= stopped < max_steps, output[-3000:]
    assert output.count(f"SIGTERM: stopped after step {stopped} of {max_steps}; checkpoint") == 1, output[-3000:]
    assert not (out / "final").exists()
    assert len(read_metrics(metrics)) == stopped
    return stopped


def assert_sigterm_resume_matches(args: list[str], straight: Path, out: Path, max_steps: int, target: str = "ranks",
                                  nproc: int = 2) -> None:
    """``stop_with_sigterm`` a run of ``args`` (writing to ``out``), continue it with --resume_from latest, and check
    that it ends exactly like ``straight``, the same run uninterrupted: same metrics, and an export."""
    stop_with_sigterm(args, out, max_steps, target, nproc)
    run_torchrun([*args, "--resume_from", "latest"], nproc=nproc)
    assert_same_metrics(straight, out)
    assert (out / "final").is_dir()


def assert_resume_matches(straight: Path, out: Path, step: int, args: list[str], nproc: int = 2) -> None:
    """Copy the finished run ``straight`` to ``out`` as if it had stopped after ``step`` (no later checkpoint, no
    export), continue it with ``torchrun args --resume_from latest`` (``args`` writing to ``out``) and check that it
    logs the same metrics as ``straight``: a resume test at the cost of the steps after ``step`` only."""
    cut_back(straight, out, step)
    run_torchrun([*args, "--resume_from", "latest"], nproc=nproc)
    assert_same_metrics(straight, out)


def cut_back(straight: Path, out: Path, step: int) -> None:
    """Copy the finished run ``straight`` to ``out`` as if it had stopped after ``step``: its later checkpoints and
    its export removed (what a resume test continues from)."""
    import shutil

    from fastvideo.checkpoint import checkpoint_step

    shutil.copytree(straight, out)
    for path in (out / "checkpoints").iterdir():
        if checkpoint_step(path) > step:
            shutil.rmtree(path)
    shutil.rmtree(out / "final")


def comparable(row: dict) -> dict:
    """A metrics row without its timing and memory keys: what two runs of the same computation must agree on."""
    return {k: v for k, v in row.items() if not k.startswith(TIMING_KEYS)}


def assert_same_metrics(straight: Path, resumed: Path) -> None:
    """The run in folder ``resumed`` logged the same steps and values as ``straight`` (the LR column included), timings
    aside: the check that a resumed run continued exactly."""
    from fastvideo.logging import read_metrics

    a, b = read_metrics(straight / "metrics.jsonl"), read_metrics(resumed / "metrics.jsonl")
    assert [r["step"] for r in b] == [r["step"] for r in a], ([r["step"] for r in a], [r["step"] for r in b])
    for x, y in zip(map(comparable, a), map(comparable, b)):
        diff = {k: (x.get(k), y.get(k)) for k in x.keys() | y.keys() if x.get(k) != y.get(k)}
        assert not diff, f"step {x['step']}: (straight, resumed) differ in {diff}"
