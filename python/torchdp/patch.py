"""``torchdp.patch_torch()``: swap torchdp in for ``torch.nn.DataParallel`` and friends."""

from __future__ import annotations

import importlib
import threading
from typing import Any

from typing_extensions import Self

__all__ = ["TorchPatch", "patch_torch"]

# (module name, attribute, torchdp attribute)
_TARGETS: tuple[tuple[str, str, str], ...] = (
    ("torch.nn", "DataParallel", "DataParallel"),
    ("torch.nn.parallel", "DataParallel", "DataParallel"),
    ("torch.nn.parallel", "data_parallel", "data_parallel"),
    ("torch.nn.parallel", "replicate", "replicate"),
    ("torch.nn.parallel", "scatter", "scatter"),
    ("torch.nn.parallel", "gather", "gather"),
    ("torch.nn.parallel", "parallel_apply", "parallel_apply"),
    ("torch.nn.parallel.scatter_gather", "scatter", "scatter"),
    ("torch.nn.parallel.scatter_gather", "scatter_kwargs", "scatter_kwargs"),
    ("torch.nn.parallel.scatter_gather", "gather", "gather"),
    ("torch.nn.parallel.replicate", "replicate", "replicate"),
    ("torch.nn.parallel.parallel_apply", "parallel_apply", "parallel_apply"),
    ("torch.nn.parallel.data_parallel", "DataParallel", "DataParallel"),
    ("torch.nn.parallel.data_parallel", "data_parallel", "data_parallel"),
    ("torch.nn.parallel.data_parallel", "replicate", "replicate"),
    ("torch.nn.parallel.data_parallel", "scatter_kwargs", "scatter_kwargs"),
    ("torch.nn.parallel.data_parallel", "gather", "gather"),
    ("torch.nn.parallel.data_parallel", "parallel_apply", "parallel_apply"),
)

_lock = threading.Lock()
_active: set[int] = set()  # ids of the handles that have not been undone
_saved: dict[tuple[str, str], Any] = {}  # (module, attribute) -> the original value
_next_id = 0


def _replacement(name: str) -> Any:
    import torchdp

    return getattr(torchdp, name)


def _apply() -> None:
    # All or nothing: a name missing from this torch release raises before anything is replaced.
    found = []
    for module_name, attribute, ours in _TARGETS:
        # importlib: the attribute torch.nn.parallel.replicate is the function, not the submodule.
        module = importlib.import_module(module_name)
        found.append((module_name, attribute, module, getattr(module, attribute), ours))
    for module_name, attribute, module, current, ours in found:
        replacement = _replacement(ours)
        if current is not replacement:
            # Keep the first original seen (PyTorch's), even if someone replaced it since.
            _saved.setdefault((module_name, attribute), current)
            setattr(module, attribute, replacement)


def _restore() -> None:
    for module_name, attribute, ours in _TARGETS:
        key = (module_name, attribute)
        if key not in _saved:
            continue
        original = _saved.pop(key)
        module = importlib.import_module(module_name)
        # Leave alone an attribute that someone else replaced after us.
        if getattr(module, attribute) is _replacement(ours):
            setattr(module, attribute, original)


class TorchPatch:
    r"""Handle returned by :func:`patch_torch`.

    :meth:`undo` (alias :meth:`remove`, idempotent) takes this handle's patch back; PyTorch's
    originals return once every handle is undone. Also a context manager."""

    __slots__ = ("_id",)

    def __init__(self, handle_id: int) -> None:
        self._id = handle_id

    @property
    def active(self) -> bool:
        """True until :meth:`undo` is called on this handle."""
        return self._id in _active

    def undo(self) -> None:
        """Takes this patch back; the originals return when no other patch is active."""
        with _lock:
            if self._id in _active:
                _active.remove(self._id)
                if not _active:
                    _restore()

    remove = undo

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.undo()

    def __repr__(self) -> str:
        return f"<torchdp.TorchPatch #{self._id} ({'active' if self.active else 'undone'})>"


def patch_torch() -> TorchPatch:
    r"""Makes ``torch.nn.DataParallel`` and ``torch.nn.parallel``'s functions torchdp's.

    Replaces ``DataParallel``, ``data_parallel``, ``replicate``, ``scatter``, ``scatter_kwargs``,
    ``gather`` and ``parallel_apply`` wherever ``torch.nn``, ``torch.nn.parallel`` and its
    submodules ``scatter_gather``, ``replicate``, ``parallel_apply`` and ``data_parallel`` define
    them, so code that looks them up at call time uses torchdp; names bound earlier with
    ``from torch.nn.parallel import ...`` keep PyTorch's objects. If a name is missing from this
    torch release, nothing is replaced. Calling it again re-applies the patch and returns another
    handle; the objects the first call found return once every handle is undone. While active,
    instances of PyTorch's own class are not instances of ``torch.nn.DataParallel`` and pickle
    cannot save them by name (undo the patch first); names bound and subclasses defined
    meanwhile keep torchdp's class after the undo.

    Returns:
        :class:`TorchPatch`: ``undo()`` / ``remove()`` restores; usable as a context manager.

    Example::

        >>> with torchdp.patch_torch():
        ...     model = torch.nn.DataParallel(net)   # a torchdp.DataParallel
        >>> torch.nn.DataParallel is torchdp.DataParallel
        False
    """
    global _next_id
    with _lock:
        _next_id += 1
        _apply()
        _active.add(_next_id)
        return TorchPatch(_next_id)
