"""Gradient buckets of the differentiable broadcast (csrc/torchdp/autograd/buckets.cpp,
Note [Gradient buckets and reduction streams]): one backward node per bucket, taken from the end of
the parameter list, so that each bucket's reduce-add starts as soon as its gradients exist; the
results equal the single-bucket reduction and the plain module's gradients."""

from __future__ import annotations

import pytest
import torch
from dp_testing import (
    assert_gpu_bound_buckets_ordered,
    clone_module,
    cpu_devices,
    gradient_penalty,
)
from torch import nn

import torchdp


def _mlp(layers: int = 6, width: int = 32) -> nn.Sequential:
    torch.manual_seed(0)
    mods: list[nn.Module] = []
    for _ in range(layers):
        mods += [nn.Linear(width, width), nn.Tanh()]
    return nn.Sequential(*mods)


class Partly(nn.Module):
    """A module whose second layer takes no part in the forward."""

    def __init__(self) -> None:
        super().__init__()
        self.used = nn.Linear(4, 4)
        self.unused = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.used(x)


def _bucket_sizes(replica: nn.Module) -> list[int]:
    """Tensors per backward node, in parameter order (one entry per distinct node)."""
    sizes: list[int] = []
    seen: list[object] = []
    for m in replica.modules():
        for key in m._former_parameters:
            node = getattr(m, key).grad_fn
            assert node is not None and node.name() == "torchdp::BroadcastBackward"
            if not any(node is s for s in seen):
                seen.append(node)
                # Slots: one per tensor of the bucket and device.
                sizes.append(len(node.next_functions))
    return sizes


@pytest.mark.parametrize(
    "mib, expected",
    [
        (0, [12]),  # one bucket for everything
        (0.000001, [1] * 12),  # every tensor alone
        # Weights of 4096 bytes, biases of 128; 0.01 MiB = 10485 bytes. From the end: b5 w5 b4 w4
        # b3 (8576 bytes), then w3 b2 w2 b1 (8448), then w1 b0 w0; listed in parameter order.
        (0.01, [3, 4, 5]),
    ],
)
def test_buckets_are_cut_from_the_end(mib, expected):
    net = _mlp()
    r0, _ = torchdp.replicate(net, cpu_devices(2), bucket_cap_mb=mib)
    assert _bucket_sizes(r0) == expected


def test_a_bucket_reduces_as_soon_as_its_gradients_exist():
    # The last layer's bucket must run as soon as both replicas' last layers have their backward,
    # before the rest of the backward pass (its reduce-add overlaps it), not after all of the
    # device's work. On CPU every node shares one ready queue, which runs one replica's backward
    # (the later one's ops come first), then the other's: the bucket must run before the second
    # replica reaches its first layer.
    net = _mlp(layers=4, width=8)
    # Every tensor in a bucket of its own.
    replicas = torchdp.replicate(net, cpu_devices(2), bucket_cap_mb=0.000001)
    events: list[str] = []
    last_bias_node = replicas[0][-2].bias.grad_fn
    assert last_bias_node.name() == "torchdp::BroadcastBackward"
    last_bias_node.register_hook(lambda *_: events.append("last bucket"))
    loss = torch.zeros(())
    for i, replica in enumerate(replicas):
        x = torch.randn(3, 8, requires_grad=True)
        # The replica's input gets its gradient from the first layer's backward.
        x.register_hook(lambda g, i=i: events.append(f"input {i}"))
        loss = loss + replica(x).sum()
    loss.backward()
    assert events.index("last bucket") < max(events.index("input 0"), events.index("input 1")), (
        events
    )
    assert net[-2].bias.grad is not None


def test_default_buckets_hold_small_models_in_one_node():
    r0, _ = torchdp.replicate(_mlp(), cpu_devices(2))
    assert _bucket_sizes(r0) == [12]  # 6 x 4224 bytes < 1 MiB, the first bucket's cap


def test_first_bucket_is_small():
    # 256 KiB weights and 1 KiB biases: the 1 MiB first bucket takes the last three layers and the
    # bias before them (7 tensors), the 25 MiB second bucket the rest.
    net = _mlp(layers=6, width=256)
    r0, _ = torchdp.replicate(net, cpu_devices(2))
    assert _bucket_sizes(r0) == [5, 7]


@pytest.mark.parametrize("mib", [0, 0.000001, 0.01, 25])
@pytest.mark.parametrize("n", [2, 3])
def test_bucketed_gradients_equal_the_module(mib, n):
    net = _mlp()
    ref = clone_module(net)
    dp = torchdp.DataParallel(net, devices=cpu_devices(n), bucket_cap_mb=mib)
    x = torch.randn(7, 32)
    dp(x).pow(2).sum().backward()
    ref(x).pow(2).sum().backward()
    for (name, p), q in zip(net.named_parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6, msg=name)


def test_bucketed_double_backward():
    net = _mlp(layers=3, width=8)
    ref = clone_module(net)
    dp = torchdp.DataParallel(net, devices=cpu_devices(2), bucket_cap_mb=0.000001)

    x = torch.randn(6, 8)
    gradient_penalty(ref, x).backward()
    gradient_penalty(dp, x).backward()
    for p, q in zip(net.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6)


def test_unused_parameters_get_zero_gradients_in_every_bucket():
    net = Partly()
    dp = torchdp.DataParallel(net, devices=cpu_devices(2), bucket_cap_mb=0.000001)
    dp(torch.randn(4, 4)).sum().backward()
    assert net.used.weight.grad is not None and net.used.weight.grad.abs().sum() > 0
    torch.testing.assert_close(net.unused.weight.grad, torch.zeros(4, 4))


@pytest.mark.needs_cuda
@pytest.mark.parametrize("mib", [0, 0.001, 25])
def test_bucketed_reduction_on_cuda_side_streams(mib):
    # The same CUDA device twice: the reduction runs on its side stream while the backward of
    # the replicas is still queued on the default stream.
    dev = torch.device("cuda", 0)
    net = _mlp(layers=8, width=512).to(dev)
    ref = clone_module(net)
    dp = torchdp.DataParallel(net, devices=[dev, dev], bucket_cap_mb=mib)
    x = torch.randn(64, 512, device=dev)
    for _ in range(3):  # several steps: recycled memory must not be overwritten early
        net.zero_grad()
        ref.zero_grad()
        dp(x).pow(2).mean().backward()
        ref(x).pow(2).mean().backward()
        for p, q in zip(net.parameters(), ref.parameters(), strict=True):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5)


@pytest.mark.needs_cuda
@pytest.mark.parametrize("set_to_none", [False, True])
@pytest.mark.parametrize("bucket_cap_mb", [1, 25])
def test_bucketed_reduction_is_ordered_with_a_gpu_bound_backward(bucket_cap_mb, set_to_none):
    # Two replicas on one GPU (one side stream): see assert_gpu_bound_buckets_ordered.
    dev = torch.device("cuda", 0)
    assert_gpu_bound_buckets_ordered(
        [dev, dev], bucket_cap_mb=bucket_cap_mb, layers=3, set_to_none=set_to_none
    )


@pytest.mark.needs_cuda
@pytest.mark.parametrize("order", ["cuda_first", "cpu_first"])
def test_bucketed_reduction_over_mixed_device_types(order):
    # cpu and cuda in one device list: no side streams, the buckets reduce in order.
    torch.manual_seed(0)
    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    devices = [cuda, cpu] if order == "cuda_first" else [cpu, cuda]
    net = _mlp(layers=4, width=256).to(devices[0])
    eager = clone_module(net)
    dp = torchdp.DataParallel(net, devices=devices, bucket_cap_mb=0.5)
    for _ in range(2):
        x = torch.randn(32, 256, device=devices[0])
        for m in (net, eager):
            m.zero_grad(set_to_none=True)
        dp(x).pow(2).mean().backward()
        eager(x).pow(2).mean().backward()
        for p, q in zip(net.parameters(), eager.parameters(), strict=True):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6)


def test_bucket_cap_mb_option_sizes_the_buckets():
    net = _mlp()
    r0, _ = torchdp.replicate(net, cpu_devices(2), bucket_cap_mb=0.01)
    assert _bucket_sizes(r0) == [3, 4, 5]
    r0, _ = torchdp.replicate(net, cpu_devices(2))  # the default again
    assert _bucket_sizes(r0) == [12]
    ref = clone_module(net)
    dp = torchdp.DataParallel(net, devices=cpu_devices(2), bucket_cap_mb=0.000001)
    assert dp.bucket_cap_mb == 0.000001
    replicas = dp.replicate(net, dp.device_ids)
    assert _bucket_sizes(replicas[0]) == [1] * 12
    x = torch.randn(5, 32)
    dp(x).pow(2).sum().backward()
    ref(x).pow(2).sum().backward()
    for p, q in zip(net.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("bad", [-1, float("nan"), float("inf"), "25", True])
def test_bad_bucket_cap_mb_is_named(bad):
    with pytest.raises(ValueError, match="bucket_cap_mb must be a non-negative number of MiB"):
        torchdp.DataParallel(_mlp(), devices=cpu_devices(2), bucket_cap_mb=bad)
    with pytest.raises(ValueError, match="torchdp.replicate: bucket_cap_mb"):
        torchdp.replicate(_mlp(), cpu_devices(2), bucket_cap_mb=bad)
