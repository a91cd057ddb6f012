"""Checkpoints survive SIGKILL at any point of a save and a full disk, refuse damaged or foreign files, and load
without unpickling anything that could run code (issue #12)."""
from __future__ import annotations

import errno
import json
import os
import pickle
import random
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from fastvideo import checkpoint as ckpt
from fastvideo.checkpoint import (checkpoint_path, clean_interrupted_saves, latest_checkpoint, load_checkpoint,
                                  prune_checkpoints, read_meta, save_checkpoint)
from fastvideo.seeding import rng_state

from test_checkpoint import training_state, train_step, weights


def _saved_run(tmp_path: Path):
    """A model trained one step and checkpointed as step-1; returns (model, opt, sched, ema, step-1 path, weights)."""
    model, opt, sched, ema = training_state()
    train_step(model, opt, sched, ema, 0)
    good = save_checkpoint(checkpoint_path(tmp_path, 1), model=model, optimizer=opt, lr_scheduler=sched, ema=ema,
                           extra={"step": 1, "rng": rng_state()})
    return model, opt, sched, ema, good, weights(model)


def _killed_save(out: str, point: str, step: int) -> None:
    """(child process) save ``step`` and SIGKILL this process at ``point`` of the save."""
    import torch.distributed.checkpoint as dcp

    def die(*_args, **_kwargs):
        os.kill(os.getpid(), signal.SIGKILL)

    model, opt, sched, ema = training_state()
    train_step(model, opt, sched, ema, 0)
    train_step(model, opt, sched, ema, 1)
    if point == "model shards":
        dcp.save = die
    elif point == "ema shards":
        real = dcp.save
        dcp.save = lambda state, *a, **k: die() if "ema" in state else real(state, *a, **k)
    elif point == "trainer state":
        ckpt.write_trainer_state = die
    elif point == "meta.json":
        real_json = ckpt._write_json
        ckpt._write_json = lambda path, obj: die() if path.name == "meta.json" else real_json(path, obj)
    elif point in ("rename", "swap"):  # the first os.replace of the save (swap: of a re-saved step, old moved aside)
        real_replace = os.replace
        calls = []

        def replace(src, dst):
            calls.append(dst)
            if point == "rename" or len(calls) == 2:
                die()
            return real_replace(src, dst)

        ckpt.os.replace = replace
    save_checkpoint(checkpoint_path(out, step), model=model, optimizer=opt, lr_scheduler=sched, ema=ema,
                    extra={"step": step})
    os._exit(3)  # not killed: the patch missed


# one crash point in the default suite (a model shard), the other five slow (suite time, ~3.5 s each): the same save,
# killed at another of its writes
SLOW_POINT = pytest.mark.slow(
    cover="test_checkpoint_safety.py::test_sigkill_during_a_save_keeps_the_newest_complete_checkpoint[model shards]",
    cost_s=4)


@pytest.mark.parametrize("point", ["model shards", pytest.param("ema shards", marks=SLOW_POINT),
                                   pytest.param("trainer state", marks=SLOW_POINT),
                                   pytest.param("meta.json", marks=SLOW_POINT), pytest.param("rename", marks=SLOW_POINT),
                                   pytest.param("swap", marks=SLOW_POINT)])
def test_sigkill_during_a_save_keeps_the_newest_complete_checkpoint(tmp_path, point):
    model, opt, sched, ema, good, trained = _saved_run(tmp_path)
    step = 1 if point == "swap" else 2  # swap: re-saving the step that exists (its old copy is moved aside first)
    code = (f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); "
            f"from test_checkpoint_safety import _killed_save; _killed_save({str(tmp_path)!r}, {point!r}, {step})")
    child = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                           env={**os.environ, "OMP_NUM_THREADS": "1"})  # a fresh process: no inherited locks
    assert child.returncode == -signal.SIGKILL, f"the save was not killed at {point}: {child.stderr[-2000:]}"

    names = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert any(".tmp-" in n for n in names), names  # the killed save left its partial directory ...
    clean_interrupted_saves(tmp_path)  # ... which every start removes (or puts back, for a moved-aside step)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step-1"]
    assert latest_checkpoint(tmp_path) == good
    model2, opt2, sched2, ema2 = training_state(perturb=5)
    extra = load_checkpoint(good, model=model2, optimizer=opt2, lr_scheduler=sched2, ema=ema2)
    assert extra["step"] == 1
    assert all(torch.equal(weights(model2)[k], v) for k, v in trained.items())


def test_disk_full_before_writing_is_refused_with_the_bytes_needed(tmp_path, monkeypatch):
    model, opt, sched, ema, good, _ = _saved_run(tmp_path)
    usage = ckpt.shutil.disk_usage(tmp_path)
    monkeypatch.setattr(ckpt.shutil, "disk_usage", lambda path: usage._replace(free=1000))
    with pytest.raises(OSError, match=r"no space left for checkpoint .*step-2: it needs .*\(\d+ bytes\), 0.00 GiB "
                                      r"free.*--resume_from latest") as err:
        save_checkpoint(checkpoint_path(tmp_path, 2), model=model, optimizer=opt, ema=ema, extra={"step": 2})
    assert err.value.errno == errno.ENOSPC
    needed = int(str(err.value).split("(")[1].split(" bytes")[0])
    params = sum(p.numel() * 4 for p in model.parameters())
    estimate = (needed - 2**20) / 1.05  # the estimate, without the margin
    assert 4 * params <= estimate < 4 * params + 4096  # model + Adam's two moments + the EMA, in fp32 (+ step counts)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step-1"]
    assert latest_checkpoint(tmp_path) == good


@pytest.mark.parametrize("where", ["dcp", "trainer state"])
def test_disk_full_while_writing_removes_the_partial_save(tmp_path, monkeypatch, where):
    model, opt, sched, ema, good, _ = _saved_run(tmp_path)

    def no_space(*_args, **_kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    if where == "dcp":
        from torch.distributed.checkpoint import FileSystemWriter

        monkeypatch.setattr(FileSystemWriter, "write_data", no_space)
    else:
        monkeypatch.setattr(ckpt, "write_trainer_state", no_space)
    with pytest.raises(OSError, match=r"no space left for checkpoint .*step-2: it needs") as err:
        save_checkpoint(checkpoint_path(tmp_path, 2), model=model, optimizer=opt, ema=ema, extra={"step": 2})
    assert err.value.errno == errno.ENOSPC
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step-1"]
    assert latest_checkpoint(tmp_path) == good


def test_meta_records_every_file_and_a_damaged_checkpoint_is_refused(tmp_path):
    model, opt, sched, ema, good, _ = _saved_run(tmp_path)
    save_checkpoint(checkpoint_path(tmp_path, 2), model=model, optimizer=opt, lr_scheduler=sched, ema=ema,
                    extra={"step": 2}, manifest={"algorithm": "grpo", "config_fingerprint": "abc"})
    meta = read_meta(checkpoint_path(tmp_path, 2))
    assert meta["algorithm"] == "grpo" and meta["config_fingerprint"] == "abc" and meta["format_version"] == 2
    assert {"state/.metadata", "trainer_state_rank0.json", "trainer_state_rank0.safetensors"} <= set(meta["files"])
    assert not list(checkpoint_path(tmp_path, 2).glob("*.pt"))  # nothing pickled of ours
    shard = next(checkpoint_path(tmp_path, 2).glob("state/*.distcp"))
    shard.write_bytes(shard.read_bytes()[:100])  # truncated (e.g. copied off a full disk)
    with pytest.raises(ValueError, match=r"damaged: state/.*distcp is 100 bytes, \d+ expected; resume from an older"):
        read_meta(checkpoint_path(tmp_path, 2))
    with pytest.warns(UserWarning, match="skipping .*step-2"):
        assert latest_checkpoint(tmp_path) == good
    with pytest.raises(ValueError, match="damaged"):
        load_checkpoint(checkpoint_path(tmp_path, 2), model=model, optimizer=opt)


def test_prune_never_deletes_the_resumed_or_the_just_saved_checkpoint(tmp_path):
    root = tmp_path / "checkpoints"
    for step in (10, 20, 30, 40):
        (root / f"step-{step}").mkdir(parents=True)
        (root / f"step-{step}" / "meta.json").write_text("{}")
    removed = prune_checkpoints(tmp_path, 1, protect=(root / "step-20", root / "step-30"))
    assert sorted(p.name for p in removed) == ["step-10"]
    assert sorted(p.name for p in root.iterdir()) == ["step-20", "step-30", "step-40"]


def test_trainer_state_round_trips_without_pickle(tmp_path):
    random.seed(4)
    np.random.seed(4)
    state = {"rng": [rng_state()], "sampler": {"epoch": 2, "order": [3, 1, 2]}, "by_int": {1: (2.5, None)},
             "nan": float("nan"), "path": Path("/x"), "np_scalar": np.float32(0.5), "empty": np.zeros((0, 3))}
    ckpt.write_trainer_state(state, tmp_path / "trainer_state_rank0")
    back = ckpt.read_trainer_state(tmp_path / "trainer_state_rank0")
    py, npy, tt = back["rng"][0]["python"], back["rng"][0]["numpy"], back["rng"][0]["torch"]
    assert py == random.getstate() and isinstance(py, tuple)
    assert npy[0] == "MT19937" and np.array_equal(npy[1], np.random.get_state()[1]) and npy[1].dtype == np.uint32
    assert torch.equal(tt, torch.get_rng_state())
    random.setstate(py)
    np.random.set_state(npy)  # accepted by NumPy as is
    assert back["sampler"] == state["sampler"] and back["by_int"] == {1: (2.5, None)}
    assert np.isnan(back["nan"]) and back["path"] == "/x" and back["np_scalar"] == 0.5
    assert back["empty"].shape == (0, 3)
    with pytest.raises(TypeError, match=r"trainer_state.bad is a object"):
        ckpt.write_trainer_state({"bad": object()}, tmp_path / "x")


def test_format_one_trainer_state_loads_with_weights_only(tmp_path):
    legacy = {"extra": {"step": 3, "rng": [rng_state()]}, "lr_scheduler": None, "ema": None, "shadows": {}}
    torch.save(legacy, tmp_path / "trainer_state_rank0.pt")
    back = ckpt.read_trainer_state(tmp_path / "trainer_state_rank0")
    assert back["extra"]["step"] == 3 and np.array_equal(back["extra"]["rng"][0]["numpy"][1],
                                                         legacy["extra"]["rng"][0]["numpy"][1])
    torch.save({"extra": {"step": 3, "evil": Path("/x")}}, tmp_path / "evil.pt")  # a class outside NumPy
    with pytest.raises(ValueError, match="refusing"):
        ckpt.read_trainer_state(tmp_path / "evil")


class _Exploit:
    def __reduce__(self):
        return (os.system, ("touch EXPLOITED",))


def test_a_malicious_dcp_metadata_or_entry_is_refused_without_running_it(tmp_path, monkeypatch):
    model, opt, sched, ema, good, _ = _saved_run(tmp_path)
    monkeypatch.chdir(tmp_path)
    metadata = good / "state" / ".metadata"
    original = metadata.read_bytes()
    metadata.write_bytes(pickle.dumps(_Exploit()))
    meta = json.loads((good / "meta.json").read_text())
    meta["files"]["state/.metadata"] = metadata.stat().st_size  # sizes alone would not catch a crafted file
    (good / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(ValueError, match=r"\.metadata is not a safe DCP metadata file .*posix.system"):
        load_checkpoint(good, model=model, optimizer=opt, lr_scheduler=sched, ema=ema)
    assert not (tmp_path / "EXPLOITED").exists()
    metadata.write_bytes(original)
    planner = ckpt._safe_load_planner()  # a DCP non-tensor entry carrying a pickled callable
    import io

    buf = io.BytesIO()
    torch.save(_Exploit(), buf)
    buf.seek(0)
    with pytest.raises(pickle.UnpicklingError):
        planner.load_bytes(None, buf)
    assert not (tmp_path / "EXPLOITED").exists()
