"""Data-parallel calls of a wrapped module's other methods (``DataParallel.parallel_method``):
the method looked up and checked, each replica's bound method, and its parameters listed while it
runs (Note [Parameters of replicas in method calls])."""

from __future__ import annotations

import contextlib
import contextvars
import difflib
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

from torch import nn

from torchdp.scatter_gather import _check_pad_value

if TYPE_CHECKING:
    from torchdp.data_parallel import DataParallel

_API = "torchdp.DataParallel.parallel_method"

# The pad value of the gather in progress (DataParallel.gather reads it): set only around the
# gather of a method call, so overrides of gather that call super().gather() pad too, and forwards
# nested in the replicas never see it.
PAD_VALUE: contextvars.ContextVar[Any] = contextvars.ContextVar("torchdp_pad_value", default=None)


@contextlib.contextmanager
def padding(pad_value: Any) -> Iterator[None]:
    """``PAD_VALUE`` is ``pad_value`` inside the block."""
    token = PAD_VALUE.set(pad_value)
    try:
        yield
    finally:
        PAD_VALUE.reset(token)


def check_method(module: nn.Module, name: Any) -> None:
    """Raises unless ``module`` has a callable attribute ``name``."""
    if not isinstance(name, str):
        raise TypeError(
            f"{_API}: the method name must be a str, got {type(name).__qualname__} {name!r:.40}; "
            "pass the name of a method of the wrapped module, e.g. dp.parallel_method('generate')"
        )
    cls = type(module).__qualname__
    try:
        attr = getattr(module, name)
    except AttributeError:
        methods = [n for n in dir(module) if not n.startswith("_")]
        close = difflib.get_close_matches(name, methods, n=3)
        hint = f" (did you mean {', '.join(repr(c) for c in close)}?)" if close else ""
        raise AttributeError(
            f"{_API}: the wrapped module ({cls}) has no attribute {name!r}{hint}; give the name "
            "of one of its methods"
        ) from None
    if not callable(attr):
        raise TypeError(
            f"{_API}: {cls}.{name} is a {type(attr).__qualname__}, not a method, so it cannot be "
            "called on the replicas; give the name of a method of the wrapped module"
        )


def missing_attribute(dp: nn.Module, name: str, error: AttributeError) -> AttributeError:
    """``error`` (the wrapper has no attribute ``name``), saying how to call the wrapped module's
    method of that name where it has one."""
    module = dp.__dict__.get("_modules", {}).get("module")
    attr = getattr(type(module), name, None) if module is not None else None
    if not callable(attr) or name.startswith("__"):
        return error
    return AttributeError(
        f"{error}; the wrapped module's {type(module).__qualname__}.{name} runs split over the "
        f"devices through dp.parallel_method({name!r})(...), or on one device as "
        f"dp.module.{name}(...)"
    )


# Note [Parameters of replicas in method calls]
# A replica's parameter copies are plain attributes (they are not leaves), so its parameters()
# lists nothing, as in PyTorch. Forward rarely asks, but other methods do: transformers'
# generate() takes the model's device and dtype from next(self.parameters()). While a replica runs
# a method, each of its modules lists its copies (kept in _former_parameters) in _parameters; its
# own dict is put back afterwards, so kept replicas and forwards see no change. Attributes still
# read the copies from the instance __dict__.
@contextlib.contextmanager
def listed_parameters(replica: nn.Module) -> Iterator[None]:
    swapped = []
    try:
        for module in replica.modules():
            state = module.__dict__
            former = state.get("_former_parameters")
            if former:
                own = state["_parameters"]
                listed = dict(own)
                listed.update(former)
                state["_parameters"] = listed
                swapped.append((state, own))
        yield
    finally:
        for state, own in swapped:
            state["_parameters"] = own


class ReplicaMethod:
    """A replica's method as ``DataParallel.parallel_apply`` receives it in a method call: called
    like the replica, it runs ``getattr(module, name)`` with the replica's parameters listed.

    Attributes:
        module (Module): the replica.
        name (str): the method's name.
    """

    __slots__ = ("module", "name")

    def __init__(self, module: nn.Module, name: str) -> None:
        self.module, self.name = module, name

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        with listed_parameters(self.module):
            return getattr(self.module, self.name)(*args, **kwargs)

    def __repr__(self) -> str:
        return f"ReplicaMethod({type(self.module).__qualname__}.{self.name})"


def bound(module: nn.Module, method: str | None) -> Callable[..., Any]:
    """The module, or its method ``method``."""
    return module if method is None else getattr(module, method)


def bound_replicas(replicas: Sequence[nn.Module], method: str | None) -> Sequence[Any]:
    """What parallel_apply calls: the replicas, or their methods ``method`` (called like them)."""
    if method is None:
        return replicas
    return [ReplicaMethod(replica, method) for replica in replicas]


class ParallelMethod:
    """``dp.parallel_method(name, pad_value=...)``: calling it runs the wrapped module's method
    ``name`` split over the devices (:meth:`torchdp.DataParallel.parallel_method`)."""

    __slots__ = ("__weakref__", "dp", "name", "pad_value")

    def __init__(self, dp: DataParallel[Any], name: str, pad_value: Any) -> None:
        check_method(dp.module, name)
        self.dp, self.name = dp, name
        self.pad_value = _check_pad_value(pad_value, _API)

    def __call__(self, *inputs: Any, **kwargs: Any) -> Any:
        method = None if self.name == "forward" else self.name
        return self.dp._call_module(method, self.pad_value, inputs, kwargs)

    def __repr__(self) -> str:
        return f"ParallelMethod({type(self.dp.module).__qualname__}.{self.name})"
