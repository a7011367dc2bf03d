"""torchdp.patch_torch(): swaps torchdp in for torch.nn.DataParallel and torch.nn.parallel's
functions (package and submodule aliases), restores everything, nests, is idempotent."""

from __future__ import annotations

import importlib

import pytest
import torch
from dp_testing import cpu_devices
from torch import nn

import torchdp

SWAPPED = [
    ("torch.nn", "DataParallel", "DataParallel"),
    ("torch.nn.parallel", "DataParallel", "DataParallel"),
    ("torch.nn.parallel", "data_parallel", "data_parallel"),
    ("torch.nn.parallel", "replicate", "replicate"),
    ("torch.nn.parallel", "scatter", "scatter"),
    ("torch.nn.parallel", "gather", "gather"),
    ("torch.nn.parallel", "parallel_apply", "parallel_apply"),
    ("torch.nn.parallel.scatter_gather", "scatter", "scatter"),
    ("torch.nn.parallel.scatter_gather", "scatter_kwargs", "scatter_kwargs"),
    ("torch.nn.parallel.scatter_gather", "gather", "gather"),
    ("torch.nn.parallel.replicate", "replicate", "replicate"),
    ("torch.nn.parallel.parallel_apply", "parallel_apply", "parallel_apply"),
    ("torch.nn.parallel.data_parallel", "DataParallel", "DataParallel"),
    ("torch.nn.parallel.data_parallel", "data_parallel", "data_parallel"),
    ("torch.nn.parallel.data_parallel", "replicate", "replicate"),
    ("torch.nn.parallel.data_parallel", "scatter_kwargs", "scatter_kwargs"),
    ("torch.nn.parallel.data_parallel", "gather", "gather"),
    ("torch.nn.parallel.data_parallel", "parallel_apply", "parallel_apply"),
]


def _snapshot():
    return {(m, a): getattr(importlib.import_module(m), a) for m, a, _ in SWAPPED}


@pytest.fixture(autouse=True)
def _always_restored():
    before = _snapshot()
    yield
    assert _snapshot() == before, "a test left torch patched"


def test_patch_swaps_and_undo_restores():
    before = _snapshot()
    assert all(not getattr(v, "__module__", "").startswith("torchdp") for v in before.values())
    handle = torchdp.patch_torch()
    try:
        for module, attribute, ours in SWAPPED:
            assert getattr(importlib.import_module(module), attribute) is getattr(torchdp, ours), (
                module,
                attribute,
            )
        assert torch.nn.DataParallel is torchdp.DataParallel
        assert handle.active
    finally:
        handle.undo()
    assert not handle.active
    assert _snapshot() == before
    handle.undo()  # idempotent
    assert _snapshot() == before


def test_context_manager_and_remove_alias():
    before = _snapshot()
    with torchdp.patch_torch() as handle:
        assert torch.nn.parallel.scatter is torchdp.scatter
    assert _snapshot() == before and not handle.active
    handle = torchdp.patch_torch()
    handle.remove()
    assert _snapshot() == before


def test_patch_is_idempotent_and_nests():
    before = _snapshot()
    outer = torchdp.patch_torch()
    inner = torchdp.patch_torch()
    assert torch.nn.DataParallel is torchdp.DataParallel
    inner.undo()
    assert torch.nn.DataParallel is torchdp.DataParallel  # the outer patch still holds
    outer.undo()
    assert _snapshot() == before


def test_patched_torch_runs_torchdp():
    net = nn.Linear(3, 2)
    x = torch.randn(4, 3)
    with torchdp.patch_torch():
        dp = torch.nn.DataParallel(net, devices=cpu_devices(2))
        assert type(dp) is torchdp.DataParallel
        torch.testing.assert_close(dp(x), net(x))
        parts = torch.nn.parallel.scatter_gather.scatter(x, cpu_devices(2))
        torch.testing.assert_close(torch.nn.parallel.gather(list(parts), "cpu"), x)
        replicas = torch.nn.parallel.replicate(net, cpu_devices(2))
        outs = torch.nn.parallel.parallel_apply(replicas, [x, x], None, cpu_devices(2))
        torch.testing.assert_close(outs[1], net(x))


def test_upstream_subclass_methods_resolve_to_torchdp():
    # Code that subclasses PyTorch's DataParallel calls the module globals of
    # torch.nn.parallel.data_parallel from its methods: patched, those are torchdp's.
    upstream = importlib.import_module("torch.nn.parallel.data_parallel")
    with torchdp.patch_torch():
        assert upstream.replicate is torchdp.replicate
        assert upstream.scatter_kwargs is torchdp.scatter_kwargs
        assert upstream.gather is torchdp.gather
        assert upstream.parallel_apply is torchdp.parallel_apply


def test_undo_leaves_a_later_replacement_alone():
    sentinel = object()
    handle = torchdp.patch_torch()
    saved = torch.nn.parallel.gather
    torch.nn.parallel.gather = sentinel
    try:
        handle.undo()
        assert torch.nn.parallel.gather is sentinel
    finally:
        torch.nn.parallel.gather = importlib.import_module(
            "torch.nn.parallel.scatter_gather"
        ).gather
    assert saved is torchdp.gather


def test_repr():
    handle = torchdp.patch_torch()
    assert "active" in repr(handle)
    handle.undo()
    assert "undone" in repr(handle)


def test_a_missing_target_replaces_nothing(monkeypatch):
    patch_module = importlib.import_module("torchdp.patch")
    targets = [*patch_module._TARGETS, ("torch.nn.parallel", "NoSuchName", torchdp.DataParallel)]
    monkeypatch.setattr(patch_module, "_TARGETS", targets)
    original = torch.nn.DataParallel
    with pytest.raises(AttributeError, match="NoSuchName"):
        torchdp.patch_torch()
    assert torch.nn.DataParallel is original
    assert not patch_module._saved


def test_a_pytorch_checkpoint_unpickled_while_patched_gets_every_attribute():
    import io
    import pickle

    buffer = io.BytesIO()
    pickle.dump(torch.nn.DataParallel(nn.Linear(2, 2)), buffer)
    with torchdp.patch_torch():
        loaded = pickle.loads(buffer.getvalue())
    assert isinstance(loaded, torchdp.DataParallel)
    assert loaded._place_module is False and loaded._placed is False
    assert loaded.gather_output is True and loaded(torch.ones(3, 2)).shape == (3, 2)
