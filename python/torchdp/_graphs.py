"""CUDA-graph replicas: ``torchdp.DataParallel(..., cuda_graphs=True)``.

Note [Graphed replicas]
A model made of many small layers is bound by the CPU: on one H200 the 200-layer MLP of the
benchmarks spends three quarters of an eager step issuing kernels, and every replica of a
data-parallel step issues as many kernels as the whole model does on one GPU. Replaying each
replica's forward and backward as CUDA graphs removes that work. Graphs need fixed addresses, so
this mode keeps its replicas between steps instead of building them in every forward:

* replica 0 is the wrapped module itself, on ``device_ids[0]`` (as in the eager mode, where replica
  0 shares the module's storage); replica j >= 1 is built once by :func:`torchdp.replicate`
  (post-replicate hooks and callbacks run then) and its parameters and buffers are then replaced by
  views of one flat tensor per dtype on its device, refreshed from the module before every forward
  (one packing kernel per dtype on the first device, one copy per device);
* per input signature (the shapes, dtypes and devices of the scattered tensors, the other inputs,
  training flag, grad mode and autocast state) each replica's forward and, when gradients are
  needed, its backward are captured once, after warm-up iterations whose effects on buffers and
  random number generators are undone; the backward graph also packs the parameter gradients into
  one flat tensor per dtype (zeros for unused parameters, as the eager mode gives);
* a forward copies the scattered chunks into the graphs' input tensors and replays the forward
  graphs; one autograd node, whose inputs are the chunks and the module's parameters, replays the
  backward graphs, adds the flat gradients of all replicas on the first device and hands each
  parameter its slice, so ``.grad`` is set as in the eager mode (the scatter and gather around the
  node are the eager ones).

Limits, checked where they can be: the replicas' forwards must be capturable (no synchronisation
with the CPU, no data-dependent shapes or control flow); every parameter that needs a gradient has
one dtype per group; a captured forward's activations live in its graph, so a second forward of the
same signature while the first one's backward is still pending runs eagerly, and a backward through
a forward whose graph has been replayed since raises. The parameters and buffers of the module must
keep their storage (optimizers update them in place); when one of them is replaced (``p.data =``,
``.to()``, a new submodule) everything is rebuilt at the next forward. Signatures beyond
``max_signatures`` run eagerly, with a warning. Outputs must be tensors and containers that
``torch.utils._pytree`` flattens (other objects are refused at the capture: a replay could not
refresh the tensors inside them).
"""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Sequence
from itertools import chain
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from torchdp._attributes import internal_keys, map_state, may_hold_state
from torchdp.replicate import replicate
from torchdp.scatter_gather import GATHER_CONSTANTS

_API = "torchdp.DataParallel(cuda_graphs=True)"
_WARMUP = 3
# Only this thread's unsafe CUDA calls may break a capture: in the default "global" mode a call
# from any other thread (a DataLoader's pin-memory thread allocating pinned memory) invalidates it.
# The backward is captured on the autograd engine's threads, whose kernels go to the capturing
# stream and are captured whatever their thread's mode.
_CAPTURE_MODE = "thread_local"
MAX_SIGNATURES = 8


class _Flat:
    """Tensors of one device grouped by dtype into flat tensors, each tensor a view of its group."""

    def __init__(self, tensors: Sequence[torch.Tensor], device: torch.device) -> None:
        self.groups: dict[torch.dtype, torch.Tensor] = {}
        totals: dict[torch.dtype, int] = {}
        slots = []
        for t in tensors:
            offset = totals.get(t.dtype, 0)
            slots.append((t.dtype, offset, t.numel(), t.shape))
            totals[t.dtype] = offset + t.numel()
        for dtype, total in totals.items():
            self.groups[dtype] = torch.empty(total, dtype=dtype, device=device)
        self.views = [
            self.groups[dtype][offset : offset + n].view(shape) for dtype, offset, n, shape in slots
        ]
        # Per dtype: the views of that group in order, for packing.
        self.by_dtype: dict[torch.dtype, list[int]] = {}
        for i, (dtype, _, _, _) in enumerate(slots):
            self.by_dtype.setdefault(dtype, []).append(i)


class _Mirror:
    """Keeps copies of ``sources`` (tensors of the first device) on other devices: the sources are
    packed into flat tensors on their device, and each copy is one flat copy per dtype."""

    def __init__(self, sources: Sequence[torch.Tensor]) -> None:
        self.sources = list(sources)
        device = self.sources[0].device if self.sources else torch.device("cpu")
        self.packed = _Flat(self.sources, device)
        # Detached once (same storage): packing runs before every forward.
        self._pairs = {
            dtype: ([self.packed.views[i] for i in idx], [self.sources[i].detach() for i in idx])
            for dtype, idx in self.packed.by_dtype.items()
        }

    def mirror(self, device: torch.device) -> _Flat:
        return _Flat(self.sources, device)

    def pack(self) -> None:
        with torch.no_grad():
            for views, sources in self._pairs.values():
                torch._foreach_copy_(views, sources)

    def copy_to(self, flat: _Flat) -> None:
        with torch.no_grad():
            for dtype, packed in self.packed.groups.items():
                flat.groups[dtype].copy_(packed, non_blocking=True)


class _Replica:
    """A replica made by torchdp.replicate whose parameters are then replaced by leaf tensors of
    their own over ``param_storage`` and whose buffers are ``buffer_storage`` (graph-stable).

    Replica 0 gets leaves over the module's own parameter storage and the module's own buffers
    (so its forward reads the current weights and updates the module's running statistics, as
    the eager replica 0 does) but is a separate module: capturing it never touches the module's
    parameters' autograd nodes, which a live graph of the caller's stream may hold."""

    def __init__(
        self,
        module: nn.Module,
        copy: nn.Module,
        params: list[nn.Parameter],
        buffers: list[torch.Tensor],
        param_storage: list[torch.Tensor],
        buffer_storage: list[torch.Tensor],
        device: torch.device,
    ) -> None:
        originals, copies = list(module.modules()), list(copy.modules())
        if len(originals) != len(copies):
            raise RuntimeError(
                f"{_API}: the replica on {device} has {len(copies)} modules where the module has "
                f"{len(originals)} (post-replicate hooks that add modules are not supported in "
                "this mode); use cuda_graphs=False"
            )
        leaf_of = {
            id(p): nn.Parameter(v, requires_grad=p.requires_grad)
            for p, v in zip(params, param_storage, strict=True)
        }
        buffer_of = {id(b): v for b, v in zip(buffers, buffer_storage, strict=True)}
        # What plain attributes may alias: the module's tensors and the replica's own copies of
        # them (replicate's, before they are replaced below); each becomes the replica's tensor.
        alias_of: dict[int, torch.Tensor] = {}
        for original, replica in zip(originals, copies, strict=True):
            for table, new_of in ((_parameters, leaf_of), (_buffers, buffer_of)):
                for key, t in getattr(original, table).items():
                    if t is not None:
                        alias_of[id(t)] = new_of[id(t)]
                        held = getattr(replica, table).get(key)
                        if held is not None:
                            alias_of[id(held)] = new_of[id(t)]
        for original, replica in zip(originals, copies, strict=True):
            for key, p in original._parameters.items():
                if p is None:
                    continue
                leaf = leaf_of[id(p)]
                # Through the class's __setattr__ (nn.RNNBase keeps its _flat_weights list in step).
                setattr(replica, key, leaf)
                if getattr(replica, key) is not leaf:
                    raise RuntimeError(
                        f"{_API}: {type(replica).__qualname__}.__setattr__ did not take the "
                        f"parameter {key!r} of the replica on {device}; this module cannot run "
                        "with cuda_graphs=True"
                    )
                former = replica.__dict__.get("_former_parameters")
                if isinstance(former, dict) and key in former:
                    former[key] = leaf  # not the broadcast copy, which would stay alive
            for key, b in original._buffers.items():
                if b is not None:
                    # Directly: some classes' __setattr__ copies into the existing buffer instead.
                    replica._buffers[key] = buffer_of[id(b)]
        _rebind_plain_attributes(copies, alias_of)
        self.module = copy
        self.grad_params = [leaf_of[id(p)] for p in params if p.requires_grad]
        self.params: _Flat | None = None  # the flat copies (replicas on other devices)
        self.buffers: _Flat | None = None


_parameters, _buffers = "_parameters", "_buffers"


def _plain_attributes(module: nn.Module) -> list[str]:
    skip = internal_keys()
    return [k for k, v in module.__dict__.items() if k not in skip and may_hold_state(v)]


def _refuse_unregistered_leaves(network: nn.Module) -> None:
    """A plain attribute holding a leaf tensor that requires grad but is not a registered
    parameter (directly or in a container) would get no gradient from the captured backward,
    which differentiates with respect to the replicas' parameters: refused, naming it."""
    registered = {id(p) for p in network.parameters()}
    for name, module in network.named_modules():

        def check(t: Any, where: str, module: nn.Module = module, name: str = name) -> Any:
            if (
                isinstance(t, torch.Tensor)
                and t.requires_grad
                and t.is_leaf
                and id(t) not in registered
            ):
                raise RuntimeError(
                    f"{_API}: attribute {where!r} of module '{name or '<root>'}' (type "
                    f"{type(module).__qualname__}) is a tensor that requires grad but is not a "
                    "registered parameter, so the captured backward could not give it a gradient. "
                    "Register it (nn.Parameter), or use cuda_graphs=False"
                )
            return t

        for key in _plain_attributes(module):
            map_state(module.__dict__[key], check, key)


def _rebind_plain_attributes(copies: list[nn.Module], alias_of: dict[int, torch.Tensor]) -> None:
    """Points the replica's plain attributes (``self.w = self.linear.weight``, directly or in
    containers) that hold the module's parameters or buffers, or replicate's copies of them, at
    the replica's graph-stable tensors: a captured forward that read a parameter through such an
    alias would drop its gradient (the backward graph differentiates with respect to the
    replica's own leaves)."""

    def rebind(t: Any, where: str) -> Any:
        return alias_of.get(id(t), t) if isinstance(t, torch.Tensor) else t

    for replica in copies:
        state = replica.__dict__
        for key in _plain_attributes(replica):
            fixed = map_state(state[key], rebind, key)
            if fixed is not state[key]:
                state[key] = fixed


def _tensor_key(t: torch.Tensor) -> tuple[Any, ...]:
    return (tuple(t.shape), t.stride(), t.dtype, t.device, t.requires_grad)


def _autocast_key() -> tuple[Any, ...]:
    return (
        torch.is_autocast_enabled("cuda"),
        torch.get_autocast_dtype("cuda"),
    )


class _Capture:
    """The graphs of one input signature, for every replica."""

    def __init__(self) -> None:
        self.static_in: list[list[torch.Tensor]] = []  # tensor leaves of each replica's inputs
        self.in_specs: list[Any] = []
        self.constants: list[list[Any]] = []  # all leaves (tensors replaced at replay)
        self.forward_graphs: list[torch.cuda.CUDAGraph] = []
        self.backward_graphs: list[torch.cuda.CUDAGraph] = []
        self.static_out: list[list[Any]] = []  # every leaf of each replica's output
        self.out_specs: list[Any] = []
        self.out_grad_index: list[list[int]] = []  # leaves of static_out that take gradients
        self.static_grad_out: list[list[torch.Tensor]] = []
        self.flat_grads: list[dict[torch.dtype, torch.Tensor]] = []
        self.in_grad_index: list[list[int]] = []  # tensor leaves of the inputs that take grads
        self.static_grad_in: list[list[torch.Tensor]] = []
        self.generation = 0
        self.last_ctx: weakref.ref | None = None
        # What the backward needs even after a rebuild: the replicas whose weights its graphs
        # read, and the parameters its gradients are sliced for.
        self.replicas: list[_Replica] = []
        self.grad_params: list[torch.Tensor] = []


class GraphedReplicas:
    """Persistent replicas of ``module`` on ``devices`` whose steps replay CUDA graphs."""

    def __init__(
        self,
        module: nn.Module,
        devices: Sequence[torch.device],
        max_signatures: int,
        stale_attributes: str | None = None,
    ):
        self.module = module
        self.devices = list(devices)
        self.max_signatures = max_signatures
        # Applied when the replicas are built (torchdp.replicate's stale_attributes=).
        self.stale_attributes = stale_attributes
        self._layout: tuple[Any, ...] | None = None
        self._captures: dict[Any, _Capture] = {}
        self._replicas: list[_Replica] = []
        self._warned_full = False
        self.captures_made = 0  # for tests and benchmarks

    # -- layout -------------------------------------------------------------------------------

    @staticmethod
    def _current_layout(modules: list[nn.Module]) -> tuple[Any, ...]:
        # Checked before every forward, so one direct pass over the modules' dictionaries
        # (Module.parameters() and buffers() cost several times more): which modules, which
        # parameter and buffer objects, and where and in what shape each lives (p.data = ...,
        # .to() and a new nn.Parameter over the same storage all show).
        seen: set[int] = set()
        key: list[Any] = []
        for m in modules:
            key.append(id(m))
            for p in m._parameters.values():
                if p is not None and id(p) not in seen:
                    seen.add(id(p))
                    key.append((id(p), p.data_ptr(), p.requires_grad, p.shape, p.dtype))
            for b in m._buffers.values():
                if b is not None and id(b) not in seen:
                    seen.add(id(b))
                    key.append((id(b), b.data_ptr(), b.shape, b.dtype))
        return tuple(key)

    def _rebuild(self, n: int) -> None:
        self._captures.clear()
        self._replicas = []
        self.params = list(self.module.parameters())
        self.buffers = list(self.module.buffers())
        self.grad_params = [p for p in self.params if p.requires_grad]
        for t in chain(self.params, self.buffers):
            if t.device != self.devices[0]:
                raise RuntimeError(
                    f"{_API}: every parameter and buffer must be on {self.devices[0]}, found one "
                    f"on {t.device}"
                )
        _refuse_unregistered_leaves(self.module)
        self.param_mirror = _Mirror(self.params)
        self.buffer_mirror = _Mirror(self.buffers)
        devices = self.devices[:n]
        # One replicate call, so post-replicate hooks see each replica's own index.
        with torch.no_grad():
            copies = replicate(
                self.module, devices, detach=True, stale_attributes=self.stale_attributes
            )
        for j, (copy, device) in enumerate(zip(copies, devices, strict=True)):
            if j == 0:
                flats = None
                param_storage = [p.detach() for p in self.params]
                buffer_storage = list(self.buffers)
            else:
                flats = (self.param_mirror.mirror(device), self.buffer_mirror.mirror(device))
                param_storage, buffer_storage = flats[0].views, flats[1].views
            replica = _Replica(
                self.module,
                copy,
                self.params,
                self.buffers,
                param_storage,
                buffer_storage,
                device,
            )
            if flats is not None:
                replica.params, replica.buffers = flats
            self._replicas.append(replica)

    # -- the step ------------------------------------------------------------------------------

    def run(self, inputs: Sequence[Any], kwargs: Sequence[Any]) -> list[Any] | None:
        """The per-replica outputs of one forward, or None when this forward must run eagerly."""
        n = len(inputs)
        if torch.is_inference_mode_enabled():
            # Tensors made now would be inference tensors, which later (training) forwards
            # could not refresh in place; inference mode runs eagerly.
            return None
        modules = list(self.module.modules())
        layout = self._current_layout(modules)
        if layout != self._layout or len(self._replicas) < n:
            self._rebuild(n)
            self._layout = layout
        training = tuple(m.training for m in modules)
        leaves, specs, keys = [], [], []
        for args, kws in zip(inputs, kwargs, strict=True):
            flat, spec = tree_flatten((tuple(args), dict(kws)))
            key = []
            for leaf in flat:
                if isinstance(leaf, torch.Tensor):
                    key.append(_tensor_key(leaf))
                else:
                    try:
                        hash(leaf)
                    except TypeError:
                        return None  # an unhashable constant: no signature, run eagerly
                    key.append((type(leaf), leaf))
            leaves.append(flat)
            specs.append(spec)
            keys.append((spec, tuple(key)))
        grad = torch.is_grad_enabled()
        signature = (tuple(keys), training, grad, _autocast_key())
        capture = self._captures.get(signature)
        if capture is None:
            if len(self._captures) >= self.max_signatures:
                if not self._warned_full:
                    self._warned_full = True
                    warnings.warn(
                        f"{_API}: {len(self._captures)} input signatures are captured already "
                        f"(max_signatures); forwards with other shapes run eagerly (raise the "
                        "limit with cuda_graphs=<n>, or pad inputs to a few fixed shapes)",
                        stacklevel=4,
                    )
                return None
            self._set_training(training, n)
            capture = self._capture(leaves, specs, grad)
            self._captures[signature] = capture
        elif capture.last_ctx is not None:
            pending = capture.last_ctx()
            if pending is not None and not pending.done:
                return None  # the previous forward's activations are still needed
        self._refresh(n)
        tensors = [t for flat in leaves for t in flat if isinstance(t, torch.Tensor)]
        if grad:
            outs = _GraphedStep.apply(self, capture, *tensors, *capture.grad_params)
        else:
            outs = self._forward(capture, tensors)
        return self._outputs(capture, outs)

    def _set_training(self, training: tuple[bool, ...], n: int) -> None:
        # The replicas' flags as the module's (read by the forward being captured).
        for replica in self._replicas[:n]:
            for flag, module in zip(training, replica.module.modules(), strict=True):
                module.training = flag

    def _refresh(self, n: int) -> None:
        if n <= 1:
            return
        self.param_mirror.pack()
        self.buffer_mirror.pack()
        for replica in self._replicas[1:n]:
            assert replica.params is not None and replica.buffers is not None
            self.param_mirror.copy_to(replica.params)
            self.buffer_mirror.copy_to(replica.buffers)

    def _forward(self, capture: _Capture, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        it = iter(tensors)
        for static_in in capture.static_in:
            for static in static_in:
                t = next(it)
                if static.data_ptr() != t.data_ptr():
                    static.copy_(t.detach())
        for graph in capture.forward_graphs:
            graph.replay()
        capture.generation += 1
        return [leaf.clone() for outs in capture.static_out for leaf in outs if _is_tensor(leaf)]

    def _outputs(self, capture: _Capture, outs: Sequence[torch.Tensor]) -> list[Any]:
        it = iter(outs)
        result = []
        for static_out, spec in zip(capture.static_out, capture.out_specs, strict=True):
            leaves = [next(it) if _is_tensor(leaf) else leaf for leaf in static_out]
            result.append(tree_unflatten(leaves, spec))
        return result

    # -- capture -------------------------------------------------------------------------------

    def _modules(self, n: int) -> list[nn.Module]:
        return [r.module for r in self._replicas[:n]]

    def _grad_params(self, j: int) -> list[torch.Tensor]:
        return self._replicas[j].grad_params

    def _capture(self, leaves: list[list[Any]], specs: list[Any], grad: bool) -> _Capture:
        n = len(leaves)
        self._refresh(n)
        capture = _Capture()
        capture.replicas = self._replicas[:n]
        capture.grad_params = list(self.grad_params)
        modules = self._modules(n)
        devices = self.devices[:n]
        for flat, spec, device in zip(leaves, specs, devices, strict=True):
            static = []
            constants = []
            for leaf in flat:
                if isinstance(leaf, torch.Tensor):
                    s = torch.empty_strided(
                        leaf.shape, leaf.stride(), dtype=leaf.dtype, device=leaf.device
                    )
                    with torch.no_grad():
                        s.copy_(leaf)
                    s.requires_grad_(leaf.requires_grad)
                    static.append(s)
                    constants.append(s)
                else:
                    constants.append(leaf)
            capture.static_in.append(static)
            capture.constants.append(constants)
            capture.in_specs.append(spec)
            capture.in_grad_index.append([i for i, s in enumerate(static) if s.requires_grad])
        # Autocast's cast cache would keep tensors of the graphs' pools alive between captures
        # (torch.cuda.make_graphed_callables asks for it to be off too).
        cache = torch.is_autocast_cache_enabled()
        torch.set_autocast_cache_enabled(False)
        saved_buffers = [b.detach().clone() for b in self.buffers]
        rng = {d: torch.cuda.get_rng_state(d) for d in set(devices)}
        try:
            self._warm_up(capture, modules, devices, grad)
        finally:
            # Undo the warm-up's effects on buffers and random number generators.
            with torch.no_grad():
                for b, saved in zip(self.buffers, saved_buffers, strict=True):
                    b.copy_(saved)
            for d, state in rng.items():
                torch.cuda.set_rng_state(state, d)
            torch.set_autocast_cache_enabled(cache)
        self._refresh(n)  # the replicas' buffers too
        torch.set_autocast_cache_enabled(False)
        streams = {d: torch.cuda.current_stream(d) for d in set(devices)}
        current_device = torch.cuda.current_device()
        try:
            self._record(capture, modules, devices, grad)
        except Exception as e:
            # torch.cuda.graph does not restore the current stream when ending a failed capture
            # raises too; set_stream also makes the stream's device current, so the caller's
            # current device is restored after.
            for stream in streams.values():
                torch.cuda.set_stream(stream)
            torch.cuda.set_device(current_device)
            # A capture that fails before its end leaves each device's default generator in
            # capture mode (every later random op raises "Offset increment outside graph capture
            # encountered unexpectedly"): each gets a fresh state, at the state before the capture.
            for d, state in rng.items():
                fresh = torch.Generator(device=d)
                fresh.set_state(state)
                torch.cuda.default_generators[d.index].graphsafe_set_state(fresh)
            raise RuntimeError(
                f"{_API}: capturing the replicas' forward and backward as CUDA graphs failed "
                f"({type(e).__name__}: {e}). The forward must be capturable: no synchronisation "
                "with the CPU (.item(), printing tensors, data-dependent shapes such as "
                "nonzero()), no new CUDA streams; use cuda_graphs=False for this model"
            ) from e
        finally:
            torch.set_autocast_cache_enabled(cache)
        self.captures_made += 1
        return capture

    def _warm_up(
        self, capture: _Capture, modules: list[nn.Module], devices: list[torch.device], grad: bool
    ) -> None:
        # cuBLAS/cuDNN workspaces and lazy initialisation, on side streams, as
        # torch.cuda.make_graphed_callables does. The parameters' AccumulateGrad nodes may belong
        # to a live graph of the current stream; the extra synchronisation that autograd warns
        # about then is what the warm-up needs anyway.
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="The AccumulateGrad node's stream")
            self._warm_up_steps(capture, modules, devices, grad)

    def _warm_up_steps(
        self, capture: _Capture, modules: list[nn.Module], devices: list[torch.device], grad: bool
    ) -> None:
        for _ in range(_WARMUP):
            for j, (module, device) in enumerate(zip(modules, devices, strict=True)):
                with torch.cuda.device(device):
                    side = torch.cuda.Stream()
                    side.wait_stream(torch.cuda.current_stream())
                    try:
                        with torch.cuda.stream(side):
                            out = self._call(module, capture, j)
                            _check_output(out, j, device)
                            if grad:
                                outs = [o for o in tree_flatten(out)[0] if _needs_grad(o)]
                                wrt = self._wrt(capture, j)
                                if outs and wrt:
                                    torch.autograd.grad(
                                        outs,
                                        wrt,
                                        grad_outputs=[torch.ones_like(o) for o in outs],
                                        allow_unused=True,
                                    )
                            del out
                    finally:
                        # Also when the forward failed: the caller's restoring copies of the
                        # buffers must come after the side stream's updates of them.
                        torch.cuda.current_stream().wait_stream(side)
        for device in set(devices):
            torch.cuda.synchronize(device)

    def _record(
        self, capture: _Capture, modules: list[nn.Module], devices: list[torch.device], grad: bool
    ) -> None:
        for j, (module, device) in enumerate(zip(modules, devices, strict=True)):
            with torch.cuda.device(device):
                pool = torch.cuda.graph_pool_handle()
                # A capture stream of this device (torch.cuda.graph's default one belongs to the
                # device that was current when it was first used).
                stream = torch.cuda.Stream(device)
                forward = torch.cuda.CUDAGraph()
                with torch.cuda.graph(
                    forward, pool=pool, stream=stream, capture_error_mode=_CAPTURE_MODE
                ):
                    out = self._call(module, capture, j)
                out_leaves, out_spec = tree_flatten(out)
                capture.forward_graphs.append(forward)
                capture.static_out.append(out_leaves)
                capture.out_specs.append(out_spec)
                grad_index = [i for i, o in enumerate(out_leaves) if _needs_grad(o)]
                capture.out_grad_index.append(grad_index)
                if not grad:
                    capture.static_out[j] = [o.detach() if _is_tensor(o) else o for o in out_leaves]
                    continue
                outs = [out_leaves[i] for i in grad_index]
                grad_out = [torch.empty_like(o) for o in outs]
                params = self._grad_params(j)
                wrt = self._wrt(capture, j)
                backward = torch.cuda.CUDAGraph()
                with torch.cuda.graph(
                    backward, pool=pool, stream=stream, capture_error_mode=_CAPTURE_MODE
                ):
                    if outs and wrt:
                        grads = torch.autograd.grad(
                            outs, wrt, grad_outputs=grad_out, allow_unused=True
                        )
                    else:
                        grads = (None,) * len(wrt)
                    full = [
                        torch.zeros_like(t) if g is None else g
                        for g, t in zip(grads, wrt, strict=True)
                    ]
                    flat_grads = {}
                    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
                    for g in full[: len(params)]:
                        by_dtype.setdefault(g.dtype, []).append(g.reshape(-1))
                    for dtype, parts in by_dtype.items():
                        flat_grads[dtype] = torch.cat(parts)
                # The captured autograd graph is not needed any more: outputs that keep it alive
                # would also keep the parameters' AccumulateGrad nodes of the capture stream.
                capture.static_out[j] = [o.detach() if _is_tensor(o) else o for o in out_leaves]
                capture.backward_graphs.append(backward)
                capture.static_grad_out.append(grad_out)
                capture.flat_grads.append(flat_grads)
                capture.static_grad_in.append(full[len(params) :])
        for device in set(devices):
            torch.cuda.synchronize(device)

    @staticmethod
    def _call(module: nn.Module, capture: _Capture, j: int) -> Any:
        args, kwargs = tree_unflatten(capture.constants[j], capture.in_specs[j])
        return module(*args, **kwargs)

    def _wrt(self, capture: _Capture, j: int) -> list[torch.Tensor]:
        inputs = [capture.static_in[j][i] for i in capture.in_grad_index[j]]
        return self._grad_params(j) + inputs


# Output leaves other than tensors that a replay may hand back as they were at the capture.
_CONSTANT_TYPES = (type(None), torch.Size, *GATHER_CONSTANTS)


def _check_output(out: Any, j: int, device: torch.device) -> None:
    """Refuses outputs whose tensors a replay could not refresh: objects that pytree does not
    look into come back from every replay as the object of the capture."""
    for leaf in tree_flatten(out)[0]:
        if not isinstance(leaf, (torch.Tensor, *_CONSTANT_TYPES)):
            kind = type(leaf)
            raise TypeError(
                f"{_API}: the forward of replica {j} on {device} returned a "
                f"{kind.__module__}.{kind.__qualname__} object, which a graph replay cannot "
                "refresh (it would come back as the object of the capture, with the capture's "
                "tensors). Return tensors, tuples, lists, dicts or named tuples of them, register "
                "the type with torch.utils._pytree.register_pytree_node (dataclasses: "
                "torch.utils._pytree.register_dataclass), or use cuda_graphs=False"
            )
        if isinstance(leaf, torch.Tensor) and leaf.device != device:
            # A capture would hold a copy between devices, made on a stream it does not capture.
            raise RuntimeError(
                f"{_API}: the forward of replica {j} on {device} returned a tensor on "
                f"{leaf.device}; in this mode each replica's outputs must stay on its device "
                "(the gather moves them). Return it on the replica's device, or use "
                "cuda_graphs=False"
            )


def _is_tensor(x: Any) -> bool:
    return isinstance(x, torch.Tensor)


def _needs_grad(x: Any) -> bool:
    return isinstance(x, torch.Tensor) and x.requires_grad


class _GraphedStep(torch.autograd.Function):
    """One node for the graphed forwards of all replicas: inputs are the scattered chunks' tensors
    and the module's parameters that need gradients; outputs are every replica's output tensors."""

    @staticmethod
    def forward(ctx, graphed: GraphedReplicas, capture: _Capture, *tensors: torch.Tensor):
        n_in = sum(len(s) for s in capture.static_in)
        outs = graphed._forward(capture, tensors[:n_in])
        ctx.graphed = graphed
        ctx.capture = capture
        ctx.generation = capture.generation
        ctx.n_in = n_in
        ctx.done = False
        capture.last_ctx = weakref.ref(ctx)
        k = 0
        non_differentiable = []
        for static_out, grad_index in zip(capture.static_out, capture.out_grad_index, strict=True):
            wanted = set(grad_index)
            for i, leaf in enumerate(static_out):
                if _is_tensor(leaf):
                    if i not in wanted:
                        non_differentiable.append(outs[k])
                    k += 1
        if non_differentiable:
            ctx.mark_non_differentiable(*non_differentiable)
        return tuple(outs)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, *grad_outputs: torch.Tensor):
        graphed: GraphedReplicas = ctx.graphed
        capture: _Capture = ctx.capture
        if capture.generation != ctx.generation:
            raise RuntimeError(
                f"{_API}: this backward pass goes through a forward whose CUDA graphs have been "
                "replayed by a later forward since, which overwrote its saved activations; run "
                "the backward before the next forward of the same input shapes, or use "
                "cuda_graphs=False"
            )
        if ctx.done:
            raise RuntimeError(
                f"{_API}: a second backward pass through the same graphed forward is not "
                "supported (the captured backward does not keep the saved activations); run the "
                "forward again, or use cuda_graphs=False for retain_graph=True"
            )
        devices = graphed.devices[: len(capture.forward_graphs)]
        first = devices[0]
        # The engine made this node's stream wait for every incoming gradient; the other
        # devices' streams wait for this one.
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(first))
        for device in set(devices):
            if device != first:
                torch.cuda.current_stream(device).wait_event(ready)
        k = 0
        for j, (static_out, grad_index) in enumerate(
            zip(capture.static_out, capture.out_grad_index, strict=True)
        ):
            wanted = {i: slot for slot, i in enumerate(grad_index)}
            for i, leaf in enumerate(static_out):
                if not _is_tensor(leaf):
                    continue
                if i in wanted:
                    g = grad_outputs[k]
                    target = capture.static_grad_out[j][wanted[i]]
                    if g is None:
                        target.zero_()
                    else:
                        target.copy_(g)
                k += 1
        for j, graph in enumerate(capture.backward_graphs):
            with torch.cuda.device(devices[j]):
                graph.replay()
        ctx.done = True

        param_grads: list[torch.Tensor | None] = [None] * len(capture.grad_params)
        totals = {}
        for dtype, flat in capture.flat_grads[0].items():
            total = flat.clone()
            for j in range(1, len(devices)):
                total.add_(capture.flat_grads[j][dtype].to(first, non_blocking=True))
            totals[dtype] = total
        offsets: dict[torch.dtype, int] = {}
        for i, p in enumerate(capture.grad_params):
            offset = offsets.get(p.dtype, 0)
            param_grads[i] = totals[p.dtype][offset : offset + p.numel()].view(p.shape)
            offsets[p.dtype] = offset + p.numel()

        input_grads: list[torch.Tensor | None] = []
        for j, static_in in enumerate(capture.static_in):
            wanted = {i: slot for slot, i in enumerate(capture.in_grad_index[j])}
            for i in range(len(static_in)):
                slot = wanted.get(i)
                input_grads.append(
                    None if slot is None else capture.static_grad_in[j][slot].clone()
                )
        # The engine orders the consumers of these gradients after this node's stream only: that
        # stream waits for the work queued on the other devices' streams (replays, clones).
        node_stream = torch.cuda.current_stream(first)
        for device in set(devices):
            if device != first:
                node_stream.wait_stream(torch.cuda.current_stream(device))
        return (None, None, *input_grads, *param_grads)
