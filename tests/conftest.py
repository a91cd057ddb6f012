"""Shared fixtures: tiny model folders, the toy world and other costly inputs are built once per test session."""
from __future__ import annotations

import os
import re
import sys
from pathlib import Path
from typing import Callable, TypeVar

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))  # tests/helpers.py
from suite_rules import (pytest_addoption, pytest_collection_modifyitems, pytest_configure,  # noqa: E402,F401
                         pytest_collectreport, pytest_runtest_makereport, pytest_runtest_protocol,
                         pytest_sessionfinish, pytest_terminal_summary)  # tiers, covers, shards, timeouts, skips, costs
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
T = TypeVar("T")


@pytest.fixture(scope="session")
def built_once(tmp_path_factory) -> Callable[[str, Callable[[Path], T]], T]:
    """The session's cache of costly test inputs (model folders, stores, finished runs) that tests of several tiers
    or modules read: ``built_once(key, build)`` calls ``build(folder)`` with a new folder the first time ``key`` is
    asked for, and returns that result ever after. What it returns is read-only to tests: a test that writes takes a
    copy. (A module fixture would be built again for the slow tier's tests of the same module.)"""
    cache: dict[str, object] = {}

    def get(key: str, build: Callable[[Path], T]) -> T:
        if key not in cache:
            cache[key] = build(tmp_path_factory.mktemp(re.sub(r"\W+", "-", key)))
        return cache[key]

    return get


@pytest.fixture(scope="session")
def tiny_preset(built_once) -> Callable[..., Path]:
    """``tiny_preset(name, seed=0)``: the folder of ``fastvideo.tiny.build_preset(name, seed)``, built once per session
    (the builders are byte-identical for a seed, so every module may share it; read-only to tests)."""
    from fastvideo.tiny import build_preset

    def get(name: str, seed: int = 0) -> Path:
        return built_once(f"preset-{name}-{seed}", lambda root: build_preset(root / "model", name, seed))

    return get


@pytest.fixture(scope="session")
def tiny_flux_dir(tmp_path_factory) -> Path:
    """A `tiny` preset FLUX folder (seed 0), built once."""
    from fastvideo.tiny import build_tiny_flux

    return build_tiny_flux(tmp_path_factory.mktemp("tiny-flux") / "model", preset="tiny", seed=0)


@pytest.fixture(scope="session")
def tiny_data(tiny_flux_dir, tmp_path_factory) -> Path:
    """Embeddings of the first 16 prompts of assets/prompts.txt for `tiny_flux_dir` (32 T5 tokens): the manifest."""
    from helpers import make_embeddings

    return make_embeddings(tiny_flux_dir, tmp_path_factory.mktemp("tiny-emb"), 16, "--max_sequence_length", "32")


@pytest.fixture(scope="session")
def hps_flags(tmp_path_factory) -> tuple[str, ...]:
    """Trainer flags for the tiny HPS reward: smooth in the pixels, so runs that differ only in reduction order rank
    images alike."""
    from fastvideo.rewards.hpsv2 import TINY_CHECKPOINT, TINY_CONFIG, build_tiny_hps

    hps = build_tiny_hps(tmp_path_factory.mktemp("hps") / "hps-tiny", seed=0)
    return ("--reward", "hpsv2:1.0", "--hps_checkpoint", str(hps / TINY_CHECKPOINT), "--hps_model",
            str(hps / TINY_CONFIG))


@pytest.fixture(scope="session")
def shared_runs(tiny_flux_dir, tiny_data, hps_flags, tmp_path_factory) -> Callable[[str], Path]:
    """``shared_runs(key)``: the output folder of the trainer run a module declared with ``helpers.shared_run``. The
    first request for a run of N ranks makes every declared N-rank run not yet made, in one torchrun job (their
    order: as declared)."""
    from helpers import SHARED_RUNS, run_in_one_job

    inputs = {"model": tiny_flux_dir, "data": tiny_data, "hps": hps_flags}
    done: dict[str, Path] = {}

    def get(key: str) -> Path:
        if key not in done:
            nproc = SHARED_RUNS[key][0]
            root = tmp_path_factory.mktemp(f"shared-runs-{nproc}-ranks")
            batch = {k: root / k for k, (n, _) in SHARED_RUNS.items() if n == nproc and k not in done}
            runs = [SHARED_RUNS[k][1](inputs, out) for k, out in batch.items()]
            run_in_one_job([(r[0], r[1:]) for r in runs], root, nproc=nproc, timeout=300 + 120 * len(runs))
            done.update(batch)
        return done[key]

    return get


@pytest.fixture(scope="session")
def toy_world(tmp_path_factory) -> dict[str, Path]:
    """The one toy world of the test run, built once (~15 s) and read-only to tests: the toy-world FLUX built from
    the shipped weights, its prompt files, and embeddings (16 T5 tokens) of every training prompt, of the first 64
    held-out prompts (a seeded random subset) and of every held-out prompt: ``{"model", "prompts", "train",
    "heldout", "heldout_all"}`` paths (``prompts``: the folder of train.txt and heldout.txt)."""
    from helpers import make_embeddings

    from fastvideo.toyworld.scenes import write_prompt_files
    from fastvideo.toyworld.pretrain import build_from_shipped

    root = tmp_path_factory.mktemp("toyworld")
    model = build_from_shipped(root / "model")
    files = write_prompt_files(root / "prompts")
    out = {"model": model, "prompts": root / "prompts"}
    for split, source, n in (("train", "train", 100_000), ("heldout", "heldout", 64),
                             ("heldout_all", "heldout", 100_000)):
        (root / split).mkdir()
        out[split] = make_embeddings(model, root / split, n, "--max_sequence_length", "16", prompt_file=files[source])
    return out

