"""GPU tests (2 GPUs): parity with torch.nn.DataParallel over the model table, and DESIGN.md's
three motivating cases. Skipped without 2 GPUs; failed instead when TORCHDP_REQUIRE_CUDA=1."""

from __future__ import annotations

import importlib
import itertools
import warnings

import pytest
import torch
from dp_testing import (
    MODELS,
    STRUCTURES,
    ModelSpec,
    assert_gpu_bound_buckets_ordered,
    assert_steps_match_eager,
    assert_structures_close,
    clone_module,
    cuda_devices,
    grads_of,
    loss_of,
    masked_linear_class,
    module_to,
)
from torch import nn

import torchdp

pytestmark = pytest.mark.needs_multi_gpu

# torch.nn.DataParallel as PyTorch ships it, even if a test patched torch.
TorchDataParallel = importlib.import_module("torch.nn.parallel.data_parallel").DataParallel


class ConvBNTrain(nn.Module):
    """BatchNorm in training mode: its running statistics are updated by replica 0."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Conv2d(3, 4, 3, padding=1),
            nn.BatchNorm2d(4),
            nn.ReLU(),
            nn.Conv2d(4, 2, 1),
            nn.BatchNorm2d(2),
        )

    def forward(self, x):
        return self.net(x)


PARITY_MODELS = [pytest.param(m, d, id=f"{m.name}-dim{d}") for m in MODELS for d in m.dims] + [
    pytest.param(
        ModelSpec(
            "conv_bn_train", (0,), lambda dim: ConvBNTrain(), lambda dim, b: torch.randn(b, 3, 5, 5)
        ),
        0,
        id="conv_bn_train-dim0",
    ),
]


@pytest.mark.parametrize("structure", STRUCTURES, ids=lambda s: s.name)
@pytest.mark.parametrize("model, dim", PARITY_MODELS)
def test_parity_with_torch_data_parallel(model, dim, structure):
    core = module_to(model.factory(dim), torch.device("cuda", 0))
    theirs_module = structure.harness(core)
    ours_module = structure.harness(clone_module(core))
    theirs = TorchDataParallel(theirs_module, device_ids=[0, 1], dim=dim)
    ours = torchdp.DataParallel(ours_module, device_ids=[0, 1], dim=dim)
    assert ours.device_ids == theirs.device_ids == [0, 1]
    assert ours.output_device == theirs.output_device == 0
    opt_theirs = torch.optim.SGD(theirs_module.parameters(), lr=0.05)
    opt_ours = torch.optim.SGD(ours_module.parameters(), lr=0.05)

    for _ in range(3):
        x = model.make_input(dim, 9)
        if model.differentiable_input:
            x.requires_grad_()
        x2 = x.detach().clone().requires_grad_(x.requires_grad)
        results = []
        for dp, module, opt, inp in (
            (theirs, theirs_module, opt_theirs, x),
            (ours, ours_module, opt_ours, x2),
        ):
            opt.zero_grad(set_to_none=True)
            args, kwargs = structure.build(inp)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # RNN flat-weight warnings of nn.DataParallel
                out = dp(*args, **kwargs)
            loss_of(out).backward()
            results.append((out, grads_of(module), inp.grad))
            opt.step()
        (out_t, grads_t, xg_t), (out_o, grads_o, xg_o) = results
        assert_structures_close(out_o, out_t, rtol=1e-5, atol=1e-5)
        assert grads_o.keys() == grads_t.keys()
        for name in grads_t:
            torch.testing.assert_close(
                grads_o[name],
                grads_t[name],
                rtol=1e-5,
                atol=1e-5,
                msg=lambda m, name=name: f"gradient of {name}: {m}",
            )
        if x.requires_grad:
            torch.testing.assert_close(xg_o, xg_t, rtol=1e-5, atol=1e-5)

    for (name, a), b in zip(
        ours_module.state_dict().items(), theirs_module.state_dict().values(), strict=True
    ):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")


def test_parity_scalar_outputs_and_no_grad():
    net = nn.Linear(4, 1).cuda()
    theirs = TorchDataParallel(net, device_ids=[0, 1])
    ours = torchdp.DataParallel(net, device_ids=[0, 1])
    x = torch.randn(6, 4)
    with torch.no_grad():
        torch.testing.assert_close(ours(x), theirs(x))
    with pytest.warns(UserWarning):
        a = torchdp.DataParallel(_Sum(net), device_ids=[0, 1])(x)
    with pytest.warns(UserWarning):
        b = TorchDataParallel(_Sum(net), device_ids=[0, 1])(x)
    torch.testing.assert_close(a, b)


class _Sum(nn.Module):
    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x):
        return self.inner(x).sum()


def test_output_device_cpu_and_device_objects():
    net = nn.Linear(4, 2).cuda(1)
    ours = torchdp.DataParallel(net, device_ids=[torch.device("cuda:1"), 0], output_device=-1)
    theirs = TorchDataParallel(net, device_ids=[torch.device("cuda:1"), 0], output_device=-1)
    x = torch.randn(5, 4)
    with pytest.warns(FutureWarning):
        out = ours(x)
    assert out.device == torch.device("cpu")
    with pytest.warns(FutureWarning):
        torch.testing.assert_close(out, theirs(x))


def test_key_error_in_replica_like_pytorch():
    class Fails(nn.Module):
        def forward(self, x):
            raise KeyError("wonderful")

    for dp_class in (TorchDataParallel, torchdp.DataParallel):
        with pytest.raises(
            KeyError,
            match=r"Caught KeyError in replica \d on device \d.\n"
            r"Original Traceback[\s\S]+wonderful",
        ):
            dp_class(Fails().cuda(), device_ids=[0, 1])(torch.randn(4, 2))


# ---------------------------------------------------------------------------------------------
# Motivating case 1: a CPU model wrapped for GPUs.
# ---------------------------------------------------------------------------------------------


def test_case1_cpu_model_error_names_the_parameter_and_the_fix():
    model = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        dp = torchdp.DataParallel(model, device_ids=[0, 1])  # silent construction
    with pytest.raises(RuntimeError) as ours:
        dp(torch.randn(4, 4))
    with pytest.raises(RuntimeError) as theirs:
        TorchDataParallel(model, device_ids=[0, 1])(torch.randn(4, 4))
    # PyTorch's message first, then the parameter and the fix.
    assert str(ours.value).startswith(str(theirs.value))
    assert "parameter '0.weight'" in str(ours.value)
    assert "place_module=True" in str(ours.value)


def test_case1_fixes():
    x = torch.randn(6, 4)
    model = nn.Linear(4, 2)
    expected = model(x)
    dp = torchdp.DataParallel(model, device_ids=[0, 1]).cuda()  # the ImageNet-example pattern
    torch.testing.assert_close(dp(x).cpu(), expected)
    model = nn.Linear(4, 2)
    dp = torchdp.DataParallel(model, device_ids=[0, 1], place_module=True)
    out = dp(x)
    assert model.weight.device == torch.device("cuda", 0) and out.device == torch.device("cuda", 0)


# ---------------------------------------------------------------------------------------------
# Motivating case 2: every replica's submodules live on its GPU; plain attributes are shared.
# ---------------------------------------------------------------------------------------------


class WithPlainTensor(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))
        self.pixel_mean = torch.zeros(4)  # not a buffer (detectron2 #1105)

    def forward(self, x):
        return self.blocks(x - self.pixel_mean)


def test_case2_registered_tensors_are_on_each_gpu():
    model = WithPlainTensor().cuda(0)
    model.pixel_mean = model.pixel_mean.cuda(0)
    replicas = torchdp.replicate(model, [0, 1])
    for j, replica in enumerate(replicas):
        for m in replica.modules():
            for t in itertools.chain(m._former_parameters.values(), m._buffers.values()):
                if t is not None:
                    assert t.device == torch.device("cuda", j)
    # A plain attribute is shared by reference, as in PyTorch ...
    assert replicas[1].pixel_mean is model.pixel_mean
    # ... unless a post-replicate hook moves it.

    def move(replica, original, device, index, ctx):
        replica.pixel_mean = original.pixel_mean.to(device)

    with torchdp.register_post_replicate_hook(WithPlainTensor, move):
        replicas = torchdp.replicate(model, [0, 1])
    assert replicas[1].pixel_mean.device == torch.device("cuda", 1)
    dp = torchdp.DataParallel(model, device_ids=[0, 1])
    with torchdp.register_post_replicate_hook(WithPlainTensor, move):
        assert dp(torch.randn(6, 4)).shape == (6, 2)


# ---------------------------------------------------------------------------------------------
# Motivating case 3: the cplxmodule masked layer.
# ---------------------------------------------------------------------------------------------


def test_case3_masked_layer_torch_fails_torchdp_works():
    cls = masked_linear_class("GpuMaskedLinear")
    layer = cls(8, 4).cuda(0)
    ref = cls(8, 4).cuda(0)
    ref.load_state_dict(layer.state_dict())
    x = torch.randn(6, 8)
    with pytest.raises(RuntimeError, match="Caught RuntimeError in replica 1 on device 1"):
        TorchDataParallel(layer, device_ids=[0, 1])(x)
    # (PyTorch's replicate also wrote replica 1's mask into the original: restore it.)
    layer.load_state_dict(ref.state_dict())
    mask = layer.mask
    with pytest.warns(UserWarning, match="GpuMaskedLinear"):
        out = torchdp.DataParallel(layer, device_ids=[0, 1])(x)
    torch.testing.assert_close(out, ref(x.cuda(0)))
    out.sum().backward()
    ref(x.cuda(0)).sum().backward()
    torch.testing.assert_close(layer.weight.grad, ref.weight.grad)
    assert layer.mask is mask and layer.mask.device == torch.device("cuda", 0)
    replicas = torchdp.replicate(layer, [0, 1])
    assert replicas[1].mask.device == torch.device("cuda", 1)


# ---------------------------------------------------------------------------------------------
# Per-replica outputs and losses (gather_output=False + DataParallelCriterion).
# ---------------------------------------------------------------------------------------------


def test_per_replica_outputs_stay_on_their_gpus_and_the_loss_matches():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 5)).cuda(0)
    ref = clone_module(net)
    weight = torch.rand(5, device="cuda:0") + 0.5  # class weights: a buffer, replicated per GPU
    dp = torchdp.DataParallel(net, device_ids=[0, 1], gather_output=False)
    crit = torchdp.DataParallelCriterion(nn.CrossEntropyLoss(weight=weight, reduction="sum"))
    x, y = torch.randn(10, 6), torch.randint(0, 5, (10,))
    outs = dp(x)
    assert [o.device for o in outs] == [torch.device("cuda", 0), torch.device("cuda", 1)]
    loss = crit(outs, y)
    assert loss.device == torch.device("cuda", 0)
    expected = nn.CrossEntropyLoss(weight=weight, reduction="sum")(ref(x.cuda(0)), y.cuda(0))
    torch.testing.assert_close(loss, expected)
    loss.backward()
    expected.backward()
    for p, q in zip(net.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5)
    cpu_weight = torchdp.DataParallelCriterion(nn.CrossEntropyLoss(weight=weight.cpu()))
    with pytest.raises(RuntimeError, match="criterion.to\\('cuda:0'\\)"):
        cpu_weight(dp(x), y)


@pytest.mark.parametrize("serial", [False, True])
def test_each_replica_runs_with_its_gpu_current(serial):
    class Where(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(3, 3)

        def forward(self, x):
            return self.lin(x), torch.full((x.shape[0],), torch.cuda.current_device())

    dp = torchdp.DataParallel(Where().cuda(0), device_ids=[0, 1], serial_forward=serial)
    out, where = dp(torch.randn(4, 3))
    assert where.tolist() == [0, 0, 1, 1]
    assert out.device == torch.device("cuda", 0)


# ---------------------------------------------------------------------------------------------
# Bucketed gradient reduction on two GPUs: several buckets in flight on the side streams (NCCL or
# peer copies), over several optimizer steps, against the same training on one GPU.
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("bucket_cap_mb", [0, 1, 25])
def test_bucketed_training_matches_one_gpu(bucket_cap_mb):
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(6):
        layers += [nn.Linear(512, 512), nn.GELU()]  # ~1 MiB per layer: several buckets
    net = nn.Sequential(*layers, nn.Linear(512, 10)).cuda(0)
    ref = clone_module(net)
    dp = torchdp.DataParallel(net, device_ids=[0, 1], bucket_cap_mb=bucket_cap_mb)
    opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    for step in range(4):
        x = torch.randn(64, 512, device="cuda:0")
        y = torch.randint(0, 10, (64,), device="cuda:0")
        for model, optimizer in ((dp, opt), (ref, ref_opt)):
            optimizer.zero_grad(set_to_none=True)
            nn.functional.cross_entropy(model(x), y).backward()
            optimizer.step()
        for p, q in zip(net.parameters(), ref.parameters(), strict=True):
            torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-5, msg=f"step {step}")


@pytest.mark.parametrize("set_to_none", [False, True])
def test_bucket_reduction_waits_for_the_second_gpus_backward(set_to_none):
    """GPU-bound backward: the CPU queues every kernel long before GPU 1 has run them, so a bucket's
    reduction is issued while GPU 1 is still computing that bucket's gradients. Every side stream
    must wait for them (the engine orders only the node's own stream), and GPU 0's current stream
    for the sums before reading them."""
    assert_gpu_bound_buckets_ordered(
        cuda_devices(2), bucket_cap_mb=1, layers=4, set_to_none=set_to_none
    )


def test_compiled_module_on_two_gpus_matches_eager():
    """torch.compile(module) under DataParallel: each replica runs a compiled call of its own
    module on its own GPU (nn.DataParallel rewrites the wrapped module's dictionaries instead)."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 8)).cuda(0)
    eager = clone_module(net)
    keys = list(net._modules)
    dp = torchdp.DataParallel(torch.compile(net, backend="aot_eager"), device_ids=[0, 1])
    replicas = dp.replicate(dp.module, dp.device_ids)
    assert replicas[1]._orig_mod[0].weight.device == torch.device("cuda", 1)
    inputs = [torch.randn(32, 64, device="cuda:0") for _ in range(3)]
    assert_steps_match_eager(dp, net, eager, inputs, rtol=1e-4, atol=1e-5)
    assert list(net._modules) == keys
