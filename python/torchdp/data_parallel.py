"""``torchdp.DataParallel`` and ``torchdp.data_parallel``, drop-ins for ``torch.nn.DataParallel``
and ``torch.nn.parallel.data_parallel``."""

from __future__ import annotations

import contextlib
import functools
import importlib
import operator
import warnings
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

import torch
from torch import nn
from torch._utils import (
    _get_all_device_indices,
    _get_available_device_type,
    _get_device_index,
)

from torchdp import _C, _compile, _methods, _samples, _step
from torchdp._attributes import check_stale_attribute_policy
from torchdp._devices import (
    DeviceLike,
    _check_balance,
    _check_device_ids,
    _check_dim,
    _check_shares,
    _device_error,
    _resolve_explicit,
)
from torchdp._graphs import GraphedReplicas, check_cuda_graphs
from torchdp._process_group import ProcessGroupSync, check_process_group
from torchdp.parallel_apply import parallel_apply, record_function
from torchdp.replicate import _bucket_bytes, _check_module, _replicate, replicate
from torchdp.scatter_gather import gather, scatter_kwargs

__all__ = ["DataParallel", "data_parallel"]

T = TypeVar("T", bound=nn.Module)

# The base class, taken before torchdp.patch_torch() can replace torch.nn.DataParallel (through
# importlib: the function torch.nn.parallel.data_parallel shadows the submodule).
_TorchDataParallel = importlib.import_module("torch.nn.parallel.data_parallel").DataParallel


_API = "torchdp.DataParallel"


def _indices(
    device_ids: Any, output_device: Any, device_type: str, api: str
) -> tuple[list[int], int]:
    """PyTorch's device_ids and output_device defaults and index conversion, checked for CUDA."""
    if device_ids is None:
        device_ids = _get_all_device_indices()
    if device_ids is None:
        raise RuntimeError("no available devices were found")
    if output_device is None:
        output_device = device_ids[0]
    ids = [_get_device_index(x, True) for x in device_ids]
    output = _get_device_index(output_device, True)
    if device_type == "cuda":
        _check_device_ids(ids, output, api)
    return ids, output


# Per-wrapper state kept outside the module, so that copying or pickling the wrapper never meets
# CUDA graphs, process groups or kept replicas; data_parallel() keeps its caches per module.
_GRAPHED: weakref.WeakKeyDictionary[nn.Module, GraphedReplicas] = weakref.WeakKeyDictionary()

_SYNCS: weakref.WeakKeyDictionary[nn.Module, ProcessGroupSync] = weakref.WeakKeyDictionary()

_REPLICA_CACHES: weakref.WeakKeyDictionary[nn.Module, _C.ReplicaCache] = weakref.WeakKeyDictionary()
_FUNCTIONAL_CACHES: weakref.WeakKeyDictionary[nn.Module, _C.ReplicaCache] = (
    weakref.WeakKeyDictionary()
)


def _unchanged(outputs: Any) -> Any:
    return outputs


_warned_ignored_device_ids = False


def _warn_ignored_device_ids(device_ids: Any) -> None:
    """Once per process: the passthrough (no accelerator) ignores explicit device_ids."""
    global _warned_ignored_device_ids
    if not _warned_ignored_device_ids:
        _warned_ignored_device_ids = True
        warnings.warn(
            f"{_API}: device_ids={list(device_ids)!r} are ignored because no accelerator is "
            "visible, so the wrapper only calls the module (as torch.nn.DataParallel does). To "
            "run replicas on the CPU, pass devices=[torch.device('cpu')] * n instead",
            UserWarning,
            stacklevel=3,
        )


class DataParallel(_TorchDataParallel[T]):
    r"""Implements data parallelism at the module level: a drop-in for
    :class:`torch.nn.DataParallel`, backed by torchdp's C++ data-parallel machinery.

    The input is split across the devices along :attr:`dim` (other objects are passed to every
    device by reference), the module is replicated on each device in every forward, each replica
    runs on its chunk on a persistent worker, and the outputs are gathered on
    :attr:`output_device`. The gradients of all replicas are summed into :attr:`module`'s
    parameters. The replica on ``device_ids[0]`` shares storage with :attr:`module`, so in-place
    buffer updates there (BatchNorm running statistics) persist.

    Constructor, attributes, overridable methods (:meth:`replicate`, :meth:`scatter`,
    :meth:`parallel_apply`, :meth:`gather`), messages and exception types follow
    :class:`torch.nn.DataParallel`; ``isinstance(dp, torch.nn.DataParallel)`` is true. On top:

    * post-replicate hooks (:func:`torchdp.register_post_replicate_hook`) and
      ``__data_parallel_replicate__`` callbacks run on every replica, and every replica's
      parameters and buffers are checked to be on its device;
    * the device error of a forward names the offending parameter and the fix;
    * ``devices=`` runs the full machinery on an explicit device list, CPU and meta included.

    Args:
        module (Module): module to be parallelized.
        device_ids (list of int or torch.device): CUDA devices (default: all devices).
        output_device (int or torch.device): device location of output (default:
            ``device_ids[0]``); ``-1`` means the CPU.
        dim (int): the dimension inputs are split along and outputs concatenated along.
            Default: ``0``.
        devices (list of torch.device, keyword-only): an explicit device list (cpu, meta or cuda;
            a device may repeat) used instead of :attr:`device_ids`, even without an accelerator.
            Then ``device_ids`` is this list and :attr:`output_device` (default ``devices[0]``)
            may be the CPU.
        place_module (bool, keyword-only): move :attr:`module` to ``device_ids[0]`` at the first
            forward instead of raising when it is elsewhere. Default: ``False``.
        gather_output (bool, keyword-only): ``False`` returns the list of the replicas' outputs,
            each on its own device; compute the loss per replica with
            :class:`torchdp.DataParallelCriterion` so that the first device does not hold the whole
            batch's outputs. Default: ``True``.
        serial_forward (bool, keyword-only): issue the replicas' forwards one after the other on
            the calling thread instead of on parallel workers, which then do not trade the GIL;
            whether that is faster depends on the model (on two H200s it was not, for any model
            of the benchmark suite), so measure it. Replicas that wait for each other inside the
            forward (cross-replica BatchNorm through queues) must keep the default. Default:
            ``False``.
        bucket_cap_mb (float, keyword-only): size in MiB of the gradient buckets reduced while
            the backward pass runs, as DDP's ``bucket_cap_mb`` (``0``: one bucket, reduced at the
            end). Default: 25.
        stale_attributes (str, keyword-only): what to do with plain (unregistered) attributes of
            the replicas on the other devices that still hold tensors on ``device_ids[0]`` or the
            module's own submodules (a non-buffer ``self.pixel_mean``, a Python list of stages):
            ``'move'`` gives each replica its own copies, ``'warn'`` warns once per class and
            attribute, ``'error'`` raises. Checked after the post-replicate hooks. Default:
            ``None`` (as PyTorch: shared, unchecked).
        cuda_graphs (bool or int, keyword-only): keep the replicas between steps and replay each
            replica's forward and backward as CUDA graphs, captured once per input signature
            (shapes, dtypes, training flags, grad mode, autocast state; ``True`` captures up to 8,
            an int sets the limit, further ones run eagerly). For models bound by the CPU; the
            forward must be capturable (no synchronisation with the CPU, no data-dependent
            shapes). Post-replicate hooks run when the replicas are built; :meth:`replicate` and
            :meth:`parallel_apply` are not called. CUDA devices only. Default: ``False``.
        cache_replicas (bool, keyword-only): keep the replica modules between forwards and refill
            them at each forward, exactly as new ones would be filled, so changes to the module
            show up and nothing a forward writes into a replica survives. Replicas still
            referenced after the forward are not reused; modules with their own ``__setattr__``,
            ``_replicate_for_data_parallel``, ``__new__`` or ``__slots__``, and compiled modules,
            get new replicas every time. ``False`` builds new replicas at every forward, as
            ``torch.nn.DataParallel`` does. Default: ``True``.
        process_group (torch.distributed.ProcessGroup, keyword-only): average the gradients over
            the processes of this group after each backward pass, as
            ``DistributedDataParallel`` does (one process per host, each driving its devices).
            The first forward takes group rank 0's parameters and buffers; the backward of a
            forward with grad mode on, outside :meth:`no_sync`, leaves every ``.grad`` averaged
            over the group. Every process must run the same steps. Not with ``cuda_graphs``; not
            copied or pickled with the wrapper. Default: ``None``.
        broadcast_buffers (bool, keyword-only): with a :attr:`process_group`, every forward with
            grad mode on first copies group rank 0's buffers to the other processes, as in
            ``DistributedDataParallel``. Default: ``True``.
        shares (sequence of float, keyword-only): each device's share of the batch, weights
            (``[1, 2, 2, 2]``) or row counts, one per device in :attr:`device_ids`, for devices of
            different sizes or a smaller share on the device that also holds the gathered output
            and the loss. The rows are divided as :func:`torchdp.scatter` divides them; devices
            that get no rows do not run. The gathered output, a loss of it and the gradients are
            those of the whole batch on one device. Not with ``cuda_graphs``. Default: ``None``
            (equal shares, ``torch.chunk``'s split).
        samples (bool or sequence of int and str, keyword-only): split lists of samples by item,
            for models that take a list of images of different sizes and a list of target dicts
            (torchvision's detection models): ``True`` for every list or tuple argument, or the
            positions and keyword names of those arguments. Each device gets whole samples, its
            share of them (:attr:`shares`, else equal), and list outputs (one detection dict per
            image) are joined into one list in order; other tensors are split by the same counts.
            Without it, a list whose tensors cannot be one batch (different sizes along
            :attr:`dim`, or different shapes with fewer rows than devices) raises a
            ``ValueError`` naming it. Not with ``cuda_graphs``. Default: ``False``.

    Attributes:
        module (Module): the module to be parallelized.

    Example::

        >>> net = torchdp.DataParallel(model, device_ids=[0, 1, 2])
        >>> output = net(input_var)  # input_var can be on any device, including CPU
        >>> cpu_net = torchdp.DataParallel(model, devices=[torch.device("cpu")] * 2)
    """

    # Class-level defaults, for wrappers pickled without these options (and torch.nn.DataParallel
    # checkpoints unpickled under torchdp.patch_torch()).
    gather_output: bool = True
    serial_forward: bool = False
    bucket_cap_mb: float | None = None
    stale_attributes: str | None = None
    cuda_graphs: int = 0
    cache_replicas: bool = True
    broadcast_buffers: bool = True
    shares: list[float] | None = None
    samples: bool | tuple[int | str, ...] = False
    require_backward_grad_sync: bool = True
    _place_module: bool = False
    _placed: bool = False

    def __init__(
        self,
        module: T,
        device_ids: Sequence[int | torch.device] | None = None,
        output_device: int | torch.device | None = None,
        dim: int = 0,
        *,
        devices: Sequence[DeviceLike] | None = None,
        place_module: bool = False,
        gather_output: bool = True,
        serial_forward: bool = False,
        bucket_cap_mb: float | None = None,
        stale_attributes: str | None = None,
        cuda_graphs: bool | int = False,
        cache_replicas: bool = True,
        process_group: Any = None,
        broadcast_buffers: bool = True,
        shares: Sequence[float] | None = None,
        samples: bool | Sequence[int | str] = False,
    ) -> None:
        """Wraps :attr:`module`; the arguments are described in the class docstring."""
        # Not torch.nn.DataParallel.__init__: the base class is there for isinstance checks.
        nn.Module.__init__(self)
        torch._C._log_api_usage_once(_API)
        dim = _check_dim(dim, _API)
        self._place_module = bool(place_module)
        self._placed = False
        self.gather_output = bool(gather_output)
        self.serial_forward = bool(serial_forward)
        _bucket_bytes(bucket_cap_mb, _API)  # checked now, not at the forward
        self.bucket_cap_mb = bucket_cap_mb
        self.stale_attributes = check_stale_attribute_policy(stale_attributes, _API)
        self.cuda_graphs = check_cuda_graphs(cuda_graphs, _API)
        if shares is not None and self.cuda_graphs:
            raise ValueError(
                f"{_API}: shares and cuda_graphs cannot be combined (a graph is captured for "
                "one split of the batch); turn cuda_graphs off or leave shares unset"
            )
        self.samples = _samples.check_option(samples, _API)
        if self.samples and self.cuda_graphs:
            raise ValueError(
                f"{_API}: samples and cuda_graphs cannot be combined (a graph is captured for one "
                "split of a batch tensor); turn cuda_graphs off or leave samples unset"
            )
        self.cache_replicas = bool(cache_replicas)
        self.broadcast_buffers = bool(broadcast_buffers)
        self.require_backward_grad_sync = True
        self.process_group = process_group

        if devices is not None:
            self.device_ids, self.output_device = _resolve_explicit(
                devices, device_ids, output_device, _API
            )
            _check_module(module, _API)
            self.src_device_obj = self.device_ids[0]
            if all(d.type == "cuda" for d in self.device_ids) and torch.cuda.is_available():
                _check_balance([operator.index(d.index) for d in self.device_ids])
            if self.cuda_graphs:
                _C.check_cuda_graphs(self.device_ids, _API)
        else:
            device_type = _get_available_device_type()
            if device_type is None or device_type == "mps":
                # No accelerator: a passthrough, as torch.nn.DataParallel (dim etc. are not set).
                if device_ids is not None:
                    _warn_ignored_device_ids(device_ids)
                self.module = module
                self.device_ids = []
                given = len(shares) if isinstance(shares, Sequence) else 0
                self.shares = _check_shares(shares, given, _API)  # used with an accelerator
                return
            _check_module(module, _API)
            self.device_ids, self.output_device = _indices(
                device_ids, output_device, device_type, _API
            )
            self.src_device_obj = torch.device(device_type, self.device_ids[0])
            if device_type == "cuda":
                _check_balance(self.device_ids)
        self.shares = _check_shares(shares, len(self.device_ids), _API)
        self.dim = dim
        self.module = module
        if len(self.device_ids) == 1:
            self.module.to(self.src_device_obj)

    @property
    def process_group(self) -> Any:
        """The ``torch.distributed`` process group the gradients are averaged over, or None.
        Assigning one takes effect at the next forward; it is not copied or pickled."""
        sync = _SYNCS.get(self)
        return None if sync is None else sync.group

    @process_group.setter
    def process_group(self, group: Any) -> None:
        group = check_process_group(group, _API)
        if group is None:
            _SYNCS.pop(self, None)
            return
        _C.check_group_and_graphs(True, bool(self.cuda_graphs), _API)
        _SYNCS[self] = ProcessGroupSync(group, _API)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Forwards inside this context do not average their gradients over the
        :attr:`process_group` (gradient accumulation, as ``DistributedDataParallel.no_sync``)."""
        old = self.require_backward_grad_sync
        self.require_backward_grad_sync = False
        try:
            yield
        finally:
            self.require_backward_grad_sync = old

    def _check_or_place_module(self) -> None:
        found = _C.misplaced_tensor(self.module, self.src_device_obj)
        if found is not None and self._place_module and not self._placed:
            self.module.to(self.src_device_obj)
            found = _C.misplaced_tensor(self.module, self.src_device_obj)
        self._placed = True
        if found is not None:
            raise _device_error(self.src_device_obj, found, wrapper=True)

    @_compile.skip_frame
    def __call__(self, *inputs: Any, **kwargs: Any) -> Any:
        # Under torch.compile the step runs eagerly and the replicas compiled (Note [Compiling
        # the wrapper]); otherwise nn.Module.__call__ as it is.
        return _compile.enter(super().__call__, *inputs, **kwargs)

    def compile(self, *args: Any, **kwargs: Any) -> None:
        """Compiles the replicas' forward with :func:`torch.compile` in place, as
        ``torch.compile(dp)`` does (Note [Compiling the wrapper]); the arguments are
        :func:`torch.compile`'s."""
        call = functools.partial(_compile.enter, self._call_impl)
        self._compiled_call_impl = torch.compile(call, *args, **kwargs)

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        r"""Runs :attr:`module` on every device, each replica on its share of the inputs.

        Tensors in the inputs, also inside lists, tuples, dicts and types registered with
        ``torch.utils._pytree``, are split into chunks along :attr:`dim`, chunk ``i`` going to
        ``device_ids[i]``; other objects are passed to every replica as they are. A batch
        smaller than the device list runs fewer replicas. With one device, or no accelerator
        and no ``devices=``, the module is called directly.

        Args:
            *inputs: the module's positional arguments.
            **kwargs: the module's keyword arguments, split like the positional ones.

        Returns:
            Any: the replicas' outputs gathered on :attr:`output_device`, the tensors
            concatenated along :attr:`dim`, in the structure the module returns. With
            ``gather_output=False``, the list of the replicas' outputs instead, each on its own
            device, for :class:`torchdp.DataParallelCriterion`.

        Raises:
            RuntimeError: :attr:`module` is not on ``device_ids[0]`` (and ``place_module`` is
                off); the message names the misplaced parameter or buffer.
            ValueError: tensor inputs split into different numbers of chunks along :attr:`dim`.

        An exception in a replica's forward is raised again with its type, the message
        naming the replica and its device.
        """
        return self._call_module(None, None, inputs, kwargs)

    def _call_module(
        self, method: str | None, pad_value: Any, inputs: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        """The forward, or with ``method`` that method of the module (:meth:`parallel_method`);
        ``pad_value`` goes to :meth:`gather`."""
        with record_function(f"DataParallel.{method or 'forward'}"):
            watch = self._before_forward()
            if not self.device_ids:
                call = _compile.compiled(_methods.bound(self.module, method))
                return watch(self._one_output(call(*inputs, **kwargs)))
            n = len(self.device_ids)
            if n > 1:
                _C.check_forward_context(_API)
            chunks, chunk_kwargs = _step.nonempty(*self.scatter(inputs, kwargs, self.device_ids))
            graphed = self.cuda_graphs and method is None  # methods run eagerly
            outputs = self._graphed_outputs(chunks, chunk_kwargs) if graphed else None
            if outputs is not None:
                return watch(
                    self._one_output(outputs[0]) if n == 1 else self._gathered(outputs, pad_value)
                )
            if n == 1:
                call = _compile.compiled(_methods.bound(self.module, method))
                return watch(self._one_output(call(*chunks[0], **chunk_kwargs[0])))
            chunks, chunk_kwargs = _step.check_chunks(
                inputs,
                kwargs,
                chunks,
                chunk_kwargs,
                n if self.shares is None and not self.samples else 0,
                self.dim,
                _API,
            )
            ids = _step.running_ids(self.device_ids, self.shares, chunks, chunk_kwargs)
            return watch(
                _step.run_replicated(
                    self.module,
                    lambda: self.replicate(self.module, ids),
                    lambda replicas: self.parallel_apply(
                        _methods.bound_replicas(replicas, method), chunks, chunk_kwargs
                    ),
                    lambda outputs: self._gathered(outputs, pad_value),
                    lambda: _step.weak_entry(_REPLICA_CACHES, self, None),
                )
            )

    def parallel_method(self, name: str, *, pad_value: Any = None) -> Callable[..., Any]:
        r"""The wrapped module's method ``name``, run split over the devices as :meth:`forward`
        runs the module: ``dp.parallel_method("generate")(input_ids, max_new_tokens=8)``.

        Calling the result scatters its arguments as :meth:`forward` does, replicates the module,
        calls ``replica.<name>(...)`` on each replica's share through :meth:`parallel_apply` and
        gathers the outputs, through the same overridable :meth:`scatter`, :meth:`replicate`,
        :meth:`parallel_apply` and :meth:`gather`, post-replicate hooks, device check and
        rollback of the buffers of a failed call. With one device, or no accelerator and no
        ``devices=``, the method is called on :attr:`module` directly. ``parallel_method("forward")``
        is the forward (without the hooks of the wrapper itself).

        The options are given here, not with the method's arguments, so they never clash with
        the method's own keyword arguments.

        :meth:`parallel_apply` gets, instead of the replicas, callables that run the method on
        them (each with its replica as ``.module``). While a replica runs the method, its
        ``parameters()`` lists its parameter copies (a replica's forward lists none, as in
        PyTorch), for methods that read the device or dtype from them, as transformers'
        ``generate`` does. CUDA graphs apply to the forward only; other methods run eagerly.

        Args:
            name (str): the name of a method (or other callable attribute) of :attr:`module`.
            pad_value (number, keyword-only): outputs whose tensors differ in size along a
                dimension other than :attr:`dim` (sequences generated to different lengths) are
                padded at the end of that dimension with this value to the largest size before
                they are concatenated; without it such outputs raise. For token ids, the
                tokenizer's ``pad_token_id``. Default: ``None``.

        Returns:
            A callable taking the method's arguments and returning its gathered output.

        Raises:
            AttributeError: :attr:`module` has no attribute ``name``.
            TypeError: ``name`` is not a str, the attribute is not callable, or ``pad_value`` is
                not a number.

        Example::

            >>> class Scaler(torch.nn.Module):
            ...     def __init__(self):
            ...         super().__init__()
            ...         self.weight = torch.nn.Parameter(torch.ones(3))
            ...
            ...     def scaled(self, x, factor, *, shift=0.0):
            ...         return x * self.weight * factor + shift
            >>> dp = torchdp.DataParallel(Scaler(), devices=[torch.device("cpu")] * 2)
            >>> dp.parallel_method("scaled")(torch.ones(4, 3), 2.0, shift=1.0).shape
            torch.Size([4, 3])
            >>> # generate() of a transformers model, sequences padded to the longest:
            >>> tokens = dp_lm.parallel_method("generate", pad_value=tok.pad_token_id)(
            ...     input_ids, attention_mask=mask, max_new_tokens=20, do_sample=False
            ... )
        """
        return _methods.ParallelMethod(self, name, pad_value)

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError as error:
            raise _methods.missing_attribute(self, name, error) from None

    def _before_forward(self) -> Callable[[Any], Any]:
        """A forward's checks and the process group's work before the module runs; returns what
        the outputs go through."""
        sync = _SYNCS.get(self)
        if sync is not None:
            _C.check_group_and_graphs(True, bool(self.cuda_graphs), _API)
        if self.device_ids:
            self._check_or_place_module()
        if sync is None:
            return _unchanged
        grad_sync = torch.is_grad_enabled() and self.require_backward_grad_sync
        bucket_bytes = _bucket_bytes(self.bucket_cap_mb, _API) if grad_sync else None
        sync.before_forward(self.module, grad_sync and self.broadcast_buffers)
        if not grad_sync:
            return _unchanged

        def watch(outputs: Any) -> Any:
            sync.watch(self.module, outputs, bucket_bytes)
            return outputs

        return watch

    def _one_output(self, output: Any) -> Any:
        """The output of a forward that ran once, where the module put it."""
        return output if self.gather_output else [output]

    def _gathered(self, outputs: Sequence[Any], pad_value: Any = None) -> Any:
        """The outputs gathered on :attr:`output_device` (as they are, with gather_output=False)."""
        if not self.gather_output:
            return list(outputs)
        if pad_value is None:
            return self.gather(outputs, self.output_device)
        with _methods.padding(pad_value):
            return self.gather(outputs, self.output_device)

    def _graphed_outputs(self, inputs: Any, kwargs: Any) -> list[Any] | None:
        graphed = _GRAPHED.get(self)
        devices = [
            d if isinstance(d, torch.device) else torch.device("cuda", d) for d in self.device_ids
        ]
        if graphed is None or graphed.module is not self.module or graphed.devices != devices:
            graphed = _GRAPHED[self] = GraphedReplicas(
                self.module, devices, int(self.cuda_graphs), self.stale_attributes
            )
        return graphed.run(inputs, kwargs)

    def replicate(self, module: T, device_ids: Sequence[int | torch.device]) -> list[T]:
        """Replicates :attr:`module` on :attr:`device_ids` (detached under ``torch.no_grad()``)."""
        detach = not torch.is_grad_enabled()
        if self.cache_replicas and module is self.module:
            cache = _step.weak_entry(_REPLICA_CACHES, self, _C.ReplicaCache)
            return _replicate(
                module,
                device_ids,
                detach,
                self.bucket_cap_mb,
                self.stale_attributes,
                cache,
                "torchdp.replicate",
            )
        if self.bucket_cap_mb is None and self.stale_attributes is None:  # PyTorch's call
            return replicate(module, device_ids, detach)
        return replicate(
            module,
            device_ids,
            detach,
            bucket_cap_mb=self.bucket_cap_mb,
            stale_attributes=self.stale_attributes,
        )

    def scatter(
        self,
        inputs: tuple[Any, ...],
        kwargs: dict[str, Any] | None,
        device_ids: Sequence[int | torch.device],
    ) -> Any:
        """Splits positional and keyword arguments across :attr:`device_ids` along ``dim``, by
        :attr:`shares` when set; lists of samples by item with :attr:`samples`."""
        if self.samples:
            return scatter_kwargs(
                inputs, kwargs, device_ids, self.dim, shares=self.shares, samples=self.samples
            )
        if len(device_ids) > 1:
            _samples.check_batch_lists(inputs, kwargs, len(device_ids), self.dim, _API)
        if self.shares is None:
            return scatter_kwargs(inputs, kwargs, device_ids, dim=self.dim)
        return scatter_kwargs(inputs, kwargs, device_ids, dim=self.dim, shares=self.shares)

    def parallel_apply(
        self, replicas: Sequence[T], inputs: Sequence[Any], kwargs: Any
    ) -> list[Any]:
        """Runs each replica on its chunk, replica ``i`` on ``device_ids[i]``."""
        return parallel_apply(
            replicas,
            inputs,
            kwargs,
            _step.running_ids(self.device_ids, self.shares, inputs, kwargs or ())[: len(replicas)],
            serial=self.serial_forward or _step.first_compiled_call(self.module, inputs, kwargs),
        )

    def gather(self, outputs: Any, output_device: int | torch.device) -> Any:
        """Concatenates the replicas' outputs on :attr:`output_device` along ``dim`` (padded with
        the ``pad_value`` of a :meth:`parallel_method` call)."""
        return gather(
            outputs,
            output_device,
            dim=self.dim,
            pad_value=_methods.PAD_VALUE.get(),
            samples=bool(self.samples),
        )


def data_parallel(
    module: nn.Module,
    inputs: Any,
    device_ids: Sequence[int | torch.device] | None = None,
    output_device: int | torch.device | None = None,
    dim: int = 0,
    module_kwargs: Any | None = None,
    *,
    devices: Sequence[DeviceLike] | None = None,
    stale_attributes: str | None = None,
    cache_replicas: bool = True,
    shares: Sequence[float] | None = None,
    samples: bool | Sequence[int | str] = False,
) -> Any:
    r"""Evaluates ``module(*inputs, **module_kwargs)`` in parallel across devices: the functional
    form of :class:`DataParallel`, a drop-in for :func:`torch.nn.parallel.data_parallel`.

    Unlike the class, it has no passthrough without an accelerator (unless :attr:`devices` is
    given), never moves the module, and always replicates differentiably.

    Args:
        module (Module): the module to evaluate in parallel.
        inputs (Any): the positional inputs (a tuple) or the single input.
        device_ids (list of int or torch.device): CUDA devices to replicate on (default: all).
        output_device (int or torch.device): where the output goes; ``-1`` for the CPU
            (default: ``device_ids[0]``).
        dim (int): the dimension to split inputs and concatenate outputs along. Default: ``0``.
        module_kwargs (dict, optional): keyword arguments for the module.
        devices (list of torch.device, keyword-only): an explicit device list (cpu, meta or cuda;
            a device may repeat) used instead of :attr:`device_ids`, even without an accelerator.
        stale_attributes (str, keyword-only): ``'move'``, ``'warn'`` or ``'error'`` for plain
            attributes of the replicas still on the first device, as in :class:`DataParallel`.
            Default: ``None``.
        cache_replicas (bool, keyword-only): keep the replica modules of :attr:`module` between
            calls, as :class:`DataParallel` does. Default: ``True``.
        shares (sequence of float, keyword-only): each device's share of the batch, as in
            :class:`DataParallel`. Default: ``None`` (equal shares).
        samples (bool or sequence of int and str, keyword-only): lists of samples split by
            item, as in :class:`DataParallel`. Default: ``False``.

    Returns:
        The gathered output of the module, on :attr:`output_device`.

    Example::

        >>> out = torchdp.data_parallel(model, x, devices=[torch.device("cpu")] * 2)
    """
    api = "torchdp.data_parallel"
    check_stale_attribute_policy(stale_attributes, api)
    _check_module(module, api)
    dim = _check_dim(dim, api)
    if not isinstance(inputs, tuple):
        inputs = (inputs,) if inputs is not None else ()

    used_ids: list[Any]
    if devices is not None:
        used_ids, target = _resolve_explicit(devices, device_ids, output_device, api)
        src_device = used_ids[0]
    else:
        device_type = _get_available_device_type()
        if device_type is None:
            raise RuntimeError("device type could not be determined")
        used_ids, target = _indices(device_ids, output_device, device_type, api)
        src_device = torch.device(device_type, used_ids[0])

    found = _C.misplaced_tensor(module, src_device)
    if found is not None:
        raise _device_error(src_device, found, wrapper=False)

    checked = _check_shares(shares, len(used_ids), api)
    samples = _samples.check_option(samples, api)
    if len(used_ids) > 1:
        _C.check_forward_context(api)
        if not samples:
            _samples.check_batch_lists(inputs, module_kwargs, len(used_ids), dim, api)
    chunks, chunk_kwargs = _step.nonempty(
        *scatter_kwargs(inputs, module_kwargs, used_ids, dim, shares=checked, samples=samples)
    )
    if len(used_ids) == 1:
        return module(*chunks[0], **chunk_kwargs[0])
    chunks, chunk_kwargs = _step.check_chunks(
        inputs,
        module_kwargs,
        chunks,
        chunk_kwargs,
        len(used_ids) if checked is None and not samples else 0,
        dim,
        api,
    )
    used = _step.running_ids(used_ids, checked, chunks, chunk_kwargs)
    cache = (
        _step.weak_entry(_FUNCTIONAL_CACHES, module, _C.ReplicaCache) if cache_replicas else None
    )

    def replicate_fn() -> list[nn.Module]:
        if cache is not None:
            return _replicate(
                module, used, False, None, stale_attributes, cache, "torchdp.replicate"
            )
        if stale_attributes is None:  # the call PyTorch makes
            return replicate(module, used)
        return replicate(module, used, stale_attributes=stale_attributes)

    serial = _step.first_compiled_call(module, chunks, chunk_kwargs)
    return _step.run_replicated(
        module,
        replicate_fn,
        lambda replicas: parallel_apply(replicas, chunks, chunk_kwargs, used, serial=serial),
        lambda outputs: gather(outputs, target, dim, samples=bool(samples)),
        lambda: cache,
    )
