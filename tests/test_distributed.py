"""distributed.py: world-size-1 behaviour in process, collectives under torchrun (2 ranks, gloo)."""
from __future__ import annotations

import re
import textwrap

import pytest
import torch

from helpers import run_torchrun

from fastvideo import distributed as D


def test_world_size_one_is_the_identity():
    info = D.init_distributed("cpu")
    assert (info.rank, info.world_size, info.device.type, info.backend) == (0, 1, "cpu", "gloo")
    t = torch.arange(3)
    assert torch.equal(D.all_gather_tensor(t), t)
    assert D.all_gather_object({"a": 1}) == [{"a": 1}]
    assert D.broadcast_object("x") == "x"
    assert D.is_main_process() and D.get_world_size() == 1
    D.cleanup()


def test_device_override_errors_name_the_fix(monkeypatch):
    """Both sides of each availability check, whatever this host has: CUDA / torch_npu availability is patched."""
    with pytest.raises(ValueError, match="--device"):
        D.pick_device_type("tpu")
    monkeypatch.setattr(D, "npu_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match="--device cpu"):
        D.pick_device_type("cuda")
    with pytest.raises(ValueError, match="torch_npu is not installed"):
        D.pick_device_type("npu:0")
    assert D.pick_device_type(None) == "cpu"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert D.pick_device_type("cuda:1") == "cuda" and D.pick_device_type(None) == "cuda"
    assert D.pick_device_type("cpu") == "cpu"


def test_collectives_on_two_ranks(tmp_path):
    script = tmp_path / "collectives.py"
    script.write_text(textwrap.dedent("""
        import torch
        from fastvideo import distributed as D
        info = D.init_distributed("cpu")
        assert info.world_size == 2 and info.backend == "gloo"
        r = info.rank
        # uneven sizes per rank: rank 0 has 1 row, rank 1 has 3
        local = torch.full((1 + 2 * r, 2), float(r))
        out = D.all_gather_tensor(local)
        assert out.shape == (4, 2) and out[0].eq(0).all() and out[1:].eq(1).all(), out
        assert D.all_gather_object(("rank", r)) == [("rank", 0), ("rank", 1)]
        assert D.broadcast_object(r * 10 + 7) == 7
        assert D.all_reduce_sum(torch.tensor(float(r + 1))).item() == 3.0
        assert D.all_reduce_max(r) == 1
        D.barrier()
        D.cleanup()
        print("ok", r)
    """))
    proc = run_torchrun([str(script)], nproc=2, timeout=120)
    assert proc.stdout.count("ok") == 2


def test_an_error_on_one_rank_ends_every_rank_with_its_message(tmp_path):
    """Rank 1 raises while rank 0 waits (as in a collective that never notices a dead peer, NCCL's case): both
    ranks end, non-zero, and rank 0 reports rank 1's error. Rank 0's wait (600 s) outlasts the job's timeout (100 s),
    so the job ends only if rank 0 is stopped, and its "stopping: rank 1 failed" line shows that its own watchdog
    did it; the time from rank 1's error to the job's end is seconds (timed from rank 1's clock, so the launch, whose
    length depends on the host's load, is not counted)."""
    import subprocess
    import sys
    import time

    from helpers import REPO, free_port

    script = tmp_path / "fail.py"
    script.write_text(textwrap.dedent("""
        import time
        from fastvideo import distributed as D
        info = D.init_distributed("cpu")
        with D.fail_fast(poll_seconds=0.2):
            D.barrier()
            if info.rank == 1:
                print("raising at", time.time(), flush=True)
                raise ValueError("non-finite reward on rank 1 (test)")
            time.sleep(600)  # rank 0: stuck, like a rank blocked in an NCCL collective
        print("unreachable", info.rank)
    """))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
           "--master_port", str(free_port()), str(script)]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=100,
                          env={**__import__("os").environ, "OMP_NUM_THREADS": "1"})
    ended = time.time()
    assert proc.returncode != 0 and "unreachable" not in proc.stdout
    raised = float(re.search(r"raising at (\S+)", proc.stdout).group(1))
    assert ended - raised < 30, ended - raised  # measured ~2 s (fail_fast polls every 0.2 s)
    assert "[rank 1] rank 1 failed: ValueError: non-finite reward on rank 1 (test)" in proc.stderr
    assert "[rank 0] stopping: rank 1 failed: ValueError: non-finite reward on rank 1 (test)" in proc.stderr


def test_local_rank_beyond_the_visible_devices_names_the_fix(monkeypatch):
    """torchrun --nproc_per_node 5 on 4 visible GPUs: a ValueError naming CUDA_VISIBLE_DEVICES and --nproc_per_node,
    raised before set_device (which would fail with "invalid device ordinal"); NPUs name ASCEND_RT_VISIBLE_DEVICES."""
    import types

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: pytest.fail("set_device before the check"))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3")
    monkeypatch.setenv("LOCAL_RANK", "4")
    monkeypatch.setattr(D, "_INFO", None)
    expected = ("LOCAL_RANK 4 but only 4 CUDA devices are visible (CUDA_VISIBLE_DEVICES=0,1,2,3): launch at most 4 "
                "processes per node with torchrun --nproc_per_node, or make more devices visible")
    with pytest.raises(ValueError) as err:
        D.init_distributed("cuda")
    assert str(err.value) == expected
    D.check_local_rank("cuda", 3)  # the last visible device is fine
    monkeypatch.setattr(torch, "npu", types.SimpleNamespace(device_count=lambda: 1), raising=False)
    monkeypatch.delenv("ASCEND_RT_VISIBLE_DEVICES", raising=False)
    with pytest.raises(ValueError, match=r"LOCAL_RANK 1 but only 1 NPU device is visible \(ASCEND_RT_VISIBLE_DEVICES "
                                         r"is not set\): launch at most 1 process per node"):
        D.check_local_rank("npu", 1)
    with pytest.raises(ValueError, match="--dist_timeout_minutes must be > 0"):
        D.init_distributed("cpu", timeout_minutes=0)


# slow for the default suite's time (each waits out a collective timeout): the store wait itself runs at every export
# and checkpoint of the default trainer tests (e.g. test_train_grpo.py::test_short_run_writes_every_metric)
@pytest.mark.slow(cover="test_train_grpo.py::test_short_run_writes_every_metric", cost_s=15)
@pytest.mark.parametrize("mode", ["store", "collective", "disk_full"])
def test_rank0_file_work_outlasting_the_collective_timeout(tiny_flux_dir, tmp_path, mode):
    """2 ranks with a 4 s collective timeout; rank 0's final export (bf16), a checkpoint deletion and a re-saved
    step's swap each take 7 s. store: the job succeeds (the others wait in the TCP store), and the policy and the
    frozen reference share one DeviceMesh. collective: the barrier the code had there times out. disk_full: rank 0's
    export error ends both ranks with its message (fail_fast), not with a timeout."""
    from helpers import REPO

    args = [str(REPO / "tests" / "dist_scripts" / "cluster_checks.py"), str(tiny_flux_dir), str(tmp_path / "out"),
            "4", "7", mode]
    if mode == "store":
        proc = run_torchrun(args, timeout=300)
        assert proc.stdout.count("cluster ok") == 2, proc.stdout[-3000:]
        return
    with pytest.raises(AssertionError, match="torchrun failed") as failed:
        run_torchrun(args, timeout=300)
    if mode == "collective":
        assert "Timed out waiting 4000ms" in str(failed.value)
    else:
        assert str(failed.value).count("rank 0 failed: OSError: [Errno 28] No space left on device (test)") >= 2
        assert "Timed out" not in str(failed.value)
