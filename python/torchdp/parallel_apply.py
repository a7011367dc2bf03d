"""Running replicas in parallel on C++ workers, as ``torch.nn.parallel.parallel_apply``."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence, Sized
from typing import Any

import torch
from torch import nn
from torch._utils import ExceptionWrapper

from torchdp import _C, _compile, _tree
from torchdp._devices import DeviceLike, _device_label, _to_device

__all__ = ["get_a_var", "parallel_apply"]

_API = "torchdp.parallel_apply"


def record_function(name: str) -> contextlib.AbstractContextManager[Any]:
    """A profiler range named ``name`` while the autograd profiler runs, else nothing: entering
    one is a torch op (microseconds; std::terminate in a daemon thread at interpreter exit)."""
    if torch._C._autograd._profiler_enabled():
        return torch.autograd.profiler.record_function(name)
    return contextlib.nullcontext()


def get_a_var(obj: Any) -> torch.Tensor | None:
    """The first tensor found in :attr:`obj` (a tensor, or inside the containers that scatter
    splits: lists, tuples, dicts, pytree types), or ``None``."""
    return _tree.first_tensor(obj)


class _Failure:
    """A replica's exception, caught in its worker, re-raised by the caller."""

    __slots__ = ("wrapper",)

    def __init__(self, wrapper: ExceptionWrapper) -> None:
        self.wrapper = wrapper


def _replica_call(
    index: int, module: nn.Module, input: Any, kwargs: dict[str, Any], label: int | str
) -> Callable[[], Any]:
    module = _compile.compiled(module)  # Note [Compiling the wrapper]

    def run() -> Any:
        try:
            # A single object is the only argument (this also avoids slicing a tensor).
            args = input if isinstance(input, (list, tuple)) else (input,)
            return module(*args, **kwargs)
        except Exception:  # noqa: BLE001  re-raised in the caller's thread
            return _Failure(ExceptionWrapper(where=f"in replica {index} on device {label}"))

    return run


def _default_device(input: Any) -> torch.device:
    # As PyTorch, the current CUDA device; without CUDA the input's device, not a failure.
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    found = get_a_var(input)
    if found is not None:
        return _to_device(found.device, _API)
    return torch.device("cpu")


def _length_error(modules: Sized, name: str, given: Sized) -> AssertionError:
    """PyTorch's assertion for an argument list whose length is not the number of modules."""
    return AssertionError(
        f"The number of modules {len(modules)} is not equal to the number of {name} {len(given)}"
    )


def parallel_apply(
    modules: Sequence[nn.Module],
    inputs: Sequence[Any],
    kwargs_tup: Sequence[dict[str, Any]] | None = None,
    devices: Sequence[DeviceLike | None] | None = None,
    *,
    serial: bool = False,
) -> list[Any]:
    r"""Applies each module to its input in parallel, each on its device.

    Same contract as :func:`torch.nn.parallel.parallel_apply`: :attr:`modules`, :attr:`inputs`,
    :attr:`kwargs_tup` and :attr:`devices` (if given) have the same length; a list or tuple input
    is the positional arguments, anything else the only argument. Each module runs with its
    device current and the caller's stream, grad mode and autocast state. The lowest failing
    replica's exception is re-raised as ``Caught <type> in replica <i> on device <d>.`` with the
    original traceback and, where possible, type. Ctrl-C raises ``KeyboardInterrupt`` at once;
    replicas still running finish in the background, their results dropped.

    Args:
        modules (list of Module): the replicas.
        inputs (list): one input (or tuple of positional arguments) per module.
        kwargs_tup (list of dict, optional): keyword arguments per module. Default: none.
        devices (list of int or torch.device, optional): each module's device; ints are CUDA
            indices. Default: the current CUDA device, else the input's first tensor's or the CPU.
        serial (bool, keyword-only): run the modules in order on the calling thread, each with
            its device current, so that no workers trade the GIL at each operation (not always
            faster: measure it). Same results and errors (Ctrl-C skips the later replicas);
            modules that wait for each other need the workers. Default: ``False``.

    Returns:
        list: the output of each module, in order.

    Example::

        >>> outs = torchdp.parallel_apply(replicas, [x0, x1], None, [torch.device("cpu")] * 2)
    """
    if len(modules) != len(inputs):
        raise _length_error(modules, "inputs", inputs)
    if kwargs_tup is None:
        kwargs_tup = ({},) * len(modules)
    elif len(modules) != len(kwargs_tup):
        raise _length_error(modules, "kwargs_tup", kwargs_tup)
    if devices is None:
        devices = (None,) * len(modules)
    elif len(modules) != len(devices):
        raise _length_error(modules, "devices", devices)
    device_list = [
        _default_device(inp) if d is None else _to_device(d, _API)
        for inp, d in zip(inputs, devices, strict=True)
    ]
    if not modules:
        return []

    fns = [
        _replica_call(i, module, inp, kw, _device_label(dev))
        for i, (module, inp, kw, dev) in enumerate(
            zip(modules, inputs, kwargs_tup, device_list, strict=True)
        )
    ]
    results = _C.parallel_apply(fns, device_list, bool(serial))
    for result in results:
        if isinstance(result, _Failure):
            result.wrapper.reraise()
    return results
