"""The one Python rule for nested inputs and outputs: which objects are containers, what their
children are and how they are rebuilt.

Note [The Python tree]
Containers: non-empty tuples and lists, named tuples (also empty), non-empty dicts of any subclass
(rebuilt by their own constructor or item assignment, so attribute mirrors such as Hugging Face's
ModelOutput follow), objects split by their attributes (Note [Objects split by their
attributes]) and types registered with torch.utils._pytree with children (register_dataclass,
deque, ...). Everything else is a leaf: tensors, None, constants, strings, empty containers,
unregistered dataclasses and other objects, which scatter passes to every replica by reference.
flatten() gives the leaves in order and a Spec; unflatten() builds a new structure of that shape
around other leaves (a replica's chunks). scatter, the short-batch check, the compiled-signature
key, parallel_apply's device lookup and the process group's tensor walk read it; gather pairs the
replicas' outputs by the same rule and keeps its own checks of equal structure. C++ has its own
engine over IValues (csrc/torchdp/structure.h); tests/python/structure_cases.py holds the cases
both are tested from.
"""

from __future__ import annotations

import collections
import copy
import enum
from collections.abc import Callable
from typing import Any

import torch
from torch.utils import _pytree

__all__ = ["CONSTANTS", "Spec", "first_tensor", "flatten", "node", "paths", "unflatten"]

# Leaves other than tensors that gather passes through when every replica returned an equal one.
CONSTANTS = (
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


def is_namedtuple(obj: Any) -> bool:
    return isinstance(obj, tuple) and hasattr(obj, "_asdict") and hasattr(obj, "_fields")


def _holds(rebuilt: dict[Any, Any], items: dict[Any, Any]) -> bool:
    """Whether ``rebuilt`` holds exactly ``items``, in order and by identity."""
    return list(dict.keys(rebuilt)) == list(items) and all(
        dict.__getitem__(rebuilt, k) is v for k, v in items.items()
    )


def rebuild_dict(like: dict[Any, Any], pairs: Any, api: str) -> dict[Any, Any]:
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
    except Exception:  # noqa: BLE001  any failure of a foreign constructor: rebuild by items
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


def splits_by_attributes(obj: Any) -> bool:
    cls = type(obj)
    known = _by_attributes_cache.get(cls)
    if known is None:
        known = hasattr(obj, "__dict__") and any(
            f"{c.__module__}.{c.__qualname__}" in SPLIT_BY_ATTRIBUTES for c in cls.__mro__
        )
        _by_attributes_cache[cls] = known
    return known


def is_scalar_tensor(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() == 0


def _object_node(obj: Any) -> tuple[list[Any], Callable[[list[Any]], Any], tuple[str, ...]]:
    """An object split by its attributes: the attributes that split, and a rebuild that copies
    the object and sets them (Note [Objects split by their attributes])."""
    attributes = dict(vars(obj))
    names = tuple(
        k
        for k, v in attributes.items()
        if not is_scalar_tensor(v) and (isinstance(v, torch.Tensor) or node(v) is not None)
    )

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
            if is_scalar_tensor(value):  # each replica its own (in-place updates)
                state[key] = value.to(device or value.device, copy=True)
            elif isinstance(value, torch.device) and device is not None:
                state[key] = device
        return new

    return [attributes[k] for k in names], rebuild, names


def node(obj: Any) -> tuple[list[Any], Callable[[list[Any]], Any], Any] | None:
    """``(children, rebuild, context)`` of a container (Note [The Python tree]), ``None`` for a
    leaf. ``rebuild(new_children)`` makes a new container of ``obj``'s kind; ``context`` tells
    two containers of one type apart (dict keys, attribute names, a pytree context)."""
    if isinstance(obj, (tuple, list)):
        if is_namedtuple(obj):
            cls = type(obj)
            return list(obj), lambda c: cls(*c), None
        if not obj:
            return None
        return list(obj), tuple if isinstance(obj, tuple) else list, None
    if splits_by_attributes(obj):
        return _object_node(obj)
    if isinstance(obj, dict):
        if not obj:
            return None
        keys = tuple(obj)
        return (
            list(obj.values()),
            lambda c: rebuild_dict(obj, zip(keys, c, strict=True), "torchdp.scatter"),
            keys,
        )
    registered = _pytree.SUPPORTED_NODES.get(type(obj))
    if registered is None:
        return None
    # Split field by field, as gather takes it apart: PyTorch passes it whole to every replica,
    # so the gathered result would hold n copies.
    children, context = registered.flatten_fn(obj)
    if not children:
        return None
    return list(children), lambda c: registered.unflatten_fn(c, context), context


def _labels(obj: Any, children: list[Any], context: Any) -> list[str]:
    """How the children of ``obj`` read in messages: ``[0]``, ``['key']``, ``.field``."""
    if splits_by_attributes(obj):
        return [f".{k}" for k in context]
    if isinstance(obj, dict):
        return [f"[{k!r}]" for k in context]
    registered = _pytree.SUPPORTED_NODES.get(type(obj))
    keyed = registered is not None and registered.flatten_with_keys_fn is not None
    if keyed and not isinstance(obj, (tuple, list)):  # field names (its context differs)
        return [str(k) for k, _ in registered.flatten_with_keys_fn(obj)[0]]
    return [f"[{i}]" for i in range(len(children))]


class Spec:
    """The shape of a container in a flattened structure: its type, context, rebuild and
    children's specs (``None`` for a leaf)."""

    __slots__ = ("children", "context", "rebuild", "type")

    def __init__(
        self, cls: type, context: Any, rebuild: Callable[[list[Any]], Any], children: tuple
    ) -> None:
        self.type, self.context, self.rebuild, self.children = cls, context, rebuild, children

    def key(self) -> tuple[Any, ...]:
        """The structure alone, hashable and holding no container: type, context and the
        children's keys (``None`` for a leaf)."""
        context = self.context
        try:
            hash(context)
        except TypeError:  # a pytree context need not be hashable: its type stands for it
            context = type(context)
        return (self.type, context, tuple(None if c is None else c.key() for c in self.children))


def _flatten(obj: Any, leaves: list[Any]) -> Spec | None:
    if isinstance(obj, torch.Tensor):
        leaves.append(obj)
        return None
    found = node(obj)
    if found is None:
        leaves.append(obj)
        return None
    children, rebuild, context = found
    return Spec(type(obj), context, rebuild, tuple([_flatten(c, leaves) for c in children]))


def flatten(obj: Any) -> tuple[list[Any], Spec | None]:
    """The leaves of ``obj`` in order (depth first) and its spec (``None``: ``obj`` is a leaf)."""
    leaves: list[Any] = []
    return leaves, _flatten(obj, leaves)


def _build(spec: Spec | None, leaves: Any) -> Any:
    if spec is None:
        return next(leaves)
    return spec.rebuild([_build(c, leaves) for c in spec.children])


def unflatten(spec: Spec | None, leaves: list[Any]) -> Any:
    """A new structure of ``spec``'s shape holding ``leaves`` (new containers, the leaves as
    they are)."""
    return _build(spec, iter(leaves))


def paths(obj: Any, path: str, out: list[tuple[str, Any]]) -> None:
    """Appends ``(path, leaf)`` for the leaves of ``obj``, each path ``path`` followed by the
    labels of the containers on the way (``positional argument 0[1]['x']``)."""
    found = None if isinstance(obj, torch.Tensor) else node(obj)
    if found is None:
        out.append((path, obj))
        return
    children, _, context = found
    for label, child in zip(_labels(obj, children, context), children, strict=True):
        paths(child, path + label, out)


def first_tensor(obj: Any) -> torch.Tensor | None:
    """The first tensor among the leaves of ``obj``, or ``None``."""
    return next((leaf for leaf in flatten(obj)[0] if isinstance(leaf, torch.Tensor)), None)
