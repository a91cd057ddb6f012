"""distributed.py: world-size-1 behaviour in process, collectives under torchrun (2 ranks, gloo)."""
from __future__ import annotations

import textwrap

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


def test_device_override_errors_name_the_fix():
    import pytest

    with pytest.raises(ValueError, match="--device"):
        D.pick_device_type("tpu")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="--device cpu"):
            D.pick_device_type("cuda")


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
