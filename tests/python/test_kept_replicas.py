"""Replicas kept between forwards (``torchdp.DataParallel(cache_replicas=True)``, the default;
Note [Kept replicas] in csrc/python/replicate_cache.cpp): reused when nothing else holds them,
refilled from the module at every forward, rebuilt when the structure changes."""

from __future__ import annotations

import copy
import importlib
import pickle
import sysconfig
import threading
import warnings
import weakref
from typing import Any

import pytest
import torch
from dp_testing import cpu_devices
from torch import nn
from torch.profiler import ProfilerActivity, profile
from torch.utils.checkpoint import checkpoint

import torchdp
from torchdp import _C
from torchdp.data_parallel import _REPLICA_CACHES

# Note [Kept replicas]: a free-threaded build keeps none (tests/python/test_threads.py checks it).
pytestmark = pytest.mark.skipif(
    bool(sysconfig.get_config_var("Py_GIL_DISABLED")),
    reason="no replicas are kept on a free-threaded Python",
)


class Net(nn.Module):
    """Linear -> BatchNorm -> Linear, with a plain attribute, an optional buffer and a counter
    that the forward increments (on the replica)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 6)
        self.bn = nn.BatchNorm1d(6)
        self.b = nn.Linear(6, 3)
        self.scale = 1.0
        self.counter = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.counter += 1
        h = torch.relu(self.bn(self.a(x)))
        offset = self.a._buffers.get("offset")
        if offset is not None:
            h = h + offset
        return self.b(h) * self.scale * self.counter


def cache_of(dp: torchdp.DataParallel) -> _C.ReplicaCache:
    return _REPLICA_CACHES[dp]


def pair(seed: int = 0) -> tuple[nn.Module, nn.Module]:
    """Two equal networks: one for the kept replicas, one for new replicas at every forward."""
    torch.manual_seed(seed)
    net = Net()
    return net, copy.deepcopy(net)


def step(dp: nn.Module, net: nn.Module, x: torch.Tensor, lr: float = 0.1) -> torch.Tensor:
    net.zero_grad(set_to_none=True)
    out = dp(x)
    out.square().sum().backward()
    with torch.no_grad():
        for p in net.parameters():
            if p.grad is not None:
                p -= lr * p.grad
    return out.detach()


def assert_same_state(kept: nn.Module, fresh: nn.Module) -> None:
    for (name, a), b in zip(kept.state_dict().items(), fresh.state_dict().values(), strict=True):
        torch.testing.assert_close(a, b, msg=name)


def wrap_both(
    net: nn.Module, ref: nn.Module, devices: list[torch.device], **options: Any
) -> tuple[torchdp.DataParallel, torchdp.DataParallel]:
    """``net`` with kept replicas and ``ref`` (an equal network) with new ones at every forward."""
    return (
        torchdp.DataParallel(net, devices=devices, **options),
        torchdp.DataParallel(ref, devices=devices, cache_replicas=False, **options),
    )


def started(n: int, batch: int) -> tuple[Any, ...]:
    """(net, ref, dp, fresh, x): ``wrap_both`` over ``n`` CPU devices after one training step of
    each wrapper on the batch ``x``."""
    net, ref = pair()
    dp, fresh = wrap_both(net, ref, cpu_devices(n))
    x = torch.randn(batch, 4)
    step(dp, net, x)
    step(fresh, ref, x)
    return net, ref, dp, fresh, x


def assert_steps_match(
    dp: nn.Module,
    net: nn.Module,
    fresh: nn.Module,
    ref: nn.Module,
    x: torch.Tensor,
    msg: Any = None,
) -> None:
    """One training step through each wrapper gives the same output."""
    torch.testing.assert_close(step(dp, net, x), step(fresh, ref, x), msg=msg)


class ReplicaIds:
    """Records id() of the replicas of `module` that run (ids only: a reference would keep them
    from being reused)."""

    def __init__(self, module: nn.Module) -> None:
        self.ids: list[list[int]] = []
        self.handle = module.register_forward_pre_hook(self.record)

    def record(self, module: nn.Module, args: Any) -> None:
        assert module.__dict__.get("_is_replica", False)
        self.ids[-1].append(id(module))

    def next_step(self) -> None:
        self.ids.append([])


def test_replicas_are_kept_refilled_and_match_new_replicas():
    net, ref = pair()
    dp, fresh = wrap_both(net, ref, cpu_devices(2))
    ids = ReplicaIds(net.a)
    for i in range(4):
        ids.next_step()
        x = torch.randn(8, 4)
        assert_steps_match(dp, net, fresh, ref, x, msg=f"step {i}")
        assert_same_state(net, ref)
    # The same two replica objects ran at every step; the forward's counter never survived.
    assert all(sorted(s) == sorted(ids.ids[0]) for s in ids.ids) and len(set(ids.ids[0])) == 2
    assert net.counter == 0
    cache = cache_of(dp)
    assert (cache.builds, cache.reuses, cache.state) == (1, 3, "parked")
    assert fresh not in _REPLICA_CACHES


def test_parked_replicas_keep_no_tensors_alive():
    net, _ = pair()
    dp = torchdp.DataParallel(net, devices=cpu_devices(2))
    copies: list[weakref.ref[torch.Tensor]] = []

    def remember(module: nn.Module, args: Any) -> None:
        copies.append(weakref.ref(module.weight))

    net.b.register_forward_pre_hook(remember)
    out = dp(torch.randn(6, 4))
    out.sum().backward()
    assert cache_of(dp).state == "parked"
    assert len(copies) == 2
    del out
    # The replicas' weights were made for this forward: only the autograd graph held them.
    assert all(ref() is None for ref in copies)


@pytest.mark.parametrize(
    "change",
    [
        "eval",
        "plain_attribute",
        "new_parameter",
        "register_buffer",
        "requires_grad",
        "load_state_dict",
        "dtype",
    ],
)
def test_changes_between_forwards_show_up_in_kept_replicas(change):
    net, ref, dp, fresh, x = started(2, 8)
    for m in (net, ref):
        torch.manual_seed(5)
        if change == "eval":
            m.eval()
        elif change == "plain_attribute":
            m.scale = 3.0
        elif change == "new_parameter":
            m.b.weight = nn.Parameter(torch.randn(3, 6))
        elif change == "register_buffer":
            m.a.register_buffer("offset", torch.randn(6))
        elif change == "requires_grad":
            m.a.weight.requires_grad_(False)
        elif change == "load_state_dict":
            m.load_state_dict({k: v + 1 for k, v in Net().state_dict().items()})
        elif change == "dtype":
            m.double()
    if change == "dtype":
        x = x.double()
    for i in range(2):
        assert_steps_match(dp, net, fresh, ref, x, msg=f"step {i}")
        assert_same_state(net, ref)
        for (name, p), q in zip(net.named_parameters(), ref.parameters(), strict=True):
            assert (p.grad is None) == (q.grad is None), name
    cache = cache_of(dp)
    assert (cache.builds, cache.reuses) == (1, 2)


@pytest.mark.parametrize("change", ["add_child", "class", "devices"])
def test_structure_changes_build_new_replicas(change):
    net, ref, dp, fresh, x = started(3, 9)

    class Scaled(nn.Linear):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return super().forward(x) * 2

    for m in (net, ref):
        torch.manual_seed(7)
        if change == "add_child":
            m.extra = nn.Linear(2, 2)
        elif change == "class":
            m.b.__class__ = Scaled
    if change == "devices":
        x = torch.randn(4, 4)  # two chunks of two: two replicas
    assert_steps_match(dp, net, fresh, ref, x)
    assert_same_state(net, ref)
    assert cache_of(dp).builds == 2
    assert_steps_match(dp, net, fresh, ref, x)
    assert (cache_of(dp).builds, cache_of(dp).reuses) == (2, 1)


def test_no_grad_and_grad_forwards_alternate_on_kept_replicas():
    net, ref = pair()
    dp, fresh = wrap_both(net, ref, cpu_devices(2))
    for i in range(3):
        x = torch.randn(8, 4)
        with torch.no_grad():
            torch.testing.assert_close(dp(x), fresh(x), msg=f"no_grad {i}")
        assert_steps_match(dp, net, fresh, ref, x, msg=f"step {i}")
        assert_same_state(net, ref)
    assert cache_of(dp).builds == 1


def test_replicas_still_referenced_are_not_reused():
    net, _ = pair()
    dp = torchdp.DataParallel(net, devices=cpu_devices(2))
    held: list[nn.Module] = []
    handle = net.b.register_forward_hook(lambda m, args, out: held.append(m))
    x = torch.randn(8, 4)
    dp(x).sum().backward()
    assert cache_of(dp).state == "empty"  # dropped: the hook holds replicas
    weights = [m.weight.detach().clone() for m in held]
    dp(x).sum().backward()
    assert (cache_of(dp).builds, cache_of(dp).reuses) == (2, 0)
    # The held replicas were left as they were.
    for m, w in zip(held[:2], weights, strict=True):
        torch.testing.assert_close(m.weight.detach(), w)
        assert m.__dict__["_is_replica"]
    handle.remove()
    held.clear()
    dp(x).sum().backward()
    dp(x).sum().backward()
    assert (cache_of(dp).builds, cache_of(dp).reuses) == (3, 1)


class Checkpointed(nn.Module):
    def __init__(self, reentrant: bool) -> None:
        super().__init__()
        self.first = nn.Linear(4, 8)
        self.block = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 2))
        self.reentrant = reentrant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return checkpoint(self.block, self.first(x), use_reentrant=self.reentrant)


@pytest.mark.parametrize("reentrant", [True, False])
def test_two_checkpointed_forwards_before_one_backward(reentrant):
    # The first forward's checkpoint runs its replicas again in the backward pass, after the
    # second forward: kept replicas must not have been refilled under it.
    torch.manual_seed(0)
    net = Checkpointed(reentrant)
    ref = copy.deepcopy(net)
    dp, fresh = wrap_both(net, ref, cpu_devices(2))
    for i in range(2):
        x1, x2 = torch.randn(6, 4), torch.randn(6, 4)
        for wrapper, m in ((dp, net), (fresh, ref)):
            m.zero_grad(set_to_none=True)
            (wrapper(x1).square().sum() + wrapper(x2).sum()).backward()
        for (name, p), q in zip(net.named_parameters(), ref.parameters(), strict=True):
            torch.testing.assert_close(p.grad, q.grad, msg=f"round {i}: {name}")


def test_failed_forward_then_kept_replicas_again():
    class Fails(Net):
        fail = False

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if self.fail:
                raise ValueError("bad batch")
            return super().forward(x)

    torch.manual_seed(0)
    net = Fails()
    ref = copy.deepcopy(net)
    dp, fresh = wrap_both(net, ref, cpu_devices(2))
    x = torch.randn(8, 4)
    step(dp, net, x)
    step(fresh, ref, x)
    net.fail = True
    with pytest.raises(ValueError, match="bad batch"):
        dp(x)
    assert cache_of(dp).state == "empty"  # the traceback held the replicas: dropped at once
    net.fail = False
    for _ in range(2):
        assert_steps_match(dp, net, fresh, ref, x)
    assert_same_state(net, ref)
    assert (cache_of(dp).builds, cache_of(dp).reuses) == (2, 2)


def test_forwards_from_two_threads_on_one_wrapper():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 2))
    dp = torchdp.DataParallel(net, devices=cpu_devices(2))
    xs = [torch.randn(8, 4) for _ in range(2)]
    with torch.no_grad():
        expected = [net(x) for x in xs]
    errors: list[Exception] = []

    def work(k: int) -> None:
        try:
            for _ in range(50):
                torch.testing.assert_close(dp(xs[k]), expected[k])
        except Exception as e:
            errors.append(e)

    with torch.no_grad():
        threads = [threading.Thread(target=work, args=(k,)) for k in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert not errors, errors[0]
    assert cache_of(dp).builds + cache_of(dp).reuses == 100


def test_post_replicate_hooks_run_on_every_forward_of_kept_replicas():
    net, ref = pair()

    def hook(replica, module, device, index, ctx):
        replica.doubled = replica.weight.detach() * 2

    class Doubled(nn.Linear):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return nn.functional.linear(x, self.doubled, self.bias)

    for m in (net, ref):
        m.b.__class__ = Doubled
        m.b.doubled = m.b.weight.detach() * 2
    handle = torchdp.register_post_replicate_hook(Doubled, hook)
    try:
        dp, fresh = wrap_both(net, ref, cpu_devices(2))
        for i in range(3):
            x = torch.randn(8, 4)
            assert_steps_match(dp, net, fresh, ref, x, msg=f"step {i}")
            assert_same_state(net, ref)
        assert (cache_of(dp).builds, cache_of(dp).reuses) == (1, 2)
    finally:
        handle.remove()


def _device_checks(call: Any) -> int:
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        call()
    return sum(e.count for e in prof.key_averages() if e.key == "torchdp.replicate.device_check")


def test_device_check_runs_only_when_something_can_misplace_a_tensor():
    net = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    x = torch.randn(4, 4)
    dp = torchdp.DataParallel(net, devices=cpu_devices(2))
    assert _device_checks(lambda: dp(x)) == 0
    assert _device_checks(lambda: torchdp.replicate(net, cpu_devices(2))) == 0
    handle = torchdp.register_post_replicate_hook(nn.BatchNorm1d, lambda *args: None)
    try:
        assert _device_checks(lambda: dp(x)) == 1
    finally:
        handle.remove()

    class WithCallback(nn.Linear):
        def __data_parallel_replicate__(self, ctx: Any, copy_id: int) -> None:
            pass

    net[0].__class__ = WithCallback
    assert _device_checks(lambda: dp(x)) == 1

    class OwnSetattr(nn.Linear):
        def __setattr__(self, key: str, value: Any) -> None:
            nn.Linear.__setattr__(self, key, value)

    net[0].__class__ = OwnSetattr
    assert _device_checks(lambda: torchdp.replicate(net, cpu_devices(2))) == 1
    assert _device_checks(lambda: dp(x)) == 1
    assert cache_of(dp).state == "empty"  # such a class is never kept


def test_registration_hooks_build_new_replicas_every_time():
    net, _ = pair()
    dp = torchdp.DataParallel(net, devices=cpu_devices(2))
    seen: list[str] = []
    handle = torch.nn.modules.module.register_module_buffer_registration_hook(
        lambda module, name, buffer: seen.append(name)
    )
    try:
        for _ in range(2):
            dp(torch.randn(4, 4))
    finally:
        handle.remove()
    assert cache_of(dp).builds == 2 and cache_of(dp).reuses == 0
    assert "running_mean" in seen  # replicas built with setattr, which calls the hook


def test_wrapper_with_kept_replicas_copies_and_pickles():
    net, _ = pair()
    dp = torchdp.DataParallel(net, devices=cpu_devices(2))
    x = torch.randn(8, 4)
    with torch.no_grad():
        expected = dp(x)
    for clone in (copy.deepcopy(dp), pickle.loads(pickle.dumps(dp))):
        assert clone not in _REPLICA_CACHES
        assert clone.cache_replicas
        with torch.no_grad():
            torch.testing.assert_close(clone(x), expected)
        assert cache_of(clone).builds == 1


def test_option_off_builds_new_replicas_and_keeps_nothing():
    net, _ = pair()
    dp = torchdp.DataParallel(net, devices=cpu_devices(2), cache_replicas=False)
    ids = ReplicaIds(net.a)
    alive: list[weakref.ref[nn.Module]] = []
    net.b.register_forward_pre_hook(lambda m, args: alive.append(weakref.ref(m)))
    for _ in range(2):
        ids.next_step()
        dp(torch.randn(8, 4)).sum().backward()
    assert dp not in _REPLICA_CACHES
    assert all(ref() is None for ref in alive)  # every replica died with its forward


def test_replica_cache_binding():
    net, _ = pair()
    cache = _C.ReplicaCache()
    assert (cache.state, cache.builds, cache.reuses) == ("empty", 0, 0)
    copies, plain_only, reused, _buffers = cache.replicate(net, cpu_devices(2))
    assert plain_only and not reused and cache.state == "lent"
    assert len(copies) == 2 and len(copies[1]) == len(list(net.modules()))
    assert not cache.park()  # `copies` still refers to them
    assert cache.state == "empty"
    copies, _, _, _ = cache.replicate(net, cpu_devices(2))
    first = [id(m) for m in copies[1]]
    del copies
    assert cache.park() and cache.state == "parked"
    copies, _, reused, _ = cache.replicate(net, cpu_devices(2))
    assert reused and [id(m) for m in copies[1]] == first
    assert copies[1][0].a is copies[1][1] and copies[1][0].scale == 1.0
    cache.drop()
    assert cache.state == "empty"
    with pytest.raises(ValueError, match="needs a device"):
        cache.replicate(net, [])


def test_inference_mode_first_then_training():
    """The kept buffer copy is made of normal tensors even when the first forward runs under
    inference mode (a validation pass before training), so later forwards can refresh it."""
    for functional in (False, True):
        net = nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3))
        dp = torchdp.DataParallel(net, devices=cpu_devices(2))

        def run(x, net=net, dp=dp, functional=functional):
            return torchdp.data_parallel(net, x, devices=cpu_devices(2)) if functional else dp(x)

        net.eval()
        with torch.inference_mode():
            run(torch.randn(6, 3))
        net.train()
        for _ in range(2):
            run(torch.randn(6, 3)).sum().backward()
        assert net[1].num_batches_tracked.item() == 2


def test_replica_cache_buffer_snapshots():
    """Note [Buffers of failed forwards]: each call copies the network's buffers before anything
    else happens; the copy is refreshed in place at the next call, or made anew while a caller
    still holds the last one."""
    net = nn.BatchNorm1d(3)
    mean = net.running_mean
    cache = _C.ReplicaCache()
    first = cache.replicate(net, cpu_devices(2))[3]
    assert len(first) == 3  # running_mean, running_var, num_batches_tracked
    mean.fill_(1.0)
    second = cache.replicate(net, cpu_devices(2))[3]  # `first` is still held: a new copy
    mean.fill_(2.0)
    # Two forwards in flight on the same buffers cannot tell their changes apart: neither rolls
    # back (a successful forward's update is never lost).
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert first.restore() == 0 and second.restore() == 0
    assert torch.equal(mean, torch.full((3,), 2.0))
    first.release()
    second.release()
    del first, second
    for value in (3.0, 4.0):  # the kept copy, refreshed in place
        mean.fill_(value)
        third = cache.replicate(net, cpu_devices(2))[3]
        mean.fill_(-1.0)
        third.restore()
        assert torch.equal(mean, torch.full((3,), value))
        del third
    net.running_mean = torch.full((3,), 5.0)  # another tensor: copied anew
    fourth = cache.replicate(net, cpu_devices(2))[3]
    net.running_mean.zero_()
    fourth.restore()
    assert torch.equal(net.running_mean, torch.full((3,), 5.0))


class ConvBN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.Dropout(0.0)
        )
        self.head = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x).mean((2, 3)))


DEVICE_LISTS = [
    pytest.param(["cpu", "cpu"], id="cpu"),
    pytest.param(["cuda:0", "cuda:0"], id="cuda0-twice", marks=pytest.mark.needs_cuda),
    pytest.param(["cuda:0", "cuda:1"], id="two-gpus", marks=pytest.mark.needs_multi_gpu),
]


@pytest.mark.parametrize("names", DEVICE_LISTS)
def test_training_with_kept_replicas_matches_new_replicas(names):
    devices = [torch.device(n) for n in names]
    torch.manual_seed(0)
    net = ConvBN().to(devices[0])
    ref = copy.deepcopy(net)
    dp, fresh = wrap_both(net, ref, devices)
    torch_dp = None
    if all(d.type == "cuda" for d in devices) and len(set(devices)) == len(devices):
        torch_net = copy.deepcopy(net)
        torch_dp = (torch_net, torch.nn.DataParallel(torch_net, [d.index for d in devices]))
    for i in range(5):
        x = torch.randn(8, 3, 6, 6, device=devices[0])
        out = step(dp, net, x)
        torch.testing.assert_close(out, step(fresh, ref, x), msg=f"step {i}")
        assert_same_state(net, ref)
        if torch_dp is not None:
            torch.testing.assert_close(out, step(torch_dp[1], torch_dp[0], x), msg=f"torch {i}")
            assert_same_state(net, torch_dp[0])
        if i == 2:
            for m in (net, ref) + ((torch_dp[0],) if torch_dp else ()):
                m.eval()
    assert (cache_of(dp).builds, cache_of(dp).reuses) == (1, 4)


@pytest.mark.parametrize("rewrite", ["dict", "class"])
def test_forward_that_rewrites_its_replica_is_not_kept(rewrite):
    class Quirky(nn.Linear):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            out = super().forward(x)
            if rewrite == "dict":
                self.__dict__ = dict(self.__dict__, seen=True)
            else:
                self.__class__ = nn.Linear
            return out

    torch.manual_seed(0)
    net = nn.Sequential(Quirky(4, 4), nn.Linear(4, 2))
    ref = copy.deepcopy(net)
    dp, fresh = wrap_both(net, ref, cpu_devices(2))
    for i in range(3):
        x = torch.randn(6, 4)
        assert_steps_match(dp, net, fresh, ref, x, msg=f"step {i}")
        assert cache_of(dp).state == "empty"
    assert type(net[0]) is Quirky and not hasattr(net[0], "seen")
    assert (cache_of(dp).builds, cache_of(dp).reuses) == (3, 0)


@pytest.mark.parametrize("kind", ["weight_norm", "orthogonal", "spectral_norm"])
def test_parametrized_and_hooked_weights_on_kept_replicas(kind):
    # Parametrizations (a class made per module, properties, a ParametrizationList child) and
    # spectral_norm's forward pre-hook (which sets a plain `weight` attribute and updates buffers
    # in place) behave as with new replicas.
    def make() -> nn.Module:
        torch.manual_seed(0)
        lin = nn.Linear(4, 4)
        if kind == "weight_norm":
            lin = nn.utils.parametrizations.weight_norm(lin)
        elif kind == "orthogonal":
            lin = nn.utils.parametrizations.orthogonal(lin)
        else:
            lin = nn.utils.spectral_norm(lin)
        return nn.Sequential(lin, nn.Tanh(), nn.Linear(4, 2))

    net, ref = make(), make()
    dp, fresh = wrap_both(net, ref, cpu_devices(2))
    for i in range(3):
        x = torch.randn(6, 4)
        assert_steps_match(dp, net, fresh, ref, x, msg=f"step {i}")
        assert_same_state(net, ref)
    assert (cache_of(dp).builds, cache_of(dp).reuses) == (1, 2)


@pytest.mark.needs_cuda
def test_kept_replicas_hold_no_gpu_memory_between_steps():
    # Replica 1's copies live only as long as the autograd graph: after a step the allocator holds
    # what it holds after a step with new replicas (the module, its gradients, the input).
    device = torch.device("cuda", 0)
    torch.manual_seed(0)
    net = nn.Sequential(*[nn.Linear(512, 512) for _ in range(4)]).to(device)  # 4 MiB of weights
    x = torch.randn(16, 512, device=device)
    # New replicas first: the gradients and the worker threads' cuBLAS workspaces get allocated,
    # and nothing of the replicas outlives a step.
    fresh = torchdp.DataParallel(net, devices=[device, device], cache_replicas=False)
    for _ in range(2):
        fresh(x).sum().backward()
    torch.cuda.synchronize(device)
    baseline = torch.cuda.memory_allocated(device)
    dp = torchdp.DataParallel(net, devices=[device, device])
    for _ in range(3):
        out = dp(x)
        out.sum().backward()
        del out
        torch.cuda.synchronize(device)
        assert cache_of(dp).state == "parked"
        assert torch.cuda.memory_allocated(device) == baseline
    assert cache_of(dp).reuses == 2


@pytest.mark.needs_cuda
@pytest.mark.parametrize("held", ["tensor", "module_list"])
def test_stale_attributes_move_with_kept_replicas(held):
    # 'move' gives the replica on another device its own copies of plain attributes at every
    # forward. A moved tensor leaves the replicas reusable; a moved list of submodules refers to
    # replica modules from inside a replica, so those replicas are built anew at every forward.
    class WithPlain(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(4, 4)
            self.b = nn.Linear(4, 2)
            self.offset = torch.ones(4)  # a plain tensor, not a buffer
            self.stages = [self.a, self.b]  # a plain list of submodules

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if held == "tensor":
                return self.b(torch.tanh(self.a(x) + self.offset))
            h = x
            for stage in self.stages:
                h = stage(torch.tanh(h))
            return h

    devices = [torch.device("cpu"), torch.device("cuda", 0)]
    torch.manual_seed(0)
    net = WithPlain()
    ref = copy.deepcopy(net)
    if held == "tensor":
        del net.stages, ref.stages
    dp, fresh = wrap_both(net, ref, devices, stale_attributes="move")
    for i in range(3):
        x = torch.randn(6, 4)
        assert_steps_match(dp, net, fresh, ref, x, msg=f"step {i}")
        assert_same_state(net, ref)
    expected = (1, 2) if held == "tensor" else (3, 0)
    assert (cache_of(dp).builds, cache_of(dp).reuses) == expected


def test_a_submodule_replaced_by_one_of_its_class_refills_the_kept_replicas():
    # The refill takes everything from this forward's walk: the kept objects only need the same
    # classes in the same positions.
    net, ref, dp, fresh, x = started(2, 8)
    torch.manual_seed(7)
    net.b = nn.Linear(6, 3)
    ref.b = copy.deepcopy(net.b)
    for i in range(2):
        assert_steps_match(dp, net, fresh, ref, x, msg=f"step {i}")
        assert_same_state(net, ref)
    assert (cache_of(dp).builds, cache_of(dp).reuses) == (1, 2)


def test_classes_with_slots_are_never_kept():
    class Slotted(nn.Linear):
        __slots__ = ("seen",)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            # A fresh replica's slot is empty at every forward; a kept one's would not be.
            first = not hasattr(self, "seen")
            self.seen = True
            return super().forward(x) * (2.0 if first else 1.0)

    torch.manual_seed(0)
    net = nn.Sequential(Slotted(4, 4), nn.Linear(4, 2))
    dp = torchdp.DataParallel(net, devices=cpu_devices(2))
    x = torch.randn(6, 4)
    with torch.no_grad():
        expected = net[1](net[0].__class__.__mro__[1].forward(net[0], x) * 2.0)
        for _ in range(3):
            torch.testing.assert_close(dp(x), expected)
    assert (cache_of(dp).builds, cache_of(dp).reuses, cache_of(dp).state) == (3, 0, "empty")


def test_functional_data_parallel_keeps_replicas_per_module_without_keeping_the_module():
    import gc

    from torchdp.data_parallel import _FUNCTIONAL_CACHES

    net, ref = pair()
    x = torch.randn(8, 4)
    for i in range(3):
        for m in (net, ref):
            m.zero_grad(set_to_none=True)
        out = torchdp.data_parallel(net, x, devices=cpu_devices(2))
        expected = torchdp.data_parallel(ref, x, devices=cpu_devices(2), cache_replicas=False)
        torch.testing.assert_close(out, expected, msg=f"call {i}")
        out.square().sum().backward()
        expected.square().sum().backward()
        for (name, p), q in zip(net.named_parameters(), ref.parameters(), strict=True):
            torch.testing.assert_close(p.grad, q.grad, msg=f"call {i}: {name}")
    cache = _FUNCTIONAL_CACHES[net]
    assert (cache.builds, cache.reuses, cache.state) == (1, 2, "parked")
    assert ref not in _FUNCTIONAL_CACHES
    alive = weakref.ref(net)
    del net, out, cache
    gc.collect()
    assert alive() is None  # the kept replicas did not keep the module alive


def test_modules_that_cannot_be_dictionary_keys():
    # A class that defines __eq__ without __hash__ is unhashable: no kept replicas for it in the
    # functional form (keyed by the module), the same results; the wrapper keys on itself.
    class Unhashable(nn.Module):  # noqa: PLW1641  unhashable on purpose
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.lin(x)

        def __eq__(self, other: object) -> bool:
            return self is other

    torch.manual_seed(0)
    net = Unhashable()
    x = torch.randn(6, 4)
    with torch.no_grad():
        expected = net(x)
        for _ in range(2):
            torch.testing.assert_close(
                torchdp.data_parallel(net, x, devices=cpu_devices(2)), expected
            )
        dp = torchdp.DataParallel(net, devices=cpu_devices(2))
        for _ in range(2):
            torch.testing.assert_close(dp(x), expected)
    assert (cache_of(dp).builds, cache_of(dp).reuses) == (1, 1)
    # With dynamo loaded, DataParallel tracks compiled signatures per module.
    importlib.import_module("torch._dynamo")

    with torch.no_grad():
        torch.testing.assert_close(dp(x), expected)


def test_a_failing_post_replicate_hook_leaves_nothing_kept():
    net, _ = pair()
    dp = torchdp.DataParallel(net, devices=cpu_devices(2))
    x = torch.randn(8, 4)
    dp(x).sum().backward()
    assert cache_of(dp).state == "parked"

    def broken(replica, module, device, index, ctx):
        raise ValueError("no mask for this device")

    handle = torchdp.register_post_replicate_hook(nn.BatchNorm1d, broken)
    try:
        with pytest.raises(RuntimeError, match="no mask for this device"):
            dp(x)
    finally:
        handle.remove()
    assert cache_of(dp).state == "empty"
    dp(x).sum().backward()
    assert (cache_of(dp).builds, cache_of(dp).reuses, cache_of(dp).state) == (2, 1, "parked")
