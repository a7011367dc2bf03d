"""scatter / scatter_kwargs / gather: PyTorch's structure rules on CPU device lists, plus a
hypothesis round trip gather(scatter(x)) == x over random nested structures."""

from __future__ import annotations

import gc
import warnings
from collections import Counter, OrderedDict, defaultdict, namedtuple
from dataclasses import dataclass
from typing import NamedTuple

import pytest
import torch
from dp_testing import cpu_devices
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import torchdp

CPU = torch.device("cpu")
META = torch.device("meta")

Point = namedtuple("Point", ["x", "y"])


class TypedPoint(NamedTuple):
    x: torch.Tensor
    label: str


class MyDict(dict):
    pass


@dataclass
class Box:
    t: torch.Tensor


def test_scatter_tensor_returns_a_tuple_of_chunks():
    x = torch.arange(10.0).reshape(5, 2)
    chunks = torchdp.scatter(x, cpu_devices(2))
    assert isinstance(chunks, tuple) and len(chunks) == 2
    assert [c.shape[0] for c in chunks] == [3, 2]
    torch.testing.assert_close(torch.cat(chunks), x)


def test_scatter_may_give_fewer_chunks_than_devices():
    chunks = torchdp.scatter(torch.randn(5, 2), cpu_devices(4))
    assert [c.shape[0] for c in chunks] == [2, 2, 1]


@pytest.mark.parametrize("dim", [1, -1])
def test_scatter_along_other_dims(dim):
    x = torch.randn(2, 6)
    chunks = torchdp.scatter(x, cpu_devices(3), dim=dim)
    assert [c.shape for c in chunks] == [torch.Size([2, 2])] * 3


def test_scatter_structures():
    x = torch.randn(4, 3)
    box = Box(torch.randn(4))
    inputs = (
        x,
        [x, "s"],
        {"k": x, "n": 1},
        Point(x, 2),
        TypedPoint(x, "lbl"),
        MyDict(a=x),
        None,
        5,
        box,
        (),
        [],
        {},
    )
    parts = torchdp.scatter(inputs, cpu_devices(2))
    assert isinstance(parts, list) and len(parts) == 2
    for i, part in enumerate(parts):
        assert isinstance(part, tuple) and len(part) == len(inputs)
        rows = slice(2 * i, 2 * i + 2)
        torch.testing.assert_close(part[0], x[rows])
        assert isinstance(part[1], list) and part[1][1] == "s"
        assert isinstance(part[2], dict) and part[2]["n"] == 1
        assert type(part[3]) is Point and part[3].y == 2
        assert type(part[4]) is TypedPoint and part[4].label == "lbl"
        assert type(part[5]) is MyDict
        torch.testing.assert_close(part[5]["a"], x[rows])
        assert part[6] is None and part[7] == 5
        assert part[8] is box  # non-tensors (dataclasses included) by reference
        assert part[9] == () and part[10] == [] and part[11] == {}
        assert part[10] is inputs[10]


def test_scatter_zip_truncates_to_the_shortest_branch():
    parts = torchdp.scatter((torch.randn(2, 1), torch.randn(6, 1), "x"), cpu_devices(3))
    assert len(parts) == 2


def test_scatter_is_differentiable():
    x = torch.randn(6, 2, requires_grad=True)
    chunks = torchdp.scatter(x, cpu_devices(3))
    sum((c * (i + 1)).sum() for i, c in enumerate(chunks)).backward()
    torch.testing.assert_close(x.grad, torch.tensor([1.0, 1, 2, 2, 3, 3])[:, None].expand(6, 2))


def test_scatter_to_meta():
    chunks = torchdp.scatter(torch.randn(4, 2), [CPU, META])
    assert chunks[0].device == CPU and chunks[1].device.type == "meta"


def test_scatter_kwargs_pads_the_shorter_side():
    x = torch.randn(4, 2)
    inputs, kwargs = torchdp.scatter_kwargs((x,), {}, cpu_devices(2))
    assert len(inputs) == 2 and kwargs == ({}, {})
    inputs, kwargs = torchdp.scatter_kwargs((), {"x": x}, cpu_devices(2))
    assert inputs == ((), ()) and len(kwargs) == 2
    assert isinstance(inputs, tuple) and isinstance(kwargs, tuple)


def test_scatter_kwargs_quirk_is_kept():
    # kwargs scatter into fewer chunks than the inputs, but there are no more positional
    # arguments than kwargs chunks: PyTorch compares against len(inputs) and does not pad.
    inputs, kwargs = torchdp.scatter_kwargs(
        (torch.randn(4, 2),), {"y": torch.randn(1, 2)}, cpu_devices(2)
    )
    assert len(inputs) == 2 and len(kwargs) == 1
    # With more positional arguments than kwargs chunks, the kwargs side is padded.
    inputs, kwargs = torchdp.scatter_kwargs(
        (torch.randn(4, 2), 1, 2), {"y": torch.randn(1, 2)}, cpu_devices(2)
    )
    assert len(inputs) == 2 and len(kwargs) == 2 and kwargs[1] == {}


def test_gather_tensors_and_structures():
    a, b = torch.randn(2, 3), torch.randn(1, 3)
    out = torchdp.gather([a, b], CPU)
    torch.testing.assert_close(out, torch.cat([a, b]))
    out = torchdp.gather([(a, None), (b, None)], "cpu")
    assert isinstance(out, tuple) and out[1] is None
    out = torchdp.gather([[a], [b]], CPU)
    assert isinstance(out, list)
    out = torchdp.gather([OrderedDict(z=a, y=a), OrderedDict(z=b, y=b)], CPU)
    assert type(out) is OrderedDict and list(out) == ["z", "y"]
    out = torchdp.gather([Point(a, a), Point(b, b)], CPU)
    assert type(out) is Point
    out = torchdp.gather([MyDict(k=a), MyDict(k=b)], CPU)
    assert type(out) is MyDict


def test_gather_along_dim():
    a, b = torch.randn(2, 3), torch.randn(2, 1)
    torch.testing.assert_close(torchdp.gather([a, b], CPU, dim=1), torch.cat([a, b], 1))
    torch.testing.assert_close(torchdp.gather([a, b], CPU, dim=-1), torch.cat([a, b], 1))


def test_gather_is_differentiable():
    a = torch.randn(2, 3, requires_grad=True)
    b = torch.randn(1, 3, requires_grad=True)
    (torchdp.gather([a, b], CPU) * 2).sum().backward()
    torch.testing.assert_close(a.grad, torch.full((2, 3), 2.0))
    torch.testing.assert_close(b.grad, torch.full((1, 3), 2.0))


def test_gather_scalars_become_a_vector_with_a_warning():
    with pytest.warns(
        UserWarning,
        match="Was asked to gather along dimension 0, but all input "
        "tensors were scalars; will instead unsqueeze and "
        "return a vector.",
    ):
        out = torchdp.gather([torch.tensor(1.0), torch.tensor(2.0)], CPU)
    torch.testing.assert_close(out, torch.tensor([1.0, 2.0]))


def test_gather_minus_one_means_cpu_with_a_future_warning():
    with pytest.warns(
        FutureWarning,
        match="Using -1 to represent CPU tensor is deprecated. "
        "Please use a device object or string instead, "
        'e.g., "cpu".',
    ):
        out = torchdp.gather([torch.ones(1), torch.ones(1)], -1)
    assert out.device == CPU
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        torchdp.gather([torch.ones(1), torch.ones(1)], "cpu")


def test_gather_dicts_must_have_the_same_number_of_keys():
    with pytest.raises(ValueError, match="All dicts must have the same number of keys"):
        torchdp.gather([{"a": torch.ones(1)}, {"a": torch.ones(1), "b": torch.ones(1)}], CPU)


def test_gather_sequences_of_different_lengths_fail():
    with pytest.raises(ValueError, match=r"tuple outputs of different lengths \[1, 2\]"):
        torchdp.gather([(torch.ones(1),), (torch.ones(1), torch.ones(1))], CPU)
    with pytest.raises(ValueError, match=r"list outputs of different lengths \[2, 2, 1\]"):
        torchdp.gather([[torch.ones(1)] * 2, [torch.ones(1)] * 2, [torch.ones(1)]], CPU)


def test_gather_of_nothing_and_of_iterators_is_an_error():
    with pytest.raises(ValueError, match="torchdp.gather: expected one output per replica"):
        torchdp.gather([], CPU)
    for make in (lambda: (t for t in [torch.ones(1)]), lambda: iter([torch.ones(1)])):
        with pytest.raises(TypeError, match="return a tuple or list instead"):
            torchdp.gather([make(), make()], CPU)
    with pytest.raises(TypeError, match="output 0 holds tuple where output 1 holds NoneType"):
        torchdp.gather([(torch.ones(1),), None], CPU)
    with pytest.raises(TypeError, match="a replica output is a set"):
        torchdp.gather([{1}, {1}], CPU)


def test_gather_to_meta():
    out = torchdp.gather([torch.ones(1, device="meta"), torch.ones(2, device="meta")], META)
    assert out.device.type == "meta" and out.shape == (3,)


@pytest.mark.parametrize("bad", [1.5, object(), [CPU]])
def test_gather_rejects_bad_target(bad):
    with pytest.raises(TypeError, match="torchdp.gather: expected a device"):
        torchdp.gather([torch.ones(1)], bad)


@pytest.mark.parametrize("bad", ["a", 1.0, None, True])
def test_dim_must_be_an_int(bad):
    x = torch.ones(4, 2)
    with pytest.raises(TypeError, match="torchdp.scatter: dim must be an int"):
        torchdp.scatter(x, [CPU] * 2, dim=bad)
    with pytest.raises(TypeError, match="torchdp.scatter: dim must be an int"):
        torchdp.scatter_kwargs((x,), {}, [CPU] * 2, dim=bad)
    with pytest.raises(TypeError, match="torchdp.gather: dim must be an int"):
        torchdp.gather([x, x], CPU, dim=bad)


def test_gather_integer_like_dims():
    class Index:  # any type with __index__, like numpy's integers
        def __index__(self) -> int:
            return 1

    out = torchdp.gather([torch.ones(2, 1), torch.ones(2, 2)], CPU, dim=Index())
    assert out.shape == (2, 3)


def test_gather_of_outputs_that_are_not_tensors_is_an_error():
    t = torch.ones(2)
    with pytest.raises(TypeError, match="output 0 holds a tensor where output 1 holds NoneType"):
        torchdp.gather([t, None], CPU)
    with pytest.raises(TypeError, match="output 0 holds a tensor where output 2 holds int"):
        torchdp.gather([(t, t), (t, t), (t, 1)], CPU)
    # The other way round too (PyTorch returns None, or cuts the tensor into rows).
    with pytest.raises(TypeError, match="output 0 holds NoneType where output 1 holds a tensor"):
        torchdp.gather([None, t], CPU)
    with pytest.raises(TypeError, match="output 0 holds NoneType where output 2 holds a tensor"):
        torchdp.gather([(t, None), (t, None), (t, t)], CPU)
    with pytest.raises(TypeError, match="output 0 holds tuple where output 1 holds a tensor"):
        torchdp.gather([(t,), t], CPU)
    for bad in ([1.0, 2.0], ["a", "b"], [(t, 1), (t, 2)], [b"x", b"y"], [1, 1.0]):
        kind = type(bad[0][1] if isinstance(bad[0], tuple) else bad[0]).__qualname__
        with pytest.raises(TypeError, match=f"outputs of type {kind} differ between replicas"):
            torchdp.gather(bad, CPU)
    # Equal constants are kept (PyTorch fails on numbers and garbles strings).
    assert torchdp.gather([(t, "tag", 3), (t, "tag", 3)], CPU)[1:] == ("tag", 3)
    assert torchdp.gather([{"n": 2.5}, {"n": 2.5}], CPU) == {"n": 2.5}
    # None, containers and named tuples are still fine.
    assert torchdp.gather([None, None], CPU) is None
    assert torchdp.gather([[t], [t]], CPU)[0].shape == (4,)
    # NaN is equal to itself here; dtypes and enum members are constants too.
    both = torchdp.gather([(t, float("nan"), torch.float16)] * 2, CPU)
    assert both[1] != both[1] and both[2] is torch.float16


@dataclass
class ModelOut:
    loss: torch.Tensor
    logits: torch.Tensor


def test_gather_refuses_objects_it_cannot_take_apart():
    # Comparing such objects says nothing about their tensors: replica 0's object would drop the
    # others' tensors (and gradients). PyTorch fails on them too.
    w = torch.ones(2, requires_grad=True)
    outs = [ModelOut(w.sum(), w * 1), ModelOut(w.sum(), w * 2)]  # equal losses
    with pytest.raises(
        TypeError, match=r"holds a .*ModelOut object, which gather cannot take"
    ) as e:
        torchdp.gather(outs, CPU)
    assert "register_dataclass" in str(e.value) and "gather_output=False" in str(e.value)


def test_gather_takes_apart_types_registered_with_pytree():
    from torch.utils import _pytree

    @dataclass
    class Registered:
        loss: torch.Tensor
        logits: torch.Tensor

    _pytree.register_dataclass(Registered)
    w = torch.ones(2, requires_grad=True)
    with pytest.warns(UserWarning, match="scalars"):  # the losses: 0-dim tensors
        out = torchdp.gather([Registered(w.sum(), w * 1), Registered(w.sum(), w * 2)], CPU)
    assert isinstance(out, Registered)
    assert torch.equal(out.logits, torch.tensor([1.0, 1.0, 2.0, 2.0]))
    with pytest.warns(UserWarning, match="scalars"):
        out = torchdp.gather([Registered(w.sum(), w), Registered(w.sum(), w)], CPU)
    out.loss.sum().backward()  # both replicas' losses reach w
    assert torch.equal(w.grad, torch.full((2,), 2.0))
    with pytest.raises(TypeError, match="differ in type or structure"):
        torchdp.gather([Registered(w.sum(), w), ModelOut(w.sum(), w)], CPU)


def test_scatter_splits_types_registered_with_pytree():
    """Symmetric with gather: a registered dataclass input is split field by field, so a model
    that takes and returns one gives the plain module's rows and gradients."""
    from collections import deque

    from torch.utils import _pytree

    @dataclass
    class Batch:
        x: torch.Tensor
        tag: str

    _pytree.register_dataclass(Batch)
    x = torch.arange(12.0).reshape(6, 2)
    chunks = torchdp.scatter(Batch(x, "t"), cpu_devices(3))
    assert [type(c) for c in chunks] == [Batch] * 3
    assert [c.tag for c in chunks] == ["t"] * 3
    assert torch.equal(torch.cat([c.x for c in chunks]), x)
    chunks = torchdp.scatter(deque([x, 1]), cpu_devices(2))
    assert [type(c) for c in chunks] == [deque] * 2 and chunks[1][1] == 1
    assert torch.equal(chunks[1][0], x[3:])

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(2, 3)

        def forward(self, b):
            return Batch(self.lin(b.x), b.tag)

    net = Net()
    out = torchdp.DataParallel(net, devices=cpu_devices(3))(Batch(x, "t"))
    assert isinstance(out, Batch) and out.x.shape == (6, 3) and out.tag == "t"
    out.x.sum().backward()
    dp_grad = net.lin.weight.grad.clone()
    net.zero_grad()
    net(Batch(x, "t")).x.sum().backward()
    torch.testing.assert_close(dp_grad, net.lin.weight.grad)


def test_scatter_rejects_bad_targets():
    with pytest.raises(
        TypeError, match="torchdp.scatter: expected a list of devices, got a single device"
    ):
        torchdp.scatter(torch.ones(2), CPU)
    with pytest.raises(ValueError, match="torchdp.scatter: device index -2 is negative"):
        torchdp.scatter(torch.ones(2), [-2])
    with pytest.raises(RuntimeError, match="torchdp.scatter: 'nonsense' is not a device"):
        torchdp.scatter(torch.ones(2), ["nonsense"])


def test_scatter_does_not_leave_reference_cycles():
    x = torch.randn(4, 2)
    gc_was = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        torchdp.scatter((x, {"a": [x]}), cpu_devices(2))
        torchdp.gather([(x, {"a": x}), (x, {"a": x})], CPU)
        assert gc.collect() == 0
    finally:
        if gc_was:
            gc.enable()


# ---------------------------------------------------------------------------------------------
# Property: gather(scatter(x)) == x, for nested structures of tensors and non-tensors.
# ---------------------------------------------------------------------------------------------

_BATCH = 6


def _chunks(n: int) -> int:
    return len(torch.empty(_BATCH).chunk(n))


tensors = st.lists(st.integers(1, 3), min_size=0, max_size=2).map(lambda s: torch.randn(_BATCH, *s))
leaves = tensors | st.none()
# Non-tensor leaves are only allowed where gather can rebuild them: none (above), and inside
# namedtuples/dicts we keep tensors. Non-tensors are checked separately on the scatter side.
structures = st.recursive(
    leaves,
    lambda children: (
        st.lists(children, min_size=1, max_size=3)
        | st.lists(children, min_size=1, max_size=3).map(tuple)
        | st.dictionaries(st.text("abc", min_size=1, max_size=2), children, min_size=1, max_size=3)
        | st.tuples(children, children).map(lambda p: Point(*p))
    ),
    max_leaves=8,
)


def _has_tensor(obj) -> bool:
    if isinstance(obj, torch.Tensor):
        return True
    if isinstance(obj, dict):
        return any(_has_tensor(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return any(_has_tensor(v) for v in obj)
    return False


def _assert_same(actual, expected):
    assert type(actual) is type(expected)
    if isinstance(expected, torch.Tensor):
        torch.testing.assert_close(actual, expected, rtol=0, atol=0)
    elif isinstance(expected, dict):
        assert list(actual) == list(expected)
        for k in expected:
            _assert_same(actual[k], expected[k])
    elif isinstance(expected, (list, tuple)):
        assert len(actual) == len(expected)
        for a, e in zip(actual, expected, strict=True):
            _assert_same(a, e)
    else:
        assert actual is expected or actual == expected


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(structure=structures, n=st.integers(1, 4))
def test_gather_of_scatter_is_identity(structure, n):
    if not _has_tensor(structure) or isinstance(structure, torch.Tensor):
        # A lone tensor scatters to a tuple of chunks; wrap it like DataParallel's inputs are.
        structure = (structure,)
    if not _has_tensor(structure):
        return
    parts = torchdp.scatter(structure, cpu_devices(n))
    assert len(parts) == _chunks(n)
    _assert_same(torchdp.gather(parts, CPU), structure)


non_tensor_leaves = (
    st.integers() | st.text(max_size=3) | st.none() | st.booleans() | st.builds(object)
)


@settings(max_examples=60, deadline=None)
@given(
    leaf=non_tensor_leaves,
    container=st.sampled_from(["tuple", "list", "dict", "namedtuple"]),
    n=st.integers(1, 4),
)
def test_non_tensors_are_passed_by_reference(leaf, container, n):
    x = torch.randn(_BATCH, 2)
    build = {
        "tuple": lambda a, b: (a, b),
        "list": lambda a, b: [a, b],
        "dict": lambda a, b: {"t": a, "v": b},
        "namedtuple": Point,
    }[container]
    parts = torchdp.scatter(build(x, leaf), cpu_devices(n))
    assert len(parts) == _chunks(n)
    for i, part in enumerate(parts):
        value = part["v"] if container == "dict" else part[1]
        assert value is leaf
        tensor = part["t"] if container == "dict" else part[0]
        assert tensor.shape[0] == len(x.chunk(n)[i])


def test_mapping_types_are_rebuilt_per_chunk():
    # PyTorch rebuilds dicts with type(obj)(pairs), which a defaultdict refuses (pytorch #52597)
    # and a Counter misreads; torchdp takes their constructor from a dict where it rebuilds them,
    # else item assignment into a copy (keeping the factory).
    d = defaultdict(list, {"a": torch.randn(4)})
    chunks = torchdp.scatter(d, cpu_devices(2))
    assert [type(c) for c in chunks] == [defaultdict, defaultdict]
    assert all(c.default_factory is list and c["a"].shape == (2,) for c in chunks)
    counts = Counter({"a": torch.arange(4.0)})
    chunks = torchdp.scatter(counts, cpu_devices(2))
    assert [type(c) for c in chunks] == [Counter, Counter]
    assert torch.equal(chunks[1]["a"], torch.tensor([2.0, 3.0]))
    gathered = torchdp.gather(chunks, "cpu")
    assert type(gathered) is Counter and torch.equal(gathered["a"], torch.arange(4.0))

    class Uncopyable(dict):
        def __init__(self, owner, **items):  # not constructible from a dict alone
            super().__init__(**items)

        def __reduce_ex__(self, protocol):
            raise TypeError("no copies")

    with pytest.raises(TypeError, match=r"cannot rebuild a .*Uncopyable per replica: neither"):
        torchdp.scatter(Uncopyable("me", a=torch.randn(4)), cpu_devices(2))


def test_a_dict_subclass_reports_the_error_of_its_values_not_of_its_copy():
    outputs = [MyDict(a=torch.ones(2)), MyDict(a="two")]
    with pytest.raises(TypeError, match=r"output 0 holds a tensor where output 1 holds str"):
        torchdp.gather(outputs, "cpu")


def test_gather_names_the_replicas_and_keys_of_different_dicts():
    outputs = [{"a": torch.ones(1), "b": torch.ones(1)}, {"a": torch.ones(1), "c": torch.ones(1)}]
    with pytest.raises(ValueError, match=r"replica 0 has \['a', 'b'\], replica 1 has \['a', 'c'\]"):
        torchdp.gather(outputs, "cpu")


class _TakesPerReplica(torch.nn.Module):
    """Scales each chunk's rows by its own per-replica value (as the Hugging Face Trainer's
    num_items_in_batch, one row per device)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(3, 2)

    def forward(self, x, per_replica):
        assert per_replica.shape == (1, 1)
        return self.lin(x) / per_replica


def test_short_batch_takes_the_per_replica_rows_of_the_replicas_that_run():
    net = _TakesPerReplica()
    dp = torchdp.DataParallel(net, devices=cpu_devices(3))
    x = torch.randn(4, 3)  # chunks of 2 and 2: two of the three replicas run
    per_replica = torch.tensor([[2.0], [4.0], [8.0]])
    out = dp(x, per_replica=per_replica)
    want = torch.cat([net.lin(x[:2]) / 2.0, net.lin(x[2:]) / 4.0])
    torch.testing.assert_close(out, want)
    # A tensor that is neither the batch nor one row per device still may not lose rows.
    with pytest.raises(ValueError, match=r"'per_replica' has 6 but positional argument 0 has 4"):
        dp(x, per_replica=torch.ones(6, 1))
    # With as many chunks as devices nothing is dropped and every row is used.
    out = dp(torch.randn(6, 3), per_replica=per_replica)
    assert out.shape == (6, 2)


class _LayerBase:
    """Stands for transformers.cache_utils.CacheLayerMixin: matched by name, not imported."""


_LayerBase.__module__, _LayerBase.__qualname__ = "transformers.cache_utils", "CacheLayerMixin"


class _Layer(_LayerBase):
    def __init__(self, rows: int, seen: int) -> None:
        self.keys = torch.randn(rows, 2, seen, 3)
        self.seen = seen
        self.window = torch.tensor(4)
        self.device = torch.device("cpu")
        self.flags: dict[int, bool] = {}


def test_objects_split_by_their_attributes():
    layer = _Layer(5, seen=6)
    chunks = torchdp.scatter((layer,), cpu_devices(3))
    parts = [c[0] for c in chunks]
    assert [p.keys.shape[0] for p in parts] == [2, 2, 1] and all(type(p) is _Layer for p in parts)
    torch.testing.assert_close(torch.cat([p.keys for p in parts]), layer.keys)
    for p in parts:  # per-object scalars: each replica its own copy, never the original's
        assert p.seen == 6 and p.window.item() == 4 and p.window is not layer.window
        assert p.flags == {} and p.flags is not layer.flags
    assert layer.keys.shape[0] == 5  # the input is left as it was
    for p in parts:
        p.keys = torch.cat([p.keys, torch.ones(p.keys.shape[0], 2, 1, 3)], dim=2)
        p.seen += 1
    joined = torchdp.gather(parts, "cpu")
    assert type(joined) is _Layer and joined.seen == 7 and joined.window.dim() == 0
    assert joined.keys.shape == (5, 2, 7, 3) and joined.device == torch.device("cpu")
    parts[2].seen = 3
    with pytest.raises(
        TypeError,
        match=r"_Layer objects along dim 0: its attribute 'seen' "
        r"differs between replicas \(\[7, 7, 3\]\).*use_cache=False",
    ):
        torchdp.gather(parts, "cpu")
