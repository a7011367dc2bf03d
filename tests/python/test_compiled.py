"""Replicating compiled modules (csrc/python/replicate_build.cpp, Note [Replicating compiled modules]):
``torch.compile(module)`` wrappers and modules compiled in place with ``module.compile()``.

A counting dynamo backend (no code generation) shows that every replica runs its own compiled call
and that nothing is recompiled per step."""

from __future__ import annotations

import contextlib
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


def compiled_dp(style: str, net: nn.Module, devices: list, **options) -> nn.Module:
    """``net`` in a DataParallel compiled as a whole: ``torch.compile(dp)`` or ``dp.compile()``."""
    dp = torchdp.DataParallel(net, devices=devices)
    if style == "torch_compile":
        return torch.compile(dp, **options)
    dp.compile(**options)
    return dp


@contextlib.contextmanager
def no_warnings():
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        yield
    assert [str(w.message) for w in seen] == []


@pytest.mark.parametrize("style", ["torch_compile", "in_place"])
def test_compiling_the_wrapper_compiles_the_replicas_once(style):
    # Note [Compiling the wrapper]: torchdp's step runs eagerly, every replica's forward runs
    # compiled, one graph for the device (both replicas are on the CPU), reused by every step.
    torch.manual_seed(0)
    net = Net()
    eager = clone_module(net)
    backend = CountingBackend()
    dp = compiled_dp(style, net, cpu_devices(2), backend=backend)
    per_step = []
    with no_warnings():
        for _ in range(4):
            before = (backend.compiles, backend.calls)
            assert_steps_match_eager(dp, net, eager, [torch.randn(6, 8)])
            per_step.append((backend.compiles - before[0], backend.calls - before[1]))
    assert per_step == [(1, 2), (0, 2), (0, 2), (0, 2)], per_step


def test_explain_of_the_compiled_wrapper_finds_one_graph_and_no_break():
    dp = torchdp.DataParallel(Net(), devices=cpu_devices(2))
    with no_warnings():
        explained = torch_dynamo.explain(dp)(torch.randn(6, 8))
    assert explained.graph_count == 1
    assert explained.graph_break_count == 0 and explained.break_reasons == []
    assert explained.op_count >= 3  # the replica's linear, relu, linear and scale


def test_replicas_of_torch_nn_modules_compile_too():
    # Dynamo compiles no frame of torch.nn's own modules called directly; the replicas run in a
    # frame of torchdp's (one per module class) that it compiles whole.
    net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    with no_warnings():
        explained = torch_dynamo.explain(torchdp.DataParallel(net, devices=cpu_devices(2)))(
            torch.randn(6, 8)
        )
    assert (explained.graph_count, explained.graph_break_count, explained.op_count) == (1, 0, 3)


def test_fullgraph_compiles_the_replicas_and_names_a_replica_that_breaks():
    torch.manual_seed(0)
    net = Net()
    eager = clone_module(net)
    dp = compiled_dp("torch_compile", net, cpu_devices(2), backend="eager", fullgraph=True)
    assert_steps_match_eager(dp, net, eager, [torch.randn(6, 8) for _ in range(2)])

    class Breaks(Net):
        def forward(self, x):
            torch_dynamo.graph_break()
            return super().forward(x)

    dp = compiled_dp("torch_compile", Breaks(), cpu_devices(2), backend="eager", fullgraph=True)
    with pytest.raises(
        torch_dynamo.exc.Unsupported, match=r"(?s)in replica 0 on device cpu.*graph_break"
    ):
        dp(torch.randn(6, 8))


def test_one_device_under_the_compiled_wrapper_calls_the_module_compiled():
    backend = CountingBackend()
    one = compiled_dp("torch_compile", Net(), cpu_devices(1), backend=backend)
    one(torch.randn(4, 8))
    assert (backend.compiles, backend.calls) == (1, 1)


def test_a_compiled_model_holding_the_wrapper_breaks_once_before_it():
    # The wrapper inside a model compiled as a whole: dynamo stops at the wrapper with a reason
    # (no warning), and the replicas still run compiled.
    class Outer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.dp = torchdp.DataParallel(Net(), devices=cpu_devices(2))

        def forward(self, x):
            return self.dp(x * 2.0) + 1.0

    torch.manual_seed(0)
    outer = Outer()
    x = torch.randn(6, 8)
    with no_warnings():
        explained = torch_dynamo.explain(outer)(x)
    reasons = [str(r.reason) for r in explained.break_reasons]
    assert len(reasons) == 1 and "DataParallel.__call__" in reasons[0], reasons
    backend = CountingBackend()
    with no_warnings():
        out = torch.compile(outer, backend=backend)(x)
    torch.testing.assert_close(out, outer.dp.module(x * 2.0) + 1.0)
    assert backend.calls >= 2 + 2  # the graph before the wrapper and the two replicas (and after)


def test_the_wrapper_runs_eagerly_and_unchanged_outside_compile():
    from torchdp import _compile

    dp = torchdp.DataParallel(Net(), devices=cpu_devices(2))
    dp(torch.randn(4, 8))
    assert _compile.callback() is None


@pytest.mark.needs_cuda
def test_inductor_compiled_wrapper_on_two_replicas_of_one_gpu():
    torch.manual_seed(0)
    dev = torch.device("cuda", 0)
    net = Net().to(dev)
    eager = clone_module(net)
    dp = compiled_dp("torch_compile", net, [dev, dev])
    inputs = [torch.randn(16, 8, device=dev) for _ in range(3)]
    assert_steps_match_eager(dp, net, eager, inputs, rtol=1e-4, atol=1e-5)


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


@pytest.mark.parametrize("style", ["wrapper", "in_place", "whole"])
def test_replicas_on_threads_compile_a_new_signature_once(style):
    # Replicas meeting a new input shape together on worker threads would each compile it (and
    # use up dynamo's recompile limit with copies of one graph); the first call of a signature runs
    # them in order, later ones on the threads.
    torch.manual_seed(0)
    backend = CountingBackend()
    if style == "whole":  # torch.compile of the DataParallel (Note [Compiling the wrapper])
        dp = compiled_dp("torch_compile", Net(), cpu_devices(4), backend=backend)
    else:
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
