"""torchdp.replicate on CPU and meta device lists: PyTorch's replica semantics, the custom
__setattr__ repair (the cplxmodule case), and the __data_parallel_replicate__ protocol."""

from __future__ import annotations

import functools
import itertools
import types
import warnings
from typing import ClassVar

import pytest
import torch
from dp_testing import SharedCore, cpu_devices, masked_linear_class
from torch import nn

import torchdp

CPU = torch.device("cpu")
META = torch.device("meta")
_names = itertools.count()


def _fresh_masked_class():
    return masked_linear_class(f"MaskedLinear{next(_names)}")


@pytest.mark.parametrize("n", [1, 2, 3])
def test_replicas_are_replicas(n):
    net = nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3))
    replicas = torchdp.replicate(net, cpu_devices(n))
    assert len(replicas) == n
    for r in replicas:
        assert type(r) is nn.Sequential and r is not net
        assert r._is_replica and r[0]._is_replica
        # Parameters of replicas are non-leaf plain attributes, as in PyTorch (#33907).
        assert list(r.parameters()) == []
        assert set(r[0]._former_parameters) == {"weight", "bias"}
        assert r[0].weight.grad_fn is not None and not r[0].weight.is_leaf
        assert r[0].weight.device == CPU
        torch.testing.assert_close(r[0].weight, net[0].weight)
        torch.testing.assert_close(r[1].running_mean, net[1].running_mean)
        assert r.training == net.training


def test_detach_gives_no_history():
    net = nn.Linear(4, 3)
    replicas = torchdp.replicate(net, cpu_devices(3), detach=True)
    for r in replicas:
        assert r.weight.grad_fn is None
    # As with PyTorch's broadcast_coalesced, replica 0 gets the original tensors as they are.
    for r in replicas[1:]:
        assert not r.weight.requires_grad


def test_replica_zero_shares_storage_with_the_original():
    net = nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3))
    r0, r1 = torchdp.replicate(net, cpu_devices(2))
    assert r0[0].weight.data_ptr() == net[0].weight.data_ptr()
    assert r0[1].running_mean.data_ptr() == net[1].running_mean.data_ptr()
    # The other replicas have storage of their own, even on the same device.
    assert r1[0].weight.data_ptr() != net[0].weight.data_ptr()
    assert r1[1].running_mean.data_ptr() != net[1].running_mean.data_ptr()


def test_gradients_of_all_replicas_sum_into_the_original():
    net = nn.Linear(3, 1, bias=False)
    replicas = torchdp.replicate(net, cpu_devices(3))
    x = torch.randn(2, 3)
    sum(r(x).sum() for r in replicas).backward()
    torch.testing.assert_close(net.weight.grad, 3 * x.sum(0, keepdim=True))


def test_shared_submodules_and_tied_parameters_stay_shared():
    net = SharedCore()
    for r in torchdp.replicate(net, cpu_devices(2)):
        assert r.a is r.b
        assert r.tied.weight is r.tied2.weight


def test_none_entries_are_kept():
    net = nn.Linear(4, 3, bias=False)
    net.register_buffer("nothing", None)
    for r in torchdp.replicate(net, cpu_devices(2)):
        assert r.bias is None and "bias" in r._parameters
        assert r.nothing is None and "nothing" in r._buffers


def test_training_flags_of_submodules_are_kept():
    net = nn.Sequential(nn.Linear(2, 2), nn.Dropout())
    net[1].eval()
    for r in torchdp.replicate(net, cpu_devices(2)):
        assert r.training and r[0].training and not r[1].training


def test_buffers_requiring_grad_are_differentiable():
    net = nn.Linear(2, 2)
    net.register_buffer("shift", torch.ones(2, requires_grad=True))
    replicas = torchdp.replicate(net, cpu_devices(2))
    assert all(r.shift.grad_fn is not None for r in replicas)
    sum((r.shift * 2).sum() for r in replicas).backward()
    torch.testing.assert_close(net.shift.grad, torch.full((2,), 4.0))
    detached = torchdp.replicate(net, cpu_devices(2), detach=True)
    assert all(r.shift.grad_fn is None for r in detached)
    assert not detached[1].shift.requires_grad


def test_empty_device_list_gives_no_replicas():
    assert torchdp.replicate(nn.Linear(2, 2), []) == []


def test_script_module_with_python_children_is_rejected():
    # Current PyTorch scripts the children of a ScriptModule and refuses Python ones; build such
    # a module by hand to exercise the rule (torch.nn.parallel.replicate's _replicatable_module).
    class HandBuiltScript(torch.jit.ScriptModule):
        pass

    odd = HandBuiltScript.__new__(HandBuiltScript)
    nn.Module.__init__(odd)
    odd._modules["child"] = nn.Linear(2, 2)
    with pytest.raises(
        RuntimeError,
        match="Cannot replicate network where python modules are children of ScriptModule",
    ):
        torchdp.replicate(nn.Sequential(odd), cpu_devices(2))


def test_script_modules_replicate():
    scripted = torch.jit.script(nn.Sequential(nn.Linear(3, 2), nn.ReLU()))
    x = torch.randn(4, 3)
    for r in torchdp.replicate(scripted, cpu_devices(2)):
        torch.testing.assert_close(r(x), scripted(x))
    # A scripted submodule inside a Python network (the dictionary walks fall back to Python).
    net = nn.Sequential(nn.Linear(3, 3), scripted)
    for r in torchdp.replicate(net, cpu_devices(2)):
        torch.testing.assert_close(r(x), net(x))


def test_replicate_on_cpu_and_meta():
    net = nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3))
    r0, r1 = torchdp.replicate(net, [CPU, META])
    assert r0[0].weight.device == CPU and r0[1].running_var.device == CPU
    assert r1[0].weight.device.type == "meta" and r1[1].running_var.device.type == "meta"
    assert net[0].weight.device == CPU


def test_lazy_modules_are_rejected_like_pytorch():
    with pytest.raises(RuntimeError, match="Modules with uninitialized parameters"):
        torchdp.replicate(nn.LazyLinear(3), cpu_devices(2))


def test_rnn_flat_weights_follow_the_replica():
    lstm = nn.LSTM(3, 2)
    r0, r1 = torchdp.replicate(lstm, [CPU, META])
    assert all(w.device.type == "meta" for w in r1._flat_weights)
    assert all(w.device == CPU for w in r0._flat_weights)
    assert r1._flat_weights is not lstm._flat_weights


# ---------------------------------------------------------------------------------------------
# The cplxmodule case: a __setattr__ that copies into the existing mask instead of rebinding it.
# ---------------------------------------------------------------------------------------------


def test_masked_layer_replicated_on_cpu_and_meta():
    cls = _fresh_masked_class()
    layer = cls(4, 3)
    mask = layer.mask
    values = mask.clone()
    version = mask._version
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        r0, r1 = torchdp.replicate(layer, [CPU, META])
    assert r1.mask.device.type == "meta"
    assert r0.mask.device == CPU
    torch.testing.assert_close(r0.mask, values)
    # The original keeps its mask object and values, and is never written.
    assert layer.mask is mask and layer._buffers["mask"] is mask
    assert torch.equal(layer.mask, values) and mask._version == version
    relevant = [
        w for w in caught if issubclass(w.category, UserWarning) and cls.__name__ in str(w.message)
    ]
    assert len(relevant) == 1, [str(w.message) for w in caught]
    assert "mask" in str(relevant[0].message)

    # Once per class: a second replicate does not warn again.
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torchdp.replicate(layer, [CPU, META])
    assert not [w for w in caught if cls.__name__ in str(w.message)]


class DetachingMask(nn.Module):
    """cplxmodule's fixed pattern: __setattr__ re-registers the mask as a detached alias on the
    weight's device, a correct override (a new object over the replica's own copy)."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(3, 4))
        self.register_buffer("mask", torch.ones(3, 4))

    def __setattr__(self, name, value):
        if name == "mask":
            self.register_buffer("mask", value.detach().to(self.weight.device, self.weight.dtype))
        else:
            super().__setattr__(name, value)

    def forward(self, x):
        return x @ (self.weight * self.mask).t()


def test_a_setattr_that_stores_an_alias_of_the_copy_is_not_repaired():
    layer = DetachingMask()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        r0, r1 = torchdp.replicate(layer, [CPU, META])
    assert not [w for w in caught if "DetachingMask" in str(w.message)], [
        str(w.message) for w in caught
    ]
    assert r1.mask.device.type == "meta" and r0.mask.device == CPU
    assert layer.mask.device == CPU


def test_masked_layer_trains_through_data_parallel_on_cpu():
    cls = _fresh_masked_class()
    layer = cls(4, 3)
    ref = cls(4, 3)
    ref.load_state_dict(layer.state_dict())
    mask = layer.mask
    version = mask._version
    dp = torchdp.DataParallel(layer, devices=cpu_devices(2))
    x = torch.randn(6, 4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = dp(x)
    torch.testing.assert_close(out, ref(x))
    out.sum().backward()
    ref(x).sum().backward()
    torch.testing.assert_close(layer.weight.grad, ref.weight.grad)
    assert layer.mask is mask and mask._version == version


# ---------------------------------------------------------------------------------------------
# __data_parallel_replicate__ (Synchronized-BatchNorm's protocol), run natively.
# ---------------------------------------------------------------------------------------------


class _SyncLike(nn.Module):
    def __init__(self, tag: str, log: list) -> None:
        super().__init__()
        self.tag = tag
        self.log = log  # shared with the replicas through the __dict__ copy
        self.lin = nn.Linear(2, 2)

    def __data_parallel_replicate__(self, ctx, copy_id):
        self.log.append((self.tag, ctx, copy_id, self))
        if copy_id == 0:
            ctx.master = self
        else:
            self.master = ctx.master

    def forward(self, x):
        return self.lin(x)


@pytest.mark.parametrize("n", [2, 3])
def test_data_parallel_replicate_callbacks(n):
    log: list = []
    first, second = _SyncLike("first", log), _SyncLike("second", log)
    net = nn.Sequential(first, nn.ReLU(), second)
    net.again = first  # a shared module is one position: called once per replica
    replicas = torchdp.replicate(net, cpu_devices(n))

    # Replica-major, master copy first; one ctx per module position, shared by its copies.
    assert [(tag, cid) for tag, _, cid, _ in log] == [
        (tag, cid) for cid in range(n) for tag in ("first", "second")
    ]
    ctx_first = {id(ctx) for tag, ctx, _, _ in log if tag == "first"}
    ctx_second = {id(ctx) for tag, ctx, _, _ in log if tag == "second"}
    assert len(ctx_first) == 1 and len(ctx_second) == 1 and ctx_first != ctx_second
    # The callbacks run on the replicas, and the slaves see the master copy.
    for tag, _, cid, module in log:
        position = 0 if tag == "first" else 2
        assert module is replicas[cid][position]
        if cid > 0:
            assert module.master is replicas[0][position]
    assert not hasattr(first, "master")


def test_replicate_callbacks_set_on_an_instance_run_too():
    """Synchronized-BatchNorm's loop asks hasattr of each module: a callback set on an instance
    counts (it is copied into every replica's __dict__)."""
    calls: list = []
    net = nn.Sequential(nn.Linear(3, 3), nn.ReLU())
    net[0].__data_parallel_replicate__ = lambda ctx, copy_id: calls.append(copy_id)
    torchdp.replicate(net, cpu_devices(2))
    assert calls == [0, 1]
    torchdp.DataParallel(net, devices=cpu_devices(3))(torch.randn(6, 3))
    assert calls == [0, 1, 0, 1, 2]


def test_data_parallel_replicate_callbacks_run_in_data_parallel_forward():
    log: list = []
    net = nn.Sequential(_SyncLike("only", log))
    dp = torchdp.DataParallel(net, devices=cpu_devices(3))
    dp(torch.randn(6, 2))
    assert [cid for _, _, cid, _ in log] == [0, 1, 2]


def test_replicate_rejects_a_single_device_that_is_not_a_list():
    with pytest.raises(TypeError, match="torchdp.replicate: expected a list of devices"):
        torchdp.replicate(nn.Linear(2, 2), CPU)


def test_replicate_rejects_a_negative_index():
    with pytest.raises(ValueError, match="torchdp.replicate: device index -1 is negative"):
        torchdp.replicate(nn.Linear(2, 2), [-1])


@pytest.mark.parametrize("bad", [3, None, lambda x: x])
def test_replicate_rejects_what_is_not_a_module(bad):
    with pytest.raises(TypeError, match="torchdp.replicate: expected a torch.nn.Module, got"):
        torchdp.replicate(bad, cpu_devices(2))


def test_a_failing_replication_callback_keeps_its_type_and_says_where():
    class Failing(nn.Linear):
        def __data_parallel_replicate__(self, ctx, copy_id):
            if copy_id == 1:
                raise KeyError("no such queue")

    net = nn.Sequential(nn.ReLU(), Failing(2, 2))
    before = {k: v.clone() for k, v in net.state_dict().items()}
    with pytest.raises(KeyError, match="no such queue") as info:
        torchdp.replicate(net, cpu_devices(2))
    if hasattr(info.value, "__notes__"):  # Python >= 3.11
        assert info.value.__notes__ == [
            (
                "torchdp.replicate: raised by the __data_parallel_replicate__ callback of module '1' "
                "(type test_a_failing_replication_callback_keeps_its_type_and_says_where.<locals>."
                "Failing) for copy_id 1"
            )
        ]
    for k, v in net.state_dict().items():
        assert torch.equal(v, before[k])


def test_replicate_rejects_non_devices():
    with pytest.raises(TypeError, match="torchdp.replicate: expected a device"):
        torchdp.replicate(nn.Linear(2, 2), [1.5])


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error without CUDA")
def test_replicate_on_cuda_without_cuda_fails_clearly():
    with pytest.raises(RuntimeError, match="torchdp"):
        torchdp.replicate(nn.Linear(2, 2), [0, 1])


def test_check_replica_devices_reports_a_misplaced_tensor():
    bn = nn.BatchNorm1d(3)
    copies = torchdp._C.replicate(bn, cpu_devices(2), False)
    copies[1][0]._buffers["running_mean"] = torch.zeros(3, device="meta")
    with pytest.raises(RuntimeError, match="running_mean"):
        torchdp._C.check_replica_devices(copies, cpu_devices(2), "torchdp.test")


# --- The dictionary fast path (Note [Two ways to build a replica] in replicate_build.cpp) -------
# While a global registration hook is installed, every module is built the PyTorch way
# (_replicate_for_data_parallel + setattr); the fast path must give the same replicas.


class _Attributes(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scale = 2.5
        self.name = "attrs"
        self.lin = nn.Linear(3, 3)
        self.register_buffer("steps", torch.zeros((), dtype=torch.long))
        self.register_buffer("cache", torch.ones(3), persistent=False)
        self.register_buffer("nothing", None)
        self.register_parameter("absent", None)
        self.extra = nn.Parameter(torch.randn(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * self.scale + self.extra + self.cache


class _Shared(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(3, 3)
        self.b = self.a  # the same module under two names
        self.c = nn.Linear(3, 3)
        self.c.weight = self.a.weight  # a parameter shared by two modules
        self.gap = None
        self.d = _Attributes()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.d(self.c(self.b(self.a(x))))


def _fingerprint(root: nn.Module) -> list:
    """Everything observable about a replica tree: per module (named_modules order, duplicates
    kept), its type and __dict__ (keys in order; tensors by device, shape, value, grad_fn kind
    and identity class; modules and other containers by identity class)."""
    ids: dict[int, int] = {}

    def ident(obj: object) -> int:
        return ids.setdefault(id(obj), len(ids))

    def describe(value: object) -> object:
        if isinstance(value, torch.Tensor):
            return (
                "tensor",
                type(value).__name__,
                ident(value),
                str(value.device),
                tuple(value.shape),
                value.requires_grad,
                type(value.grad_fn).__name__ if value.grad_fn is not None else None,
                value.detach().tolist() if value.device.type != "meta" else None,
            )
        if isinstance(value, nn.Module):
            return ("module", type(value).__name__, ident(value))
        if isinstance(value, dict):
            return (type(value).__name__, [(k, describe(v)) for k, v in value.items()])
        return ("object", type(value).__name__, repr(value) if value is None else ident(value))

    out = []
    for name, m in root.named_modules(remove_duplicate=False):
        out.append((name, type(m).__name__, ident(m), describe(m.__dict__)))
    return out


class _Symmetric(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.triu() + x.triu(1).transpose(-1, -2)


def _symmetric(module: nn.Module) -> nn.Module:
    nn.utils.parametrize.register_parametrization(module, "weight", _Symmetric())
    return module


@pytest.fixture
def slow_path():
    calls: list[str] = []
    handle = torch.nn.modules.module.register_module_buffer_registration_hook(
        lambda module, name, buffer: calls.append(name)
    )
    try:
        yield calls
    finally:
        handle.remove()


@pytest.mark.parametrize("detach", [False, True])
@pytest.mark.parametrize(
    "make",
    [
        lambda: nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.BatchNorm1d(4)),
        _Shared,
        lambda: nn.TransformerEncoder(nn.TransformerEncoderLayer(8, 2, 16), 2),
        lambda: nn.Sequential(nn.Linear(3, 3), nn.LSTM(3, 3)),  # RNNs take the PyTorch way
        lambda: nn.Sequential(_symmetric(nn.Linear(3, 3)), nn.ReLU()),
        lambda: nn.Sequential(nn.utils.parametrizations.spectral_norm(nn.Linear(3, 3))),
        lambda: nn.Sequential(nn.utils.parametrizations.weight_norm(nn.Linear(3, 3))),
    ],
    ids=[
        "sequential",
        "shared",
        "transformer",
        "with-lstm",
        "parametrized",
        "spectral-norm",
        "weight-norm",
    ],
)
def test_fast_replicas_equal_pytorch_built_replicas(make, detach, request):
    torch.manual_seed(0)
    net = make()
    devices = [CPU, CPU, META]
    fast = torchdp.replicate(net, devices, detach=detach)
    calls = request.getfixturevalue("slow_path")
    slow = torchdp.replicate(net, devices, detach=detach)
    assert calls or not list(net.buffers())  # setattr ran: the PyTorch way was taken
    for f, s in zip(fast, slow, strict=True):
        assert _fingerprint(f) == _fingerprint(s)
        assert _fingerprint(f) != _fingerprint(net)
    # The replicas compute what the module computes (eval mode: no dropout or batch statistics).
    if not isinstance(net, _Shared) and not any(isinstance(m, nn.LSTM) for m in net.modules()):
        first = next(m for m in net.modules() if isinstance(m, nn.Linear))
        x = torch.randn(2, first.in_features)
        net.eval()
        with torch.no_grad():
            for r in torchdp.replicate(net, [CPU, CPU], detach=detach):
                torch.testing.assert_close(r.eval()(x), net(x))


def test_fast_replicas_share_nothing_mutable_with_the_original():
    net = _Shared()
    r0, r1 = torchdp.replicate(net, cpu_devices(2))
    for original, replica in zip(net.modules(), r1.modules(), strict=True):
        assert replica is not original and type(replica) is type(original)
        assert replica.__dict__ is not original.__dict__
        for key in ("_parameters", "_buffers", "_modules"):
            assert getattr(replica, key) is not getattr(original, key)
        # Hook dictionaries are the replica's own copies (Note [Replicas own their instance
        # state]): what a replica's forward registers stays out of the original.
        assert replica._forward_hooks is not original._forward_hooks
        assert replica._forward_hooks == original._forward_hooks
    r1.d.scale = 7.0
    r1.d._buffers["steps"] = torch.ones((), dtype=torch.long)
    assert net.d.scale == 2.5 and net.d.steps.item() == 0
    assert r1.b is r1.a and r1.c.weight is r1.a.weight and r1.gap is None
    x = torch.randn(2, 3)
    torch.testing.assert_close(r0(x), net(x))


def test_replicas_follow_changes_between_calls():
    # Nothing is cached between calls: attributes, flags and structure changes show up at once.
    net = _Shared()
    assert torchdp.replicate(net, cpu_devices(2))[1].d.scale == 2.5
    net.d.scale = 4.0
    net.eval()
    net.new = nn.Linear(3, 3)
    r = torchdp.replicate(net, cpu_devices(2))[1]
    assert r.d.scale == 4.0 and not r.training and not r.d.lin.training
    assert isinstance(r.new, nn.Linear) and r.new is not net.new


class WatchesCollector(nn.Linear):
    """Records whether the garbage collector runs while its replicas are built, and can turn it
    off from there, as another thread could."""

    seen: ClassVar[list[bool]] = []
    disable = False

    def _replicate_for_data_parallel(self):
        import gc

        WatchesCollector.seen.append(gc.isenabled())
        if WatchesCollector.disable:
            gc.disable()
        return super()._replicate_for_data_parallel()


def test_replicate_leaves_the_garbage_collector_to_the_program():
    # The collector is process-wide: replication must neither turn it off where other code (or
    # another thread) sees it, nor undo a change made meanwhile.
    import gc

    net = nn.Sequential(WatchesCollector(2, 2), nn.ReLU())
    WatchesCollector.seen.clear()
    assert gc.isenabled()
    torchdp.replicate(net, [CPU, CPU])
    torchdp.DataParallel(net, devices=[CPU, CPU])(torch.randn(4, 2))
    assert WatchesCollector.seen and all(WatchesCollector.seen)
    assert gc.isenabled()
    WatchesCollector.disable = True
    try:
        torchdp.replicate(net, [CPU, CPU])
        assert not gc.isenabled()  # the change made during replication stands
    finally:
        WatchesCollector.disable = False
        gc.enable()
    with pytest.raises(RuntimeError, match="is on meta but the replicas are built from"):
        torchdp.replicate(nn.Linear(2, 2, device="meta"), [CPU, CPU])
    assert gc.isenabled()


class OnlyTrainable(nn.Module):
    """parameters() overridden to yield only the trainable parameters (fine-tuning code)."""

    def __init__(self) -> None:
        super().__init__()
        self.backbone = nn.Linear(4, 4).requires_grad_(False)
        self.head = nn.Linear(4, 2)

    def parameters(self, recurse=True):
        return (p for p in super().parameters(recurse) if p.requires_grad)

    def forward(self, x):
        return self.head(self.backbone(x))


class _ParamDict(dict):
    """Not an exact dict: replicate then takes the tensors from parameters() as PyTorch does."""


def test_a_root_whose_parameters_lists_fewer_tensors():
    torch.manual_seed(0)
    net = OnlyTrainable()
    ref = OnlyTrainable()
    ref.load_state_dict(net.state_dict())
    x = torch.randn(8, 4)
    torchdp.DataParallel(net, devices=cpu_devices(2))(x).pow(2).sum().backward()
    ref(x).pow(2).sum().backward()
    torch.testing.assert_close(net.head.weight.grad, ref.head.weight.grad)
    assert net.backbone.weight.grad is None
    # Where the modules' own dicts cannot be read directly, the missing tensor is named clearly.
    odd = OnlyTrainable()
    odd.backbone._parameters = _ParamDict(odd.backbone._parameters)
    with pytest.raises(RuntimeError, match=r"registers a parameter that the root module's "):
        torchdp.replicate(odd, cpu_devices(2))


class _CallsThrough(nn.Module):
    """Calls ``self.fn(x)``: an instance attribute holding a callable bound to a module."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3)

    def forward(self, x):
        return self.fn(x)


def _run_lin(module, x):
    return module.lin(x)


def _bindings(net):
    """The ways code stores a callable bound to one of the network's modules."""
    closure_target = net

    def closure(x):
        return closure_target.lin(x)

    return {
        "method": types.MethodType(_run_lin, net),
        "partial": functools.partial(_run_lin, net),
        "partial-of-method": functools.partial(types.MethodType(_run_lin, net)),
        "closure": closure,
        "default": lambda x, m=net: m.lin(x),
        "bound-child-method": net.lin.__call__,
    }


@pytest.mark.parametrize("kind", list(_bindings(_CallsThrough())))
def test_callables_bound_to_the_network_are_rebound_to_each_replica(kind):
    net = _CallsThrough()
    net.fn = _bindings(net)[kind]
    seen = []
    net.lin.register_forward_hook(lambda module, args, out: seen.append(module))
    x = torch.randn(4, 3)
    want = net.lin(x)
    replicas = torchdp.replicate(net, cpu_devices(2))
    for r in replicas:
        torch.testing.assert_close(r(x), want)
    # Each replica ran its own child (the forward hook saw it), never the original's.
    assert seen[0] is net.lin
    assert seen[1:] == [r.lin for r in replicas]
    assert replicas[0].fn is not net.fn and replicas[1].fn is not replicas[0].fn
    # The user's callable still calls the user's module.
    seen.clear()
    net.fn(x)
    assert seen == [net.lin]
    out = torchdp.DataParallel(net, devices=cpu_devices(2))(x)
    out.sum().backward()
    torch.testing.assert_close(out, net.lin(x))
    assert net.lin.weight.grad is not None


class _Caller:
    """A callable object holding a module: torchdp cannot know how to remake it."""

    def __init__(self, module):
        self.module = module

    def __call__(self, x):
        return self.module.lin(x)


def test_a_callable_object_holding_the_network_is_refused():
    net = _CallsThrough()
    net.fn = _Caller(net)
    with pytest.raises(
        TypeError,
        match=r"attribute 'fn' of module '<root>'.*_Caller object "
        r"whose attribute 'module' holds module '<root>'.*functools.partial",
    ):
        torchdp.replicate(net, cpu_devices(2))
    # Nothing of the user's module changed.
    assert net.fn.module is net and list(net.__dict__["_forward_hooks"]) == []


def test_hooks_a_forward_registers_stay_in_the_replica():
    class RegistersOnce(nn.Linear):
        def forward(self, x):
            if not getattr(self, "hooked", False):
                self.register_forward_hook(lambda m, a, out: out * 2)
                self.register_buffer("extra", torch.zeros(1), persistent=False)
                self.hooked = True
            return super().forward(x)

    net = nn.Sequential(RegistersOnce(3, 3))
    dp = torchdp.DataParallel(net, devices=cpu_devices(3))
    x = torch.randn(6, 3)
    for _ in range(3):
        torch.testing.assert_close(dp(x), nn.functional.linear(x, net[0].weight, net[0].bias))
    assert len(net[0]._forward_hooks) == 0 and not hasattr(net[0], "hooked")
    assert "extra" not in net[0]._buffers and not net[0]._non_persistent_buffers_set
