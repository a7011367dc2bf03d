"""Outputs and gradients of torchdp.DataParallel equal those of the unwrapped module, over a table
of models x input structures x dim x CPU device lists (the full machinery runs on CPU replicas)."""

from __future__ import annotations

import itertools

import pytest
import torch
from dp_testing import (
    MODELS,
    STRUCTURES,
    ModelSpec,
    StructureSpec,
    assert_structures_close,
    clone_module,
    cpu_devices,
    cuda_devices,
    gradient_penalty,
    module_to,
    run_and_grad,
    tensors_of,
)
from torch import nn

import torchdp

# Device lists: the full machinery on 2 and 3 CPU replicas, and the same cases on 2 GPUs.
DEVICE_LISTS = [
    pytest.param(cpu_devices(2), id="cpu2"),
    pytest.param(cpu_devices(3), id="cpu3"),
    pytest.param(cuda_devices(2), id="cuda2", marks=pytest.mark.needs_multi_gpu),
]


def _cases(structures):
    return [
        pytest.param(
            model,
            structure,
            dim,
            devices.values[0],
            id=f"{model.name}-{structure.name}-dim{dim}-{devices.id}",
            marks=devices.marks,
        )
        for model, structure, devices in itertools.product(MODELS, structures, DEVICE_LISTS)
        for dim in model.dims
    ]


BATCH = 7  # uneven chunks: [4, 3] on 2 devices, [3, 3, 1] on 3


def _call(module: nn.Module, structure: StructureSpec, x: torch.Tensor):
    args, kwargs = structure.build(x)
    return lambda: module(*args, **kwargs)


def _check(
    model: ModelSpec,
    structure: StructureSpec,
    dim: int,
    devices: list[torch.device],
    functional: bool,
) -> None:
    core = module_to(model.factory(dim), devices[0])
    reference = structure.harness(core)
    wrapped_module = structure.harness(clone_module(core))

    x = model.make_input(dim, BATCH)  # on the CPU: DataParallel scatters it to the devices
    if model.differentiable_input:
        x.requires_grad_()
    x_ref = x.detach().to(devices[0]).requires_grad_(x.requires_grad)

    expected, expected_grads, expected_xgrad = run_and_grad(
        reference, _call(reference, structure, x_ref), x_ref if x.requires_grad else None
    )
    if functional:
        args, kwargs = structure.build(x)

        def call():
            return torchdp.data_parallel(
                wrapped_module, args, dim=dim, module_kwargs=kwargs, devices=devices
            )

        actual, grads, xgrad = run_and_grad(wrapped_module, call, x if x.requires_grad else None)
    else:
        dp = torchdp.DataParallel(wrapped_module, dim=dim, devices=devices)
        actual, grads, xgrad = run_and_grad(
            wrapped_module, _call(dp, structure, x), x if x.requires_grad else None
        )

    assert_structures_close(actual, expected, rtol=1e-5, atol=1e-5)
    assert all(t.device == devices[0] for t in tensors_of(actual))
    assert grads.keys() == expected_grads.keys()
    for name in expected_grads:
        assert expected_grads[name] is not None, name
        assert grads[name] is not None, f"no gradient reached {name}"
        torch.testing.assert_close(
            grads[name],
            expected_grads[name],
            rtol=1e-4,
            atol=1e-5,
            msg=lambda m, name=name: f"gradient of {name}: {m}",
        )
    if x.requires_grad:
        assert xgrad.device == torch.device("cpu")
        torch.testing.assert_close(xgrad, expected_xgrad.cpu(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("model, structure, dim, devices", _cases(STRUCTURES))
def test_data_parallel_matches_module(model, structure, dim, devices):
    _check(model, structure, dim, devices, functional=False)


@pytest.mark.parametrize("model, structure, dim, devices", _cases(STRUCTURES[:1]))
def test_functional_data_parallel_matches_module(model, structure, dim, devices):
    _check(model, structure, dim, devices, functional=True)


@pytest.mark.parametrize("n", [2, 3])
def test_sparse_embedding_gradient_is_summed(n):
    emb = nn.Embedding(10, 3, sparse=True)
    dp = torchdp.DataParallel(emb, devices=cpu_devices(n))
    idx = torch.tensor([[1, 2], [1, 3], [4, 1], [2, 2], [9, 9]])
    dp(idx).sum().backward()
    assert emb.weight.grad is not None and emb.weight.grad.is_sparse
    counts = torch.bincount(idx.flatten(), minlength=10).float()
    torch.testing.assert_close(emb.weight.grad.to_dense(), counts[:, None].expand(10, 3))


class SometimesEmbeds(nn.Module):
    """A sparse embedding used only for the rows that carry indices (idx >= 0): a replica whose
    chunk has none gives it no gradient; ``dense_rows`` reach its weight densely instead."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 3, sparse=True)
        self.lin = nn.Linear(3, 3)

    def forward(self, x, idx):
        out = self.lin(x)
        if bool((idx >= 0).all()):
            out = out + self.emb(idx).sum(1)
        elif bool((idx == -2).all()):
            out = out + self.emb.weight[:3].sum(0)  # a dense gradient for the same weight
        return out


def _chunkwise_reference(net, x, idx, n):
    """The plain module run on each chunk, its summed loss backward: DataParallel's gradients."""
    size = -(-x.shape[0] // n)
    loss = sum(net(x[i : i + size], idx[i : i + size]).sum() for i in range(0, x.shape[0], size))
    loss.backward()


@pytest.mark.parametrize(
    "rows", [[0, 0, -1, -1, 0, 0], [-1, -1, 0, 0, -1, -1], [0, 0, -1, -1, -2, -2]]
)
def test_a_sparse_gradient_from_some_replicas_only(rows):
    # pytorch's reduce densifies a sparse gradient meeting a dense one; replicas that did not use
    # the embedding give none, and the sum stays sparse as on one device.
    net = SometimesEmbeds()
    ref = clone_module(net)
    x = torch.randn(6, 3)
    idx = torch.randint(0, 10, (6, 2))
    for i, r in enumerate(rows):
        if r < 0:
            idx[i] = r
    torchdp.DataParallel(net, devices=cpu_devices(3))(x, idx).sum().backward()
    _chunkwise_reference(ref, x, idx, 3)
    got, want = net.emb.weight.grad, ref.emb.weight.grad
    assert got is not None and got.is_sparse == want.is_sparse == (-2 not in rows)
    torch.testing.assert_close(got.to_dense(), want.to_dense())
    torch.testing.assert_close(net.lin.weight.grad, ref.lin.weight.grad)


@pytest.mark.parametrize("n", [2, 3])
def test_double_backward_gradient_penalty(n):
    net = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 1))
    ref = clone_module(net)
    dp = torchdp.DataParallel(net, devices=cpu_devices(n))

    x = torch.randn(9, 6)
    gradient_penalty(ref, x).backward()
    gradient_penalty(dp, x).backward()
    for (name, p), q in zip(net.named_parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6, msg=name)


def test_grad_of_parameters_with_create_graph():
    # pytorch #16532: autograd.grad(create_graph=True) with respect to the parameters.
    net = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 1))
    ref = clone_module(net)
    dp = torchdp.DataParallel(net, devices=cpu_devices(2))
    x = torch.randn(6, 4)
    for module, params in ((ref, list(ref.parameters())), (dp, list(net.parameters()))):
        grads = torch.autograd.grad(module(x).sum(), params, create_graph=True)
        sum(g.pow(2).sum() for g in grads).backward()
    for p, q in zip(net.parameters(), ref.parameters(), strict=True):
        # The last bias's gradient is constant, so the penalty does not depend on it: the plain
        # module leaves its .grad None, torchdp's reduction gives zeros.
        expected = torch.zeros_like(q) if q.grad is None else q.grad
        torch.testing.assert_close(p.grad, expected, rtol=1e-4, atol=1e-6)


def test_batchnorm_running_stats_updated_by_replica_zero():
    # Replica 0 shares storage with the original (the DataParallel guarantee), so the running
    # statistics it updates in place persist; here replica 0 sees the first chunk.
    bn = nn.BatchNorm1d(3)
    ref = clone_module(bn)
    dp = torchdp.DataParallel(bn, devices=cpu_devices(2))
    x = torch.randn(8, 3)
    dp(x)
    ref(x[:4])
    torch.testing.assert_close(bn.running_mean, ref.running_mean)
    torch.testing.assert_close(bn.running_var, ref.running_var)
    assert int(bn.num_batches_tracked) == 1


def test_training_several_sgd_steps_matches_single_device():
    net = nn.Sequential(nn.Linear(5, 8), nn.ReLU(), nn.Linear(8, 2))
    ref = clone_module(net)
    dp = torchdp.DataParallel(net, devices=cpu_devices(3))
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.1)
    for _ in range(3):
        x = torch.randn(10, 5)
        for module, o in ((dp, opt), (ref, opt_ref)):
            o.zero_grad()
            module(x).pow(2).mean().backward()
            o.step()
    for p, q in zip(net.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


class _GradModeProbe(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 2)
        self.seen: list[bool] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.append(torch.is_grad_enabled())  # a list shared by every replica
        return self.lin(x)


@pytest.mark.parametrize("grad_enabled", [True, False])
def test_grad_mode_reaches_every_replica(grad_enabled):
    net = _GradModeProbe()
    dp = torchdp.DataParallel(net, devices=cpu_devices(3))
    x = torch.randn(6, 4)
    with torch.set_grad_enabled(grad_enabled):
        out = dp(x)
    assert net.seen == [grad_enabled] * 3
    assert out.requires_grad == grad_enabled
    with torch.no_grad():
        torch.testing.assert_close(out, net.lin(x))
