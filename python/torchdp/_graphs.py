"""CUDA-graph replicas (``DataParallel(cuda_graphs=True)``): the Python front end of
``torchdp._C.GraphedSteps`` (Note [Graphed replicas] in csrc/torchdp/graphed_replicas.h)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from torchdp import _C
from torchdp._attributes import map_state, plain_attributes
from torchdp._tree import CONSTANTS
from torchdp.replicate import replicate

_API = "torchdp.DataParallel(cuda_graphs=True)"
MAX_SIGNATURES = 8
# Inputs and outputs are flattened with torch.utils._pytree, not torchdp._tree (Note [The Python
# tree]): the specs are kept per signature for the replays and their text is part of the key,
# and a pytree TreeSpec holds only types and contexts, where a tree Spec rebuilds from the
# containers it was made from (holding the capture's tensors).
# Output leaves other than tensors that a replay may hand back as they were at the capture.
_CONSTANT_TYPES = (type(None), torch.Size, *CONSTANTS)
_TENSOR = object()  # a tensor's place among the leaves


def check_cuda_graphs(cuda_graphs: Any, api: str) -> int:
    """0 (off) or the number of input signatures to capture (True: MAX_SIGNATURES)."""
    if cuda_graphs is True:
        return MAX_SIGNATURES
    if (
        cuda_graphs is False
        or cuda_graphs is None
        or (type(cuda_graphs) is int and cuda_graphs == 0)
    ):
        return 0
    if isinstance(cuda_graphs, int) and cuda_graphs > 0:
        return cuda_graphs
    raise ValueError(
        f"{api}: cuda_graphs must be True, False or a positive number of input "
        f"signatures to capture, got {cuda_graphs!r}"
    )


def _install(module: nn.Module, copy: nn.Module, tensors: dict[int, torch.Tensor], j: int) -> None:
    """Makes ``copy`` (replica j) hold ``tensors[id(t)]`` wherever ``module`` holds its tensor
    ``t``, registered or aliased in plain attributes, so no alias keeps a tensor the graphs miss."""
    originals, copies = list(module.modules()), list(copy.modules())
    if len(originals) != len(copies):
        raise RuntimeError(
            f"{_API}: replica {j} has {len(copies)} modules where the module has "
            f"{len(originals)} (post-replicate hooks that add modules are not supported in this "
            "mode); use cuda_graphs=False"
        )
    alias = dict(tensors)
    for original, replica in zip(originals, copies, strict=True):
        for table in ("_parameters", "_buffers"):
            for key, t in getattr(original, table).items():
                held = getattr(replica, table).get(key)
                if t is not None and held is not None:
                    alias[id(held)] = tensors[id(t)]
    for original, replica in zip(originals, copies, strict=True):
        for key, p in original._parameters.items():
            if p is None:
                continue
            # Through the class's __setattr__ (nn.RNNBase keeps its _flat_weights in step).
            setattr(replica, key, tensors[id(p)])
            if getattr(replica, key) is not tensors[id(p)]:
                raise RuntimeError(
                    f"{_API}: {type(replica).__qualname__}.__setattr__ did not take the "
                    f"parameter {key!r} of replica {j}; this module cannot run with "
                    "cuda_graphs=True"
                )
            former = replica.__dict__.get("_former_parameters")
            if isinstance(former, dict) and key in former:
                former[key] = tensors[id(p)]  # not the broadcast copy, which would stay alive
        for key, b in original._buffers.items():
            if b is not None:
                # Directly: some classes' __setattr__ copies into the existing buffer instead.
                replica._buffers[key] = tensors[id(b)]
    for replica in copies:
        state = replica.__dict__
        for key in plain_attributes(replica):
            state[key] = map_state(state[key], lambda t, _: _lookup(alias, t), key)


def _lookup(alias: dict[int, torch.Tensor], t: Any) -> Any:
    return alias.get(id(t), t) if isinstance(t, torch.Tensor) else t


def _refuse_unregistered_leaves(network: nn.Module) -> None:
    """Refuses unregistered leaves that require grad: the captured backward gives them none."""
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

        for key in plain_attributes(module):
            map_state(module.__dict__[key], check, key)


def _check_output(out: Any, j: int, device: torch.device) -> tuple[list[Any], list[torch.Tensor]]:
    """Replica j's output as (leaves with tensors left out, spec) and its tensors; refuses objects
    that pytree leaves whole (no replay)."""
    leaves, spec = tree_flatten(out)
    for leaf in leaves:
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
    # The template drops the tensors: they would keep the capture's autograd graph alive.
    template = [[_TENSOR if isinstance(t, torch.Tensor) else t for t in leaves], spec]
    return template, [t for t in leaves if isinstance(t, torch.Tensor)]


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
        self.stale_attributes = stale_attributes
        self._steps = _C.GraphedSteps(self.devices, max_signatures, _API)
        self._layout: tuple[Any, ...] | None = None
        self._replicas: list[nn.Module] = []
        self._outputs: dict[str, list[list[Any]]] = {}  # per signature: leaves, spec

    @property
    def captures_made(self) -> int:
        return self._steps.captures_made

    @staticmethod
    def _current_layout(modules: list[nn.Module]) -> tuple[Any, ...]:
        # Checked before every forward (a change rebuilds): one pass over the modules' dicts.
        key: list[Any] = []
        for m in modules:
            key.append(id(m))
            for p in m._parameters.values():
                if p is not None:
                    key.append((id(p), p.data_ptr(), p.requires_grad, p.shape, p.dtype))
            for b in m._buffers.values():
                if b is not None:
                    key.append((id(b), b.data_ptr(), b.shape, b.dtype))
        return tuple(key)

    def _rebuild(self, n: int) -> None:
        self._outputs.clear()
        params, buffers = list(self.module.parameters()), list(self.module.buffers())
        _refuse_unregistered_leaves(self.module)
        storage = self._steps.rebuild(params, buffers, n)
        with torch.no_grad():
            copies = replicate(
                self.module, self.devices[:n], detach=True, stale_attributes=self.stale_attributes
            )
        for j, (copy, (param_storage, buffer_storage)) in enumerate(
            zip(copies, storage, strict=True)
        ):
            leaves = [
                nn.Parameter(v, requires_grad=p.requires_grad)
                for p, v in zip(params, param_storage, strict=True)
            ]
            tensors = {id(p): leaf for p, leaf in zip(params, leaves, strict=True)}
            tensors.update({id(b): v for b, v in zip(buffers, buffer_storage, strict=True)})
            _install(self.module, copy, tensors, j)
            self._steps.bind(j, [leaf for leaf in leaves if leaf.requires_grad])
        self._replicas = copies

    def run(self, inputs: Sequence[Any], kwargs: Sequence[Any]) -> list[Any] | None:
        """The per-replica outputs of one forward, or None when this forward must run eagerly."""
        if torch.is_inference_mode_enabled():
            return None  # the engine runs it eagerly; no replicas of inference tensors either
        n = len(inputs)
        modules = list(self.module.modules())
        layout = self._current_layout(modules)
        if layout != self._layout or self._steps.replicas < n:
            self._rebuild(n)
            self._layout = layout
        training = [m.training for m in modules]
        tensors, templates, signature = [], [], []
        for args, kws in zip(inputs, kwargs, strict=True):
            flat, spec = tree_flatten((tuple(args), dict(kws)))
            tensors.append([t for t in flat if isinstance(t, torch.Tensor)])
            templates.append((flat, spec))
            constants = [t for t in flat if not isinstance(t, torch.Tensor)]
            try:
                hash(tuple(constants))
            except TypeError:
                return None  # an unhashable constant: no signature, run eagerly
            signature.append((spec, [(type(c), c) for c in constants]))
        key = "".join("1" if t else "0" for t in training) + repr(signature)
        key = self._steps.signature(key, tensors)  # also the tensors, grad mode, autocast

        def forward(j: int, static: list[torch.Tensor]) -> list[torch.Tensor]:
            for flag, module in zip(training, self._replicas[j].modules(), strict=True):
                module.training = flag
            it = iter(static)
            flat, spec = templates[j]
            leaves = [next(it) if isinstance(t, torch.Tensor) else t for t in flat]
            args, kws = tree_unflatten(leaves, spec)
            out = self._replicas[j](*args, **kws)
            template, outs = _check_output(out, j, self.devices[j])
            self._outputs.setdefault(key, [None] * n)[j] = template
            return outs

        outs = self._steps.run(key, tensors, forward)
        if outs is None:
            return None
        result = []
        for replica_outs, (leaves, spec) in zip(outs, self._outputs[key], strict=True):
            it = iter(replica_outs)
            leaves = [next(it) if t is _TENSOR else t for t in leaves]
            result.append(tree_unflatten(leaves, spec))
        return result
