"""stale_attributes=: plain attributes of replicas that still hold the source device's tensors or
the network's own modules (detectron2's non-buffer pixel_mean and stages list, #1105)."""

from __future__ import annotations

import itertools
import warnings
from collections import OrderedDict, defaultdict, deque
from typing import NamedTuple

import pytest
import torch
from torch import nn

import torchdp

CPU = torch.device("cpu")
META = torch.device("meta")
_names = itertools.count()


class Entry(NamedTuple):
    module: nn.Module
    name: str


def backbone_class() -> type[nn.Module]:
    """A fresh class each time, so that warn-once state of other tests does not interfere."""

    class Backbone(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.res2 = nn.Linear(4, 4)
            self.res3 = nn.Linear(4, 4)
            # Plain attributes: replicate shares them by reference.
            self.pixel_mean = torch.tensor([0.5, -0.25, 1.0, 2.0])
            self.stages_and_names = [(self.res2, "res2"), (self.res3, "res3")]
            self.entries = OrderedDict(first=Entry(self.res2, "res2"))
            self.tied = [self.res2.weight]
            self.scale = {"value": torch.tensor(2.0), "unit": "none"}
            self.options = [1, "two", (3.0,)]

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = x - self.pixel_mean
            for stage, _ in self.stages_and_names:
                x = stage(x)
            return x * self.scale["value"]

    Backbone.__qualname__ = f"Backbone{next(_names)}"
    return Backbone


def test_default_keeps_pytorchs_sharing():
    net = backbone_class()()
    _, r1 = torchdp.replicate(net, [CPU, META])
    assert r1.pixel_mean is net.pixel_mean
    assert r1.stages_and_names is net.stages_and_names
    assert r1.stages_and_names[0][0] is net.res2


def test_move_gives_each_replica_its_own_state():
    net = backbone_class()()
    before = {k: net.__dict__[k] for k in ("pixel_mean", "stages_and_names", "entries", "scale")}
    r0, r1 = torchdp.replicate(net, [CPU, META], stale_attributes="move")

    assert r1.pixel_mean.device == META and r1.pixel_mean.shape == (4,)
    assert [(s, n) for s, n in r1.stages_and_names] == [(r1.res2, "res2"), (r1.res3, "res3")]
    assert type(r1.stages_and_names) is list and type(r1.stages_and_names[0]) is tuple
    entry = r1.entries["first"]
    assert type(r1.entries) is OrderedDict and type(entry) is Entry
    assert entry.module is r1.res2 and entry.name == "res2"
    # A registered parameter referenced from a plain attribute becomes the replica's copy.
    assert r1.tied[0] is r1.res2.weight
    assert r1.scale["value"].device == META and r1.scale["unit"] == "none"
    # Containers with nothing stale in them stay the same objects.
    assert r1.options is net.options

    # The original and the replica on the source device are untouched.
    for key, value in before.items():
        assert net.__dict__[key] is value
    assert net.stages_and_names[0][0] is net.res2 and net.pixel_mean.device == CPU
    assert r0.pixel_mean is net.pixel_mean and r0.stages_and_names is net.stages_and_names

    out = r1(torch.empty(3, 4, device=META))
    assert out.device == META and out.shape == (3, 4)


def test_move_and_error_see_defaultdicts_and_deques():
    net = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    net.by_name = defaultdict(list, first=[net[0]])
    net.recent = deque([net[1]], maxlen=3)
    net.offsets = defaultdict(float, shift=torch.ones(4))
    _, r1 = torchdp.replicate(net, [CPU, META], stale_attributes="move")
    assert type(r1.by_name) is defaultdict and r1.by_name.default_factory is list
    assert r1.by_name["first"][0] is r1[0]
    assert type(r1.recent) is deque and r1.recent.maxlen == 3 and r1.recent[0] is r1[1]
    assert r1.offsets["shift"].device == META
    # The original's containers are untouched.
    assert net.by_name["first"][0] is net[0] and net.recent[0] is net[1]
    with pytest.raises(RuntimeError, match="attribute 'recent'"):
        torchdp.replicate(_with_deque(), [CPU, META], stale_attributes="error")


def _with_deque() -> nn.Module:
    net = nn.Sequential(nn.Linear(2, 2))
    net.recent = deque([net[0]])
    return net


def test_tensors_on_other_devices_are_left_alone():
    net = nn.Linear(4, 4)
    # On neither the source device nor, for replica 0, the replica's: every replica sees the
    # same tensor there, as the user wrote it.
    net.table = torch.zeros(4, device=META)
    net.cpu_only = [torch.zeros(2, device=META)]
    r0, r1 = torchdp.replicate(net, [CPU, META], stale_attributes="error")
    assert r0.table is r1.table is net.table and r1.cpu_only is net.cpu_only


def test_error_names_the_module_attribute_and_fix():
    cls = backbone_class()
    net = nn.Sequential(nn.Identity(), cls())
    with pytest.raises(RuntimeError) as info:
        torchdp.replicate(net, [CPU, META], stale_attributes="error")
    message = str(info.value)
    assert message.startswith("torchdp.replicate: attribute 'pixel_mean' of module '1'")
    assert f"(type {cls.__qualname__}) in replica 1 on meta" in message
    assert "tensor on cpu" in message
    assert "register_buffer" in message and "stale_attributes='move'" in message
    assert "register_post_replicate_hook" in message
    # Nothing of the original changed.
    assert net[1].stages_and_names[0][0] is net[1].res2 and net[1].pixel_mean.device == CPU


def test_error_reports_module_references():
    net = backbone_class()()
    del net.pixel_mean, net.scale, net.tied
    with pytest.raises(RuntimeError) as info:
        torchdp.replicate(net, [CPU, META], stale_attributes="error")
    assert "attribute 'stages_and_names' of the root module" in str(info.value)
    assert "stages_and_names[0][0] is the original module (type Linear)" in str(info.value)


def test_hooks_run_first_and_the_check_catches_only_what_they_miss():
    cls = backbone_class()
    net = cls()

    def fix(replica, original, device, index, ctx):
        replica.pixel_mean = original.pixel_mean.to(device)
        replica.stages_and_names = [(replica.res2, "res2"), (replica.res3, "res3")]
        replica.entries = OrderedDict(first=Entry(replica.res2, "res2"))
        replica.tied = [replica.res2.weight]

    with torchdp.register_post_replicate_hook(cls, fix):
        with pytest.raises(RuntimeError, match=r"attribute 'scale'.*\['value'\] is a tensor"):
            torchdp.replicate(net, [CPU, META], stale_attributes="error")
        net.scale = {"value": 2.0}
        _, r1 = torchdp.replicate(net, [CPU, META], stale_attributes="error")
    assert r1.pixel_mean.device == META


def test_warn_once_per_class_and_attribute_and_leave_the_replica():
    cls = backbone_class()
    net = cls()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _, r1 = torchdp.replicate(net, [CPU, META], stale_attributes="warn")
        torchdp.replicate(net, [CPU, META], stale_attributes="warn")
    messages = [str(w.message) for w in caught if cls.__qualname__ in str(w.message)]
    keys = sorted(m.split("'")[1] for m in messages)
    assert keys == ["entries", "pixel_mean", "scale", "stages_and_names", "tied"]
    assert all("stale_attributes='move'" in m for m in messages)
    assert r1.pixel_mean is net.pixel_mean


def test_same_device_replicas_are_not_reported():
    net = backbone_class()()
    replicas = torchdp.replicate(net, [CPU, CPU, CPU], stale_attributes="error")
    assert all(r.pixel_mean is net.pixel_mean for r in replicas)


@pytest.mark.parametrize("bad", ["Move", "copy", 1, True])
def test_bad_policy_is_refused_everywhere(bad):
    net = nn.Linear(2, 2)
    pattern = r"stale_attributes must be None .*'move', 'warn' or 'error', got "
    with pytest.raises(ValueError, match="torchdp.replicate: " + pattern):
        torchdp.replicate(net, [CPU, CPU], stale_attributes=bad)
    with pytest.raises(ValueError, match="torchdp.DataParallel: " + pattern):
        torchdp.DataParallel(net, devices=[CPU, CPU], stale_attributes=bad)
    with pytest.raises(ValueError, match="torchdp.data_parallel: " + pattern):
        torchdp.data_parallel(net, torch.ones(2, 2), devices=[CPU, CPU], stale_attributes=bad)


def test_data_parallel_passes_the_policy_to_replicate():
    cls = backbone_class()
    dp = torchdp.DataParallel(cls(), devices=[CPU, META], stale_attributes="error")
    assert dp.stale_attributes == "error"
    with pytest.raises(RuntimeError, match=r"attribute 'pixel_mean' of the root module"):
        dp.replicate(dp.module, dp.device_ids)
    moved = torchdp.DataParallel(cls(), devices=[CPU, META], stale_attributes="move")
    _, r1 = moved.replicate(moved.module, moved.device_ids)
    assert r1.stages_and_names[1][0] is r1.res3


def _train_against_eager(devices: list[torch.device], policy: str | None) -> None:
    torch.manual_seed(0)
    net = backbone_class()().to(devices[0])
    net.pixel_mean = net.pixel_mean.to(devices[0]).requires_grad_()  # a plain leaf with a grad
    eager = backbone_class()().to(devices[0])
    eager.load_state_dict(net.state_dict())
    eager.pixel_mean = net.pixel_mean.detach().clone().requires_grad_()
    dp = torchdp.DataParallel(net, devices=devices, stale_attributes=policy)
    x = torch.randn(8, 4, device=devices[0])
    dp(x).pow(2).sum().backward()
    eager(x).pow(2).sum().backward()
    for p, q in zip(net.parameters(), eager.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6)
    # The moved copies are differentiable: both replicas' gradients reach the original.
    torch.testing.assert_close(net.pixel_mean.grad, eager.pixel_mean.grad, rtol=1e-5, atol=1e-6)


@pytest.mark.needs_cuda
def test_moved_attributes_train_like_the_plain_module_cpu_and_gpu():
    devices = [CPU, torch.device("cuda", 0)]
    with pytest.raises(RuntimeError, match="device"):  # what PyTorch's sharing gives
        _train_against_eager(devices, None)
    _train_against_eager(devices, "move")


@pytest.mark.needs_multi_gpu
def test_moved_attributes_train_like_the_plain_module_on_two_gpus():
    devices = [torch.device("cuda", 0), torch.device("cuda", 1)]
    with pytest.raises(RuntimeError, match="device"):
        _train_against_eager(devices, None)
    _train_against_eager(devices, "move")
