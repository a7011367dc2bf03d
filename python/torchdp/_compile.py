"""``torch.compile`` of the wrapper: the replicas compiled, torchdp's own code eager.

Note [Compiling the wrapper]
----------------------------
``torch.compile(DataParallel(m))`` calls the wrapper with dynamo's frame callback set on the
calling thread. Traced, torchdp's step would break the graph at every call into ``_C`` and run
the replicas on workers, whose threads have no callback, eagerly. Instead the wrapper's entry
frames are skipped by dynamo (not traced; the frames they call still are): the entry takes the
callback off the thread, runs the step eagerly and sets the callback again on whichever thread
runs a replica, around that replica's call only. Each replica's forward is then compiled with
the caller's backend and options (``fullgraph``, ``dynamic``, ``mode``, or ``explain``'s
counting backend): one graph per device, shared by the replicas of a device and reused by later
steps, as dynamo's guards allow. ``DataParallel.compile()`` takes the same path.

The callback is dynamo's own object, read and set through ``torch._C._dynamo.eval_frame``; where
that module is missing (a build without dynamo) the wrapper runs eagerly, as before.
"""

from __future__ import annotations

import threading
import types
import weakref
from collections.abc import Callable
from typing import Any

try:
    from torch._C._dynamo import eval_frame as _eval_frame

    _SKIP = _eval_frame._FrameExecStrategy(
        _eval_frame._FrameAction.SKIP, _eval_frame._FrameAction.DEFAULT
    )
except (ImportError, AttributeError):  # pragma: no cover - torch without dynamo
    _eval_frame = None
    _SKIP = None

_state = threading.local()


def skip_frame(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Marks ``fn``'s frames as not traced by dynamo; the frames they call still are."""
    if _SKIP is not None:
        _eval_frame.set_code_exec_strategy(fn.__code__, _SKIP)
    # Dynamo tracing a caller of fn breaks the graph there instead of tracing into it.
    fn._torchdynamo_disable = True  # type: ignore[attr-defined]
    return fn


@skip_frame
def enter(call: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``call(*args, **kwargs)`` with the thread's dynamo callback kept for the replicas only."""
    if _eval_frame is None:
        return call(*args, **kwargs)
    caught = _eval_frame.set_eval_frame(None)
    if caught is None:
        return call(*args, **kwargs)
    outer = getattr(_state, "callback", None)
    _state.callback = caught
    try:
        return call(*args, **kwargs)
    finally:
        _state.callback = outer
        _eval_frame.set_eval_frame(caught)


def callback() -> Any:
    """The callback of the compiled call running on this thread, else ``None``."""
    return getattr(_state, "callback", None)


def _call(call: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    return call(*args, **kwargs)


# One copy of _call's code per module class: the frame dynamo compiles a replica's call in (it
# skips torch.nn's own frames, so a torch.nn module called directly would compile nothing), with
# a cache of its own, so that models do not share one frame's recompile limit.
_frames: weakref.WeakKeyDictionary[type, Callable[..., Any]] = weakref.WeakKeyDictionary()


def _frame(call: Callable[..., Any]) -> Callable[..., Any]:
    owner = getattr(call, "__self__", None) or getattr(call, "module", None) or call
    cls = type(owner)
    frame = _frames.get(cls)
    if frame is None:
        name = f"torchdp_replica_{cls.__name__}"
        code = _call.__code__.replace(co_name=name)
        frame = _frames[cls] = types.FunctionType(code, _call.__globals__, name)
    return frame


def compiled(call: Callable[..., Any], caught: Any = None) -> Callable[..., Any]:
    """``call`` run with the callback ``caught`` (default: this thread's) set on the thread that
    runs it: a replica's call, compiled; ``call`` itself without one."""
    if caught is None:
        caught = callback()
    if caught is None:
        return call
    frame = _frame(call)

    def run(*args: Any, **kwargs: Any) -> Any:
        before = _eval_frame.set_eval_frame(caught)
        try:
            return frame(call, *args, **kwargs)
        finally:
            _eval_frame.set_eval_frame(before)

    return run
