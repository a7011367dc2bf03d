"""Training features around the replicas: activation checkpointing inside replicas, frozen layers,
gradient accumulation across steps, inference_mode, and mixed precision with GradScaler."""

from __future__ import annotations

import pytest
import torch
from dp_testing import clone_module, cpu_devices
from torch import nn
from torch.utils.checkpoint import checkpoint

import torchdp


class CheckpointedNet(nn.Module):
    def __init__(self, reentrant: bool) -> None:
        super().__init__()
        self.a = nn.Linear(8, 16)
        self.b = nn.Linear(16, 16)
        self.frozen = nn.Linear(16, 16)
        self.frozen.requires_grad_(False)
        self.c = nn.Linear(16, 4)
        self.reentrant = reentrant

    def block(self, t: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.b(t))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.tanh(self.a(x))
        x = checkpoint(self.block, x, use_reentrant=self.reentrant)
        return self.c(self.frozen(x))


def _assert_grads_match(net: nn.Module, eager: nn.Module) -> None:
    for (name, p), q in zip(net.named_parameters(), eager.parameters(), strict=True):
        if q.grad is None:
            assert p.grad is None, name
        else:
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("reentrant", [False, True], ids=["non_reentrant", "reentrant"])
@pytest.mark.parametrize("bucket_cap_mb", [0, 0.0001], ids=["one_bucket", "small_buckets"])
def test_checkpointed_frozen_and_accumulated(reentrant, bucket_cap_mb):
    torch.manual_seed(0)
    net = CheckpointedNet(reentrant)
    eager = clone_module(net)
    dp = torchdp.DataParallel(net, devices=cpu_devices(3), bucket_cap_mb=bucket_cap_mb)
    for _step in range(3):  # no zero_grad: gradients accumulate over the steps
        x = torch.randn(7, 8)
        dp(x).pow(2).sum().backward()
        eager(x).pow(2).sum().backward()
        _assert_grads_match(net, eager)
    assert net.frozen.weight.grad is None and net.a.weight.grad is not None


def test_inference_mode_and_no_grad():
    net = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
    dp = torchdp.DataParallel(net, devices=cpu_devices(2))
    x = torch.randn(6, 8)
    expected = net(x).detach()
    with torch.inference_mode():
        out = dp(x)
    assert out.is_inference() and not out.requires_grad
    torch.testing.assert_close(out, expected)
    with torch.no_grad():
        out = dp(x)
    assert not out.requires_grad
    torch.testing.assert_close(out, expected)
    # The module still trains afterwards.
    dp(x).sum().backward()
    assert net[0].weight.grad is not None


@pytest.mark.needs_cuda
def test_autocast_float16_with_grad_scaler_on_one_gpu():
    # Two replicas on cuda:0: the scaler's unscale/inf checks see the summed gradients.
    torch.manual_seed(0)
    device = torch.device("cuda", 0)
    net = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 8)).to(device)
    eager = clone_module(net)
    dp = torchdp.DataParallel(net, devices=[device, device])
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.05) for m in (net, eager)]
    scalers = [torch.amp.GradScaler("cuda", init_scale=2.0**10) for _ in range(2)]
    for _ in range(3):
        x = torch.randn(16, 32, device=device)
        for model, opt, scaler in zip((dp, eager), optimizers, scalers, strict=True):
            opt.zero_grad(set_to_none=True)
            with torch.autocast("cuda", dtype=torch.float16):
                loss = model(x).float().pow(2).mean()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
    assert scalers[0].get_scale() == scalers[1].get_scale()
    for p, q in zip(net.parameters(), eager.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=2e-3, atol=2e-3)
