"""Replicas of modules compiled in place with ``module.compile()`` (see
csrc/python/replicate_build.cpp, Note [Replicating compiled modules])."""

from __future__ import annotations

import contextlib
import warnings
import weakref
from typing import Any

__all__ = ["rebind_compiled_call"]

# compiled function -> its dynamo context (None: not found); weak, so compiled calls can go.
_contexts: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()
_warned = False


def _dynamo_context_of(compiled: Any) -> Any:
    try:
        return _contexts[compiled]
    except (KeyError, TypeError):
        pass
    try:
        from torch._dynamo.eval_frame import _TorchDynamoContext
    except ImportError:  # pragma: no cover - torch releases without dynamo
        return None
    context = None
    for cell in getattr(compiled, "__closure__", None) or ():
        try:
            value = cell.cell_contents
        except ValueError:  # an empty cell
            continue
        if isinstance(value, _TorchDynamoContext):
            context = value
            break
    with contextlib.suppress(TypeError):  # not weak-referenceable: look it up again next time
        _contexts[compiled] = context
    return context


def rebind_compiled_call(replica: Any, compiled: Any) -> None:
    """Compiles ``replica._call_impl`` under the dynamo context that ``compiled`` (the original's
    ``_compiled_call_impl``, bound to it) closes over; without one, eagerly and warned once."""
    global _warned
    context = _dynamo_context_of(compiled)
    if context is None and not _warned:
        _warned = True
        warnings.warn(
            "torchdp.replicate: a module compiled in place with module.compile() is "
            f"replicated ({type(replica).__qualname__}), but the compiler settings of its "
            "compiled call could not be recovered, so its replicas run eagerly. Use "
            "torch.compile(module) (the wrapper torchdp replicates with its compiled forward) "
            "instead of module.compile() to compile the replicas. This warning is shown once.",
            UserWarning,
            stacklevel=3,
        )
    rebound = None if context is None else context(replica._call_impl)
    replica.__dict__["_compiled_call_impl"] = rebound
