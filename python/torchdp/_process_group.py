"""Gradient averaging across processes (``DataParallel(process_group=...)``), the Python side of
``_C.ProcessGroupSync`` (Note [Reducing across processes] in csrc/torchdp/process_group.cpp)."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn

from torchdp import _C, _tree


def check_process_group(group: Any, api: str) -> Any:
    """``group`` checked: None or a ProcessGroup this process belongs to."""
    if group is None:
        return None
    if not torch.distributed.is_available():
        raise RuntimeError(
            f"{api}: process_group needs torch.distributed, which this build of torch lacks"
        )
    dist = torch.distributed
    if not dist.is_initialized():
        raise RuntimeError(
            f"{api}: process_group was given but torch.distributed is not initialized; call "
            "torch.distributed.init_process_group(...) in every process before wrapping the model"
        )
    if group is dist.GroupMember.NON_GROUP_MEMBER:
        raise ValueError(
            f"{api}: this process is not a member of the process_group (new_group() returned "
            "GroupMember.NON_GROUP_MEMBER here); pass a group that holds this process, or None"
        )
    if not isinstance(group, dist.ProcessGroup):
        text = repr(group)
        text = text if len(text) <= 80 else text[:77] + "..."
        raise TypeError(
            f"{api}: process_group must be a torch.distributed.ProcessGroup "
            "(torch.distributed.group.WORLD or one made by torch.distributed.new_group()), got "
            f"{text} ({type(group).__name__})"
        )
    if not hasattr(_C, "ProcessGroupSync"):
        raise RuntimeError(f"{api}: process_group needs torchdp built with torch's c10d headers")
    try:
        dist.get_world_size(group)
    except Exception as exc:
        raise type(exc)(f"{api}: process_group cannot be used: {exc}") from exc
    return group


class ProcessGroupSync:
    """Keeps one wrapper's module in step with the other processes of ``group``."""

    def __init__(self, group: Any, api: str) -> None:
        self.group = group
        self.engine = _C.ProcessGroupSync(group, api)

    def before_forward(self, module: nn.Module, buffers: bool) -> None:
        """Takes group rank 0's parameters and buffers at the first forward and when the
        parameters changed, and its buffers when ``buffers`` at the other ones."""
        params = list(module.parameters())
        if not self.engine.agreed(params):
            self.engine.agree(params, list(module.buffers()), _sparse_flags(module, params))
        elif buffers:
            self.engine.broadcast(list(module.buffers()))

    def watch(self, module: nn.Module, outputs: Any, bucket_bytes: int | None) -> None:
        """Hooks ``outputs`` so that the backward pass through them averages the gradients."""
        self.engine.watch(_tensors_in(outputs), bucket_bytes)


def _sparse_flags(module: nn.Module, params: list[torch.Tensor]) -> list[bool]:
    """Which of ``params`` are sparse embeddings' weights (reduced as sparse tensors)."""
    sparse = {
        id(m.weight)
        for m in module.modules()
        if isinstance(m, (nn.Embedding, nn.EmbeddingBag)) and m.sparse
    }
    return [id(p) in sparse for p in params]


def _tensors_in(obj: Any) -> list[torch.Tensor]:
    """The tensors in a forward's output: the tree's leaves (Note [The Python tree]) and, unlike
    scatter, which passes them whole as PyTorch does, the fields of unregistered dataclasses:
    every tensor the backward pass can reach must be watched."""
    found: list[torch.Tensor] = []
    seen: set[int] = set()

    def walk(o: Any) -> None:
        for leaf in _tree.flatten(o)[0]:
            if isinstance(leaf, torch.Tensor):
                found.append(leaf)
            elif _unseen_dataclass(leaf, seen):
                for f in dataclasses.fields(leaf):
                    walk(getattr(leaf, f.name, None))

    walk(obj)
    return found


def _unseen_dataclass(obj: Any, seen: set[int]) -> bool:
    """Whether ``obj`` is a dataclass instance not walked yet (now marked as walked)."""
    if not dataclasses.is_dataclass(obj) or isinstance(obj, type) or id(obj) in seen:
        return False
    seen.add(id(obj))
    return True
