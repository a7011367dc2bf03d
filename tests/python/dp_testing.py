"""Helpers shared by torchdp's Python tests: device lists, the model table, input structures,
and output/gradient comparison against the unwrapped module."""

from __future__ import annotations

import copy
from collections import OrderedDict, namedtuple
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn


def cpu_devices(n: int) -> list[torch.device]:
    """``n`` CPU devices (the same device repeated): ``n`` replicas on one host."""
    return [torch.device("cpu")] * n


def cuda_devices(n: int) -> list[torch.device]:
    """The first ``n`` CUDA devices."""
    return [torch.device("cuda", i) for i in range(n)]


# ---------------------------------------------------------------------------------------------
# Models. Each core maps a tensor whose batch dimension is `dim` to a tensor whose batch
# dimension is `dim`.
# ---------------------------------------------------------------------------------------------


class LSTMCore(nn.Module):
    def __init__(self, batch_first: bool) -> None:
        super().__init__()
        self.lstm = nn.LSTM(5, 4, num_layers=2, batch_first=batch_first)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lstm(x)[0]


class SharedCore(nn.Module):
    """A submodule used twice (two names for one module) and a tied parameter."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(6, 6)
        self.b = self.a
        self.out = nn.Linear(6, 3)
        self.tied = nn.Linear(3, 3, bias=False)
        self.tied2 = nn.Linear(3, 3, bias=False)
        self.tied2.weight = self.tied.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.b(torch.relu(self.a(x))))
        return self.tied2(self.tied(self.out(h)))


class ParamContainersCore(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weights = nn.ParameterList(
            [nn.Parameter(torch.randn(6, 4)), nn.Parameter(torch.randn(4))]
        )
        self.extra = nn.ParameterDict(
            {"scale": nn.Parameter(torch.randn(4)), "shift": nn.Parameter(torch.randn(4))}
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x @ self.weights[0] + self.weights[1]
        return y * self.extra["scale"] + self.extra["shift"]


class BufferRequiresGradCore(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 4)
        self.register_buffer("offset", torch.randn(6).requires_grad_())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x + self.offset)


class EmbeddingCore(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(20, 5, sparse=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.emb(x)


@dataclass(frozen=True)
class ModelSpec:
    name: str
    dims: tuple[int, ...]
    factory: Callable[[int], nn.Module]
    make_input: Callable[[int, int], torch.Tensor]  # (dim, batch) -> input
    differentiable_input: bool = True

    def __repr__(self) -> str:
        return self.name


def _with_batch(shape_rest: tuple[int, ...], dim: int, batch: int) -> tuple[int, ...]:
    shape = list(shape_rest)
    shape.insert(dim, batch)
    return tuple(shape)


MODELS: list[ModelSpec] = [
    ModelSpec(
        "linear",
        (0, 1),
        lambda dim: nn.Linear(6, 4),
        lambda dim, b: (
            torch.randn(_with_batch((6,), 0, b))
            if dim == 0
            else torch.randn(_with_batch((3, 6), 1, b))
        ),
    ),
    ModelSpec(
        "conv_bn_eval",
        (0,),
        lambda dim: nn.Sequential(
            nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU()
        ).eval(),
        lambda dim, b: torch.randn(b, 3, 5, 5),
    ),
    ModelSpec(
        "lstm",
        (0, 1),
        lambda dim: LSTMCore(batch_first=(dim == 0)),
        lambda dim, b: torch.randn(_with_batch((4, 5), dim, b)),
    ),
    ModelSpec(
        "embedding_sparse",
        (0, 1),
        lambda dim: EmbeddingCore(),
        lambda dim, b: torch.randint(0, 20, _with_batch((3,), dim, b)),
        differentiable_input=False,
    ),
    ModelSpec(
        "shared_submodules", (0,), lambda dim: SharedCore(), lambda dim, b: torch.randn(b, 6)
    ),
    ModelSpec(
        "param_list_dict", (0,), lambda dim: ParamContainersCore(), lambda dim, b: torch.randn(b, 6)
    ),
    ModelSpec(
        "buffer_requires_grad",
        (0,),
        lambda dim: BufferRequiresGradCore(),
        lambda dim, b: torch.randn(b, 6),
    ),
]

# ---------------------------------------------------------------------------------------------
# Input structures. A structure wraps a core module in a harness (no parameters of its own) and
# builds the call arguments around the input tensor.
# ---------------------------------------------------------------------------------------------

Pair = namedtuple("Pair", ["x", "note"])


class Out(NamedTuple):
    y: torch.Tensor
    y2: torch.Tensor


class TensorHarness(nn.Module):
    def __init__(self, core: nn.Module) -> None:
        super().__init__()
        self.core = core

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.core(x)


class TupleHarness(TensorHarness):
    def forward(self, pair: tuple[torch.Tensor, int]) -> tuple[torch.Tensor, torch.Tensor]:
        x, k = pair
        y = self.core(x)
        return y, y * k


class DictHarness(TensorHarness):
    def forward(self, x: torch.Tensor, scale: float = 1.0) -> dict[str, Any]:
        y = self.core(x)
        return OrderedDict([("y", y * scale), ("nothing", None)])


class NamedTupleHarness(TensorHarness):
    def forward(self, batch: Pair) -> Out:
        assert batch.note == "hello"
        y = self.core(batch.x)
        return Out(y, y.sin())


class NonTensorHarness(TensorHarness):
    def forward(
        self,
        x: torch.Tensor,
        n: int,
        label: str = "",
        flag: bool = False,
        none: Any = None,
        items: list[Any] | None = None,
    ) -> list[torch.Tensor]:
        assert label == "abc" and flag is True and none is None and items is not None
        y = self.core(x) * n
        return [y, y + len(items)]


@dataclass(frozen=True)
class StructureSpec:
    name: str
    harness: type[nn.Module]
    # x -> (args, kwargs)
    build: Callable[[torch.Tensor], tuple[tuple[Any, ...], dict[str, Any]]]

    def __repr__(self) -> str:
        return self.name


STRUCTURES: list[StructureSpec] = [
    StructureSpec("tensor", TensorHarness, lambda x: ((x,), {})),
    StructureSpec("tuple", TupleHarness, lambda x: (((x, 3),), {})),
    StructureSpec("dict_kwargs", DictHarness, lambda x: ((), {"x": x, "scale": 2.0})),
    StructureSpec("namedtuple", NamedTupleHarness, lambda x: ((Pair(x, "hello"),), {})),
    StructureSpec(
        "non_tensors",
        NonTensorHarness,
        lambda x: ((x, 3), {"label": "abc", "flag": True, "none": None, "items": [1, "two", None]}),
    ),
]

# ---------------------------------------------------------------------------------------------
# Comparison
# ---------------------------------------------------------------------------------------------


def tensors_of(obj: Any) -> list[torch.Tensor]:
    """Every tensor in a nested structure, in a deterministic order."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in tensors_of(v)]
    if isinstance(obj, (list, tuple)):
        return [t for v in obj for t in tensors_of(v)]
    return []


def loss_of(output: Any) -> torch.Tensor:
    total = torch.zeros(())
    for t in tensors_of(output):
        t = t.float()
        total = total.to(t.device) + (t * t).sum() + t.sum()
    return total


def dense(t: torch.Tensor | None) -> torch.Tensor | None:
    if t is None:
        return None
    return t.to_dense() if t.is_sparse else t


def grads_of(module: nn.Module) -> dict[str, torch.Tensor | None]:
    named = dict(module.named_parameters())
    named.update({n: b for n, b in module.named_buffers() if b.requires_grad})
    return {n: dense(t.grad) for n, t in named.items()}


def assert_structures_close(actual: Any, expected: Any, **tol: Any) -> None:
    assert type(actual) is type(expected), (type(actual), type(expected))
    if isinstance(expected, torch.Tensor):
        torch.testing.assert_close(actual, expected, **tol)
    elif isinstance(expected, dict):
        assert list(actual) == list(expected)
        for k in expected:
            assert_structures_close(actual[k], expected[k], **tol)
    elif isinstance(expected, (list, tuple)):
        assert len(actual) == len(expected)
        for a, e in zip(actual, expected, strict=True):
            assert_structures_close(a, e, **tol)
    else:
        assert actual == expected


def run_and_grad(
    module: nn.Module, call: Callable[[], Any], x: torch.Tensor | None
) -> tuple[Any, dict[str, torch.Tensor | None], torch.Tensor | None]:
    module.zero_grad(set_to_none=True)
    if x is not None:
        x.grad = None
    out = call()
    loss_of(out).backward()
    return out, grads_of(module), (None if x is None else x.grad)


def clone_module(module: nn.Module) -> nn.Module:
    return copy.deepcopy(module)


def module_to(module: nn.Module, device: torch.device) -> nn.Module:
    """``module.to(device)``, keeping buffers that require grad leaves (``Module.to`` turns them
    into non-leaf copies, whose ``.grad`` is never filled)."""
    module.to(device)
    for m in module.modules():
        for key, buf in m._buffers.items():
            if buf is not None and buf.requires_grad and not buf.is_leaf:
                m._buffers[key] = buf.detach().requires_grad_()
    return module


def masked_linear_class(name: str) -> type[nn.Module]:
    """A cplxmodule-style masked linear layer class, named ``name`` (a fresh class per test, so
    torchdp's once-per-class warning can be observed): its ``__setattr__`` copies a new ``mask``
    into the existing one with ``self.mask.copy_(value)`` instead of re-registering it."""

    def __init__(self: nn.Linear, in_features: int, out_features: int) -> None:
        nn.Linear.__init__(self, in_features, out_features)
        self.register_buffer("mask", (torch.rand(out_features, in_features) > 0.3).float())

    def __setattr__(self: nn.Linear, key: str, value: Any) -> None:
        if key == "mask" and self.__dict__.get("_buffers", {}).get("mask") is not None:
            with torch.no_grad():
                self.mask.copy_(value)
        else:
            nn.Linear.__setattr__(self, key, value)

    def forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight * self.mask, self.bias)

    cls = type(
        name, (nn.Linear,), {"__init__": __init__, "__setattr__": __setattr__, "forward": forward}
    )
    cls.__qualname__ = name
    return cls


def gradient_penalty(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """A loss that needs double backward: the squared input gradient plus the squared output."""
    x = x.clone().requires_grad_()
    out = module(x)
    (g,) = torch.autograd.grad(out.sum(), x, create_graph=True)
    return g.pow(2).sum() + out.pow(2).mean()


def assert_steps_match_eager(
    wrapped: nn.Module, net: nn.Module, eager: nn.Module, inputs: list[torch.Tensor], **tol: Any
) -> None:
    """For each input: forward and backward of ``out.square().sum()`` through ``wrapped`` (which
    holds ``net``) and through ``eager`` (a copy of ``net``); outputs and gradients must match."""
    for step, x in enumerate(inputs):
        for m in (net, eager):
            m.zero_grad(set_to_none=True)
        out = wrapped(x)
        out.square().sum().backward()
        ref = eager(x)
        ref.square().sum().backward()
        torch.testing.assert_close(out, ref, msg=f"step {step}", **tol)
        for (name, p), q in zip(net.named_parameters(), eager.parameters(), strict=True):
            torch.testing.assert_close(
                p.grad, q.grad, msg=f"step {step}, gradient of {name}", **tol
            )


def assert_gpu_bound_buckets_ordered(
    devices: list[torch.device], bucket_cap_mb: float, layers: int, set_to_none: bool = False
) -> None:
    """Wide layers and a large batch make the backward GPU-bound: the CPU queues every kernel
    (and every bucket's reduction) long before the GPUs have run them, so the reductions must wait
    for the gradients on their side streams, and the current stream for the sums before anything
    reads them: with ``set_to_none=False`` they are accumulated in place into the existing .grad
    during the backward pass; with ``True`` the pass sets .grad. Gradients are compared with one
    device's over three attempts."""
    import torchdp

    torch.manual_seed(0)
    width, batch = 4096, 16384  # ~10 ms of backward per layer and replica
    net = nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)]).to(devices[0])
    ref = clone_module(net)
    for p in net.parameters():
        p.grad = torch.zeros_like(p)  # accumulated in place on the forward stream
    dp = torchdp.DataParallel(net, devices=devices, bucket_cap_mb=bucket_cap_mb)
    for attempt in range(3):
        x = torch.randn(batch, width, device=devices[0])
        ref.zero_grad(set_to_none=True)
        ref(x).square().mean().backward()
        net.zero_grad(set_to_none=set_to_none)
        dp(x).square().mean().backward()
        grads = [p.grad.clone() for p in net.parameters()]  # right away, on the current stream
        for (name, _), g, q in zip(net.named_parameters(), grads, ref.parameters(), strict=True):
            torch.testing.assert_close(
                g, q.grad, rtol=1e-3, atol=1e-6, msg=f"attempt {attempt}, gradient of {name}"
            )


def run_processes(target: Callable[..., None], args_of_rank: Callable[[int], tuple], world: int):
    """Runs ``target(*args_of_rank(rank))`` in ``world`` spawned processes and checks that every
    one exits with 0 (their tracebacks are printed above the failure)."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=target, args=args_of_rank(r)) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=240)
    codes = [p.exitcode for p in procs]
    for p in procs:
        if p.is_alive():
            p.kill()
    assert codes == [0] * world, f"worker exit codes {codes} (tracebacks above)"


def exit_process(code: int) -> None:
    """Ends a spawned worker without interpreter finalisation: with the torch builds tested here,
    gloo's teardown at exit sometimes aborts ("terminate called without an active exception"),
    with or without torchdp (plain DDP on gloo does it too); the results are saved by then."""
    import os
    import sys

    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
