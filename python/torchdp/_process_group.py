"""Gradient averaging across processes for ``torchdp.DataParallel(process_group=...)``.

Note [Reducing across processes]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
torchdp sums the gradients of one process's replicas into the module's parameters. With a
``process_group``, every process of the group then averages those sums with the other processes,
as ``DistributedDataParallel`` does, so that one process per host trains like one process on the
global batch:

* At the first forward, the processes check that their modules have the same parameters and
  buffers (count, shapes, dtypes) and take group rank 0's values (DDP does this at construction;
  here it waits for the first forward, when the module has reached its device).
* Each forward with grad mode on (outside ``no_sync()``) first broadcasts group rank 0's buffers
  when ``broadcast_buffers`` (BatchNorm's running statistics), and hooks its tensor outputs.
* The first of those outputs that the backward pass reaches queues an engine callback, which
  queues the reduction itself as a second callback: it then runs after every callback that
  torchdp's own gradient buckets queue later in the pass (TORCHDP_GRAD_DELIVERY=bucket gives
  unused parameters their zeros there), when every gradient of the pass is in place. A pass that
  accumulates into none of the parameters (``torch.autograd.grad`` of the inputs) reduces nothing.
* The reduction divides each bucket (the parameters in reverse order, by device and dtype, up to
  ``bucket_cap_mb``) by the group's size, all-reduces every bucket asynchronously and copies the
  averages back into ``.grad``. Every process must hold the same buckets, so a parameter without
  a gradient in this process takes part with zeros and gets a zero-based average, as a parameter
  unused in one replica gets zeros from ``torch.nn.DataParallel``.

Averaging a gradient that is already the same in every process leaves it as it is, so gradients
accumulated over several backward passes (with or without ``no_sync()``) come out right.
"""

from __future__ import annotations

import threading
import zlib
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.autograd import Variable
from torch.utils._pytree import tree_leaves

_DEFAULT_BUCKET_BYTES = 25 * 1024 * 1024


def check_process_group(group: Any, api: str) -> Any:
    """``group`` checked: None or a ProcessGroup this process belongs to."""
    if group is None:
        return None
    dist = _distributed(api)
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
        raise TypeError(
            f"{api}: process_group must be a torch.distributed.ProcessGroup "
            "(torch.distributed.group.WORLD or one made by torch.distributed.new_group()), got "
            f"{type(group).__name__}"
        )
    return group


def _distributed(api: str) -> Any:
    if not torch.distributed.is_available():
        raise RuntimeError(
            f"{api}: process_group needs torch.distributed, which this build of torch lacks"
        )
    return torch.distributed


def _accumulator(param: torch.Tensor) -> Any:
    """The AccumulateGrad node of a leaf that requires grad (kept, so that it stays the same)."""
    return param.view_as(param).grad_fn.next_functions[0][0]


class _Layout:
    """The parameters that need gradients, their AccumulateGrad nodes and the buckets."""

    def __init__(self, params: list[torch.Tensor], bucket_bytes: int) -> None:
        self.key = [id(p) for p in params]
        self.size = bucket_bytes
        self.params = params
        self.nodes = [_accumulator(p) for p in params]
        # Reverse registration order (the backward's order for most models), one bucket per
        # device and dtype at a time, at most bucket_bytes each (0: one bucket per kind).
        self.buckets: list[list[torch.Tensor]] = []
        open_buckets: dict[tuple[torch.device, torch.dtype], tuple[list[torch.Tensor], int]] = {}
        for p in reversed(params):
            kind = (p.device, p.dtype)
            bucket, size = open_buckets.get(kind, (None, 0))
            nbytes = p.numel() * p.element_size()
            if bucket is None or (bucket_bytes > 0 and bucket and size + nbytes > bucket_bytes):
                bucket, size = [], 0
                self.buckets.append(bucket)
            bucket.append(p)
            open_buckets[kind] = (bucket, size + nbytes)


class ProcessGroupSync:
    """Keeps one wrapper's module in step with the other processes of ``group``."""

    def __init__(self, group: Any) -> None:
        dist = torch.distributed
        self.group = group
        self.world = dist.get_world_size(group)
        self.src = dist.get_global_rank(group, 0)
        self.state_synced = False
        self._layout: _Layout | None = None
        self._lock = threading.Lock()

    # -- forward ---------------------------------------------------------------------------

    def before_forward(self, module: nn.Module, api: str, buffers: bool) -> None:
        """Takes group rank 0's parameters and buffers at the first forward, and its buffers
        when ``buffers`` at the later ones."""
        if self.world == 1:
            return
        with torch.no_grad():
            if not self.state_synced:
                params, bufs = list(module.parameters()), list(module.buffers())
                if params or bufs:
                    self._check_same_module(params, bufs, api)
                    self._broadcast(params + bufs, api)
                self.state_synced = True
            elif buffers:
                self._broadcast(list(module.buffers()), api)

    def watch(self, module: nn.Module, outputs: Any, bucket_bytes: int | None) -> None:
        """Hooks ``outputs`` so that the backward pass through them averages the gradients."""
        if self.world == 1:
            return
        # Leaf outputs (a parameter or input returned as it is) are not hooked: a hook on a leaf
        # outlives the step, and the processes would add one per forward.
        tensors = [
            t
            for t in tree_leaves(outputs)
            if isinstance(t, torch.Tensor) and t.requires_grad and t.grad_fn is not None
        ]
        if not tensors:
            return
        layout = self._layout_of(module, bucket_bytes)
        if not layout.params:
            return
        hook = _PassHook(self, layout)
        for t in tensors:
            t.register_hook(hook)

    def _layout_of(self, module: nn.Module, bucket_bytes: int | None) -> _Layout:
        params = [p for p in list(module.parameters()) if p.requires_grad]
        size = _DEFAULT_BUCKET_BYTES if bucket_bytes is None else bucket_bytes
        layout = self._layout
        if layout is None or layout.size != size or layout.key != [id(p) for p in params]:
            layout = self._layout = _Layout(params, size)
        return layout

    def _check_same_module(
        self, params: list[torch.Tensor], buffers: list[torch.Tensor], api: str
    ) -> None:
        dist = torch.distributed
        shapes = ";".join(
            f"{tuple(t.shape)}:{t.dtype}" for t in params + [None] + buffers if t is not None
        )
        mine = [
            len(params),
            sum(p.numel() for p in params),
            len(buffers),
            sum(b.numel() for b in buffers),
            zlib.crc32(shapes.encode()),
        ]
        device = _collective_device(params + buffers)
        gathered = [
            torch.empty(len(mine), dtype=torch.int64, device=device) for _ in range(self.world)
        ]
        try:
            dist.all_gather(
                gathered, torch.tensor(mine, dtype=torch.int64, device=device), group=self.group
            )
        except Exception as exc:
            raise type(exc)(f"{api} (process_group): {exc}") from exc
        rows = [g.tolist() for g in gathered]
        for rank, row in enumerate(rows):
            if row != rows[0]:

                def text(r: list[int]) -> str:
                    return (
                        f"{r[0]} parameters ({r[1]} elements) and {r[2]} buffers ({r[3]} "
                        "elements)" + ("" if r[:4] != rows[0][:4] else ", other shapes or dtypes")
                    )

                raise RuntimeError(
                    f"{api}: the processes of process_group wrap different modules: group rank "
                    f"{rank} has {text(row)}, group rank 0 has {text(rows[0])}; every process "
                    "must wrap the same model"
                )

    def _broadcast(self, tensors: list[torch.Tensor], api: str) -> None:
        dist = torch.distributed
        groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
        for t in tensors:
            if t.numel() and not t.is_sparse and t.device.type != "meta":
                groups.setdefault((t.device, t.dtype), []).append(t.detach())
        for members in groups.values():
            flat = torch.cat([t.reshape(-1) for t in members])
            try:
                dist.broadcast(flat, src=self.src, group=self.group)
            except Exception as exc:
                raise type(exc)(f"{api} (process_group): {exc}") from exc
            torch._foreach_copy_(
                members,
                [v.view_as(t) for v, t in zip(flat.split([t.numel() for t in members]), members)],
            )

    # -- backward --------------------------------------------------------------------------

    def reduce(self, layout: _Layout) -> None:
        """Averages the gradients of ``layout``'s parameters over the group (an engine callback)."""
        dist = torch.distributed
        with torch.no_grad(), self._lock:
            pending = []
            for bucket in layout.buckets:
                grads = []
                for p in bucket:
                    if p.grad is None:
                        p.grad = torch.zeros_like(p)
                    grads.append(p.grad)
                dense = [g for g in grads if g.layout == torch.strided]
                for g in grads:
                    if g.layout != torch.strided:  # sparse: reduced on its own
                        g.div_(self.world)
                        dist.all_reduce(g, group=self.group)
                if not dense:
                    continue
                flat = torch.cat([g.reshape(-1) for g in dense])
                flat.div_(self.world)
                pending.append(
                    (dist.all_reduce(flat, group=self.group, async_op=True), flat, dense)
                )
            for work, flat, dense in pending:
                work.wait()
                sizes = [g.numel() for g in dense]
                torch._foreach_copy_(
                    dense, [v.view_as(g) for v, g in zip(flat.split(sizes), dense)]
                )


def _collective_device(tensors: list[torch.Tensor]) -> torch.device:
    for t in tensors:
        if t.device.type not in ("cpu", "meta"):
            return t.device
    return torch.device("cpu")


class _PassHook:
    """The hook of one forward's outputs: queues the reduction once per backward pass."""

    def __init__(self, sync: ProcessGroupSync, layout: _Layout) -> None:
        self.sync = sync
        self.layout = layout
        self.passes: set[int] = set()
        # Outputs on several devices (gather_output=False) reach their hooks on several autograd
        # threads at once: one of them queues the reduction, or the processes could disagree on
        # how many reductions a pass makes.
        self.lock = threading.Lock()

    def __call__(self, grad: torch.Tensor) -> None:
        task = torch._C._current_graph_task_id()
        with self.lock:
            if task in self.passes:
                return
            self.passes.add(task)
        if not any(torch._C._will_engine_execute_node(n) for n in self.layout.nodes):
            return  # torch.autograd.grad of something else: no parameter gradient changes
        sync, layout = self.sync, self.layout

        def later() -> None:
            with self.lock:
                self.passes.discard(task)
            _queue(lambda: sync.reduce(layout))

        _queue(later)


def _queue(callback: Callable[[], None]) -> None:
    Variable._execution_engine.queue_callback(callback)
