"""torchdp.DataParallel / torchdp.data_parallel: constructor, attributes, forward pipeline,
error paths, overridable methods (CPU-only machine; CUDA is simulated where only the Python
logic before any device work is tested)."""

from __future__ import annotations

import gc
import importlib
import types
import warnings

import pytest
import torch
from dp_testing import cpu_devices
from torch import nn

import torchdp

CPU = torch.device("cpu")
META = torch.device("meta")
dp_module = importlib.import_module("torchdp.data_parallel")

no_accelerator = pytest.mark.skipif(
    torch.cuda.is_available(), reason="checks the behaviour without an accelerator"
)

DEVICE_MESSAGE = (
    "module must have its parameters and buffers on device {} (device_ids[0]) but "
    "found one of them on device: {}"
)


@pytest.fixture
def simulated_cuda(monkeypatch):
    """Makes the constructor believe two CUDA devices exist (no CUDA work is done)."""
    monkeypatch.setattr(dp_module, "_get_available_device_type", lambda: "cuda")
    monkeypatch.setattr(dp_module, "_get_all_device_indices", lambda: [0, 1])
    monkeypatch.setattr(dp_module, "_check_balance", lambda ids: None)
    monkeypatch.setattr(dp_module, "_check_device_ids", lambda ids, output, api: None)


def _net():
    return nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2))


# ---------------------------------------------------------------------------------------------
# Constructor
# ---------------------------------------------------------------------------------------------


@no_accelerator
def test_passthrough_without_accelerator():
    net = _net()
    # The explicit device_ids are dropped, as by torch.nn.DataParallel, with a one-time warning.
    torchdp.data_parallel._warned_ignored_device_ids = False
    with pytest.warns(UserWarning, match=r"device_ids=\[0, 1\] are ignored[\s\S]*devices="):
        dp = torchdp.DataParallel(net, device_ids=[0, 1], output_device="cpu")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once only
        torchdp.DataParallel(net, device_ids=[0])
        torchdp.DataParallel(net)  # no device_ids given: nothing was dropped
    assert dp.module is net and dp.device_ids == []
    for attribute in ("dim", "output_device", "src_device_obj"):
        with pytest.raises(AttributeError):
            getattr(dp, attribute)
    x = torch.randn(5, 4)
    torch.testing.assert_close(dp(x), net(x))
    assert isinstance(dp, torch.nn.DataParallel)


def test_is_a_torch_data_parallel_and_a_module():
    dp = torchdp.DataParallel(_net(), devices=cpu_devices(2))
    assert isinstance(dp, torch.nn.DataParallel) and isinstance(dp, nn.Module)


def test_cuda_constructor_attributes(simulated_cuda):
    net = _net()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a CPU model: no warning, no error at construction
        dp = torchdp.DataParallel(net)
    assert dp.device_ids == [0, 1] and dp.output_device == 0 and dp.dim == 0
    assert dp.src_device_obj == torch.device("cuda", 0)
    assert net[0].weight.device == CPU  # several devices: never moved
    dp = torchdp.DataParallel(net, device_ids=[torch.device("cuda:1"), 0], output_device=-1, dim=1)
    assert dp.device_ids == [1, 0] and dp.output_device == -1 and dp.dim == 1
    assert dp.src_device_obj == torch.device("cuda", 1)


@pytest.mark.parametrize("output_device", ["cpu", CPU])
def test_cpu_output_device_is_rejected_like_pytorch(simulated_cuda, output_device):
    with pytest.raises(ValueError, match="Expected a non cpu device, but got: cpu"):
        torchdp.DataParallel(_net(), device_ids=[0, 1], output_device=output_device)


def test_no_devices_found(simulated_cuda, monkeypatch):
    monkeypatch.setattr(dp_module, "_get_all_device_indices", lambda: None)
    with pytest.raises(RuntimeError, match="no available devices were found"):
        torchdp.DataParallel(_net())


def test_cpu_model_fails_at_first_forward_with_the_name_and_the_fix(simulated_cuda):
    dp = torchdp.DataParallel(_net(), device_ids=[0, 1])
    with pytest.raises(RuntimeError) as info:
        dp(torch.randn(4, 4))
    message = str(info.value)
    assert message.startswith(DEVICE_MESSAGE.format("cuda:0", "cpu"))
    assert "parameter '0.weight'" in message
    assert "model.to('cuda:0')" in message and "place_module=True" in message


def test_check_balance_warns_once(monkeypatch):
    props = [
        types.SimpleNamespace(total_memory=100, multi_processor_count=10),
        types.SimpleNamespace(total_memory=50, multi_processor_count=5),
    ]
    monkeypatch.setattr(torchdp._devices, "_get_devices_properties", lambda ids: props)
    with pytest.warns(
        UserWarning,
        match=r"There is an imbalance between your GPUs. You may want "
        r"to exclude GPU 1 which\n    has less than 75% of the "
        r"memory or cores of GPU 0",
    ) as record:
        dp_module._check_balance([0, 1])
    assert len(record) == 1
    props[1] = types.SimpleNamespace(total_memory=100, multi_processor_count=5)
    with pytest.warns(UserWarning, match="exclude GPU 1"):
        dp_module._check_balance([0, 1])
    props[1] = types.SimpleNamespace(total_memory=90, multi_processor_count=9)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        dp_module._check_balance([0, 1])


def test_devices_keyword_attributes():
    net = _net()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        dp = torchdp.DataParallel(net, devices=[CPU, "cpu:0", torch.device("cpu")])
    assert dp.device_ids == cpu_devices(3)
    assert dp.src_device_obj == CPU and dp.output_device == CPU and dp.dim == 0
    dp = torchdp.DataParallel(net, devices=[META, META], output_device="cpu")
    assert dp.output_device == CPU and dp.src_device_obj == META
    assert net[0].weight.device == CPU  # not moved with several devices
    dp = torchdp.DataParallel(net, devices=[META, META], output_device=-1)
    assert dp.output_device == CPU


def test_devices_keyword_single_device_moves_the_module():
    net = _net()
    torchdp.DataParallel(net, devices=[META])
    assert net[0].weight.device.type == "meta"


def test_devices_keyword_errors():
    with pytest.raises(
        ValueError, match="torchdp.DataParallel: pass either device_ids= or devices=, not both"
    ):
        torchdp.DataParallel(_net(), device_ids=[0], devices=[CPU])
    with pytest.raises(
        ValueError,
        match="torchdp.DataParallel: devices= must name at least one device, got an empty list",
    ):
        torchdp.DataParallel(_net(), devices=[])
    with pytest.raises(TypeError, match="torchdp.DataParallel: expected a list of devices"):
        torchdp.DataParallel(_net(), devices=CPU)
    with pytest.raises(RuntimeError, match="torchdp.DataParallel: 'gpu7' is not a device"):
        torchdp.DataParallel(_net(), devices=["gpu7"])


def test_device_ids_checked_at_construction():
    """CUDA ids the process cannot use fail when the wrapper is built (the output device too, which
    PyTorch takes and fails on at the first forward's gather), named with the argument."""
    check = dp_module._check_device_ids
    with pytest.raises(
        ValueError, match=r"torchdp.DataParallel: device_ids must hold CUDA device "
    ):
        check([0, -2], 0, "torchdp.DataParallel")
    with pytest.raises(
        ValueError, match=r"output_device must hold .* \(or -1 for the CPU\), got -3"
    ):
        check([0], -3, "torchdp.DataParallel")
    if not torch.cuda.is_available():
        with pytest.raises(
            RuntimeError, match=r"torchdp.DataParallel \(device_ids\): device cuda:0"
        ):
            check([0], -1, "torchdp.DataParallel")
        return
    count = torch.cuda.device_count()
    check([0], -1, "torchdp.DataParallel")  # -1: gather onto the CPU
    for ids, output, name in (([0, count], 0, "device_ids"), ([0], count, "output_device")):
        message = rf"torchdp.DataParallel \({name}\): device cuda:{count} does not exist"
        with pytest.raises(RuntimeError, match=message):
            torchdp.DataParallel(_net().cuda(), device_ids=ids, output_device=output)
        with pytest.raises(RuntimeError, match=message.replace("DataParallel", "data_parallel")):
            torchdp.data_parallel(
                _net().cuda(), torch.randn(4, 4, device="cuda"), ids, output_device=output
            )


def test_constructor_checks_module_and_dim():
    for bad in (None, lambda x: x, 3):
        with pytest.raises(TypeError, match="torchdp.DataParallel: expected a torch.nn.Module"):
            torchdp.DataParallel(bad, devices=cpu_devices(2))
        with pytest.raises(TypeError, match="torchdp.data_parallel: expected a torch.nn.Module"):
            torchdp.data_parallel(bad, torch.randn(4, 4), devices=cpu_devices(2))
    for bad in ("a", None, 0.0):
        with pytest.raises(TypeError, match="torchdp.DataParallel: dim must be an int"):
            torchdp.DataParallel(_net(), devices=cpu_devices(2), dim=bad)
        with pytest.raises(TypeError, match="torchdp.data_parallel: dim must be an int"):
            torchdp.data_parallel(_net(), torch.randn(4, 4), dim=bad, devices=cpu_devices(2))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error without CUDA")
def test_cuda_devices_without_cuda_fail_at_construction():
    with pytest.raises(RuntimeError, match="torchdp.DataParallel: device cuda:0 was requested"):
        torchdp.DataParallel(_net(), devices=[0, 1])
    with pytest.raises(
        RuntimeError, match=r"torchdp.DataParallel \(output_device\): device cuda:0 was requested"
    ):
        torchdp.DataParallel(_net(), devices=cpu_devices(2), output_device=0)
    with pytest.raises(
        RuntimeError, match=r"torchdp.data_parallel \(output_device\): device cuda:0"
    ):
        torchdp.data_parallel(_net(), torch.randn(4, 4), devices=cpu_devices(2), output_device=0)


def test_huge_bucket_sizes_mean_one_bucket_after_the_first():
    net = _net()
    dp = torchdp.DataParallel(net, devices=cpu_devices(2), bucket_cap_mb=1e13)
    dp(torch.randn(4, 4)).sum().backward()
    assert all(p.grad is not None for p in net.parameters())


# ---------------------------------------------------------------------------------------------
# Forward
# ---------------------------------------------------------------------------------------------


def test_cpu_model_on_meta_devices_fails_at_first_forward():
    dp = torchdp.DataParallel(_net(), devices=[META, META])
    with pytest.raises(RuntimeError) as info:
        dp(torch.randn(4, 4))
    message = str(info.value)
    assert message.startswith(DEVICE_MESSAGE.format("meta", "cpu"))
    assert "(parameter '0.weight')" in message
    assert "model.to('meta')" in message and "place_module=True" in message


def test_misplaced_buffer_is_named():
    net = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2))
    net[1]._buffers["running_var"] = net[1].running_var.to("meta")
    dp = torchdp.DataParallel(net, devices=cpu_devices(2))
    with pytest.raises(RuntimeError, match=r"on device: meta \(buffer '1.running_var'\)"):
        dp(torch.randn(4, 2))


def test_failed_forward_leaves_the_module_alone():
    net = _net()
    before = {k: v.clone() for k, v in net.state_dict().items()}
    dp = torchdp.DataParallel(net, devices=[META, META])
    with pytest.raises(RuntimeError):
        dp(torch.randn(4, 4))
    for k, v in net.state_dict().items():
        assert v.device == CPU and torch.equal(v, before[k])


def test_place_module_moves_at_first_forward():
    net = _net()
    dp = torchdp.DataParallel(net, devices=[META, META], place_module=True)
    assert net[0].weight.device == CPU  # construction does not move
    out = dp(torch.randn(5, 4))
    assert net[0].weight.device.type == "meta"
    assert out.device.type == "meta" and out.shape == (5, 2)


def test_forward_equals_module_and_output_device():
    net = _net()
    dp = torchdp.DataParallel(net, devices=cpu_devices(2))
    x = torch.randn(7, 4)
    torch.testing.assert_close(dp(x), net(x))
    # A meta output holds no data: the gradients could not come back to the CPU replicas.
    with pytest.raises(ValueError, match="output_device meta holds no data"):
        torchdp.DataParallel(net, devices=cpu_devices(2), output_device=META)
    dp = torchdp.DataParallel(net, devices=[META, META], output_device=META)
    assert dp.output_device == META


class _Counter(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(2, 2)
        self.calls: list = []  # shared by the replicas

    def forward(self, *args, **kwargs):
        self.calls.append((self, args, kwargs))
        return self.lin.weight.sum().reshape(1) if not args else self.lin(args[0])


def test_no_inputs_runs_once_on_the_first_device():
    net = _Counter()
    dp = torchdp.DataParallel(net, devices=cpu_devices(3))
    out = dp()
    assert len(net.calls) == 1 and net.calls[0][1] == () and net.calls[0][2] == {}
    assert net.calls[0][0] is not net  # a replica, then gathered
    torch.testing.assert_close(out, net.lin.weight.sum().reshape(1))


def test_fewer_chunks_than_devices_run_fewer_replicas():
    net = _Counter()
    dp = torchdp.DataParallel(net, devices=cpu_devices(4))
    out = dp(torch.randn(2, 2))
    assert len(net.calls) == 2 and out.shape == (2, 2)
    net.calls.clear()
    dp(torch.randn(5, 2))  # chunks of 2, 2, 1
    assert len(net.calls) == 3


def test_kwargs_only_call():
    net = _Counter()
    dp = torchdp.DataParallel(net, devices=cpu_devices(2))

    class KwOnly(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(2, 2)

        def forward(self, *, x, scale):
            return self.lin(x) * scale

    kw = KwOnly()
    dp = torchdp.DataParallel(kw, devices=cpu_devices(2))
    x = torch.randn(4, 2)
    torch.testing.assert_close(dp(x=x, scale=3.0), kw(x=x, scale=3.0))


def test_single_device_shortcut_calls_the_module_and_ignores_output_device():
    net = _Counter()
    dp = torchdp.DataParallel(net, devices=[CPU], output_device=META)
    hook_calls = []
    with torchdp.register_post_replicate_hook(_Counter, lambda *a: hook_calls.append(a)):
        out = dp(torch.randn(3, 2))
    assert net.calls[0][0] is net  # no replica
    assert hook_calls == []
    assert out.device == CPU  # not gathered to output_device


def test_scalar_outputs_become_a_vector():
    net = _Counter()
    dp = torchdp.DataParallel(net, devices=cpu_devices(2))

    class Scalar(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.ones(()))

        def forward(self, x):
            return (x * self.w).sum()

    dp = torchdp.DataParallel(Scalar(), devices=cpu_devices(2))
    with pytest.warns(UserWarning, match="will instead unsqueeze and return a vector"):
        out = dp(torch.ones(4, 1))
    torch.testing.assert_close(out, torch.tensor([2.0, 2.0]))


def test_state_dict_train_eval_and_to():
    net = _net()
    dp = torchdp.DataParallel(net, devices=cpu_devices(2))
    assert list(dp.state_dict()) == ["module." + k for k in net.state_dict()]
    other = torchdp.DataParallel(_net(), devices=cpu_devices(2))
    other.load_state_dict(dp.state_dict())
    torch.testing.assert_close(other.module[0].weight, net[0].weight)
    dp.eval()
    assert not net.training
    dp.train()
    assert net.training
    dp.to(torch.float64)
    assert net[0].weight.dtype == torch.float64
    assert list(dp.parameters()) == list(net.parameters())


def test_record_function_range():
    dp = torchdp.DataParallel(_net(), devices=cpu_devices(2))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        dp(torch.randn(4, 4))
    assert any(e.name == "DataParallel.forward" for e in prof.events())


def test_no_reference_cycles_after_forward():
    dp = torchdp.DataParallel(_net(), devices=cpu_devices(2))
    x = torch.randn(4, 4)
    dp(x)  # warm up (caches)
    # Collect until nothing is left: finalizers run by one collection can free further cycles
    # (earlier tests' objects, e.g. torch.compile's caches), which only the next one finds.
    while gc.collect():
        pass
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        dp(x).sum().backward()
        assert gc.collect() == 0
    finally:
        if was_enabled:
            gc.enable()


def test_overridable_methods():
    calls = []

    class Ungathered(torchdp.DataParallel):
        def replicate(self, module, device_ids):
            calls.append(("replicate", list(device_ids)))
            return super().replicate(module, device_ids)

        def scatter(self, inputs, kwargs, device_ids):
            calls.append(("scatter", len(device_ids)))
            return super().scatter(inputs, kwargs, device_ids)

        def parallel_apply(self, replicas, inputs, kwargs):
            calls.append(("parallel_apply", len(replicas)))
            return super().parallel_apply(replicas, inputs, kwargs)

        def gather(self, outputs, output_device):
            calls.append(("gather", output_device))
            return outputs  # DataParallelModel-style: per-device outputs

    dp = Ungathered(_net(), devices=cpu_devices(3))
    outs = dp(torch.randn(4, 4))  # chunks of 2 and 2
    assert isinstance(outs, list) and [o.shape[0] for o in outs] == [2, 2]
    assert calls == [
        ("scatter", 3),
        ("replicate", cpu_devices(2)),
        ("parallel_apply", 2),
        ("gather", CPU),
    ]


def test_replicate_is_detached_under_no_grad():
    seen = []

    class Spy(torchdp.DataParallel):
        def replicate(self, module, device_ids):
            replicas = super().replicate(module, device_ids)
            seen.append(replicas[1][0].weight.grad_fn is None)
            return replicas

    dp = Spy(_net(), devices=cpu_devices(2))
    dp(torch.randn(4, 4))
    with torch.no_grad():
        dp(torch.randn(4, 4))
    assert seen == [False, True]


# ---------------------------------------------------------------------------------------------
# Functional data_parallel
# ---------------------------------------------------------------------------------------------


@no_accelerator
def test_functional_without_accelerator_raises():
    with pytest.raises(RuntimeError, match="device type could not be determined"):
        torchdp.data_parallel(_net(), torch.randn(2, 4))


def test_functional_with_devices():
    net = _net()
    x = torch.randn(5, 4)
    torch.testing.assert_close(torchdp.data_parallel(net, x, devices=cpu_devices(2)), net(x))
    torch.testing.assert_close(
        torchdp.data_parallel(net, (x,), devices=cpu_devices(3), output_device="cpu"), net(x)
    )
    with pytest.raises(ValueError, match=r"torchdp\.data_parallel: output_device meta"):
        torchdp.data_parallel(net, x, devices=cpu_devices(2), output_device=META)


def test_functional_none_inputs_and_kwargs():
    net = _Counter()
    out = torchdp.data_parallel(net, None, devices=cpu_devices(2))
    assert len(net.calls) == 1 and out.shape == (1,)

    class Kw(nn.Module):
        def forward(self, x, scale=1.0):
            return x * scale

    x = torch.randn(4, 2)
    torch.testing.assert_close(
        torchdp.data_parallel(Kw(), x, devices=cpu_devices(2), module_kwargs={"scale": 2.0}), x * 2
    )


def test_functional_never_detaches(monkeypatch):
    # Like PyTorch: the functional form calls replicate(module, devices) without detach.
    calls = []
    real = dp_module.replicate

    def spy(network, devices, detach=False):
        calls.append(detach)
        return real(network, devices, detach)

    real_kept = dp_module._replicate

    def spy_kept(network, devices, detach, *args):
        calls.append(("kept", detach))
        return real_kept(network, devices, detach, *args)

    monkeypatch.setattr(dp_module, "replicate", spy)
    monkeypatch.setattr(dp_module, "_replicate", spy_kept)
    with torch.no_grad():
        torchdp.data_parallel(nn.Linear(2, 1), torch.randn(4, 2), devices=cpu_devices(2))
        torchdp.data_parallel(
            nn.Linear(2, 1), torch.randn(4, 2), devices=cpu_devices(2), cache_replicas=False
        )
        torchdp.DataParallel(nn.Linear(2, 1), devices=cpu_devices(2), cache_replicas=False)(
            torch.randn(4, 2)
        )
        torchdp.DataParallel(nn.Linear(2, 1), devices=cpu_devices(2))(torch.randn(4, 2))
    assert calls == [("kept", False), False, True, ("kept", True)]


def test_functional_device_check():
    with pytest.raises(RuntimeError) as info:
        torchdp.data_parallel(_net(), torch.randn(2, 4), devices=[META, META])
    assert str(info.value).startswith(DEVICE_MESSAGE.format("meta", "cpu"))
    assert "module.to('meta')" in str(info.value)


def test_functional_single_device_calls_module():
    net = _Counter()
    torchdp.data_parallel(net, torch.randn(3, 2), devices=[CPU])
    assert net.calls[0][0] is net


def test_functional_errors():
    with pytest.raises(
        ValueError, match="torchdp.data_parallel: pass either device_ids= or devices=, not both"
    ):
        torchdp.data_parallel(_net(), torch.randn(2, 4), device_ids=[0], devices=[CPU])
    with pytest.raises(
        ValueError, match="torchdp.data_parallel: devices= must name at least one device"
    ):
        torchdp.data_parallel(_net(), torch.randn(2, 4), devices=[])


def test_device_check_sees_every_parameter_and_buffer():
    # torchdp._C.misplaced_tensor is the per-forward check: nested, shared and scripted modules.
    inner = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2))
    net = nn.Sequential(inner, nn.ReLU(), inner, None)
    assert torchdp._C.misplaced_tensor(net, CPU) is None
    assert torchdp._C.misplaced_tensor(net, META) == ("parameter", "0.0.weight", CPU)
    inner[1]._buffers["num_batches_tracked"] = inner[1].num_batches_tracked.to("meta")
    found = torchdp._C.misplaced_tensor(net, CPU)
    assert found == ("buffer", "0.1.num_batches_tracked", META)
    scripted = nn.Sequential(nn.Linear(2, 2), torch.jit.script(nn.Linear(2, 2)))
    assert torchdp._C.misplaced_tensor(scripted, CPU) is None
    scripted[1].to("meta")
    assert torchdp._C.misplaced_tensor(scripted, CPU) == ("parameter", "1.weight", META)


def test_wrappers_pickled_before_the_new_options_still_run():
    import pickle

    dp = torchdp.DataParallel(_net(), devices=cpu_devices(2))
    del dp.__dict__["gather_output"], dp.__dict__["serial_forward"]  # as an older torchdp wrote it
    restored = pickle.loads(pickle.dumps(dp))
    assert restored.gather_output and not restored.serial_forward
    x = torch.randn(4, 4)
    torch.testing.assert_close(restored(x), restored.module(x))


class WithMask(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 3)

    def forward(self, x, mask=None):
        return self.fc(x) if mask is None else self.fc(x) * mask


def test_a_keyword_tensor_with_a_smaller_batch_names_the_cause():
    # PyTorch's scatter_kwargs leaves fewer keyword chunks than replicas here and its
    # parallel_apply asserts; torchdp raises the same AssertionError with the cause and the fix.
    dp = torchdp.DataParallel(WithMask(), devices=cpu_devices(2))
    with pytest.raises(AssertionError, match=r"kwargs_tup 1: the keyword arguments split into 1"):
        dp(torch.randn(4, 3), mask=torch.ones(1, 3))
    assert dp(torch.randn(4, 3), mask=torch.ones(4, 3)).shape == (4, 3)


def test_keyword_chunk_mismatch_in_the_functional_form_names_the_cause():
    with pytest.raises(AssertionError, match=r"kwargs_tup 1: the keyword arguments split into 1"):
        torchdp.data_parallel(
            WithMask(),
            torch.randn(4, 3),
            module_kwargs={"mask": torch.ones(1, 3)},
            devices=cpu_devices(2),
        )


def test_an_overridden_scatter_may_return_no_keyword_arguments():
    """nn.DataParallel hands the scatter's keyword side to parallel_apply, where None means none."""

    class CustomSplit(torchdp.DataParallel):
        def scatter(self, inputs, kwargs, device_ids):
            x = inputs[0]
            return [(x[:3],), (x[3:],)], None

    net = nn.Linear(4, 2)
    x = torch.randn(4, 4)
    torch.testing.assert_close(CustomSplit(net, devices=cpu_devices(2))(x), net(x))


def test_in_place_ops_on_inputs_that_require_grad():
    """A replica's forward that changes its input chunk in place (an in-place normalisation,
    nn.ReLU(inplace=True) first) neither writes into the caller's leaf tensor nor breaks backward;
    gradients equal the plain module's on an out-of-place copy of the batch."""

    class SubInPlace(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 3)

        def forward(self, x):
            x.sub_(1.0)
            return self.lin(x)

    torch.manual_seed(0)
    net = SubInPlace()
    x = torch.randn(6, 4, requires_grad=True)
    before = x.detach().clone()
    torchdp.DataParallel(net, devices=cpu_devices(2))(x).pow(2).sum().backward()
    assert torch.equal(x.detach(), before)
    reference = before.clone().requires_grad_()
    net.zero_grad()
    net(reference.clone()).pow(2).sum().backward()
    torch.testing.assert_close(x.grad, reference.grad)

    net = nn.Sequential(nn.ReLU(inplace=True), nn.Linear(4, 3))
    for n in (2, 3):
        a = torch.randn(6, 4, requires_grad=True)
        dp_out = torchdp.DataParallel(net, devices=cpu_devices(n))(a * 2)
        dp_out.pow(2).sum().backward()
        dp_grad, a.grad = a.grad, None
        net(a * 2).pow(2).sum().backward()
        torch.testing.assert_close(dp_grad, a.grad)


class CountsAndFails(nn.Module):
    """BatchNorm (running statistics updated in place on replica 0, which shares the original's
    tensors), an in-place counter, and a failure on demand in the replica whose chunk asks for it
    (a marker value in its first element)."""

    def __init__(self):
        super().__init__()
        self.bn = nn.BatchNorm1d(3)
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))

    def forward(self, x):
        self.calls += 1
        out = self.bn(x)
        if x[0, 0] == 99:
            raise RuntimeError("replica failure on demand")
        return out


def _buffers_of(module):
    return {k: v.clone() for k, v in module.state_dict().items()}


def _assert_buffers_equal(module, expected):
    for k, v in module.state_dict().items():
        assert torch.equal(v, expected[k]), k


FAILED_FORWARD_DEVICES = [
    pytest.param("cpu,cpu", id="cpu"),
    pytest.param("cuda:0,cuda:0", id="cuda0-twice", marks=pytest.mark.needs_cuda),
    pytest.param("cuda:0,cuda:1", id="two-gpus", marks=pytest.mark.needs_multi_gpu),
]


@pytest.mark.parametrize("devices", FAILED_FORWARD_DEVICES)
@pytest.mark.parametrize("form", ["module", "function"])
def test_a_failed_forward_leaves_the_buffers_as_they_were(form, devices):
    """Note [Buffers of failed forwards]: replica 0's in-place buffer updates are written back when
    another replica, the gather or a hook fails; a forward that succeeds keeps them."""
    devices = [torch.device(d) for d in devices.split(",")]
    net = CountsAndFails().to(devices[0])
    dp = torchdp.DataParallel(net, devices=devices)

    def run(x):
        x = x.to(devices[0])
        if form == "module":
            return dp(x)
        return torchdp.data_parallel(net, x, devices=devices)

    run(torch.randn(4, 3))  # a step that succeeds: updated
    assert net.calls.item() == 1 and net.bn.num_batches_tracked.item() == 1
    before = _buffers_of(net)
    failing = torch.randn(4, 3)
    failing[2, 0] = 99  # replica 1's chunk
    with pytest.raises(RuntimeError, match="replica failure on demand"):
        run(failing)
    _assert_buffers_equal(net, before)
    with pytest.raises(ValueError, match="Expected more than 1 value per channel"):
        run(torch.randn(3, 3))  # replica 1 gets one row: BatchNorm refuses it
    _assert_buffers_equal(net, before)

    # A failure after the forwards: the gather of outputs that cannot be concatenated.
    class Ragged(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = net

        def forward(self, x):
            out = self.inner(x)
            return out if x.shape[0] == 2 else out[:, :2]

    ragged = Ragged()
    x = torch.randn(5, 3, device=devices[0])
    with pytest.raises(RuntimeError, match="gather"):
        if form == "module":
            torchdp.DataParallel(ragged, devices=devices)(x)
        else:
            torchdp.data_parallel(ragged, x, devices=devices)
    _assert_buffers_equal(net, before)

    # A post-replicate hook that changes replica 0's buffer in place, then fails.
    def bad_hook(replica, original, device, index, ctx):
        replica.calls.add_(100)
        if index == 1:
            raise RuntimeError("hook failure")

    hook = torchdp.register_post_replicate_hook(CountsAndFails, bad_hook)
    with hook, pytest.raises(RuntimeError, match="hook failure"):
        run(torch.randn(4, 3))
    _assert_buffers_equal(net, before)
    run(torch.randn(4, 3))
    assert net.calls.item() == 2 and net.bn.num_batches_tracked.item() == 2


def test_buffer_snapshot():
    a, b = torch.zeros(3), torch.arange(4).reshape(2, 2)
    module = nn.Module()
    module.register_buffer("a", a)
    module.register_buffer("b", b)
    module.register_buffer("same", a)  # one tensor registered twice: copied once
    module.register_buffer("meta", torch.empty(2, device="meta"))  # no data: skipped
    module.register_buffer("expanded", torch.arange(3).expand(2, 3))  # cannot be written: skipped
    module.register_buffer("sparse", torch.eye(2).to_sparse())  # not strided: skipped
    module.register_buffer("none", None)
    snapshot = torchdp._C.snapshot_buffers(module)
    assert len(snapshot) == 2
    a.add_(1)
    b.mul_(5)
    assert snapshot.restore() == 2
    assert torch.equal(a, torch.zeros(3)) and torch.equal(b, torch.arange(4).reshape(2, 2))
    a.resize_(5).fill_(7.0)  # resized in place: the size comes back too
    b.resize_(1)
    snapshot.restore()
    assert torch.equal(a, torch.zeros(3)) and torch.equal(b, torch.arange(4).reshape(2, 2))
