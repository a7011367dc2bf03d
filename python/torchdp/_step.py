"""The Python step, shared by ``DataParallel``'s forward and ``data_parallel()``: the chunk
check after a (possibly overridden) scatter, the devices of the replicas that run, replicate /
parallel_apply / gather under the rollback of a failed call, and the first call of a compiled
module, run replica by replica. It orchestrates ``nn.DataParallel``'s overridable methods over
the C++ layers; C++ front ends share ``detail::Step`` instead (csrc/torchdp/step.h)."""

from __future__ import annotations

import sys
import weakref
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch
from torch import nn

from torchdp import _C, _compile, _tree
from torchdp.parallel_apply import get_a_var
from torchdp.replicate import _buffer_snapshot, _expect_buffer_snapshot


def nonempty(inputs: Sequence[Any], kwargs: Sequence[Any] | None) -> tuple[Any, Any]:
    """Scattered chunks; a call without arguments runs once, on the first device."""
    if kwargs is None:
        kwargs = tuple({} for _ in inputs)
    if not inputs and not kwargs:
        return ((),), ({},)
    return inputs, kwargs


def run_replicated(
    module: nn.Module,
    replicate_fn: Callable[[], Sequence[nn.Module]],
    apply_fn: Callable[[Sequence[nn.Module]], list[Any]],
    gather_fn: Callable[[list[Any]], Any],
    cache_fn: Callable[[], Any],
) -> Any:
    """replicate, parallel_apply, gather; a failure writes the module's buffers back (Note
    [Buffers of failed forwards])."""
    buffers = None
    _expect_buffer_snapshot(module)
    try:
        try:
            replicas = replicate_fn()
        finally:
            buffers = _buffer_snapshot(module, fallback=True)
        try:
            with _C.EnclosingForward(buffers):  # Note [Nested forwards]
                outputs = apply_fn(replicas)
        finally:
            # Note [Kept replicas]: taken back only when nothing else holds them.
            del replicas
            cache = cache_fn()
            if cache is not None:
                cache.park()
        return gather_fn(outputs)
    except BaseException:
        if buffers is not None:
            buffers.restore()
        raise
    finally:
        if buffers is not None:
            buffers.release()


def _tensor_sizes(obj: Any, path: str, dim: int, out: list[tuple[str, int]]) -> None:
    """(path, size along dim) of the tensors that scatter splits (Note [The Python tree])."""
    leaves: list[tuple[str, Any]] = []
    _tree.paths(obj, path, leaves)
    for where, leaf in leaves:
        if isinstance(leaf, torch.Tensor) and leaf.dim() > 0:
            out.append((where, leaf.shape[dim] if -leaf.dim() <= dim < leaf.dim() else 0))


def _padding(chunks: Sequence[Any], side: type) -> int:
    """How many of scatter_kwargs's chunks at the end are its padding (``()`` or ``{}``)."""
    count = 0
    for chunk in reversed(chunks):
        if not (isinstance(chunk, side) and len(chunk) == 0):
            break
        count += 1
    return count


def check_chunks(
    inputs: tuple[Any, ...],
    kwargs: dict[str, Any] | None,
    chunks: Sequence[Any],
    chunk_kwargs: Sequence[Any],
    n: int,
    dim: int,
    api: str,
) -> tuple[Sequence[Any], Sequence[Any]]:
    """PyTorch's parallel_apply assertion for keyword chunks that outnumber the positional ones,
    with its cause; then _C.check_chunks: a short tensor must not make scatter drop rows.

    Returns the chunks to run: where one side split into more chunks than the other only through
    tensors of one row per device (Note [Per-replica rows]), scatter_kwargs padded the other side
    with empty chunks; the replicas that would get them do not run."""
    if len(chunk_kwargs) != len(chunks):
        raise AssertionError(
            f"The number of modules {len(chunks)} is not equal to the number of "
            f"kwargs_tup {len(chunk_kwargs)}: the keyword arguments split into "
            f"{len(chunk_kwargs)} chunks along dim {dim} and the positional ones "
            f"into {len(chunks)}; give keyword tensors the same batch size as the "
            "positional inputs along that dim"
        )
    if inputs and kwargs:
        padding = max(_padding(chunks, tuple), _padding(chunk_kwargs, dict))
        if padding:
            chunks, chunk_kwargs = chunks[:-padding], chunk_kwargs[:-padding]
    if len(chunks) >= n:
        return chunks, chunk_kwargs
    sizes: list[tuple[str, int]] = []
    for i, item in enumerate(inputs):
        _tensor_sizes(item, f"positional argument {i}", dim, sizes)
    for key, item in (kwargs or {}).items():
        _tensor_sizes(item, f"keyword argument {key!r}", dim, sizes)
    _C.check_chunks(sizes, len(chunks), n, dim, api)
    return chunks, chunk_kwargs


def running_ids(
    device_ids: Sequence[Any], shares: Any, inputs: Sequence[Any], kwargs: Sequence[Any]
) -> list[Any]:
    """The devices of the replicas that run: the first ``len(inputs)``; with shares, those whose
    chunk got rows, wherever they are in the list (Note [Uneven shares]): each chunk's tensors
    are on its device."""
    n = len(inputs)
    if shares is None or n >= len(device_ids):
        return list(device_ids[:n])
    ids: list[Any] = []
    for i, chunk in enumerate(inputs):
        found = get_a_var((chunk, kwargs[i] if i < len(kwargs) else None))
        if found is None:
            return list(device_ids[:n])
        ids.append(found.device)
    return ids


V = TypeVar("V")


def weak_entry(
    table: weakref.WeakKeyDictionary[nn.Module, V], key: nn.Module, make: Callable[[], V] | None
) -> V | None:
    """``table[key]``, made with ``make()`` when missing; ``None`` for an unhashable module."""
    try:
        value = table.get(key)
        if value is None and make is not None:
            value = table[key] = make()
        return value
    except TypeError:
        return None


# Input signatures of a compiled module whose first call runs the replicas in order (dynamo's
# default recompile limit), and those seen so far per module.
_COMPILED_SIGNATURES = 8
_signatures_seen: weakref.WeakKeyDictionary[nn.Module, set[Any]] = weakref.WeakKeyDictionary()


def first_compiled_call(module: nn.Module, inputs: Sequence[Any], kwargs: Any) -> bool:
    """True the first time a compiled ``module`` meets this signature: replicas compiling it
    together on the workers would each compile it and use up dynamo's recompile limit."""
    if "torch._dynamo" not in sys.modules:
        return False
    seen = weak_entry(_signatures_seen, module, set)
    # None: an unhashable module, which named_modules() cannot walk either.
    if seen is None or len(seen) >= _COMPILED_SIGNATURES:
        return False
    wrapper = _compile.callback()  # torch.compile of the wrapper: its own cache entries
    grad = torch.is_grad_enabled()
    key = (_signature(inputs), _signature(kwargs), module.training, grad, id(wrapper))
    if key in seen:
        return False
    seen.add(key)
    return wrapper is not None or _holds_compiled(module)


def _signature(value: Any) -> Any:
    """What a compiled call is specialised on: structure (Note [The Python tree]), tensor
    metadata, the other leaves' types."""
    leaves, spec = _tree.flatten(value)
    return (
        None if spec is None else spec.key(),
        tuple(
            (tuple(v.shape), v.dtype, v.device) if isinstance(v, torch.Tensor) else type(v)
            for v in leaves
        ),
    )


def _holds_compiled(module: nn.Module) -> bool:
    """Whether ``module`` or a submodule is compiled (torch.compile or ``module.compile()``)."""
    optimized = getattr(sys.modules.get("torch._dynamo.eval_frame"), "OptimizedModule", ())
    return any(
        isinstance(m, optimized) or m.__dict__.get("_compiled_call_impl") is not None
        for m in module.modules()
    )
