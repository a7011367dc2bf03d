"""Lists of samples split by item (Note [Lists of samples] in csrc/torchdp/shares.h).

C++ decides which device gets which items, splits the batch tensors beside them by the same
counts and moves every tensor (``_C.scatter_items``), and refuses lists that cannot be one batch
(``_C.check_batch_lists``); here are only Python's containers around them: which arguments are
lists of samples, and each replica's arguments rebuilt from its items."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from torchdp import _C, _tree

OPTION = "samples=True (torchdp.DataParallel(module, samples=True))"


def check_option(samples: Any, api: str) -> bool | tuple[int | str, ...]:
    """``samples`` as given to the wrappers: a bool, or the positions and keyword names of the
    arguments that are lists of samples."""
    if isinstance(samples, bool):
        return samples
    if isinstance(samples, (list, tuple)) and all(
        isinstance(k, str) or (isinstance(k, int) and not isinstance(k, bool) and k >= 0)
        for k in samples
    ):
        return tuple(samples)
    raise TypeError(
        f"{api}: samples must be True, False, or a list of the positions (int) and keyword names "
        f"(str) of the arguments that are lists of samples, e.g. [0, 'targets']; got "
        f"{samples!r:.60}"
    )


def _name(key: int | str) -> str:
    return f"positional argument {key}" if isinstance(key, int) else f"keyword argument {key!r}"


def sample_keys(
    inputs: Sequence[Any],
    kwargs: Mapping[str, Any],
    samples: bool | tuple[int | str, ...],
    api: str,
) -> list[int | str]:
    """The arguments that are lists of samples: with ``True`` every list or tuple argument, else
    those named (each must be a list or tuple)."""
    if samples is True:
        keys: list[int | str] = [i for i, a in enumerate(inputs) if isinstance(a, (list, tuple))]
        return keys + [k for k, v in kwargs.items() if isinstance(v, (list, tuple))]
    keys = []
    for key in samples or ():
        value = (
            (inputs[key] if key < len(inputs) else None)
            if isinstance(key, int)
            else kwargs.get(key)
        )
        if not isinstance(value, (list, tuple)):
            raise TypeError(
                f"{api}: samples names {_name(key)}, which is "
                f"{'missing' if value is None else type(value).__qualname__}; it must be a list "
                "or tuple of samples (one entry per sample)"
            )
        keys.append(key)
    return keys


def scatter(
    inputs: Sequence[Any],
    kwargs: Mapping[str, Any],
    keys: list[int | str],
    devices: list[torch.device],
    shares: list[float] | None,
    dim: int,
    api: str,
) -> tuple[tuple[Any, ...], tuple[dict[str, Any], ...]]:
    """The arguments of each replica that runs: the lists named by ``keys`` split by item, the
    other tensors split along ``dim`` by the same counts, other values passed as they are."""
    lists = {k: inputs[k] if isinstance(k, int) else kwargs[k] for k in keys}
    lengths = {k: len(v) for k, v in lists.items()}
    if len(set(lengths.values())) > 1:
        shown = ", ".join(f"{_name(k)} has {n}" for k, n in lengths.items())
        raise ValueError(
            f"{api}: the lists of samples have different lengths ({shown}); give every list one "
            "entry per sample"
        )
    items = next(iter(lengths.values()))
    rest = (
        tuple(None if i in lists else a for i, a in enumerate(inputs)),
        {k: None if k in lists else v for k, v in kwargs.items()},
    )
    rest_leaves, rest_spec = _tree.flatten(rest)
    named: list[tuple[str, Any]] = []  # the same leaves, named for errors
    for i, value in enumerate(rest[0]):
        _tree.paths(value, _name(i), named)
    for key, value in rest[1].items():
        _tree.paths(value, _name(key), named)
    tensors: list[torch.Tensor] = []
    names: list[str] = []
    item_of: list[int] = []
    slots: list[tuple[Any, int]] = []  # where each tensor goes back: (leaves, index)
    for i, leaf in enumerate(rest_leaves):
        if isinstance(leaf, torch.Tensor):
            tensors.append(leaf)
            names.append(named[i][0])
            item_of.append(-1)
            slots.append((rest_leaves, i))
    flat_items: dict[int | str, list[tuple[list[Any], Any]]] = {}
    for key, values in lists.items():
        flat_items[key] = []
        for j, value in enumerate(values):
            leaves, spec = _tree.flatten(value)
            flat_items[key].append((leaves, spec))
            for i, leaf in enumerate(leaves):
                if isinstance(leaf, torch.Tensor):
                    tensors.append(leaf)
                    names.append(f"{_name(key)}[{j}]")
                    item_of.append(j)
                    slots.append((leaves, i))
    _, begins, counts, parts = _C.scatter_items(
        tensors, item_of, items, devices, shares, dim, api, names
    )
    per_inputs, per_kwargs = [], []
    for begin, count, part in zip(begins, counts, parts, strict=True):
        for (leaves, i), tensor in zip(slots, part, strict=True):
            if tensor is not None:
                leaves[i] = tensor
        args, kws = _tree.unflatten(rest_spec, rest_leaves)
        args = list(args)
        for key, values in lists.items():
            mine = [
                _tree.unflatten(s, leaves) for leaves, s in flat_items[key][begin : begin + count]
            ]
            if type(values) is tuple:
                mine = tuple(mine)
            if isinstance(key, int):
                args[key] = mine
            else:
                kws[key] = mine
        per_inputs.append(tuple(args))
        per_kwargs.append(kws)
    return tuple(per_inputs), tuple(per_kwargs)


def gather(outputs: Sequence[Any], destination: torch.device) -> list[Any]:
    """The replicas' lists of per-sample outputs joined into one list, in order, their tensors
    moved to ``destination``."""
    joined = [item for output in outputs for item in output]
    leaves, spec = _tree.flatten(joined)
    where = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]
    moved = _C.gather_samples([[leaves[i] for i in where]], destination)
    for i, tensor in zip(where, moved, strict=True):
        leaves[i] = tensor
    return _tree.unflatten(spec, leaves)


def _lists(value: Any, name: str, out: list[tuple[str, list[list[int]]]]) -> None:
    """The lists (and tuples) inside ``value`` whose entries are all tensors, or all dicts of
    tensors (one list per key), as ``(name, shapes)``."""
    if isinstance(value, Mapping):
        for key, v in value.items():
            if isinstance(v, (list, tuple, Mapping)):
                _lists(v, f"{name}[{key!r}]", out)
        return
    if not isinstance(value, (list, tuple)) or not value:
        return
    if all(isinstance(v, torch.Tensor) for v in value):
        out.append((name, [list(v.shape) for v in value]))
        return
    if all(isinstance(v, Mapping) for v in value):
        for key in value[0]:
            column = [v.get(key) for v in value]
            if all(isinstance(t, torch.Tensor) for t in column):
                out.append((f"{name}[*][{key!r}]", [list(t.shape) for t in column]))
        return
    for i, v in enumerate(value):
        if isinstance(v, (list, tuple, Mapping)):
            _lists(v, f"{name}[{i}]", out)


def check_batch_lists(
    inputs: Sequence[Any], kwargs: Mapping[str, Any] | None, devices: int, dim: int, api: str
) -> None:
    """Refuses, without samples, a list of tensors that cannot be one batch (Note [Lists of
    samples]): a ValueError naming the argument and the option."""
    found: list[tuple[str, list[list[int]]]] = []
    for i, value in enumerate(inputs):
        if isinstance(value, (list, tuple, Mapping)):
            _lists(value, _name(i), found)
    for key, value in (kwargs or {}).items():
        if isinstance(value, (list, tuple, Mapping)):
            _lists(value, _name(key), found)
    if found:
        _C.check_batch_lists(found, devices, dim, api, OPTION)
