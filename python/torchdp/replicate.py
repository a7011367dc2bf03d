"""Replication of Python modules, as ``torch.nn.parallel.replicate``, plus hooks and callbacks.

The copies are built in C++ by ``torchdp._C.replicate`` (PyTorch's algorithm: one
``_replicate_for_data_parallel()`` copy per module and device, children -> parameters -> buffers
wired through ``setattr``, parameters broadcast differentiably unless detached, buffers
differentiably only when they require grad, device-0 storage shared with the original, and a
direct-placement fallback when a custom ``__setattr__`` swallows an assignment). For modules whose
class keeps ``nn.Module``'s ``__new__``, ``__setattr__`` and ``_replicate_for_data_parallel``, the
same replica is built with direct dictionary operations instead of those Python calls, which makes
replication several times faster than ``torch.nn.parallel.replicate``. :func:`replicate` builds new
replicas at every call; ``torchdp.DataParallel`` keeps its replicas between forwards and refills
them at each one (``_C.ReplicaCache``, Note [Kept replicas] in ``csrc/python/replicate_cache.cpp``),
so either way every change to the module shows up in the next replicas. This module then
runs, in order:

1. the registered post-replicate hooks (:mod:`torchdp.hooks`),
2. the ``__data_parallel_replicate__(ctx, copy_id)`` callbacks of modules that define them (the
   Synchronized-BatchNorm convention, so SyncBN works without ``DataParallelWithCallback``),
3. the replica device check (``torchdp._C.check_replica_devices``), when hooks or callbacks ran or
   a module was built with ``setattr`` (replicas made only with dictionary operations hold the
   copies made for their device),
4. with ``stale_attributes=``, the check of plain attributes still referring to the source
   device's tensors and modules (:mod:`torchdp._attributes`).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import TypeVar, cast

import torch
from torch import nn

from torchdp import _C
from torchdp._attributes import check_stale_attribute_policy, fix_stale_attributes
from torchdp.hooks import ReplicaContext, _has_hooks, _hooks_for
from torchdp._devices import DeviceLike, _to_devices

__all__ = ["replicate"]

T = TypeVar("T", bound=nn.Module)

_API = "torchdp.replicate"


class CallbackContext:
    """The context object of ``__data_parallel_replicate__`` callbacks: an empty namespace, one per
    module position, shared by the copies of that module (as in Synchronized-BatchNorm)."""


def _module_paths(network: nn.Module) -> dict[int, str]:
    # Qualified names in network.named_modules() order; the first name of a shared module wins.
    return {id(m): name for name, m in network.named_modules()}


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
    paths = _module_paths(network)
    contexts = [
        ReplicaContext(paths.get(id(m), ""), devices) if entries else None
        for m, entries in zip(modules, hooks, strict=True)
    ]
    # Replica-major, master copy first; within a replica in module order; hooks in registration
    # order (the same order as the C++ registry).
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
    # Synchronized-BatchNorm's execute_replication_callbacks: one ctx per module position, shared
    # by all copies; the master copy (copy_id 0) of every module first, then replica 1, ...
    # False when no module has a callback.
    if not copies:
        return False
    # One attribute lookup per class, not per module (hasattr on a missing class attribute is
    # slow, and models have hundreds of modules of a few classes).
    # A callback set on an instance counts too (Synchronized-BatchNorm's loop uses hasattr on each
    # module); a dictionary lookup per module finds those.
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
                # The exception keeps its type (SyncBN code may catch it); the note (Python >=
                # 3.11) says where it came from.
                if hasattr(e, "add_note"):
                    path = _module_paths(copies[0][0]).get(id(copies[0][p]), "") or "<root>"
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
    # The range check and the conversion are the C++ DataParallel's (sizes beyond any device's
    # memory are clamped, within int64).
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

    Each replica is built with ``module._replicate_for_data_parallel()`` for every submodule;
    its parameters are copies on the replica's device (non-leaf tensors whose gradients flow back
    to the original parameters, unless :attr:`detach`), its buffers are copies (differentiable only
    when they require grad), and replica 0 shares storage with :attr:`network` when
    ``devices[0]`` is the network's device. Shared submodules and parameters stay shared inside
    each replica. Registered post-replicate hooks and ``__data_parallel_replicate__`` callbacks
    run next, then every registered parameter and buffer of every replica is checked to be on its
    replica's device.

    Args:
        network (Module): the module to replicate; its parameters and buffers must be on
            ``devices[0]``.
        devices (list of int or torch.device): one device per replica; ints are CUDA indices;
            CPU and meta devices are accepted and may repeat.
        detach (bool, optional): replicate without autograd history. Default: ``False``.
        bucket_cap_mb (float, keyword-only, optional): size in MiB of the gradient buckets that
            are reduced while the backward pass runs (as DDP's ``bucket_cap_mb``; ``0``: one
            bucket, reduced at the end). Default: 25.
        stale_attributes (str, keyword-only, optional): what to do, after the hooks, with plain
            (unregistered) attributes of the replicas on other devices than ``devices[0]`` that
            still hold tensors on ``devices[0]`` or the network's own modules, directly or in
            lists, tuples and dicts: ``'move'`` gives each replica its own copies, ``'warn'``
            warns once per class and attribute, ``'error'`` raises. Default: ``None``, PyTorch's
            behaviour (shared by reference, unchecked).

    Returns:
        list of Module: the root replica for each device.

    Example::

        >>> replicas = torchdp.replicate(model, [torch.device("cpu")] * 2)
        >>> replicas[1](x)
    """
    _check_module(network, _API)
    check_stale_attribute_policy(stale_attributes, _API)
    return _replicate(network, devices, bool(detach), bucket_cap_mb, stale_attributes, None, _API)


# Note [Buffers of failed forwards] (csrc/torchdp/replicate.h): a forward of DataParallel or
# data_parallel announces its module here before it replicates; the replicate call for that module
# leaves the copy of the module's buffers it took (before any hook ran) for the forward to pick up.
_FORWARD_BUFFERS = threading.local()


def _expect_buffer_snapshot(network: nn.Module) -> None:
    """Called by a forward before it replicates ``network`` (see _FORWARD_BUFFERS)."""
    _FORWARD_BUFFERS.network = network
    _FORWARD_BUFFERS.snapshot = None


def _buffer_snapshot(network: nn.Module, fallback: bool) -> _C.BufferSnapshot | None:
    """The copy of ``network``'s buffers that its replicate call left; when none did (a
    ``replicate`` override that builds replicas its own way), a copy taken now if ``fallback``."""
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
    """:func:`replicate` after its argument checks; with ``cache``, the replicas are that
    ``ReplicaCache``'s (lent until its ``park()``; Note [Kept replicas] in
    ``csrc/python/replicate_cache.cpp``)."""
    if not devices:
        return []
    device_list = _to_devices(devices, api)
    bucket_bytes = _bucket_bytes(bucket_cap_mb, api)
    copies: list[list[nn.Module]]
    wanted = getattr(_FORWARD_BUFFERS, "network", None) is network
    # Hooks and callbacks may change replica 0's buffers in place, which are the network's: a
    # failing one leaves them as they were (Note [Buffers of failed forwards]).
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
        # Replicas built with dictionary operations hold exactly the copies made for their
        # device; only hooks and callbacks (and the setattr way of building) can leave a tensor
        # elsewhere.
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
