"""docs/design.md principle 9 on a pretend-CUDA trace (tests/fake_cuda.py): each trainer's hot path at world size
8, bf16 mixed precision on device ``cuda``, traced on fake tensors in one CPU process (run once per module, in its own
process so that nothing of the trace leaks into the rest of the suite), then checked (``fake_cuda.CHECKS``): no
CPU/CUDA mixing, one dtype (bf16) into attention, host syncs only at ``fake_cuda.ALLOWED_SYNCS`` and within the
per-step budgets of the sampling and replay loops, no pageable or blocking host-to-device copy inside those loops.

``python tests/fake_cuda.py`` prints every finding of the same trace.
"""
from __future__ import annotations

import concurrent.futures
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import fake_cuda

HARNESS = Path(fake_cuda.__file__)


def _trace(model: Path, hps_flags: tuple[str, ...], work: Path, *extra: str) -> dict:
    """The harness's report (``fake_cuda.Report`` as JSON) for ``model``, from one run in a subprocess."""
    flag = dict(zip(hps_flags[::2], hps_flags[1::2]))
    out = work / "report.json"
    cmd = [sys.executable, str(HARNESS), "--model", str(model), "--hps_checkpoint", flag["--hps_checkpoint"],
           "--hps_model", flag["--hps_model"], "--work", str(work), "--json", str(out), *extra]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, cwd=fake_cuda.REPO)
    if not out.is_file():
        raise AssertionError(f"the pretend-CUDA trace crashed ({proc.returncode}):\n{proc.stdout[-4000:]}\n"
                             f"{proc.stderr[-6000:]}")
    return json.loads(out.read_text())


# Every other family in the default tier (~17 s each, one process per family, two at a time): the FLUX.1 trace covers
# the family-free code (rollout, replay, update, checkpoint, SP, --reward_overlap, the GRPO-Guard / Flow-DPPO / AWM
# updates); these trace each family's own velocity call, encoders' row shapes and VAE in GRPO's rollout and replay,
# DPO's and NFT's update, each with LoRA and as a full fine-tune. FLUX.2-dev is its guidance-embedding path (the family's default --guidance_scale
# 4.0 goes in); Qwen-Image's text masks are padded (row r keeps L - 1 - r tokens); Wan samples 5-frame videos,
# rewarded over frames, and adds its SP 2 path; FLUX.1-Kontext edits (its source tokens in every forward, the CFG
# halves sharing them, the sources handed to the reward) and so does Qwen-Image-Edit (its VLM rows seeing the source).
# Sequence parallelism is FLUX.1's, Wan's and FLUX.1-Kontext's (its SP 2 path over the target + source tokens; the
# other families refuse --sp_size > 1 before loading: test_sequence_parallel.py). Qwen-Image-Edit-2509's family
# (qwen-image-edit-plus) differs from Qwen-Image-Edit's only in preprocessing (the VLM's text and image size) and in
# the number of source grids in img_shapes: its rollout and replay are the traced ones.
FAMILY_PRESETS = ("sd3-tiny", "qwen-image-tiny", "flux2-tiny", "flux2-dev-tiny", "wan-tiny", "wan22-ti2v-tiny",
                  "wan22-a14b-tiny", "flux-kontext-tiny", "qwen-image-edit-tiny")
# a family's own trace flags: Wan's 5-frame videos (rewarded over frames) and its SP 2 path over the video tokens
# (Wan2.2-TI2V's: its per-token timesteps split with the tokens)
FAMILY_EXTRA = {preset: ("--extra", "--num_frames 5", "--sp_size", "2")
                for preset in ("wan-tiny", "wan22-ti2v-tiny", "wan22-a14b-tiny")}
# The edit families (FLUX.1-Kontext, Qwen-Image-Edit): GRPO's rollout and replay (the source tokens in every forward,
# the CFG halves sharing them, Qwen-Image-Edit's negative rows per source, the sources reaching the reward); DPO's and
# NFT's updates are their base families' calls with the same velocity, traced above
EDIT_PRESETS = ("flux-kontext-tiny", "qwen-image-edit-tiny")
FAMILY_EXTRA.update({preset: ("--objectives", "grpo") for preset in EDIT_PRESETS})
FAMILY_EXTRA["flux-kontext-tiny"] += ("--sp_size", "2")
FAMILY_OBJECTIVES = {preset: ("grpo",) for preset in EDIT_PRESETS}
# LoRA with true CFG (the doubled guided forward in every loop), the full fine-tune CFG-free
VARIANT_FLAGS = {"lora": "--cfg_scale 4.5", "full": "--cfg_scale 1"}


@pytest.fixture(scope="module")
def traces(tiny_flux_dir: Path, hps_flags: tuple[str, ...], tiny_preset, tmp_path_factory
           ) -> dict[str, concurrent.futures.Future]:
    """Every trace of this module, two at a time: each is one single-threaded Python process (fake tensors compute
    nothing), so two share the 2 cores without slowing each other (~55 s for the eight; six took ~100 s one after
    another). FLUX.1's: every objective x variant and the SP path; every other family's (its tiny preset): GRPO, DPO
    and NFT with LoRA and true CFG 4.5, and as a CFG-free full fine-tune; no SP or overlap path (Wan: its SP 2 path).
    A family's failure fails only its tests."""
    def flux() -> dict:
        return _trace(tiny_flux_dir, hps_flags, tmp_path_factory.mktemp("fake-cuda"))

    def family(preset: str) -> dict:
        work = tmp_path_factory.mktemp(f"fake-cuda-{preset}")
        model = tiny_preset(preset)  # the session's folder (read only: the trace writes into work)
        variant_flags = [x for v, f in VARIANT_FLAGS.items() for x in ("--variant_extra", f"{v}={f}")]
        report = _trace(model, hps_flags, work, "--sp_size", "1", "--no_overlap", "--objectives", "grpo,dpo,nft",
                        "--variants", "lora,full", *variant_flags, *FAMILY_EXTRA.get(preset, ()))
        return {**report, "preset": preset}

    pool = concurrent.futures.ThreadPoolExecutor(max_workers=2)
    # the longest first (FLUX.1's ~23 s, Wan's ~19 s), so the two workers end together
    futures = {"flux": pool.submit(flux)}
    futures |= {preset: pool.submit(family, preset)
                for preset in sorted(FAMILY_PRESETS, key=lambda p: not p.startswith("wan"))}
    yield futures
    pool.shutdown(cancel_futures=True)


@pytest.fixture(scope="module")
def report(traces) -> dict:
    """FLUX.1's trace: every objective x variant and the SP path."""
    return traces["flux"].result()


@pytest.fixture(scope="module", params=FAMILY_PRESETS)
def family_report(request, traces) -> dict:
    """Another family's trace (its tiny preset)."""
    return traces[request.param].result()


@pytest.mark.parametrize("check", list(fake_cuda.CHECKS))
def test_pretend_cuda_trace(report: dict, check: str) -> None:
    """One check of ``fake_cuda.CHECKS`` holds on the trace (the message lists every violation with its site)."""
    bad = fake_cuda.violations(report)[check]
    if bad:
        pytest.fail(f"{fake_cuda.CHECKS[check]}: {len(bad)} violation(s)\n" + "\n".join(bad), pytrace=False)


def test_trace_covers_every_path(report: dict) -> None:
    """Every objective x variant ran build, rollout, reward, update and checkpoint, GRPO with --reward_overlap too
    (its micro-batches scored on the scorer's thread while the rollout ran), and the SP path its forwards: a check
    cannot pass by skipping a path."""
    expected = {f"{o}/{v}/{phase}" for o in ("grpo", "dpo", "nft") for v in fake_cuda.VARIANTS
                for phase in ("build", "rollout", "reward", "update", "checkpoint")}
    expected |= {f"{o}/lora/{phase}" for o in ("grpo_guard", "grpo_dppo", "awm")
                 for phase in ("build", "rollout", "reward", "update", "checkpoint")}
    expected |= {f"overlap/grpo/lora/{phase}" for phase in ("build", "rollout", "reward", "update", "checkpoint")}
    expected |= {"sp2/grpo/lora/build", "sp2/grpo/lora/rollout"}
    assert expected <= set(report["paths"]), sorted(expected - set(report["paths"]))
    # --reward_overlap: the rollout's two micro-batches were scored on the scorer's worker thread, during the rollout
    assert report["scorer_threads"] == {"fastvideo-reward_0": 2}, report["scorer_threads"]
    reward_call = "fastvideo/rewards/__init__.py:RewardFn._entries"  # where each component's scores come to the CPU
    scored = {f["path"] for f in report["findings"] if f["site_key"] == reward_call}
    assert "overlap/grpo/lora/rollout" in scored and "overlap/grpo/lora/reward" not in scored, scored
    loops = {f["iteration"].split("[")[0] for f in report["attention"] if f["iteration"]}
    assert {"sampling_step", "replay_step", "dpo_update_step", "nft_update_step"} <= loops, loops
    sp = [a for a in report["attention"] if a["path"].startswith("sp2/")]
    assert sp, "no attention call in the sequence-parallel forward"


def test_harness_sees_what_it_must() -> None:
    """The recorder itself: a float32 q/k beside a bf16 v, and in each step of a toy sampling loop a host sync, a
    pageable copy and CPU indices into a CUDA tensor are found, a pinned non-blocking copy is not (in-process;
    ``pretend_cuda`` restores everything afterwards)."""
    import torch
    import torch.distributed as dist

    from fastvideo import distributed

    before = (distributed._INFO, torch.cuda.is_available(), dist.is_initialized())

    def toy_sampling_loop(x: torch.Tensor) -> None:
        for i in range(2):
            float(x.sum())  # a host sync in each step
            x = x + torch.tensor(0.5, device="cuda")  # a pageable, blocking host->device copy
            x = x + torch.ones(3).pin_memory().to("cuda", non_blocking=True)  # fine: pinned and non-blocking
            x = x + x[torch.tensor([0, 1, 2])]  # CPU indices into a CUDA tensor: device mixing

    loop = fake_cuda.LoopSpec("sampling_step", toy_sampling_loop, "float", 1)
    with fake_cuda.pretend_cuda(loops=[loop]) as rec:
        assert distributed.info().world_size == 8 and distributed.info().device == torch.device("cuda", 0)
        from diffusers.models import attention_dispatch

        with torch.autocast("cuda", torch.bfloat16):  # CUDA autocast runs rms_norm in float32: q is float32
            q = torch.nn.RMSNorm(16, device="cuda")(torch.randn(1, 2, 4, 16, device="cuda", dtype=torch.bfloat16))
            v = torch.randn(1, 2, 4, 16, device="cuda", dtype=torch.bfloat16)
            attention_dispatch.dispatch_attention_fn(q, q, v)
        toy_sampling_loop(torch.zeros(3, device="cuda"))
    assert (distributed._INFO, torch.cuda.is_available(), dist.is_initialized()) == before
    assert {(a.q, a.v) for a in rec.attention} == {("torch.float32", "torch.bfloat16")}
    found = {(f.kind, f.op, f.iteration) for f in rec.findings if f.iteration}
    assert found == {(kind, op, f"sampling_step[i={i}]") for i in (0, 1) for kind, op in (
        ("sync", "_local_scalar_dense"), ("answered", "_local_scalar_dense"), ("h2d", "_to_copy"), ("mix", "index"))}


@pytest.mark.parametrize("check", list(fake_cuda.CHECKS))
def test_family_pretend_cuda_trace(family_report: dict, check: str) -> None:
    """SD3.5, Qwen-Image and FLUX.2 on the same checks (it found Qwen-Image's host-to-device copies in every
    forward of diffusers' transformer, removed by the adapter's ``prepare_for_device``)."""
    bad = fake_cuda.violations(family_report)[check]
    if bad:
        pytest.fail(f"{fake_cuda.CHECKS[check]}: {len(bad)} violation(s)\n" + "\n".join(bad), pytrace=False)


def test_family_trace_covers_every_objective(family_report: dict) -> None:
    """GRPO's, DPO's and NFT's (FLUX.1-Kontext: GRPO's) LoRA (CFG) and full (CFG-free) paths ran every phase, and
    attention ran inside every budgeted loop."""
    objectives = FAMILY_OBJECTIVES.get(family_report["preset"], ("grpo", "dpo", "nft"))
    expected = {f"{o}/{v}/{phase}" for o in objectives for v in ("lora", "full")
                for phase in ("build", "rollout", "reward", "update", "checkpoint")}
    assert expected <= set(family_report["paths"]), sorted(expected - set(family_report["paths"]))
    loops = {f["iteration"].split("[")[0] for f in family_report["attention"] if f["iteration"]}
    budgeted = {"grpo": {"sampling_step", "replay_step"}, "dpo": {"dpo_update_step"}, "nft": {"nft_update_step"}}
    assert set().union(*(budgeted[o] for o in objectives)) <= loops, loops
    if family_report["preset"] in EDIT_PRESETS:  # each rank's edit sources reached the reward on the device
        watch = "fastvideo/rewards/__init__.py:source_distance"
        scored = {f["path"].split("/")[0] for f in family_report["findings"] if f["site_key"] == watch}
        assert scored == {"grpo"}, scored
    if "--sp_size" in FAMILY_EXTRA.get(family_report["preset"], ()):  # Wan: its SP 2 forward over the video tokens
        assert {"sp2/grpo/lora/build", "sp2/grpo/lora/rollout"} <= set(family_report["paths"])
        assert [a for a in family_report["attention"] if a["path"].startswith("sp2/")], "no attention under SP 2"
