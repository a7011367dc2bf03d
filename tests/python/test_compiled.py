"""Replicating compiled modules (csrc/python/replicate_build.cpp, Note [Replicating compiled modules]):
``torch.compile(module)`` wrappers and modules compiled in place with ``module.compile()``.

A counting dynamo backend (no code generation) shows that every replica runs its own compiled call
and that nothing is recompiled per step."""

from __future__ import annotations

import warnings

import pytest
import torch
from dp_testing import assert_steps_match_eager, clone_module, cpu_devices
from torch import nn

import torchdp

torch_dynamo = pytest.importorskip("torch._dynamo")


class Net(nn.Module):
    """A user-defined module (dynamo compiles its frame; torch.nn's own frames it skips)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 16)
        self.b = nn.Linear(16, 4)
        self.register_buffer("scale", torch.tensor(2.0))

    def forward(self, x):
        return self.b(torch.relu(self.a(x))) * self.scale


class CountingBackend:
    """A dynamo backend that counts compilations and calls of the compiled graphs."""

    def __init__(self) -> None:
        self.compiles = 0
        self.calls = 0

    def __call__(self, gm, example_inputs):
        self.compiles += 1

        def run(*args):
            self.calls += 1
            return gm.forward(*args)

        return run


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch_dynamo.reset()
    yield
    torch_dynamo.reset()


def compiled(style: str, net: nn.Module, backend) -> nn.Module:
    if style == "wrapper":
        return torch.compile(net, backend=backend)
    net.compile(backend=backend)
    return net


@pytest.mark.parametrize("style", ["wrapper", "in_place"])
def test_data_parallel_of_a_compiled_module_matches_eager(style):
    torch.manual_seed(0)
    net = Net()
    eager = clone_module(net)
    keys, own = list(net._modules), dict(net.__dict__)
    backend = CountingBackend()
    dp = torchdp.DataParallel(compiled(style, net, backend), devices=cpu_devices(2))
    compiles_after = []
    for _ in range(4):
        assert_steps_match_eager(dp, net, eager, [torch.randn(6, 8)])
        compiles_after.append(backend.compiles)
    # Every replica ran a compiled call, every step; compiled once, not per step.
    assert backend.calls >= 2 * 4
    assert compiles_after[-1] == compiles_after[1] > 0, compiles_after
    # The original module is as it was (PyTorch's replicate rewrites a wrapped module's dicts).
    assert list(net._modules) == keys
    assert "_former_parameters" not in net.__dict__ and "_is_replica" not in net.__dict__
    assert all(net.__dict__[k] is v for k, v in own.items() if k != "_compiled_call_impl")


def test_compile_wrapper_replicas_run_their_own_module():
    net = Net()
    wrapper = torch.compile(net, backend=CountingBackend())
    replicas = torchdp.replicate(wrapper, cpu_devices(2), detach=True)
    x = torch.randn(3, 8)
    for _j, replica in enumerate(replicas):
        assert type(replica) is type(wrapper)
        assert replica._orig_mod is replica._modules["_orig_mod"]
        assert replica._orig_mod is not net
    assert wrapper._orig_mod is net
    # Replica 1's own weights decide its output (not the original's).
    with torch.no_grad():
        replicas[1]._orig_mod.b.bias.add_(100.0)
    torch.testing.assert_close(replicas[1](x), net(x) + 200.0)
    torch.testing.assert_close(replicas[0](x), net(x))


def test_in_place_compiled_replicas_get_their_own_compiled_call():
    net = Net()
    backend = CountingBackend()
    net.compile(backend=backend)
    replicas = torchdp.replicate(net, cpu_devices(2), detach=True)
    for replica in replicas:
        assert replica._compiled_call_impl is not None
        assert replica._compiled_call_impl is not net._compiled_call_impl
    with torch.no_grad():
        replicas[1].b.bias.add_(100.0)
    x = torch.randn(3, 8)
    before = backend.calls
    torch.testing.assert_close(replicas[1](x), net(x) + 200.0)
    assert backend.calls > before


def test_compile_wrapper_with_global_registration_hooks_leaves_the_original_intact():
    # Global registration hooks make torchdp build other modules PyTorch's way (setattr); the
    # compile wrapper is still built with dictionary operations.
    seen = []
    handle = torch.nn.modules.module.register_module_module_registration_hook(
        lambda module, name, sub: seen.append(name)
    )
    try:
        net = Net()
        keys = list(net._modules)
        wrapper = torch.compile(net, backend=CountingBackend())
        out = torchdp.DataParallel(wrapper, devices=cpu_devices(2))(torch.randn(4, 8))
        assert out.shape == (4, 4)
        assert list(net._modules) == keys and "_former_parameters" not in net.__dict__
    finally:
        handle.remove()


def test_rebind_without_a_compiler_context_runs_eagerly_and_warns_once(monkeypatch):
    from torchdp import _compiled

    monkeypatch.setattr(_compiled, "_warned", False)
    net = Net()
    replica = Net()

    def not_compiled(*args, **kwargs):  # no dynamo context in its closure
        return net._call_impl(*args, **kwargs)

    with pytest.warns(UserWarning, match="its replicas run eagerly"):
        _compiled.rebind_compiled_call(replica, not_compiled)
    assert replica.__dict__["_compiled_call_impl"] is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _compiled.rebind_compiled_call(replica, not_compiled)  # once only


@pytest.mark.needs_cuda
def test_inductor_compiled_wrapper_on_cuda_replicas():
    # The default backend (inductor, generated kernels) with two replicas on one GPU.
    torch.manual_seed(0)
    dev = torch.device("cuda", 0)
    net = Net().to(dev)
    eager = clone_module(net)
    dp = torchdp.DataParallel(torch.compile(net), devices=[dev, dev])
    inputs = [torch.randn(16, 8, device=dev) for _ in range(3)]
    assert_steps_match_eager(dp, net, eager, inputs, rtol=1e-4, atol=1e-5)


# Dynamo warns that it cannot trace torchdp's C++ functions (the graph breaks) and about the
# replicas' non-leaf parameter copies it inspects.
@pytest.mark.filterwarnings("ignore::UserWarning")
def test_compiling_the_data_parallel_itself_runs():
    # torch.compile around the DataParallel: dynamo stops at torchdp's C++ calls (graph breaks)
    # and the replicas run as usual.
    torch.manual_seed(0)
    net = Net()
    eager = clone_module(net)
    dp = torchdp.DataParallel(net, devices=cpu_devices(2))
    assert_steps_match_eager(
        torch.compile(dp, backend=CountingBackend()),
        net,
        eager,
        [torch.randn(6, 8) for _ in range(2)],
    )


def test_compiled_submodule():
    class Outer(nn.Module):
        def __init__(self, backend) -> None:
            super().__init__()
            self.inner = torch.compile(Net(), backend=backend)
            self.head = nn.Linear(4, 3)

        def forward(self, x):
            return self.head(self.inner(x))

    backend = CountingBackend()
    net = Outer(backend)
    inner = net.inner._orig_mod
    eager = clone_module(net)
    dp = torchdp.DataParallel(net, devices=cpu_devices(2))
    calls = backend.calls
    assert_steps_match_eager(dp, net, eager, [torch.randn(6, 8) for _ in range(3)])
    assert backend.calls - calls >= 2 * 3  # both replicas' compiled inner modules, every step
    replicas = torchdp.replicate(net, cpu_devices(2))
    assert all(r.inner._orig_mod is not inner for r in replicas)
    assert net.inner._orig_mod is inner and list(inner._modules) == ["a", "b"]


def test_unreplicatable_compile_wrapper_is_refused_without_touching_the_original():
    from torch._dynamo.eval_frame import OptimizedModule

    class OwnReplicate(OptimizedModule):  # a wrapper that changes _replicate_for_data_parallel
        def _replicate_for_data_parallel(self):
            return super()._replicate_for_data_parallel()

    net = Net()
    wrapper = torch.compile(net, backend=CountingBackend())
    wrapper.__class__ = OwnReplicate
    before = dict(net.__dict__)
    with pytest.raises(
        RuntimeError,
        match=r"cannot replicate the torch\.compile wrapper "
        r".*OwnReplicate: .*wrapper\._orig_mod",
    ):
        torchdp.replicate(wrapper, cpu_devices(2))
    assert net.__dict__.keys() == before.keys()
    assert all(net.__dict__[k] is v for k, v in before.items())


@pytest.mark.parametrize("style", ["wrapper", "in_place"])
def test_replicas_on_threads_compile_a_new_signature_once(style):
    # Replicas meeting a new input shape together on worker threads would each compile it (and
    # use up dynamo's recompile limit with copies of one graph); the first call of a signature runs
    # them in order, later ones on the threads.
    torch.manual_seed(0)
    backend = CountingBackend()
    dp = torchdp.DataParallel(compiled(style, Net(), backend), devices=cpu_devices(4))
    per_step = []
    for batch in (32, 32, 20, 20, 32):
        before = (backend.compiles, backend.calls)
        dp(torch.randn(batch, 8)).sum().backward()
        per_step.append((backend.compiles - before[0], backend.calls - before[1]))
    # One compile for each new shape (32, then 5 per replica); every replica runs compiled.
    assert per_step == [(1, 4), (0, 4), (1, 4), (0, 4), (0, 4)], per_step


def test_functional_data_parallel_compiles_a_new_signature_once():
    torch.manual_seed(0)
    backend = CountingBackend()
    net = compiled("wrapper", Net(), backend)
    for _ in range(2):
        torchdp.data_parallel(net, torch.randn(32, 8), devices=cpu_devices(4)).sum().backward()
    assert (backend.compiles, backend.calls) == (1, 8)
