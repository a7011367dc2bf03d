"""Post-replicate hooks: per-device repairs of the state :func:`torchdp.replicate` does not copy."""

from __future__ import annotations

import itertools
import threading
import types
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from typing_extensions import Self

__all__ = [
    "PostReplicateHook",
    "PostReplicateHookHandle",
    "ReplicaContext",
    "register_post_replicate_hook",
]

PostReplicateHook = Callable[[nn.Module, nn.Module, torch.device, int, "ReplicaContext"], None]


class ReplicaContext(types.SimpleNamespace):
    r"""State shared by every copy of one module position during one replicate call.

    Attributes:
        path (str): qualified name of the module position (``""`` for the root module).
        devices (list of torch.device): the replica devices; replica ``i`` lives on ``devices[i]``.
        values (dict): free-form storage for the hooks (any other attribute may be set too).

    Example::

        >>> def share_master(replica, original, device, index, ctx):
        ...     if index == 0:
        ...         ctx.values["master"] = replica
        ...     else:
        ...         replica.master = ctx.values["master"]
    """

    def __init__(self, path: str, devices: list[torch.device]) -> None:
        super().__init__(path=path, devices=list(devices), values={})


class _Entry:
    __slots__ = ("_hook", "_method_ref", "description", "id", "target_class", "target_ref")

    def __init__(self, hook_id: int, hook: Callable[..., Any], target: Any) -> None:
        self.id = hook_id
        self._hook: Callable[..., Any] | None = hook
        self._method_ref: weakref.WeakMethod | None = None
        if isinstance(target, type):
            self.target_class: type | None = target
            self.target_ref: weakref.ref | None = None
            kind = f"class {target.__module__}.{target.__qualname__}"
        else:
            self.target_class = None
            self.target_ref = weakref.ref(target, lambda _: _unregister(hook_id))
            kind = f"instance of {type(target).__qualname__}"
            # A method of the target itself is held weakly, or it would keep its module alive.
            if getattr(hook, "__self__", None) is target:
                self._method_ref = weakref.WeakMethod(hook)
                self._hook = None
        self.description = f"post-replicate hook {_hook_name(hook)} (#{hook_id}, {kind})"

    @property
    def hook(self) -> Callable[..., Any]:
        if self._method_ref is not None:
            return self._method_ref() or _no_op  # None: its module is gone; the entry goes with it
        assert self._hook is not None
        return self._hook

    def matches(self, module: nn.Module) -> bool:
        if self.target_class is not None:
            return isinstance(module, self.target_class)
        assert self.target_ref is not None
        return self.target_ref() is module


# Re-entrant: an instance hook's weakref callback may fire (GC) on a thread already holding it.
_lock = threading.RLock()
_ids = itertools.count(1)
# Registration order is the call order.
_registry: dict[int, _Entry] = {}


def _no_op(*_args: Any) -> None:
    return None


def _unregister(hook_id: int) -> None:
    with _lock:
        _registry.pop(hook_id, None)


def _hook_name(hook: Callable[..., Any]) -> str:
    name = getattr(hook, "__qualname__", None) or getattr(hook, "__name__", None)
    return str(type(hook).__qualname__ if name is None else name)


class PostReplicateHookHandle:
    r"""Handle returned by :func:`register_post_replicate_hook`.

    ``remove()`` unregisters the hook (idempotent); as a context manager the handle removes it on
    exit. Dropping the handle does *not* remove the hook, as with
    :class:`torch.utils.hooks.RemovableHandle`.

    Example::

        >>> with torchdp.register_post_replicate_hook(MaskedLinear, fix_cache):
        ...     out = torchdp.DataParallel(model)(x)
    """

    __slots__ = ("__weakref__", "id")

    def __init__(self, hook_id: int) -> None:
        self.id = hook_id

    def remove(self) -> None:
        """Unregisters the hook. Idempotent."""
        _unregister(self.id)

    @property
    def active(self) -> bool:
        """True while the hook is registered."""
        return self.id in _registry

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.remove()

    def __repr__(self) -> str:
        state = "active" if self.active else "removed"
        return f"<torchdp.PostReplicateHookHandle #{self.id} ({state})>"


def register_post_replicate_hook(
    target: type[nn.Module] | nn.Module, hook: PostReplicateHook
) -> PostReplicateHookHandle:
    r"""Registers a hook that runs on every replica of matching modules after replication.

    The hook runs once per replica of every module matching :attr:`target`, after all replicas
    exist: replica 0 first, hooks in registration order; its return value is ignored. A hook
    that raises aborts the replication with a ``RuntimeError`` naming the hook, the module path
    and the replica, chained from the original exception. Afterwards every replica's parameters
    and buffers are checked to be on its device.

    Args:
        target (type or nn.Module): an ``nn.Module`` subclass (matches instances of it and of its
            subclasses) or one module instance (matches that module only; held weakly).
        hook (callable): ``hook(replica, original, device, replica_index, ctx) -> None``;
            ``ctx`` (a :class:`ReplicaContext`) is shared by the copies of one module position.

    Returns:
        :class:`PostReplicateHookHandle`: ``remove()`` unregisters; usable as a context manager.

    Example::

        >>> def move_cache(replica, original, device, index, ctx):
        ...     replica.cache = original.cache.to(device)   # a plain tensor attribute
        >>> handle = torchdp.register_post_replicate_hook(MyLayer, move_cache)
        >>> ...
        >>> handle.remove()
    """
    api = "torchdp.register_post_replicate_hook"
    if isinstance(target, type):
        if not issubclass(target, nn.Module):
            raise TypeError(
                f"{api}: target must be an nn.Module subclass or an nn.Module instance, got the "
                f"class {target.__module__}.{target.__qualname__}, which is not an nn.Module"
            )
    elif not isinstance(target, nn.Module):
        raise TypeError(
            f"{api}: target must be an nn.Module subclass or an nn.Module instance, got "
            f"{type(target).__qualname__} {target!r}"
        )
    if not callable(hook):
        raise TypeError(
            f"{api}: hook must be callable as hook(replica, original, device, replica_index, ctx), "
            f"got {type(hook).__qualname__} {hook!r}"
        )
    with _lock:
        hook_id = next(_ids)
        _registry[hook_id] = _Entry(hook_id, hook, target)
    return PostReplicateHookHandle(hook_id)


def _has_hooks() -> bool:
    return bool(_registry)


def _hooks_for(module: nn.Module) -> list[_Entry]:
    """The entries that apply to ``module``, in registration order (a snapshot)."""
    with _lock:
        entries = list(_registry.values())
    return [e for e in entries if e.matches(module)]
