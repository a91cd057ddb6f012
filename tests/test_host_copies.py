"""The helpers that keep host syncs out of the hot loops: ``devices.to_device`` (pinned, non-blocking copies) and
``training.to_host`` (a step's metrics in one device->host copy). Their use on CUDA is traced in test_fake_cuda.py."""
from __future__ import annotations

from unittest import mock

import torch

from fastvideo import devices, training


def test_to_device_keeps_tensors_already_there():
    t = torch.arange(4)
    assert devices.to_device(t, "cpu") is t and devices.to_device(t, torch.device("cpu")) is t


def test_to_device_pins_and_copies_without_blocking_for_accelerators():
    t = torch.arange(4.0)
    pinned = mock.MagicMock(name="pinned")
    with mock.patch.object(torch.Tensor, "pin_memory", return_value=pinned) as pin:
        out = devices.to_device(t, "cuda:0")
    pin.assert_called_once_with()
    pinned.to.assert_called_once_with(torch.device("cuda:0"), non_blocking=True)
    assert out is pinned.to.return_value


def test_to_host_is_one_copy_and_keeps_values_and_shapes():
    values = {"ratio": torch.tensor([1.0, 0.5, 2.0]), "loss": [torch.tensor(0.25), torch.tensor(-1.5)],
              "table": torch.arange(6, dtype=torch.float64).view(2, 3), "kl": []}
    calls = []
    real_cpu = torch.Tensor.cpu

    def counting_cpu(self, *args, **kwargs):
        calls.append(tuple(self.shape))
        return real_cpu(self, *args, **kwargs)

    with mock.patch.object(torch.Tensor, "cpu", counting_cpu):
        host = training.to_host(values)
    assert calls == [(11,)]  # one copy of the 3 + 2 + 6 values
    assert set(host) == {"ratio", "loss", "table"}  # an empty list is left out
    assert torch.equal(host["ratio"], values["ratio"]) and torch.equal(host["loss"], torch.tensor([0.25, -1.5]))
    assert host["table"].shape == (2, 3) and host["table"].dtype == torch.float32
    assert torch.equal(host["table"], values["table"].float())
    assert training.to_host({}) == {}
