"""Post-replicate hooks: registration by class and by instance, order, context, removal, errors."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from dp_testing import cpu_devices
from torch import nn

import torchdp

CPU = torch.device("cpu")
REPO = Path(__file__).resolve().parents[2]
META = torch.device("meta")


class CachedScale(nn.Module):
    """Keeps a derived tensor outside its registered buffers: replicate shares it by reference."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("scale", torch.full((3,), 2.0))
        self.cache = self.scale * 10  # a plain attribute

    def forward(self, x):
        return x * self.cache


class SubCachedScale(CachedScale):
    pass


def _record(log):
    def hook(replica, original, device, index, ctx):
        log.append((replica, original, device, index, ctx))

    return hook


def test_class_hook_runs_for_instances_and_subclasses():
    log: list = []
    net = nn.Sequential(CachedScale(), nn.Linear(3, 3), SubCachedScale())
    with torchdp.register_post_replicate_hook(CachedScale, _record(log)):
        replicas = torchdp.replicate(net, cpu_devices(2))
    # Replica-major, master copy first, module order inside a replica.
    assert [(e[1], e[3]) for e in log] == [(net[0], 0), (net[2], 0), (net[0], 1), (net[2], 1)]
    for replica, original, device, index, ctx in log:
        position = 0 if original is net[0] else 2
        assert replica is replicas[index][position]
        assert device == CPU
        assert isinstance(ctx, torchdp.ReplicaContext)
        assert ctx.path == str(position) and ctx.devices == cpu_devices(2)
    # One context per module position, shared by all its copies.
    ctx_of = {}
    for _, original, _, _, ctx in log:
        ctx_of.setdefault(id(original), set()).add(id(ctx))
    assert all(len(ids) == 1 for ids in ctx_of.values())
    assert len({next(iter(ids)) for ids in ctx_of.values()}) == 2


def test_all_replicas_exist_before_the_first_hook():
    seen = []

    def hook(replica, original, device, index, ctx):
        # Replica 0's hook can already reach the copy on the other device through ctx.
        seen.append(index)
        ctx.values.setdefault("replicas", []).append(replica)

    net = nn.Sequential(CachedScale())
    with torchdp.register_post_replicate_hook(net[0], hook):
        replicas = torchdp.replicate(net, [CPU, META])
    assert seen == [0, 1]
    assert replicas[1][0].scale.device.type == "meta"


def test_hook_fixes_a_plain_tensor_attribute():
    def move_cache(replica, original, device, index, ctx):
        replica.cache = replica.scale * 10

    net = CachedScale()
    with torchdp.register_post_replicate_hook(CachedScale, move_cache):
        r0, r1 = torchdp.replicate(net, [CPU, META])
    assert r1.cache.device.type == "meta" and r0.cache.device == CPU
    assert net.cache.device == CPU
    # Without the hook the attribute is shared by reference, as in PyTorch.
    _, r1 = torchdp.replicate(net, [CPU, META])
    assert r1.cache is net.cache


def test_instance_hook_only_matches_that_instance():
    log: list = []
    a, b = CachedScale(), CachedScale()
    net = nn.Sequential(a, b)
    handle = torchdp.register_post_replicate_hook(b, _record(log))
    try:
        torchdp.replicate(net, cpu_devices(2))
    finally:
        handle.remove()
    assert [(e[1], e[3]) for e in log] == [(b, 0), (b, 1)]
    assert log[0][4].path == "1"


def test_hooks_run_in_registration_order():
    order = []
    net = CachedScale()
    h1 = torchdp.register_post_replicate_hook(CachedScale, lambda *a: order.append(("class", a[3])))
    h2 = torchdp.register_post_replicate_hook(net, lambda *a: order.append(("instance", a[3])))
    h3 = torchdp.register_post_replicate_hook(nn.Module, lambda *a: order.append(("module", a[3])))
    try:
        torchdp.replicate(net, cpu_devices(2))
    finally:
        for h in (h1, h2, h3):
            h.remove()
    assert order == [
        ("class", 0),
        ("instance", 0),
        ("module", 0),
        ("class", 1),
        ("instance", 1),
        ("module", 1),
    ]


def test_remove_and_context_manager():
    log: list = []
    handle = torchdp.register_post_replicate_hook(CachedScale, _record(log))
    assert handle.active
    handle.remove()
    assert not handle.active
    handle.remove()  # idempotent
    torchdp.replicate(CachedScale(), cpu_devices(2))
    assert log == []

    with torchdp.register_post_replicate_hook(CachedScale, _record(log)) as h:
        assert h.active
        torchdp.replicate(CachedScale(), cpu_devices(2))
    assert not h.active
    assert len(log) == 2
    torchdp.replicate(CachedScale(), cpu_devices(2))
    assert len(log) == 2


def test_hooks_run_in_data_parallel_forward():
    log: list = []
    net = nn.Sequential(CachedScale())
    dp = torchdp.DataParallel(net, devices=cpu_devices(3))
    with torchdp.register_post_replicate_hook(CachedScale, _record(log)):
        dp(torch.randn(6, 3))
    assert [e[3] for e in log] == [0, 1, 2]


def test_instance_hook_does_not_keep_the_module_alive():
    net = CachedScale()
    handle = torchdp.register_post_replicate_hook(net, lambda *a: None)
    del net
    gc.collect()
    assert not handle.active


def test_failing_hook_names_hook_module_and_replica():
    def broken_hook(replica, original, device, index, ctx):
        if index == 1:
            raise KeyError("no cache here")

    net = nn.Sequential(nn.Linear(3, 3), nn.Sequential(CachedScale()))
    with (
        torchdp.register_post_replicate_hook(CachedScale, broken_hook),
        pytest.raises(RuntimeError) as info,
    ):
        torchdp.replicate(net, cpu_devices(2))
    message = str(info.value)
    assert "test_failing_hook_names_hook_module_and_replica.<locals>.broken_hook" in message
    assert "'1.0'" in message
    assert "replica 1 on device cpu" in message
    assert "KeyError" in message and "no cache here" in message
    assert isinstance(info.value.__cause__, KeyError)


def test_a_failing_hook_leaves_the_original_buffers_as_they_were():
    """Replica 0's buffers are the original's: a hook that changed one in place before another
    hook failed is undone (Note [Buffers of failed forwards])."""

    def hook(replica, original, device, index, ctx):
        if index == 0:
            replica.running_mean.add_(5.0)
        else:
            raise ValueError("no state for this device")

    net = nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3))
    before = net[1].running_mean.clone()
    hook_handle = torchdp.register_post_replicate_hook(nn.BatchNorm1d, hook)
    with hook_handle, pytest.raises(RuntimeError, match="no state for this device"):
        torchdp.replicate(net, cpu_devices(2))
    assert torch.equal(net[1].running_mean, before)


def test_failing_hook_on_root_and_in_data_parallel():
    def hook(replica, original, device, index, ctx):
        raise ValueError("bad")

    net = CachedScale()
    dp = torchdp.DataParallel(net, devices=cpu_devices(2))
    with (
        torchdp.register_post_replicate_hook(net, hook),
        pytest.raises(
            RuntimeError,
            match=r"failed on module '<root>' .*replica 0 on device "
            r"cpu: ValueError: bad",
        ),
    ):
        dp(torch.randn(4, 3))
    # Nothing is left half-done: the module works again once the hook is gone.
    dp(torch.randn(4, 3))


def test_hook_that_misplaces_a_tensor_is_caught_by_the_device_check():
    def misplace(replica, original, device, index, ctx):
        if index == 1:
            replica._buffers["scale"] = torch.zeros(3, device="meta")

    with (
        torchdp.register_post_replicate_hook(CachedScale, misplace),
        pytest.raises(RuntimeError, match="scale"),
    ):
        torchdp.replicate(nn.Sequential(CachedScale()), cpu_devices(2))


@pytest.mark.parametrize("target", [nn.Linear(1, 1), nn.Linear])
@pytest.mark.parametrize("hook", [None, 3, "hook"])
def test_hook_must_be_callable(target, hook):
    with pytest.raises(
        TypeError,
        match=r"torchdp.register_post_replicate_hook: hook must be "
        r"callable as hook\(replica, original, device, "
        r"replica_index, ctx\), got",
    ):
        torchdp.register_post_replicate_hook(target, hook)


@pytest.mark.parametrize("target", [int, "Linear", None, torch.zeros(1), object()])
def test_target_must_be_a_module_class_or_instance(target):
    with pytest.raises(
        TypeError,
        match="torchdp.register_post_replicate_hook: target must be an "
        "nn.Module subclass or an nn.Module instance, got",
    ):
        torchdp.register_post_replicate_hook(target, lambda *a: None)


def test_handle_repr():
    h = torchdp.register_post_replicate_hook(nn.Linear, lambda *a: None)
    assert "active" in repr(h)
    h.remove()
    assert "removed" in repr(h)


_HOOK_LIFETIME_SCRIPT = r"""
import gc, sys, weakref
import torch, torchdp
from torch import nn

# 1. An instance hook that is a method of its own module: held weakly, so the module is freed with
#    its last reference; removing the handle afterwards returns (its release frees nothing more).
class Layer(nn.Linear):
    def refresh(self, replica, original, device, index, ctx):
        replica.refreshed = True

m = Layer(4, 4)
alive = weakref.ref(m)
handle = torchdp.register_post_replicate_hook(m, m.refresh)
replicas = torchdp.replicate(m, [torch.device("cpu")] * 2)
assert replicas[1].refreshed
del m, replicas
gc.collect()
assert alive() is None, "the hook kept its module alive"
assert not handle.active
handle.remove()

# 2. Modules with instance hooks dying in cyclic collections while replicas are built (the
#    registry's lock is held then): every forward finishes.
cpu = torch.device("cpu")
dp = torchdp.DataParallel(nn.Sequential(*[nn.Linear(4, 4) for _ in range(30)]), devices=[cpu, cpu])
torchdp.register_post_replicate_hook(nn.Linear, lambda *a: None)
gc.set_threshold(3, 1, 1)
for _ in range(300):
    tmp = nn.Linear(4, 4)
    tmp.me = [tmp]
    torchdp.register_post_replicate_hook(tmp, lambda *a: None)
    del tmp
    dp(torch.randn(4, 4))
print("ok")
"""


def test_instance_hooks_do_not_keep_modules_alive_or_deadlock(tmp_path):
    # A hang would be a deadlock in the registry: run it in a child process with a time limit.
    script = tmp_path / "hook_lifetime.py"
    script.write_text(_HOOK_LIFETIME_SCRIPT)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO / "python"), env.get("PYTHONPATH", "")])
    proc = subprocess.run(
        [sys.executable, str(script)],
        check=False,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stdout + proc.stderr
