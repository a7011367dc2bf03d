"""Scatter and gather of nested inputs and outputs, as ``torch.nn.parallel.scatter_gather``."""

from __future__ import annotations

import cmath
import collections
import copy
import enum
import warnings
from collections.abc import Callable, Sequence
from typing import Any, TypeVar, overload

import torch
from torch.utils import _pytree

from torchdp import _C
from torchdp._devices import DeviceLike, _check_dim, _to_device, _to_devices

__all__ = ["scatter", "scatter_kwargs", "gather"]

_SCATTER = "torchdp.scatter"


def _is_namedtuple(obj: Any) -> bool:
    return isinstance(obj, tuple) and hasattr(obj, "_asdict") and hasattr(obj, "_fields")


def _holds(rebuilt: dict[Any, Any], items: dict[Any, Any]) -> bool:
    """Whether ``rebuilt`` holds exactly ``items``, in order and by identity."""
    return list(dict.keys(rebuilt)) == list(items) and all(
        dict.__getitem__(rebuilt, k) is v for k, v in items.items()
    )


def _rebuild_dict(like: dict[Any, Any], pairs: Any, api: str) -> dict[Any, Any]:
    """A dict of ``like``'s type holding ``pairs``, built the way that type builds itself.

    The one rule of scatter and gather for mappings. Its constructor from a dict comes first
    (Hugging Face's ``ModelOutput``, attribute dicts: their attribute views follow). A type whose
    constructor takes other arguments (``defaultdict``) or changes the values is rebuilt from a
    shallow copy by item assignment, so its own ``__setitem__`` still runs.
    """
    cls = type(like)
    if cls is dict or cls is collections.OrderedDict:
        return cls(pairs)
    items = dict(pairs)  # a gather's values first: their errors are not the rebuild's
    try:
        rebuilt = cls(items)
        if type(rebuilt) is cls and _holds(rebuilt, items):
            return rebuilt
    except Exception:
        pass
    try:
        rebuilt = copy.copy(like)
        dict.clear(rebuilt)
        for key, value in items.items():
            rebuilt[key] = value
    except Exception as e:
        raise TypeError(
            f"{api}: cannot rebuild a {cls.__module__}.{cls.__qualname__} per replica: neither "
            f"{cls.__qualname__}(dict) nor item assignment into a copy of it works ({e}); pass a "
            "plain dict instead"
        ) from e
    return rebuilt


# Note [Objects split by their attributes]
# Some objects carry per-sample state in their attributes rather than in a container: the KV caches
# of Hugging Face transformers (a Cache holding a list of layers, each holding keys and values of
# shape [batch, heads, seq, dim] next to per-layer scalars such as the sliding window, the tokens
# seen, a 0-dim window tensor). PyTorch passes them whole to every replica and gathers them through
# their iteration, which stacks the per-layer scalars into vectors. torchdp splits and joins them
# attribute by attribute: tensors with a batch dimension split and concatenate along dim; 0-dim
# tensors are per-object scalars, copied to each replica and kept as one by gather when every
# replica holds the same; other values follow scatter's and gather's rules (containers walked,
# equal constants kept); a torch.device attribute follows the object's tensors. The classes are
# found by name in the class's MRO, so torchdp needs no import of theirs.
SPLIT_BY_ATTRIBUTES = frozenset(
    {
        "transformers.cache_utils.Cache",
        "transformers.cache_utils.CacheLayerMixin",
        "transformers.cache_utils.LinearAttentionCacheLayerMixin",
    }
)
_by_attributes_cache: dict[type, bool] = {}


def _splits_by_attributes(obj: Any) -> bool:
    cls = type(obj)
    known = _by_attributes_cache.get(cls)
    if known is None:
        known = hasattr(obj, "__dict__") and any(
            f"{c.__module__}.{c.__qualname__}" in SPLIT_BY_ATTRIBUTES for c in cls.__mro__
        )
        _by_attributes_cache[cls] = known
    return known


def _is_scalar_tensor(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() == 0


def _object_parts(obj: Any) -> tuple[list[str], list[Any], Callable[[list[Any]], Any]]:
    """Scatter's parts of an object split by its attributes (Note [Objects split by their
    attributes]): the attributes that split; the rebuild copies the object and sets them."""
    attributes = dict(vars(obj))
    names = [
        k
        for k, v in attributes.items()
        if not _is_scalar_tensor(v) and (isinstance(v, torch.Tensor) or _parts(v) is not None)
    ]

    def rebuild(children: list[Any]) -> Any:
        new = copy.copy(obj)
        state = vars(new)
        for key, value in attributes.items():
            if isinstance(value, (dict, list, set)):  # an empty one: each replica its own
                state[key] = copy.copy(value)
        state.update(zip(names, children, strict=True))
        device = next(
            (c.device for c in children if isinstance(c, torch.Tensor) and c.dim() > 0), None
        )
        for key, value in attributes.items():
            if _is_scalar_tensor(value):  # each replica its own (in-place updates)
                state[key] = value.to(device or value.device, copy=True)
            elif isinstance(value, torch.device) and device is not None:
                state[key] = device
        return new

    return [f".{k}" for k in names], [attributes[k] for k in names], rebuild


def _parts(
    obj: Any, labelled: bool = False
) -> tuple[list[str] | None, list[Any], Callable[[list[Any]], Any]] | None:
    """What scatter splits ``obj`` into: (labels, children, rebuild), or ``None`` for a leaf;
    the children's labels (``[0]``, ``['key']``, ``.field``) only when ``labelled``.

    The one walk of scatter's rules, shared with DataParallel's check for short tensors.
    """
    if isinstance(obj, (tuple, list)) and (len(obj) > 0 or _is_namedtuple(obj)):
        labels = [f"[{i}]" for i in range(len(obj))] if labelled else None
        if _is_namedtuple(obj):
            return labels, list(obj), lambda c: type(obj)(*c)
        return labels, list(obj), tuple if isinstance(obj, tuple) else list
    if _splits_by_attributes(obj):
        labels, children, rebuild = _object_parts(obj)
        return (labels if labelled else None), children, rebuild
    if isinstance(obj, dict):
        if not obj:
            return None
        keys = list(obj)
        labels = [f"[{k!r}]" for k in keys] if labelled else None
        return labels, list(obj.values()), lambda c: _rebuild_dict(obj, zip(keys, c), _SCATTER)
    node = _pytree.SUPPORTED_NODES.get(type(obj))
    if node is None:
        return None
    # Split field by field, as gather takes it apart: PyTorch passes it whole to every replica,
    # so the gathered result would hold n copies.
    children, context = node.flatten_fn(obj)
    if not children:
        return None
    labels = None
    if labelled and node.flatten_with_keys_fn is not None:  # field names (its context differs)
        labels = [str(k) for k, _ in node.flatten_with_keys_fn(obj)[0]]
    elif labelled:
        labels = [f"[{i}]" for i in range(len(children))]
    return labels, list(children), lambda c: node.unflatten_fn(c, context)


def _scatter_map(obj: Any, devices: list[torch.device], dim: int) -> Any:
    # A plain recursive function (not a closure), so no reference cycle is left behind.
    if isinstance(obj, torch.Tensor):
        return tuple(_C.scatter(obj, devices, None, dim, True))
    parts = _parts(obj)
    if parts is None:
        # None, numbers, strings, empty containers, other objects: by reference.
        return [obj for _ in devices]
    _, children, rebuild = parts
    if not children:  # an object split by its attributes that holds no batch yet: one copy each
        return [rebuild([]) for _ in devices]
    split = [_scatter_map(child, devices, dim) for child in children]
    return [rebuild(list(chunk)) for chunk in zip(*split, strict=False)]


T = TypeVar("T", dict, list, tuple)


@overload
def scatter(
    inputs: torch.Tensor, target_gpus: Sequence[DeviceLike], dim: int = ...
) -> tuple[torch.Tensor, ...]: ...


@overload
def scatter(inputs: T, target_gpus: Sequence[DeviceLike], dim: int = ...) -> list[T]: ...


def scatter(inputs: Any, target_gpus: Sequence[DeviceLike], dim: int = 0) -> Any:
    r"""Slices tensors into approximately equal chunks and distributes them across devices.

    Same rules as :func:`torch.nn.parallel.scatter`: tensors are split with ``torch.chunk``
    semantics along :attr:`dim` (so there may be fewer chunks than devices); tuples, lists, dicts
    (keeping their type) and named tuples are rebuilt per chunk, ``zip`` truncating to the
    shortest branch; other objects go to every device by reference. Unlike PyTorch, types
    registered with ``torch.utils._pytree`` (``register_dataclass``, ...) are split field by
    field, as :func:`gather` takes them apart. The split is differentiable.

    Args:
        inputs (Any): a tensor or a nested structure holding tensors.
        target_gpus (list of int or torch.device): the devices; ints are CUDA indices,
            ``torch.device('cpu')`` and ``torch.device('meta')`` are accepted and may repeat.
        dim (int, optional): the dimension to split along. Default: ``0``.

    Returns:
        A tuple of chunks for a tensor input, else a list of one rebuilt structure per chunk.

    Example::

        >>> chunks = torchdp.scatter((torch.randn(4, 2), "tag"), [torch.device("cpu")] * 2)
        >>> [c[0].shape[0] for c in chunks], chunks[1][1]
        ([2, 2], 'tag')
    """
    devices = _to_devices(target_gpus, _SCATTER)
    return _scatter_map(inputs, devices, _check_dim(dim, _SCATTER))


def scatter_kwargs(
    inputs: tuple[Any, ...],
    kwargs: dict[str, Any] | None,
    target_gpus: Sequence[DeviceLike],
    dim: int = 0,
) -> tuple[tuple[Any, ...], tuple[dict[str, Any], ...]]:
    r"""Scatters positional and keyword arguments, as :func:`torch.nn.parallel.scatter_kwargs`.

    Both are scattered with :func:`scatter` and the shorter side is padded with ``()`` or
    ``{}``; as in PyTorch, the keyword side only when it has fewer chunks than ``len(inputs)``
    (the number of positional arguments, not of their chunks).

    Args:
        inputs (tuple): the positional arguments.
        kwargs (dict or None): the keyword arguments.
        target_gpus (list of int or torch.device): the devices.
        dim (int, optional): the dimension to split tensors along. Default: ``0``.

    Returns:
        ``(inputs_per_chunk, kwargs_per_chunk)``, two tuples.

    Example::

        >>> args, kws = torchdp.scatter_kwargs((torch.randn(4, 2),), {"scale": 2.0}, ["cpu"] * 2)
        >>> len(args), kws[1]["scale"]
        (2, 2.0)
    """
    scattered_inputs: list[Any] = scatter(inputs, target_gpus, dim) if inputs else []
    scattered_kwargs: list[Any] = scatter(kwargs, target_gpus, dim) if kwargs else []
    if len(scattered_inputs) < len(scattered_kwargs):
        scattered_inputs.extend(() for _ in range(len(scattered_kwargs) - len(scattered_inputs)))
    elif len(scattered_kwargs) < len(inputs):
        # PyTorch's comparison against len(inputs), not the chunk count, kept.
        scattered_kwargs.extend({} for _ in range(len(scattered_inputs) - len(scattered_kwargs)))
    return tuple(scattered_inputs), tuple(scattered_kwargs)


class _GatherTarget:
    """The destination of a gather; remembers whether a tensor went to the CPU through -1."""

    __slots__ = ("device", "minus_one", "used")

    def __init__(self, target_device: Any) -> None:
        self.minus_one = False
        self.used = False
        if isinstance(target_device, str) and target_device == "cpu":
            self.device = torch.device("cpu")
        elif isinstance(target_device, int) and target_device == -1:  # no bool equals -1
            self.device = torch.device("cpu")
            self.minus_one = True
        else:
            self.device = _to_device(target_device, "torchdp.gather")


# Leaves other than tensors that gather passes through when every replica returned an equal one.
GATHER_CONSTANTS = (
    bool,
    int,
    float,
    complex,
    str,
    bytes,
    torch.dtype,
    torch.device,
    torch.layout,
    torch.memory_format,
    enum.Enum,
)


def _same_constant(a: Any, b: Any) -> bool:
    if isinstance(a, (float, complex)) and cmath.isnan(a) and cmath.isnan(b):  # NaN equals NaN
        return True
    return bool(a == b)


def _mismatch(outputs: Sequence[Any], i: int) -> TypeError:
    def kind(o: Any) -> str:
        return "a tensor" if isinstance(o, torch.Tensor) else type(o).__qualname__

    return TypeError(
        f"torchdp.gather: output 0 holds {kind(outputs[0])} where output {i} holds "
        f"{kind(outputs[i])}; every replica must return the same structure"
    )


class _ObjectGatherError(TypeError):
    """Gather's refusal of objects split by their attributes, naming the outermost object and
    the path of attributes to the value that cannot be joined."""

    def __init__(self, cls: type, key: str, reason: str, dim: int) -> None:
        super().__init__()
        self.cls, self.path, self.reason, self.dim = cls, [key], reason, dim

    def __str__(self) -> str:
        return (
            f"torchdp.gather: cannot join the replicas' {self.cls.__module__}."
            f"{self.cls.__qualname__} objects along dim {self.dim}: its attribute "
            f"{'.'.join(self.path)!r} {self.reason}. For a transformers cache, call the model "
            "with use_cache=False (or use torchdp.DataParallel with gather_output=False to get "
            "the per-replica outputs as they are)"
        )


def _gather_object(outputs: Sequence[Any], target: _GatherTarget, dim: int) -> Any:
    """The replicas' objects split by their attributes joined into one (Note [Objects split by
    their attributes])."""
    out = outputs[0]
    cls = type(out)
    states = [vars(o) for o in outputs]
    for i, (o, state) in enumerate(zip(outputs, states, strict=True)):
        if type(o) is not cls or state.keys() != states[0].keys():
            raise TypeError(
                f"torchdp.gather: replica 0 returned a {cls.__qualname__} and replica {i} a "
                f"{type(o).__qualname__} with other attributes; every replica must return the "
                "same structure"
            )
    new = copy.copy(out)
    joined = vars(new)
    has_tensors = False
    for key in states[0]:
        values = [state[key] for state in states]
        first = values[0]
        if all(v is first for v in values) and not isinstance(first, torch.Tensor):
            continue  # one object for all (a class, a shared setting): kept as it is
        if isinstance(first, torch.device):
            continue  # follows the tensors, below
        if _is_scalar_tensor(first) or isinstance(first, GATHER_CONSTANTS):
            # A per-object scalar (tokens seen, a window): one value, the same in every replica.
            same = all(
                type(v) is type(first)
                and (
                    v.dtype == first.dtype and v.item() == first.item()
                    if _is_scalar_tensor(v)
                    else _same_constant(v, first)
                )
                for v in values
            )
            if not same:
                shown = [v.item() if _is_scalar_tensor(v) else v for v in values]
                raise _ObjectGatherError(cls, key, f"differs between replicas ({shown})", dim)
            joined[key] = first.to(target.device) if _is_scalar_tensor(first) else first
            continue
        try:
            joined[key] = _gather_map(values, target, dim)
        except _ObjectGatherError as e:
            e.cls = cls
            e.path.insert(0, key)
            raise
        except (TypeError, ValueError) as e:
            raise _ObjectGatherError(cls, key, f"cannot be joined: {e}", dim) from e
        has_tensors = has_tensors or isinstance(first, torch.Tensor)
    for key, first in states[0].items():
        if isinstance(first, torch.device):
            same = all(state[key] == first for state in states)
            joined[key] = target.device if has_tensors or not same else first
    return new


def _gather_map(outputs: Sequence[Any], target: _GatherTarget, dim: int) -> Any:
    out = outputs[0]
    if isinstance(out, torch.Tensor):
        for i, other in enumerate(outputs):
            if not isinstance(other, torch.Tensor):
                raise _mismatch(outputs, i)
        target.used = True
        return _C.gather(list(outputs), target.device, dim, True)
    for i, other in enumerate(outputs):
        # PyTorch would drop these tensors (None in output 0) or cut them into rows (a sequence).
        if isinstance(other, torch.Tensor):
            raise _mismatch(outputs, i)
    if out is None:
        return None
    if isinstance(out, GATHER_CONSTANTS):
        # Equal constants pass through; PyTorch fails or turns strings into a map object's text.
        if all(type(o) is type(out) and _same_constant(o, out) for o in outputs):
            return out
        raise TypeError(
            f"torchdp.gather: replica outputs of type {type(out).__qualname__} differ between "
            f"replicas ({', '.join(f'{o!r:.30}' for o in outputs)}) and cannot be concatenated; "
            "return tensors instead (e.g. torch.tensor(value)), or use torchdp.DataParallel "
            "with gather_output=False to get the per-replica outputs as they are"
        )
    if _splits_by_attributes(out):
        return _gather_object(outputs, target, dim)
    node = _pytree.SUPPORTED_NODES.get(type(out))
    if node is not None and not isinstance(out, (dict, list, tuple)):
        # A pytree-registered type: its children are gathered and the object rebuilt from them.
        flat = [node.flatten_fn(o) if type(o) is type(out) else None for o in outputs]
        if any(f is None or f[1] != flat[0][1] for f in flat):
            raise TypeError(
                f"torchdp.gather: the replicas' {type(out).__qualname__} outputs differ in type "
                "or structure; every replica must return the same structure"
            )
        children = [_gather_map(group, target, dim) for group in zip(*(f[0] for f in flat))]
        return node.unflatten_fn(children, flat[0][1])
    if not hasattr(out, "__iter__"):
        # Replica 0's object would silently drop the others' tensors; PyTorch fails here too.
        raise TypeError(
            f"torchdp.gather: a replica output holds a {type(out).__module__}."
            f"{type(out).__qualname__} object, which gather cannot take apart; return tensors, "
            "tuples, lists, dicts or named tuples of them, register its type with "
            "torch.utils._pytree (a dataclass: torch.utils._pytree.register_dataclass), or use "
            "torchdp.DataParallel with gather_output=False to get the per-replica outputs as they "
            "are"
        )
    if isinstance(out, dict):
        for i, d in enumerate(outputs):
            if not isinstance(d, dict):
                raise _mismatch(outputs, i)
        if not all(len(out) == len(d) for d in outputs):
            raise ValueError("All dicts must have the same number of keys")
        for i, d in enumerate(outputs):
            if d.keys() != out.keys():
                raise ValueError(
                    f"torchdp.gather: the replicas returned dicts with different keys: replica 0 "
                    f"has {list(out)}, replica {i} has {list(d)}; every replica must return the "
                    "same keys"
                )
        pairs = ((k, _gather_map([d[k] for d in outputs], target, dim)) for k in out)
        return _rebuild_dict(out, pairs, "torchdp.gather")
    if hasattr(out, "__next__") or isinstance(out, (set, frozenset)):
        # Iterators are consumed by taking them apart; sets have no order to pair items by.
        raise TypeError(
            f"torchdp.gather: a replica output is a {type(out).__qualname__}, which gather cannot "
            "pair item by item across replicas; return a tuple or list instead (e.g. "
            "tuple(generator))"
        )
    for i, other in enumerate(outputs):
        if not hasattr(other, "__len__"):
            raise _mismatch(outputs, i)
    lengths = [len(o) for o in outputs]
    if any(n != lengths[0] for n in lengths):
        # PyTorch's zip drops the longer outputs' extra items without a word.
        raise ValueError(
            f"torchdp.gather: the replicas returned {type(out).__qualname__} outputs of different "
            f"lengths {lengths}; every replica must return the same structure"
        )
    items = (_gather_map(group, target, dim) for group in zip(*outputs, strict=True))
    return type(out)._make(items) if _is_namedtuple(out) else type(out)(items)


def gather(outputs: Any, target_device: DeviceLike, dim: int = 0) -> Any:
    r"""Gathers per-device outputs onto one device, as :func:`torch.nn.parallel.gather`.

    Tensors are concatenated along :attr:`dim` (differentiably); 0-dim tensors along dim 0
    become a vector, with PyTorch's UserWarning. ``None`` stays ``None``; dicts must have the same
    keys (``ValueError`` otherwise) and keep their type; sequences keep theirs.

    Args:
        outputs (sequence): one output structure per device.
        target_device (int, str or torch.device): where to put the result; ``'cpu'`` for the
            CPU (``-1`` too, deprecated with a FutureWarning as in PyTorch).
        dim (int, optional): the dimension to concatenate along. Default: ``0``.

    Returns:
        The gathered structure.

    Example::

        >>> outs = [torch.ones(2, 3), torch.zeros(1, 3)]
        >>> torchdp.gather(outs, "cpu").shape
        torch.Size([3, 3])
    """
    target = _GatherTarget(target_device)
    if len(outputs) == 0:
        raise ValueError(
            "torchdp.gather: expected one output per replica, got an empty sequence of outputs"
        )
    result = _gather_map(outputs, target, _check_dim(dim, "torchdp.gather"))
    if target.minus_one and target.used:
        # torch.cuda.comm.gather's warning, once per call (PyTorch warns once per tensor).
        warnings.warn(
            "Using -1 to represent CPU tensor is deprecated. Please use a "
            'device object or string instead, e.g., "cpu".',
            FutureWarning,
            stacklevel=2,
        )
    return result
