"""Replication of Python modules, as ``torch.nn.parallel.replicate``, plus hooks and callbacks;
``DataParallel`` refills kept ones (Note [Kept replicas] in ``csrc/python/replicate_cache.cpp``)."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import TypeVar, cast

import torch
from torch import nn

from torchdp import _C
from torchdp._attributes import check_stale_attribute_policy, fix_stale_attributes, module_paths
from torchdp._devices import DeviceLike, _to_devices
from torchdp.hooks import ReplicaContext, _has_hooks, _hooks_for

__all__ = ["replicate"]

T = TypeVar("T", bound=nn.Module)

_API = "torchdp.replicate"


class CallbackContext:
    """The ctx of ``__data_parallel_replicate__`` callbacks: one per module position (as SyncBN)."""


def _run_post_replicate_hooks(
    modules: list[nn.Module],
    copies: list[list[nn.Module]],
    devices: list[torch.device],
    network: nn.Module,
) -> bool:
    """Runs the hooks registered for the network's modules; False when there are none."""
    hooks = [_hooks_for(m) for m in modules]
    if not any(hooks):
        return False
    paths = module_paths(network)
    contexts = [
        ReplicaContext(paths.get(id(m), ""), devices) if entries else None
        for m, entries in zip(modules, hooks, strict=True)
    ]
    # Replica-major, master copy first, then module order, then registration order (as in C++).
    for j, device in enumerate(devices):
        for p, entries in enumerate(hooks):
            for entry in entries:
                try:
                    entry.hook(copies[j][p], modules[p], device, j, contexts[p])
                except Exception as e:
                    path = paths.get(id(modules[p]), "") or "<root>"
                    raise RuntimeError(
                        f"{_API}: {entry.description} failed on module '{path}' (type "
                        f"{type(modules[p]).__qualname__}) of replica {j} on device {device}: "
                        f"{type(e).__name__}: {e}"
                    ) from e
    return True


def _run_replication_callbacks(copies: list[list[nn.Module]]) -> bool:
    # Synchronized-BatchNorm's execute_replication_callbacks: one ctx per module position, the
    # master copy (copy_id 0) of every module first. False when no module has a callback.
    # hasattr once per class (slow when missing); a dict lookup per module finds instance ones.
    with_callback = {
        cls for cls in {type(m) for m in copies[0]} if hasattr(cls, "__data_parallel_replicate__")
    }
    callbacks = [
        p
        for p, m in enumerate(copies[0])
        if type(m) in with_callback or "__data_parallel_replicate__" in getattr(m, "__dict__", ())
    ]
    if not callbacks:
        return False
    contexts = {p: CallbackContext() for p in callbacks}
    for copy_id, replica_modules in enumerate(copies):
        for p in callbacks:
            module = replica_modules[p]
            try:
                module.__data_parallel_replicate__(contexts[p], copy_id)
            except Exception as e:
                # Keeps its type (SyncBN code may catch it); the note (Python >= 3.11) says where.
                if hasattr(e, "add_note"):
                    path = module_paths(copies[0][0]).get(id(copies[0][p]), "") or "<root>"
                    e.add_note(
                        f"{_API}: raised by the __data_parallel_replicate__ callback of module "
                        f"{path!r} (type {type(module).__qualname__}) for copy_id {copy_id}"
                    )
                raise
    return True


def _check_module(network: object, api: str) -> None:
    if not isinstance(network, nn.Module):
        raise TypeError(
            f"{api}: expected a torch.nn.Module, got {type(network).__qualname__}; wrap a plain "
            "function in an nn.Module whose forward calls it"
        )


def _bucket_bytes(bucket_cap_mb: float | None, api: str) -> int | None:
    """Bytes of a gradient bucket size given in MiB (None: the default), checked."""
    if bucket_cap_mb is None:
        return None
    if isinstance(bucket_cap_mb, bool) or not isinstance(bucket_cap_mb, (int, float)):
        raise ValueError(
            f"{api}: bucket_cap_mb must be a non-negative number of MiB (0: one bucket, reduced "
            f"after the whole backward pass), got {bucket_cap_mb!r}"
        )
    # The C++ DataParallel's check and conversion (huge sizes are clamped, within int64).
    return _C.bucket_bytes_from_mib(float(bucket_cap_mb), api)


def replicate(
    network: T,
    devices: Sequence[DeviceLike],
    detach: bool = False,
    *,
    bucket_cap_mb: float | None = None,
    stale_attributes: str | None = None,
) -> list[T]:
    r"""Replicates a module on each device, as :func:`torch.nn.parallel.replicate`.

    Each submodule is copied with ``_replicate_for_data_parallel()``. Parameters are copies on
    the replica's device whose gradients flow back to the originals (unless :attr:`detach`),
    buffers are copies (differentiable only when they require grad); replica 0 shares storage
    with :attr:`network` on the network's device, and shared submodules and parameters stay
    shared within a replica. Post-replicate hooks and ``__data_parallel_replicate__`` callbacks
    run next, then every replica's parameters and buffers are checked to be on its device.

    Args:
        network (Module): the module to replicate; its parameters and buffers must be on
            ``devices[0]``.
        devices (list of int or torch.device): one device per replica; ints are CUDA indices;
            CPU and meta devices are accepted and may repeat.
        detach (bool, optional): replicate without autograd history. Default: ``False``.
        bucket_cap_mb (float, keyword-only, optional): size in MiB of the gradient buckets
            reduced during the backward pass, as DDP's (``0``: one bucket, at the end).
            Default: 25.
        stale_attributes (str, keyword-only, optional): what to do with plain attributes of the
            replicas on other devices that, after the hooks, still hold tensors on ``devices[0]``
            or the network's modules (also in lists, tuples and dicts): ``'move'`` gives each
            replica its own copies, ``'warn'`` warns once per class and attribute, ``'error'``
            raises. Default: ``None``, unchecked as in PyTorch.

    Returns:
        list of Module: the root replica for each device.

    Example::

        >>> replicas = torchdp.replicate(model, [torch.device("cpu")] * 2)
        >>> replicas[1](x)
    """
    _check_module(network, _API)
    check_stale_attribute_policy(stale_attributes, _API)
    return _replicate(network, devices, bool(detach), bucket_cap_mb, stale_attributes, None, _API)


# Note [Buffers of failed forwards] (csrc/torchdp/replicate.h): a forward announces its module
# here; that module's replicate call leaves it the buffer copy it took before the hooks.
_FORWARD_BUFFERS = threading.local()


def _expect_buffer_snapshot(network: nn.Module) -> None:
    """Called by a forward before it replicates ``network``."""
    _FORWARD_BUFFERS.network = network
    _FORWARD_BUFFERS.snapshot = None


def _buffer_snapshot(network: nn.Module, fallback: bool) -> _C.BufferSnapshot | None:
    """The buffer copy ``network``'s replicate call left; without one (a ``replicate`` override),
    a copy taken now if ``fallback``."""
    snapshot = None
    if getattr(_FORWARD_BUFFERS, "network", None) is network:
        snapshot = _FORWARD_BUFFERS.snapshot
    _FORWARD_BUFFERS.network = _FORWARD_BUFFERS.snapshot = None
    if snapshot is None and fallback:
        snapshot = _C.snapshot_buffers(network)
    return snapshot


def _replicate(
    network: T,
    devices: Sequence[DeviceLike],
    detach: bool,
    bucket_cap_mb: float | None,
    stale_attributes: str | None,
    cache: _C.ReplicaCache | None,
    api: str,
) -> list[T]:
    """:func:`replicate` after its checks; with ``cache``, its replicas (lent until ``park()``;
    Note [Kept replicas] in ``csrc/python/replicate_cache.cpp``)."""
    if not devices:
        return []
    device_list = _to_devices(devices, api)
    bucket_bytes = _bucket_bytes(bucket_cap_mb, api)
    copies: list[list[nn.Module]]
    wanted = getattr(_FORWARD_BUFFERS, "network", None) is network
    # Replica 0's buffers are the network's: a failing hook or callback's changes are undone
    # (Note [Buffers of failed forwards]).
    buffers = None
    if cache is None:
        if wanted or _has_hooks():
            buffers = _C.snapshot_buffers(network)
        copies, plain_only = _C.replicate(network, device_list, detach, bucket_bytes, report=True)
    else:
        copies, plain_only, _, buffers = cache.replicate(network, device_list, detach, bucket_bytes)
    if wanted:
        _FORWARD_BUFFERS.snapshot = buffers
    try:
        hooked = _has_hooks() and _run_post_replicate_hooks(
            list(network.modules()), copies, device_list, network
        )
        called = _run_replication_callbacks(copies)
        # Only hooks, callbacks and setattr-built replicas can leave a tensor on another device.
        if hooked or called or not plain_only:
            _C.check_replica_devices(copies, device_list, api)
        if stale_attributes is not None:
            fix_stale_attributes(
                list(network.modules()), copies, device_list, stale_attributes, api, network
            )
    except BaseException:
        if cache is not None:
            cache.drop()  # half-prepared replicas are never kept (nor their copies held)
        if buffers is not None:
            buffers.restore()
        raise
    return [cast(T, copies[j][0]) for j in range(len(device_list))]
