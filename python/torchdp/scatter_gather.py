"""Scatter and gather of nested inputs and outputs, as ``torch.nn.parallel.scatter_gather``."""

from __future__ import annotations

import cmath
import copy
import numbers
import operator
import warnings
from collections.abc import Callable, Sequence
from typing import Any, TypeVar, overload

import torch
from torch.utils import _pytree

from torchdp import _C, _samples, _tree
from torchdp._devices import DeviceLike, _check_dim, _check_shares, _to_device, _to_devices

__all__ = ["gather", "scatter", "scatter_kwargs", "share_rows"]

_SCATTER = "torchdp.scatter"


def _scatter_map(
    obj: Any,
    devices: list[torch.device],
    dim: int,
    shares: list[float] | None = None,
    api: str = _SCATTER,
) -> Any:
    """Scatter by the tree's rule (Note [The Python tree]): every tensor leaf split in one call
    into C++, one structure rebuilt per chunk around its chunks and the other leaves; with
    ``shares``, split by the rows they give each device (Note [Uneven shares])."""
    if isinstance(obj, torch.Tensor):
        if shares is not None:
            return tuple(c[0] for c in _C.scatter_shares([obj], devices, shares, dim, api)[1])
        return tuple(_C.scatter(obj, devices, None, dim, True))
    leaves, spec = _tree.flatten(obj)
    if spec is None:
        # None, numbers, strings, empty containers, other objects: by reference.
        return [obj for _ in devices]
    where = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]
    if not where:  # no batch: one rebuilt structure per device
        return [_tree.unflatten(spec, leaves) for _ in devices]
    tensors = [leaves[i] for i in where]
    if shares is not None:
        per_replica = _C.scatter_shares(tensors, devices, shares, dim, api)[1]
    else:
        per_replica = _C.scatter_leaves(tensors, devices, dim)
    out = []
    for chunks in per_replica:
        for i, chunk in zip(where, chunks, strict=True):
            leaves[i] = chunk
        out.append(_tree.unflatten(spec, leaves))
    return out


T = TypeVar("T", dict, list, tuple)


@overload
def scatter(
    inputs: torch.Tensor,
    target_gpus: Sequence[DeviceLike],
    dim: int = ...,
    *,
    shares: Sequence[float] | None = ...,
) -> tuple[torch.Tensor, ...]: ...


@overload
def scatter(
    inputs: T,
    target_gpus: Sequence[DeviceLike],
    dim: int = ...,
    *,
    shares: Sequence[float] | None = ...,
) -> list[T]: ...


def scatter(
    inputs: Any,
    target_gpus: Sequence[DeviceLike],
    dim: int = 0,
    *,
    shares: Sequence[float] | None = None,
) -> Any:
    r"""Slices tensors into approximately equal chunks and distributes them across devices.

    Same rules as :func:`torch.nn.parallel.scatter`: tensors are split with ``torch.chunk``
    semantics along :attr:`dim` (so there may be fewer chunks than devices); tuples, lists, dicts
    (keeping their type) and named tuples are rebuilt per chunk, ``zip`` truncating to the
    shortest branch; other objects go to every device by reference. Unlike PyTorch, types
    registered with ``torch.utils._pytree`` (``register_dataclass``, ...) are split field by
    field, as :func:`gather` takes them apart. The split is differentiable.

    With :attr:`shares`, device ``i`` gets its share of the batch instead of an equal one: the
    batch's ``B`` rows (the size along :attr:`dim` of the first tensor that does not have exactly
    one row per device) are divided in proportion to the shares, rounded so that they add up to
    ``B`` (the leftover rows go to the largest remainders, the earlier device on a tie; integer
    shares that add up to ``B`` are taken as row counts). Every tensor must have ``B`` rows, or
    one row per device (a value per replica). Devices that get no rows get no chunk, so the
    result may be shorter than :attr:`target_gpus`.

    Args:
        inputs (Any): a tensor or a nested structure holding tensors.
        target_gpus (list of int or torch.device): the devices; ints are CUDA indices,
            ``torch.device('cpu')`` and ``torch.device('meta')`` are accepted and may repeat.
        dim (int, optional): the dimension to split along. Default: ``0``.
        shares (sequence of float, keyword-only, optional): each device's share of the batch,
            weights (``[1, 2, 2, 2]``) or row counts; one per device, finite, ``>= 0``, not all
            zero (``ValueError`` otherwise). Default: ``None`` (``torch.chunk``'s split).

    Returns:
        A tuple of chunks for a tensor input, else a list of one rebuilt structure per chunk.

    Example::

        >>> chunks = torchdp.scatter((torch.randn(4, 2), "tag"), [torch.device("cpu")] * 2)
        >>> [c[0].shape[0] for c in chunks], chunks[1][1]
        ([2, 2], 'tag')
        >>> [c.shape[0] for c in torchdp.scatter(torch.randn(7, 2), ["cpu"] * 2, shares=[1, 2])]
        [2, 5]
    """
    devices = _to_devices(target_gpus, _SCATTER)
    dim = _check_dim(dim, _SCATTER)
    return _scatter_map(inputs, devices, dim, _check_shares(shares, len(devices), _SCATTER))


def share_rows(shares: Sequence[float], rows: int) -> list[int]:
    r"""The rows of a batch of :attr:`rows` rows that each device gets for :attr:`shares`, as
    :func:`scatter`, :class:`DataParallel` and the C++ ``torchdp::share_rows`` divide them: in
    proportion to the shares, rounded down, the rows left over one each to the largest remainders
    (the earlier device on a tie); integer shares that add up to :attr:`rows` are the counts.

    Args:
        shares (sequence of float): one share per device: finite, ``>= 0``, not all zero.
        rows (int): the batch size.

    Returns:
        list of int: one count per device, adding up to :attr:`rows`.

    Example::

        >>> torchdp.share_rows([1, 2, 2, 2], 16)
        [2, 5, 5, 4]
    """
    api = "torchdp.share_rows"
    size = len(shares) if isinstance(shares, Sequence) else 0
    return _C.share_rows(_check_shares(shares, size, api), operator.index(rows), size, api)


def scatter_kwargs(
    inputs: tuple[Any, ...],
    kwargs: dict[str, Any] | None,
    target_gpus: Sequence[DeviceLike],
    dim: int = 0,
    *,
    shares: Sequence[float] | None = None,
    samples: bool | Sequence[int | str] = False,
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
        shares (sequence of float, keyword-only, optional): each device's share of the batch,
            as in :func:`scatter`; the positional and keyword arguments are split together, by
            the same rows. Default: ``None``.
        samples (bool or sequence of int and str, keyword-only): arguments that are lists of
            samples, split by item instead of along :attr:`dim` (images of different sizes, target
            dicts): ``True`` for every list or tuple argument, or their positions and keyword
            names. Each device gets whole samples, its share of them (equal unless
            :attr:`shares`), their tensors moved to it; the other tensors are split by the same
            counts (one row per sample); devices without samples get no chunk. Default: ``False``.

    Returns:
        ``(inputs_per_chunk, kwargs_per_chunk)``, two tuples.

    Example::

        >>> args, kws = torchdp.scatter_kwargs((torch.randn(4, 2),), {"scale": 2.0}, ["cpu"] * 2)
        >>> len(args), kws[1]["scale"]
        (2, 2.0)
    """
    api = "torchdp.scatter_kwargs"
    samples = _samples.check_option(samples, api)
    keys = _samples.sample_keys(inputs, kwargs or {}, samples, api) if samples else []
    if keys:  # Note [Lists of samples]
        devices = _to_devices(target_gpus, _SCATTER)
        checked = _check_shares(shares, len(devices), api)
        dim = _check_dim(dim, _SCATTER)
        return _samples.scatter(inputs, kwargs or {}, keys, devices, checked, dim, api)
    if shares is not None and (inputs or kwargs):  # one split of both: the same rows
        devices = _to_devices(target_gpus, _SCATTER)
        checked = _check_shares(shares, len(devices), "torchdp.scatter_kwargs")
        pairs = _scatter_map(
            (tuple(inputs), dict(kwargs or {})),
            devices,
            _check_dim(dim, _SCATTER),
            checked,
            "torchdp.scatter_kwargs",
        )
        return tuple(p[0] for p in pairs), tuple(p[1] for p in pairs)
    scattered_inputs: list[Any] = scatter(inputs, target_gpus, dim) if inputs else []
    scattered_kwargs: list[Any] = scatter(kwargs, target_gpus, dim) if kwargs else []
    if len(scattered_inputs) < len(scattered_kwargs):
        scattered_inputs.extend(() for _ in range(len(scattered_kwargs) - len(scattered_inputs)))
    elif len(scattered_kwargs) < len(inputs):
        # PyTorch's comparison against len(inputs), not the chunk count, kept.
        scattered_kwargs.extend({} for _ in range(len(scattered_inputs) - len(scattered_kwargs)))
    return tuple(scattered_inputs), tuple(scattered_kwargs)


def _check_pad_value(pad_value: Any, api: str) -> bool | int | float | complex | None:
    """``pad_value`` as a Python number (a one-element tensor or a NumPy scalar converted), or
    ``None``; a TypeError naming ``api`` for anything else."""
    if pad_value is None or isinstance(pad_value, (bool, int, float, complex)):
        return pad_value
    if isinstance(pad_value, torch.Tensor) and pad_value.numel() == 1:
        return pad_value.item()
    if isinstance(pad_value, numbers.Number) and hasattr(pad_value, "item"):
        return pad_value.item()
    raise TypeError(
        f"{api}: pad_value must be a number (the value that pads outputs of different sizes, "
        f"e.g. the tokenizer's pad_token_id) or None, got {type(pad_value).__qualname__} "
        f"{pad_value!r:.40}"
    )


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


class _Join:
    """One gather: the replicas' outputs paired by the tree's rule (Note [The Python tree]) into
    the gathered structure's leaves and spec, the tensors joined in one call into C++ at the end
    (``places``: where each group's tensor goes among the leaves)."""

    __slots__ = ("dim", "groups", "leaves", "pad_value", "places", "target")

    def __init__(self, target: _GatherTarget, dim: int, pad_value: Any = None) -> None:
        self.target, self.dim, self.pad_value = target, dim, pad_value
        self.leaves: list[Any] = []
        self.groups: list[list[torch.Tensor]] = []
        self.places: list[int] = []

    def pair(self, outputs: Sequence[Any]) -> _tree.Spec | None:
        """The spec of the gathered ``outputs``, their leaves appended to ``self.leaves``."""
        out = outputs[0]
        if isinstance(out, torch.Tensor):
            for i, other in enumerate(outputs):
                if not isinstance(other, torch.Tensor):
                    raise _mismatch(outputs, i)
            self.places.append(len(self.leaves))
            self.leaves.append(None)
            self.groups.append(list(outputs))
            return None
        for i, other in enumerate(outputs):
            # PyTorch would drop these tensors (None in output 0) or cut them into rows.
            if isinstance(other, torch.Tensor):
                raise _mismatch(outputs, i)
        if out is None or isinstance(out, _tree.CONSTANTS):
            self.leaves.append(None if out is None else _constant(outputs))
            return None
        if _tree.splits_by_attributes(out):
            return self._pair_object(outputs)
        registered = _pytree.SUPPORTED_NODES.get(type(out))
        if registered is not None and not isinstance(out, (dict, list, tuple)):
            return self._pair_registered(outputs, registered)
        if not hasattr(out, "__iter__"):
            # Replica 0's object would silently drop the others' tensors; PyTorch fails too.
            raise TypeError(
                f"torchdp.gather: a replica output holds a {type(out).__module__}."
                f"{type(out).__qualname__} object, which gather cannot take apart; return "
                "tensors, tuples, lists, dicts or named tuples of them, register its type with "
                "torch.utils._pytree (a dataclass: torch.utils._pytree.register_dataclass), or "
                "use torchdp.DataParallel with gather_output=False to get the per-replica outputs "
                "as they are"
            )
        if isinstance(out, dict):
            return self._pair_dict(outputs)
        return self._pair_sequence(outputs)

    def _node(
        self, cls: type, context: Any, rebuild: Callable[[list[Any]], Any], groups: Any
    ) -> _tree.Spec:
        return _tree.Spec(cls, context, rebuild, tuple([self.pair(group) for group in groups]))

    def _pair_registered(self, outputs: Sequence[Any], registered: Any) -> _tree.Spec:
        """A pytree-registered type: its children gathered, the object rebuilt from them."""
        out = outputs[0]
        flat = [registered.flatten_fn(o) if type(o) is type(out) else None for o in outputs]
        if any(f is None or f[1] != flat[0][1] for f in flat):
            raise TypeError(
                f"torchdp.gather: the replicas' {type(out).__qualname__} outputs differ in type "
                "or structure; every replica must return the same structure"
            )
        context = flat[0][1]
        return self._node(
            type(out),
            context,
            lambda c: registered.unflatten_fn(c, context),
            zip(*(f[0] for f in flat), strict=False),
        )

    def _pair_dict(self, outputs: Sequence[Any]) -> _tree.Spec:
        out = outputs[0]
        for i, d in enumerate(outputs):
            if not isinstance(d, dict):
                raise _mismatch(outputs, i)
        if not all(len(out) == len(d) for d in outputs):
            raise ValueError("All dicts must have the same number of keys")
        for i, d in enumerate(outputs):
            if d.keys() != out.keys():
                raise ValueError(
                    f"torchdp.gather: the replicas returned dicts with different keys: replica "
                    f"0 has {list(out)}, replica {i} has {list(d)}; every replica must return "
                    "the same keys"
                )
        keys = tuple(out)
        return self._node(
            type(out),
            keys,
            lambda c: _tree.rebuild_dict(out, zip(keys, c, strict=True), "torchdp.gather"),
            ([d[k] for d in outputs] for k in keys),
        )

    def _pair_sequence(self, outputs: Sequence[Any]) -> _tree.Spec:
        out = outputs[0]
        if hasattr(out, "__next__") or isinstance(out, (set, frozenset)):
            # Iterators are consumed by taking them apart; sets have no order to pair items by.
            raise TypeError(
                f"torchdp.gather: a replica output is a {type(out).__qualname__}, which gather "
                "cannot pair item by item across replicas; return a tuple or list instead (e.g. "
                "tuple(generator))"
            )
        for i, other in enumerate(outputs):
            if not hasattr(other, "__len__"):
                raise _mismatch(outputs, i)
        lengths = [len(o) for o in outputs]
        if any(n != lengths[0] for n in lengths):
            # PyTorch's zip drops the longer outputs' extra items without a word.
            raise ValueError(
                f"torchdp.gather: the replicas returned {type(out).__qualname__} outputs of "
                f"different lengths {lengths}; every replica must return the same structure"
            )
        cls = type(out)
        rebuild = cls._make if _tree.is_namedtuple(out) else cls
        return self._node(cls, None, rebuild, zip(*outputs, strict=True))

    def _pair_object(self, outputs: Sequence[Any]) -> _tree.Spec:
        """The replicas' objects split by their attributes joined into one (Note [Objects split
        by their attributes])."""
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
        fixed: dict[str, Any] = {}  # attributes known now; the others are the node's children
        names: list[str] = []
        children: list[_tree.Spec | None] = []
        has_tensors = False
        for key in states[0]:
            values = [state[key] for state in states]
            first = values[0]
            if all(v is first for v in values) and not isinstance(first, torch.Tensor):
                continue  # one object for all (a class, a shared setting): kept as it is
            if isinstance(first, torch.device):
                continue  # follows the tensors, below
            if _tree.is_scalar_tensor(first) or isinstance(first, _tree.CONSTANTS):
                fixed[key] = self._object_scalar(cls, key, values)
                continue
            try:
                children.append(self.pair(values))
            except _ObjectGatherError as e:
                e.cls = cls
                e.path.insert(0, key)
                raise
            except (TypeError, ValueError) as e:
                raise _ObjectGatherError(cls, key, f"cannot be joined: {e}", self.dim) from e
            names.append(key)
            has_tensors = has_tensors or isinstance(first, torch.Tensor)
        for key, first in states[0].items():
            if isinstance(first, torch.device):
                same = all(state[key] == first for state in states)
                fixed[key] = self.target.device if has_tensors or not same else first

        def rebuild(joined: list[Any]) -> Any:
            new = copy.copy(out)
            state = vars(new)
            state.update(fixed)
            state.update(zip(names, joined, strict=True))
            return new

        return _tree.Spec(cls, tuple(names), rebuild, tuple(children))

    def _object_scalar(self, cls: type, key: str, values: list[Any]) -> Any:
        """A per-object scalar (tokens seen, a window): one value, the same in every replica."""
        first = values[0]
        same = all(
            type(v) is type(first)
            and (
                v.dtype == first.dtype and v.item() == first.item()
                if _tree.is_scalar_tensor(v)
                else _same_constant(v, first)
            )
            for v in values
        )
        if not same:
            shown = [v.item() if _tree.is_scalar_tensor(v) else v for v in values]
            raise _ObjectGatherError(cls, key, f"differs between replicas ({shown})", self.dim)
        return first.to(self.target.device) if _tree.is_scalar_tensor(first) else first

    def join(self) -> list[Any]:
        """The leaves with every group of tensors joined, in one call into C++ (whose errors,
        RuntimeErrors, name the tensor's index and shape)."""
        if self.groups:
            self.target.used = True
            joined = _C.gather_leaves(
                self.groups, self.target.device, self.dim, pad_value=self.pad_value
            )
            for place, tensor in zip(self.places, joined, strict=True):
                self.leaves[place] = tensor
        return self.leaves


def _constant(outputs: Sequence[Any]) -> Any:
    """Equal constants pass through; PyTorch fails or turns strings into a map object's text."""
    out = outputs[0]
    if all(type(o) is type(out) and _same_constant(o, out) for o in outputs):
        return out
    raise TypeError(
        f"torchdp.gather: replica outputs of type {type(out).__qualname__} differ between "
        f"replicas ({', '.join(f'{o!r:.30}' for o in outputs)}) and cannot be concatenated; "
        "return tensors instead (e.g. torch.tensor(value)), or use torchdp.DataParallel "
        "with gather_output=False to get the per-replica outputs as they are"
    )


def gather(
    outputs: Any,
    target_device: DeviceLike,
    dim: int = 0,
    *,
    pad_value: Any = None,
    samples: bool = False,
) -> Any:
    r"""Gathers per-device outputs onto one device, as :func:`torch.nn.parallel.gather`.

    Tensors are concatenated along :attr:`dim` (differentiably); 0-dim tensors along dim 0
    become a vector, with PyTorch's UserWarning. ``None`` stays ``None``; dicts must have the same
    keys (``ValueError`` otherwise) and keep their type; sequences keep theirs.

    Args:
        outputs (sequence): one output structure per device.
        target_device (int, str or torch.device): where to put the result; ``'cpu'`` for the
            CPU (``-1`` too, deprecated with a FutureWarning as in PyTorch).
        dim (int, optional): the dimension to concatenate along. Default: ``0``.
        pad_value (number, keyword-only): tensors that differ in size along another dimension
            (sequences generated to different lengths) are padded at its end with this value to
            the largest size; padded positions get no gradient. Without it (the default, as
            PyTorch) such tensors raise a ``RuntimeError``.
        samples (bool, keyword-only): outputs that are lists are lists of per-sample outputs
            (one detection dict per image, the replicas' samples in order): joined into one list,
            its tensors moved to :attr:`target_device`. Other outputs gather as usual.
            Default: ``False``.

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
    dim = _check_dim(dim, "torchdp.gather")
    pad_value = _check_pad_value(pad_value, "torchdp.gather")
    if samples and all(isinstance(o, list) for o in outputs):  # Note [Lists of samples]
        return _samples.gather(outputs, target.device)
    if all(isinstance(o, torch.Tensor) for o in outputs):  # the common case, with no walk
        target.used = True
        result = _C.gather(list(outputs), target.device, dim, True, pad_value)
    else:
        join = _Join(target, dim, pad_value)
        spec = join.pair(outputs)
        result = _tree.unflatten(spec, join.join())
    if target.minus_one and target.used:
        # torch.cuda.comm.gather's warning, once per call (PyTorch warns once per tensor).
        warnings.warn(
            "Using -1 to represent CPU tensor is deprecated. Please use a "
            'device object or string instead, e.g., "cpu".',
            FutureWarning,
            stacklevel=2,
        )
    return result
