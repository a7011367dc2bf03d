"""The one Python rule for nested structures (python/torchdp/_tree.py) and the C++ engine's
(csrc/torchdp/structure.h), from the shared cases of structure_cases.py."""

from __future__ import annotations

import pytest
import torch
from dp_testing import cpu_devices
from structure_cases import CASES, DEVICES, Case

import torchdp
from torchdp import _C, _tree
from torchdp.parallel_apply import get_a_var

try:  # the C++ engine's side (tests/python/torchdp_testing.cpp): make test builds it
    import torchdp_testing
except ImportError:
    torchdp_testing = None

CPU = torch.device("cpu")
_CPP_CASES = [c for c in CASES if c.cpp]


def _ids(cases: list[Case]) -> list[str]:
    return [c.name for c in cases]


def _assert_same(actual, expected):
    """Equal structure (types, keys, lengths) and leaves: tensors by value, the rest equal."""
    assert type(actual) is type(expected)
    a_leaves, a_spec = _tree.flatten(actual)
    e_leaves, e_spec = _tree.flatten(expected)
    assert (a_spec is None) == (e_spec is None)
    assert a_spec is None or a_spec.key() == e_spec.key()
    assert len(a_leaves) == len(e_leaves)
    for a, e in zip(a_leaves, e_leaves, strict=True):
        if isinstance(e, torch.Tensor):
            torch.testing.assert_close(a, e, rtol=0, atol=0)
        else:
            assert a is e or a == e


@pytest.mark.parametrize("case", CASES, ids=_ids(CASES))
def test_flatten_finds_the_leaves_and_unflatten_rebuilds(case):
    value = case.make()
    leaves, spec = _tree.flatten(value)
    assert len(leaves) == case.leaves
    assert sum(isinstance(leaf, torch.Tensor) for leaf in leaves) == case.tensors
    rebuilt = _tree.unflatten(spec, leaves)
    _assert_same(rebuilt, value)
    if spec is None:
        assert rebuilt is value  # a leaf is itself
    else:
        assert rebuilt is not value  # containers are new, their leaves the same objects
        assert all(a is b for a, b in zip(_tree.flatten(rebuilt)[0], leaves, strict=True))


@pytest.mark.parametrize("case", CASES, ids=_ids(CASES))
def test_scatter_keeps_the_structure_and_gather_joins_it(case):
    value = case.make()
    parts = torchdp.scatter(value, cpu_devices(DEVICES))
    assert len(parts) == case.replicas
    leaves, spec = _tree.flatten(value)
    for part in parts:
        part_leaves, part_spec = _tree.flatten(part)
        if isinstance(value, torch.Tensor):
            assert isinstance(part, torch.Tensor)
            continue
        assert type(part) is type(value) and part_spec.key() == spec.key()
        for mine, original in zip(part_leaves, leaves, strict=True):
            if isinstance(original, torch.Tensor):
                assert mine.shape[1:] == original.shape[1:]
            else:
                assert mine is original  # other leaves by reference
    if case.round_trip:
        _assert_same(torchdp.gather(parts, CPU), value)


@pytest.mark.parametrize("case", CASES, ids=_ids(CASES))
def test_scatter_and_gather_cross_into_cpp_once(case, monkeypatch):
    calls = []
    for name in ("scatter", "gather", "scatter_leaves", "gather_leaves"):
        original = getattr(_C, name)

        def counted(*args, _name=name, _original=original, **kwargs):
            calls.append(_name)
            return _original(*args, **kwargs)

        monkeypatch.setattr(_C, name, counted)
    parts = torchdp.scatter(case.make(), cpu_devices(DEVICES))
    if case.tensors:
        assert calls == ["scatter" if isinstance(case.make(), torch.Tensor) else "scatter_leaves"]
    else:
        assert calls == []
    calls.clear()
    if case.round_trip:
        torchdp.gather(parts, CPU)
        one = "gather" if isinstance(parts[0], torch.Tensor) else "gather_leaves"
        assert calls == ([one] if case.tensors else [])


def test_attribute_mirrors_follow_the_rebuilt_items():
    from structure_cases import Mirrored, rows

    for part in torchdp.scatter(Mirrored(logits=rows(), loss=None), cpu_devices(2)):
        assert part.logits is part["logits"] and part.logits.shape == (3,)
        assert part.loss is None


def test_paths_name_the_leaves_as_messages_do():
    from structure_cases import Layer, Point, Registered, rows

    found = []
    value = (rows(), {"a": [1, Point(rows(), None)]}, Registered(rows(), "t"), Layer(6))
    _tree.paths(value, "arg", found)
    assert [p for p, _ in found] == [
        "arg[0]",
        "arg[1]['a'][0]",
        "arg[1]['a'][1][0]",
        "arg[1]['a'][1][1]",
        "arg[2].x",
        "arg[2].tag",
        "arg[3].keys",
    ]


def test_first_tensor_and_spec_keys():
    from structure_cases import Point, rows

    x = rows()
    assert _tree.first_tensor((1, {"a": [None, Point(None, x)]}, rows())) is x
    assert _tree.first_tensor((1, "a", [])) is None
    assert get_a_var({"k": (None, x)}) is x
    # Keys tell structures apart, not values; they hold no container.
    one = _tree.flatten({"a": (x, 1)})[1].key()
    assert one == _tree.flatten({"a": (rows(2), 2)})[1].key()
    assert one != _tree.flatten({"b": (x, 1)})[1].key()
    assert one != _tree.flatten({"a": [x, 1]})[1].key()
    hash(one)


# ---------------------------------------------------------------------------------------------
# The same cases through the C++ engine: the tensors found, the replicas and their chunks.
# ---------------------------------------------------------------------------------------------

needs_cpp = pytest.mark.skipif(torchdp_testing is None, reason="make test builds torchdp_testing")


@needs_cpp
@pytest.mark.parametrize("case", _CPP_CASES, ids=_ids(_CPP_CASES))
def test_both_languages_find_the_same_tensors(case):
    value = case.make()
    cpp = torchdp_testing.structure_tensors(value)
    python = [leaf for leaf in _tree.flatten(value)[0] if isinstance(leaf, torch.Tensor)]
    assert len(cpp) == len(python) == case.tensors
    for a, b in zip(cpp, python, strict=True):
        assert a is b or torch.equal(a, b)


@needs_cpp
@pytest.mark.parametrize("case", _CPP_CASES, ids=_ids(_CPP_CASES))
def test_both_languages_scatter_and_gather_alike(case):
    value = case.make()
    devices = cpu_devices(DEVICES)
    python = torchdp.scatter(value, devices)
    cpp = torchdp_testing.structure_scatter(value, devices)
    assert len(cpp) == len(python) == case.replicas
    for mine, theirs in zip(python, cpp, strict=True):
        _assert_leaves_equal(theirs, mine)
    if case.round_trip:
        joined = torchdp_testing.structure_gather(list(python), CPU)
        _assert_leaves_equal(joined, torchdp.gather(python, CPU))


def _assert_leaves_equal(a, b):
    a_leaves, b_leaves = _tree.flatten(a)[0], _tree.flatten(b)[0]
    assert len(a_leaves) == len(b_leaves)
    for x, y in zip(a_leaves, b_leaves, strict=True):
        if isinstance(y, torch.Tensor):
            torch.testing.assert_close(x, y, rtol=0, atol=0)
        else:
            assert x == y
