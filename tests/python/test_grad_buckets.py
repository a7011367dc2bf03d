"""Gradient buckets of the differentiable broadcast (csrc/torchdp/autograd.cpp, Note [Gradient
buckets and reduction streams]): one backward node per bucket, taken from the end of the
parameter list, so that each bucket's reduce-add starts as soon as its gradients exist; the
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

ENV = "TORCHDP_GRAD_BUCKET_MB"
DELIVERY = "TORCHDP_GRAD_DELIVERY"


@pytest.fixture(params=["join", "bucket"])
def delivery(request, monkeypatch):
    """Both ways of handing the sums to the parameters (Note [Delivering bucket sums directly])."""
    monkeypatch.setenv(DELIVERY, request.param)
    return request.param


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
        ("0", [12]),  # one bucket for everything
        ("0.000001", [1] * 12),  # every tensor alone
        # Weights of 4096 bytes, biases of 128; 0.01 MiB = 10485 bytes. From the end: b5 w5 b4 w4
        # b3 (8576 bytes), then w3 b2 w2 b1 (8448), then w1 b0 w0; listed in parameter order.
        ("0.01", [3, 4, 5]),
    ],
)
def test_buckets_are_cut_from_the_end(monkeypatch, mib, expected):
    monkeypatch.setenv(ENV, mib)
    net = _mlp()
    r0, _ = torchdp.replicate(net, cpu_devices(2))
    assert _bucket_sizes(r0) == expected


def test_a_bucket_reduces_as_soon_as_its_gradients_exist(monkeypatch, delivery):
    # The last layer's bucket must run as soon as both replicas' last layers have their backward,
    # before the rest of the backward pass (its reduce-add overlaps it), not after all of the
    # device's work. On CPU every node shares one ready queue, which runs one replica's backward
    # (the later one's ops come first), then the other's: the bucket must run before the second
    # replica reaches its first layer.
    monkeypatch.setenv(ENV, "0.000001")  # every tensor in a bucket of its own
    net = _mlp(layers=4, width=8)
    replicas = torchdp.replicate(net, cpu_devices(2))
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


def test_default_buckets_hold_small_models_in_one_node(monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    r0, _ = torchdp.replicate(_mlp(), cpu_devices(2))
    assert _bucket_sizes(r0) == [12]  # 6 x 4224 bytes < 1 MiB, the first bucket's cap


def test_first_bucket_is_small(monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    # 256 KiB weights and 1 KiB biases: the 1 MiB first bucket takes the last three layers and the
    # bias before them (7 tensors), the 25 MiB second bucket the rest.
    net = _mlp(layers=6, width=256)
    r0, _ = torchdp.replicate(net, cpu_devices(2))
    assert _bucket_sizes(r0) == [5, 7]


@pytest.mark.parametrize("mib", ["0", "0.000001", "0.01", "25"])
@pytest.mark.parametrize("n", [2, 3])
def test_bucketed_gradients_equal_the_module(monkeypatch, mib, n, delivery):
    monkeypatch.setenv(ENV, mib)
    net = _mlp()
    ref = clone_module(net)
    dp = torchdp.DataParallel(net, devices=cpu_devices(n))
    x = torch.randn(7, 32)
    dp(x).pow(2).sum().backward()
    ref(x).pow(2).sum().backward()
    for (name, p), q in zip(net.named_parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6, msg=name)


def test_bucketed_double_backward(monkeypatch, delivery):
    monkeypatch.setenv(ENV, "0.000001")
    net = _mlp(layers=3, width=8)
    ref = clone_module(net)
    dp = torchdp.DataParallel(net, devices=cpu_devices(2))

    x = torch.randn(6, 8)
    gradient_penalty(ref, x).backward()
    gradient_penalty(dp, x).backward()
    for p, q in zip(net.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6)


def test_unused_parameters_get_zero_gradients_in_every_bucket(monkeypatch, delivery):
    monkeypatch.setenv(ENV, "0.000001")

    net = Partly()
    torchdp.DataParallel(net, devices=cpu_devices(2))(torch.randn(4, 4)).sum().backward()
    assert net.used.weight.grad is not None and net.used.weight.grad.abs().sum() > 0
    torch.testing.assert_close(net.unused.weight.grad, torch.zeros(4, 4))


@pytest.mark.parametrize("bad", ["-1", "lots", "1e"])
def test_bad_bucket_size_is_named(monkeypatch, bad):
    monkeypatch.setenv(ENV, bad)
    with pytest.raises(RuntimeError, match="TORCHDP_GRAD_BUCKET_MB must be a non-negative number"):
        torchdp.replicate(_mlp(), cpu_devices(2))


@pytest.mark.needs_cuda
@pytest.mark.parametrize("mib", ["0", "0.001", "25"])
def test_bucketed_reduction_on_cuda_side_streams(monkeypatch, mib, delivery):
    # The same CUDA device twice: the reduction runs on its side stream while the backward of
    # the replicas is still queued on the default stream.
    monkeypatch.setenv(ENV, mib)
    dev = torch.device("cuda", 0)
    net = _mlp(layers=8, width=512).to(dev)
    ref = clone_module(net)
    dp = torchdp.DataParallel(net, devices=[dev, dev])
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
def test_bucketed_reduction_is_ordered_with_a_gpu_bound_backward(
    bucket_cap_mb, set_to_none, delivery
):
    # Two replicas on one GPU (one side stream): see assert_gpu_bound_buckets_ordered.
    dev = torch.device("cuda", 0)
    before = torchdp._C.deferred_gradient_sums()
    assert_gpu_bound_buckets_ordered(
        [dev, dev], bucket_cap_mb=bucket_cap_mb, layers=3, set_to_none=set_to_none
    )
    deferred = torchdp._C.deferred_gradient_sums() - before
    # Bucket delivery defers every bucket's wait when .grad was None (6 tensors x 3 attempts).
    assert deferred == (18 if delivery == "bucket" and set_to_none else 0)


@pytest.mark.needs_cuda
@pytest.mark.parametrize("order", ["cuda_first", "cpu_first"])
def test_bucketed_reduction_over_mixed_device_types(order, delivery):
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


def test_bucket_cap_mb_option_overrides_the_environment(monkeypatch):
    monkeypatch.setenv(ENV, "0")
    net = _mlp()
    r0, _ = torchdp.replicate(net, cpu_devices(2), bucket_cap_mb=0.01)
    assert _bucket_sizes(r0) == [3, 4, 5]
    r0, _ = torchdp.replicate(net, cpu_devices(2))  # the environment again
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


def _next_node_names(replica: nn.Module) -> set[str]:
    return {
        fn.name()
        for m in replica.modules()
        for key in m._former_parameters
        for fn, _ in getattr(m, key).grad_fn.next_functions
        if fn is not None
    }


def test_bucket_delivery_goes_straight_to_the_parameters(monkeypatch):
    monkeypatch.setenv(ENV, "0.000001")
    net = _mlp(layers=2, width=4)
    monkeypatch.setenv(DELIVERY, "join")
    r0, _ = torchdp.replicate(net, cpu_devices(2))
    assert _next_node_names(r0) == {"torchdp::BroadcastBackwardJoin"}
    monkeypatch.setenv(DELIVERY, "bucket")
    r0, _ = torchdp.replicate(net, cpu_devices(2))
    assert _next_node_names(r0) == {"torch::autograd::AccumulateGrad"}

    # Gradients reach .grad during the backward pass: the first layer's tensor hook sees the last
    # layer's gradient already accumulated (the last layer's bucket ran before).
    seen = []
    x = torch.randn(5, 4, requires_grad=True)
    out = torchdp.DataParallel(net, devices=cpu_devices(2))(x)
    x.register_hook(lambda g: seen.append(net[2].weight.grad is not None))
    out.sum().backward()
    assert seen == [True]


def test_bucket_delivery_keeps_the_join_for_non_leaf_sources(monkeypatch):
    monkeypatch.setenv(DELIVERY, "bucket")
    leaf = torch.randn(3, requires_grad=True)
    copies = torchdp._C.broadcast_coalesced([leaf * 2], cpu_devices(2), 10485760, True)
    nexts = {fn.name() for fn, _ in copies[1][0].grad_fn.next_functions if fn is not None}
    assert nexts == {"torchdp::BroadcastBackwardJoin"}
    copies[1][0].sum().backward()
    torch.testing.assert_close(leaf.grad, torch.full((3,), 2.0))


def test_bucket_delivery_over_several_passes_and_autograd_grad(monkeypatch):
    monkeypatch.setenv(ENV, "0.000001")

    x = torch.randn(6, 4)
    results = {}
    for mode in ("join", "bucket"):
        monkeypatch.setenv(DELIVERY, mode)
        torch.manual_seed(0)
        net = Partly()
        dp = torchdp.DataParallel(net, devices=cpu_devices(2))
        loss = dp(x).pow(2).sum()
        loss.backward(retain_graph=True)
        loss.backward()  # a second pass over the same graph accumulates again
        (g,) = torch.autograd.grad(dp(x).pow(2).sum(), [net.used.weight])
        results[mode] = (net.used.weight.grad.clone(), net.unused.weight.grad.clone(), g)
    for a, b in zip(results["join"], results["bucket"], strict=True):
        torch.testing.assert_close(a, b)
    torch.testing.assert_close(results["bucket"][1], torch.zeros(4, 4))


def test_bad_delivery_is_named(monkeypatch):
    monkeypatch.setenv(DELIVERY, "eager")
    with pytest.raises(RuntimeError, match="TORCHDP_GRAD_DELIVERY must be 'join'"):
        torchdp.replicate(_mlp(), cpu_devices(2))


def test_bad_environment_fails_when_the_wrapper_is_made(monkeypatch):
    monkeypatch.setenv(ENV, "lots")
    with pytest.raises(RuntimeError, match="TORCHDP_GRAD_BUCKET_MB must be a non-negative number"):
        torchdp.DataParallel(_mlp(), devices=cpu_devices(2))
    # An explicit bucket_cap_mb does not read the variable.
    torchdp.DataParallel(_mlp(), devices=cpu_devices(2), bucket_cap_mb=5)
    monkeypatch.delenv(ENV)
    monkeypatch.setenv(DELIVERY, "eager")
    with pytest.raises(RuntimeError, match="TORCHDP_GRAD_DELIVERY must be 'join'"):
        torchdp.DataParallel(_mlp(), devices=cpu_devices(2), bucket_cap_mb=5)


def _deferred() -> int:
    return torchdp._C.deferred_gradient_sums()


class TiedOutside(nn.Module):
    """Two layers; the caller also uses the first layer's weight outside the replicas."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(6, 6)
        self.b = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(x)))


def _tied_loss(model: nn.Module, net: TiedOutside, x: torch.Tensor) -> torch.Tensor:
    return model(x).pow(2).sum() + net.a.weight.pow(2).sum()


@pytest.mark.filterwarnings("ignore:Using backward\\(\\) with create_graph=True")
def test_bucket_delivery_defers_waits_for_sums_nothing_reads(monkeypatch, recwarn):
    # Note [Delivering bucket sums directly]: a bucket's stream wait is deferred to the pass's last
    # bucket only for sums that AccumulateGrad takes without reading them; the others wait.
    monkeypatch.setenv(DELIVERY, "bucket")
    monkeypatch.setenv(ENV, "0.000001")  # every tensor in a bucket of its own
    x = torch.randn(8, 6)

    def fresh() -> tuple[TiedOutside, TiedOutside, torchdp.DataParallel]:
        torch.manual_seed(0)
        net = TiedOutside()
        return net, clone_module(net), torchdp.DataParallel(net, devices=cpu_devices(2))

    def check(net: nn.Module, ref: nn.Module) -> None:
        for (name, p), q in zip(net.named_parameters(), ref.parameters(), strict=True):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6, msg=name)

    # Plain: all four deferred (and taken as they were: no warning at the end of the pass).
    net, ref, dp = fresh()
    before = _deferred()
    dp(x).pow(2).sum().backward()
    ref(x).pow(2).sum().backward()
    assert _deferred() - before == 4
    check(net, ref)
    assert not [w for w in recwarn if "did not take" in str(w.message)]

    # The weight also used outside the replicas has two producers: the engine adds its two
    # gradients on the forward stream, so its bucket waits.
    net, ref, dp = fresh()
    before = _deferred()
    _tied_loss(dp, net, x).backward()
    _tied_loss(ref, ref, x).backward()
    assert _deferred() - before == 3
    check(net, ref)

    # Hooks read the gradient: a tensor hook and a post-accumulate-grad hook make their buckets
    # wait, and they run with the summed gradient.
    net, ref, dp = fresh()
    seen: dict[str, torch.Tensor] = {}
    net.a.bias.register_hook(lambda g: seen.__setitem__("hook", g.clone()))
    net.b.weight.register_post_accumulate_grad_hook(
        lambda p: seen.__setitem__("post", p.grad.clone())
    )
    before = _deferred()
    dp(x).pow(2).sum().backward()
    ref(x).pow(2).sum().backward()
    assert _deferred() - before == 2
    check(net, ref)
    torch.testing.assert_close(seen["hook"], ref.a.bias.grad)
    torch.testing.assert_close(seen["post"], ref.b.weight.grad)

    # Existing gradients are added to, not replaced.
    net, ref, dp = fresh()
    for _ in range(2):
        dp(x).pow(2).sum().backward()
        ref(x).pow(2).sum().backward()
    before = _deferred()
    dp(x).pow(2).sum().backward()
    ref(x).pow(2).sum().backward()
    assert _deferred() - before == 0
    check(net, ref)

    # The same module replicated twice in one forward: every parameter has two producers.
    net, ref, dp = fresh()
    before = _deferred()
    (dp(x).pow(2).sum() + dp(2 * x).pow(2).sum()).backward()
    (ref(x).pow(2).sum() + ref(2 * x).pow(2).sum()).backward()
    assert _deferred() - before == 0
    check(net, ref)

    # torch.autograd.grad and create_graph never touch .grad directly.
    net, ref, dp = fresh()
    before = _deferred()
    grads = torch.autograd.grad(dp(x).pow(2).sum(), list(net.parameters()))
    ref_grads = torch.autograd.grad(ref(x).pow(2).sum(), list(ref.parameters()))
    assert _deferred() - before == 0
    assert all(p.grad is None for p in net.parameters())
    for g, r in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-6)
    net, ref, dp = fresh()
    before = _deferred()
    dp(x).pow(2).sum().backward(create_graph=True)
    ref(x).pow(2).sum().backward(create_graph=True)
    assert _deferred() - before == 0
    check(net, ref)
    assert all(p.grad.requires_grad for p in net.parameters())
    net.zero_grad(set_to_none=True)  # break the parameter-gradient cycles create_graph made
    ref.zero_grad(set_to_none=True)

    # A plain backward through a double-backward graph (the penalty's input gradient was made
    # with create_graph by torch.autograd.grad, which defers nothing) defers again.
    net, ref, dp = fresh()
    before = _deferred()
    gradient_penalty(dp, x).backward()
    gradient_penalty(ref, x).backward()
    assert _deferred() - before == 4
    check(net, ref)


def test_bucket_delivery_keeps_the_gradient_layout(monkeypatch):
    # A channels_last weight takes its gradient in its own layout (AccumulateGrad copies the
    # contiguous sum into it, reading it), so only the bias's wait is deferred.
    monkeypatch.setenv(DELIVERY, "bucket")
    monkeypatch.setenv(ENV, "0.000001")
    torch.manual_seed(0)
    net = nn.Conv2d(3, 4, 3).to(memory_format=torch.channels_last)
    ref = clone_module(net)
    x = torch.randn(4, 3, 8, 8)
    before = _deferred()
    torchdp.DataParallel(net, devices=cpu_devices(2))(x).pow(2).sum().backward()
    ref(x).pow(2).sum().backward()
    assert _deferred() - before == 1
    assert net.weight.grad.is_contiguous(memory_format=torch.channels_last)
    torch.testing.assert_close(net.weight.grad, ref.weight.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(net.bias.grad, ref.bias.grad, rtol=1e-5, atol=1e-5)


def test_join_delivery_never_defers(monkeypatch):
    monkeypatch.setenv(DELIVERY, "join")
    net = _mlp(layers=2, width=4)
    before = _deferred()
    torchdp.DataParallel(net, devices=cpu_devices(2))(torch.randn(4, 4)).sum().backward()
    assert _deferred() == before
    assert all(p.grad is not None for p in net.parameters())


def test_a_bucket_with_one_read_sum_waits_for_all(monkeypatch):
    # One bucket for everything: a hook on one parameter makes the whole bucket wait, so none of
    # its sums counts as deferred; without the hook all four do.
    monkeypatch.setenv(DELIVERY, "bucket")
    monkeypatch.setenv(ENV, "25")
    x = torch.randn(8, 6)
    for hooked in (False, True):
        torch.manual_seed(0)
        net = TiedOutside()
        ref = clone_module(net)
        if hooked:
            net.b.bias.register_hook(lambda g: g * 1)
        before = _deferred()
        torchdp.DataParallel(net, devices=cpu_devices(2))(x).pow(2).sum().backward()
        ref(x).pow(2).sum().backward()
        assert _deferred() - before == (0 if hooked else 4)
        for p, q in zip(net.parameters(), ref.parameters(), strict=True):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6)
