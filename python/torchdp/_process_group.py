"""Gradient averaging across processes for ``torchdp.DataParallel(process_group=...)``.

Note [Reducing across processes]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
torchdp sums the gradients of one process's replicas into the module's parameters. With a
``process_group``, every process of the group then averages those sums with the other processes,
as ``DistributedDataParallel`` does, so that one process per host trains like one process on the
global batch. The C++ ``DataParallel`` does the same (csrc/torchdp/process_group.cpp).

* At the first forward, and at the first forward after the module's parameters changed (other
  tensors, another ``requires_grad``, dtype or device), the processes check that their modules
  have the same parameters and buffers (count, shapes, dtypes, ``requires_grad``) and take group
  rank 0's values (DDP does this at construction; here it waits until the module has reached its
  device). The processes must change their modules alike.
* Each forward with grad mode on (outside ``no_sync()``) first broadcasts group rank 0's buffers
  when ``broadcast_buffers`` (BatchNorm's running statistics), and hooks the tensors of its output
  (inside lists, tuples, dicts, dataclasses and pytree-registered types; not leaf tensors, whose
  hooks would outlive the step).
* The first hooked tensor that a backward pass reaches queues an engine callback, which queues the
  reduction itself as a second callback: it then runs after every callback that torchdp's own
  gradient buckets queue later in the pass (TORCHDP_GRAD_DELIVERY=bucket gives unused parameters
  their zeros there), when every gradient of the pass is in place. One reduction per pass, however
  many forwards the pass goes through. A pass that accumulates into none of the parameters
  (``torch.autograd.grad``) reduces nothing.
* The reduction divides each bucket (the parameters in reverse order, by device and dtype, up to
  ``bucket_cap_mb``) by the group's size, all-reduces every bucket asynchronously, waits for all of
  them and only then copies the averages into ``.grad`` (a failure leaves the gradients as they
  were). Every process must hold the same buckets, so a parameter without a gradient in this
  process takes part with zeros and gets the average, as a parameter unused in one replica gets
  zeros from ``torch.nn.DataParallel``. Each bucket carries one more element per parameter, 1
  where the process has a gradient: a parameter without one in every process keeps None, as
  DDP leaves it (only a process that lacks a gradient reads those sums, which waits for the
  device). The weights of sparse ``nn.Embedding``/``nn.EmbeddingBag`` modules are all-reduced one
  by one as sparse tensors (empty ones where unused), with their flags in one more all-reduce;
  other sparse gradients are reduced densely.

Averaging a gradient that is already the same in every process leaves it as it is, so gradients
accumulated over several backward passes (with or without ``no_sync()``) come out right.
"""

from __future__ import annotations

import dataclasses
import threading
import zlib
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.autograd import Variable
from torch.utils._pytree import tree_leaves

_DEFAULT_BUCKET_BYTES = 25 * 1024 * 1024
# Backward passes remembered at once (far more than run at the same time).
_MAX_PASSES = 1024


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
            f"{_short_repr(group)} ({type(group).__name__})"
        )
    return group


def _short_repr(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


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

    def __init__(self, module: nn.Module, params: list[torch.Tensor], bucket_bytes: int) -> None:
        self.size = bucket_bytes
        self.params = params
        self.nodes = [_accumulator(p) for p in params]
        sparse_weights = {
            id(m.weight)
            for m in module.modules()
            if isinstance(m, (nn.Embedding, nn.EmbeddingBag)) and m.sparse
        }
        # Sparse embeddings' weights, reduced one by one as sparse tensors in every process.
        self.sparse = [p for p in reversed(params) if id(p) in sparse_weights]
        # Reverse registration order (the backward's order for most models), one bucket per
        # device and dtype at a time, at most bucket_bytes each (0: one bucket per kind).
        self.buckets: list[list[torch.Tensor]] = []
        open_buckets: dict[tuple[torch.device, torch.dtype], tuple[list[torch.Tensor], int]] = {}
        for p in reversed(params):
            if id(p) in sparse_weights:
                continue
            kind = (p.device, p.dtype)
            bucket, size = open_buckets.get(kind, (None, 0))
            nbytes = p.numel() * p.element_size()
            if bucket is None or (bucket_bytes > 0 and bucket and size + nbytes > bucket_bytes):
                bucket, size = [], 0
                self.buckets.append(bucket)
            bucket.append(p)
            open_buckets[kind] = (bucket, size + nbytes)

    def accumulates(self) -> bool:
        """Whether the running backward pass writes the gradient of one of the parameters."""
        for node in self.nodes:
            try:
                if torch._C._will_engine_execute_node(node):
                    return True
            except RuntimeError:
                continue  # captured by torch.autograd.grad, which writes no .grad
        return False


class ProcessGroupSync:
    """Keeps one wrapper's module in step with the other processes of ``group``."""

    def __init__(self, group: Any, api: str) -> None:
        dist = torch.distributed
        self.group = group
        self.api = api
        try:
            self.world = dist.get_world_size(group)
            self.src = dist.get_global_rank(group, 0)
        except Exception as exc:
            raise type(exc)(f"{api}: process_group cannot be used: {exc}") from exc
        # The parameters the processes last agreed on, and each one's (requires_grad, dtype,
        # device): a conversion (module.double(), .to(device)) keeps the Parameter objects but
        # gives them new AccumulateGrad nodes, which the layout must follow.
        self._state: tuple[list[torch.Tensor], list[tuple[bool, Any, Any]]] | None = None
        self._layout: _Layout | None = None
        self._lock = threading.Lock()
        # The backward passes (graph task ids) whose hooks have run, oldest first: a pass ends by
        # removing its id, and one that never does (torch.autograd.grad, a failed pass) is
        # dropped once _MAX_PASSES newer ones came.
        self._passes: dict[int, None] = {}
        self._passes_lock = threading.Lock()

    # -- forward ---------------------------------------------------------------------------

    def before_forward(self, module: nn.Module, buffers: bool) -> None:
        """Takes group rank 0's parameters and buffers at the first forward and when the
        parameters changed, and its buffers when ``buffers`` at the other ones."""
        if self.world == 1:
            return
        params = list(module.parameters())
        kinds = [(p.requires_grad, p.dtype, p.device) for p in params]
        state = self._state
        with torch.no_grad():
            if (
                state is None
                or len(state[0]) != len(params)
                or any(a is not b for a, b in zip(state[0], params))
                or state[1] != kinds
            ):
                bufs = list(module.buffers())
                # Also with nothing to compare: a process whose module is empty must still meet
                # the others' check, or they would wait for it.
                self._check_same_module(params, bufs)
                self._broadcast(params + bufs)
                self._state = (params, kinds)
                self._layout = None  # made again at the next watch(), from these parameters
            elif buffers:
                self._broadcast(list(module.buffers()))

    def watch(self, module: nn.Module, outputs: Any, bucket_bytes: int | None) -> None:
        """Hooks ``outputs`` so that the backward pass through them averages the gradients."""
        if self.world == 1:
            return
        # Leaf outputs (a parameter or input returned as it is) are not hooked: a hook on a leaf
        # outlives the step, and the processes would add one per forward.
        tensors = [t for t in _tensors_in(outputs) if t.requires_grad and t.grad_fn is not None]
        if not tensors:
            return
        layout = self._layout_of(module, bucket_bytes)
        if not layout.params:
            return

        def hook(grad: torch.Tensor) -> None:
            self._reached(layout)

        for t in tensors:
            t.register_hook(hook)

    def _layout_of(self, module: nn.Module, bucket_bytes: int | None) -> _Layout:
        """The buckets of the parameters before_forward() last agreed on (no second walk)."""
        size = _DEFAULT_BUCKET_BYTES if bucket_bytes is None else bucket_bytes
        layout = self._layout
        if layout is None or layout.size != size:
            assert self._state is not None, "watch() runs after before_forward()"
            params = [p for p, (needs_grad, _, _) in zip(*self._state) if needs_grad]
            layout = self._layout = _Layout(module, params, size)
        return layout

    def _check_same_module(self, params: list[torch.Tensor], buffers: list[torch.Tensor]) -> None:
        dist = torch.distributed
        shapes = ";".join(
            f"{tuple(t.shape)}:{t.dtype}:{t.requires_grad}"
            for t in params + [None] + buffers
            if t is not None
        )
        mine = [
            len(params),
            sum(p.numel() for p in params),
            len(buffers),
            sum(b.numel() for b in buffers),
            zlib.crc32(shapes.encode()),
        ]
        device = _collective_device(params + buffers, self.group)
        gathered = [
            torch.empty(len(mine), dtype=torch.int64, device=device) for _ in range(self.world)
        ]
        mine_t = torch.tensor(mine, dtype=torch.int64, device=device)
        self._collective(lambda: dist.all_gather(gathered, mine_t, group=self.group))
        rows = [g.tolist() for g in gathered]
        for rank, row in enumerate(rows):
            if row != rows[0]:

                def text(r: list[int]) -> str:
                    return (
                        f"{r[0]} parameters ({r[1]} elements) and {r[2]} buffers ({r[3]} "
                        "elements)"
                        + (
                            ""
                            if r[:4] != rows[0][:4]
                            else ", other shapes, dtypes or requires_grad"
                        )
                    )

                raise RuntimeError(
                    f"{self.api}: the processes of process_group wrap different modules: group "
                    f"rank {rank} has {text(row)}, group rank 0 has {text(rows[0])}; every process "
                    "must wrap the same model (and change it alike)"
                )

    def _broadcast(self, tensors: list[torch.Tensor]) -> None:
        dist = torch.distributed
        groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
        for t in tensors:
            if t.numel() and t.layout == torch.strided and t.device.type != "meta":
                groups.setdefault((t.device, t.dtype), []).append(t.detach())
        for members in groups.values():
            flat = torch.cat([t.reshape(-1) for t in members])
            self._collective(lambda f=flat: dist.broadcast(f, src=self.src, group=self.group))
            torch._foreach_copy_(
                members,
                [v.view_as(t) for v, t in zip(flat.split([t.numel() for t in members]), members)],
            )

    def _collective(self, run: Callable[[], Any]) -> Any:
        try:
            return run()
        except Exception as exc:
            raise type(exc)(f"{self.api} (process_group): {exc}") from exc

    # -- backward --------------------------------------------------------------------------

    def _reached(self, layout: _Layout) -> None:
        """A hooked output's gradient: queues the reduction once per backward pass."""
        task = torch._C._current_graph_task_id()
        # Outputs on several devices (gather_output=False) reach their hooks on several autograd
        # threads at once, and a pass may go through several forwards: one reduction per pass, or
        # the processes could disagree on how many there are.
        with self._passes_lock:
            if task in self._passes:
                return
            self._passes[task] = None
            if len(self._passes) > _MAX_PASSES:
                del self._passes[next(iter(self._passes))]

        def forget() -> None:
            with self._passes_lock:
                self._passes.pop(task, None)

        if not layout.accumulates():
            _queue(forget)
            return

        def later() -> None:
            forget()
            _queue(lambda: self.reduce(layout))

        _queue(later)

    def reduce(self, layout: _Layout) -> None:
        """Averages the gradients of ``layout``'s parameters over the group (an engine callback)."""
        dist = torch.distributed
        with torch.no_grad(), self._lock:
            writes: list[tuple[torch.Tensor, torch.Tensor]] = []  # (parameter, new .grad)
            pending = []
            for bucket in layout.buckets:
                grads = []
                missing = []  # members without a gradient here
                for i, p in enumerate(bucket):
                    g = p.grad
                    if g is None:
                        g = torch.zeros_like(p)
                        missing.append(i)
                    elif g.layout != torch.strided:  # a sparse gradient outside an embedding
                        g = g.to_dense()
                    grads.append(g)
                # Each member's gradient, then one "has a gradient here" flag per member: their
                # sum says whether any process has one (no second collective).
                flags = torch.ones(len(bucket), dtype=bucket[0].dtype, device=bucket[0].device)
                for i in missing:
                    flags[i] = 0
                flat = torch.cat([g.reshape(-1) for g in grads] + [flags])
                numel = flat.numel() - len(bucket)
                flat[:numel].div_(self.world)
                work = self._collective(
                    lambda f=flat: dist.all_reduce(f, group=self.group, async_op=True)
                )
                pending.append((work, flat, numel, bucket, grads, missing))
            sparse_used = sparse_work = None
            sparse_missing = False
            if layout.sparse:
                flags = [float(p.grad is not None) for p in layout.sparse]
                sparse_missing = 0.0 in flags
                sparse_used = torch.tensor(flags, device=layout.sparse[0].device)
                sparse_work = self._collective(
                    lambda: dist.all_reduce(sparse_used, group=self.group, async_op=True)
                )
            sparse_writes = []
            for p in layout.sparse:
                g = p.grad
                if g is None:
                    g = torch.sparse_coo_tensor(
                        torch.empty((1, 0), dtype=torch.long, device=p.device),
                        torch.empty((0, *p.shape[1:]), dtype=p.dtype, device=p.device),
                        p.shape,
                    )
                elif g.layout == torch.strided:
                    g = g.to_sparse(1)
                g = g.coalesce() / self.world
                self._collective(lambda g=g: dist.all_reduce(g, group=self.group))
                sparse_writes.append((p, g))
            for work, *_ in pending:
                self._collective(work.wait)
            if sparse_work is not None:
                self._collective(sparse_work.wait)
            # Every reduction is done: only now are gradients written. A parameter without a
            # gradient in any process keeps None, as with DDP (reading the flags waits for the
            # device, so only a process that lacks a gradient reads them).
            for _, flat, numel, bucket, grads, missing in pending:
                used = flat[numel:].tolist() if missing else None
                averages = flat[:numel].split([g.numel() for g in grads])
                for i, (p, g, v) in enumerate(zip(bucket, grads, averages)):
                    current = p.grad
                    if current is not None and current.layout == torch.strided:
                        current.copy_(v.view_as(current))
                    elif current is not None or used[i] != 0:
                        writes.append((p, v.view_as(g).clone()))
            if sparse_used is not None:
                used = sparse_used.tolist() if sparse_missing else None
                for i, (p, g) in enumerate(sparse_writes):
                    if p.grad is not None or used[i] != 0:
                        writes.append((p, g))
            for p, g in writes:
                p.grad = g


def _tensors_in(obj: Any) -> list[torch.Tensor]:
    """The tensors inside a forward's output (lists, tuples, dicts and their subclasses,
    dataclasses and pytree-registered types, as deep as they go)."""
    found: list[torch.Tensor] = []
    seen: set[int] = set()

    def walk(o: Any) -> None:
        if isinstance(o, torch.Tensor):
            found.append(o)
            return
        if id(o) in seen:
            return
        seen.add(id(o))
        if isinstance(o, (list, tuple)):
            for v in o:
                walk(v)
        elif isinstance(o, dict):
            for v in o.values():
                walk(v)
        elif dataclasses.is_dataclass(o) and not isinstance(o, type):
            for f in dataclasses.fields(o):
                walk(getattr(o, f.name, None))
        else:
            leaves = tree_leaves(o)
            if not (len(leaves) == 1 and leaves[0] is o):
                for v in leaves:
                    walk(v)

    walk(obj)
    return found


def _collective_device(tensors: list[torch.Tensor], group: Any) -> torch.device:
    """Where the module check's collective runs: the module's accelerator, else the CPU (the
    current GPU for an empty module on an NCCL group, which reduces no CPU tensors)."""
    for t in tensors:
        if t.device.type not in ("cpu", "meta"):
            return t.device
    if not tensors and torch.cuda.is_available():
        try:
            backend = str(torch.distributed.get_backend(group))
        except Exception:  # noqa: BLE001  a group without a backend name: the CPU
            backend = ""
        if backend == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _queue(callback: Callable[[], None]) -> None:
    Variable._execution_engine.queue_callback(callback)
