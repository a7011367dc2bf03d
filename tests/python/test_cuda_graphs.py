"""torchdp.DataParallel(cuda_graphs=True): graphed replicas (Note [Graphed replicas]).

Every step is compared with the eager torchdp.DataParallel on a copy of the model: outputs,
gradients, buffers and, over several SGD steps, the weights. The device lists are two replicas on
one GPU (``cuda:0`` twice, which exercises the persistent replica, its refresh and the gradient sum)
and, on machines with two GPUs, ``cuda:0, cuda:1``. The argument checks run on CPU-only machines.
"""

from __future__ import annotations

import dataclasses
import sys
import threading
import warnings

import pytest
import torch
from dp_testing import clone_module, cpu_devices
from torch import nn

import torchdp

CUDA = torch.cuda.is_available()


def device_lists():
    return [
        pytest.param([0, 0], id="cuda0x2", marks=pytest.mark.needs_cuda),
        pytest.param([0, 1], id="cuda0-cuda1", marks=pytest.mark.needs_multi_gpu),
    ]


def _graphed(dp):
    """The graphed replicas behind a DataParallel (they count their captures)."""
    return sys.modules["torchdp.data_parallel"]._GRAPHED[dp]


def _devices(ids):
    return [torch.device("cuda", i) for i in ids]


class ConvBN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 4, 1)
        )
        self.head = nn.Linear(4 * 6 * 6, 5)
        self.unused = nn.Linear(3, 3)  # zero gradients, as in the eager mode

    def forward(self, x):
        return self.head(self.body(x).flatten(1))


class TwoOutputs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(6, 4)
        self.b = nn.Linear(6, 2)

    def forward(self, x, *, scale=1.0):
        h = self.a(x)
        return {"h": h * scale, "cls": self.b(x).argmax(dim=1), "tag": "kept"}


def mlp(layers=6, width=32):
    return nn.Sequential(*[m for _ in range(layers) for m in (nn.Linear(width, width), nn.ReLU())])


def _pair(model, ids, **kw):
    torch.manual_seed(0)
    net = model().cuda(ids[0])
    ref = clone_module(net)
    graphed = torchdp.DataParallel(net, devices=_devices(ids), cuda_graphs=True, **kw)
    eager = torchdp.DataParallel(ref, devices=_devices(ids), **kw)
    return net, ref, graphed, eager


def _assert_same_module_state(a: nn.Module, b: nn.Module, **tol) -> None:
    for (name, p), q in zip(a.named_parameters(), b.parameters(), strict=True):
        torch.testing.assert_close(p, q, msg=f"parameter {name}", **tol)
        torch.testing.assert_close(p.grad, q.grad, msg=f"gradient of {name}", **tol)
    for (name, x), y in zip(a.named_buffers(), b.buffers(), strict=True):
        torch.testing.assert_close(x, y, msg=f"buffer {name}", **tol)


@pytest.mark.parametrize("ids", device_lists())
@pytest.mark.parametrize("model,shape", [(mlp, (8, 32)), (ConvBN, (6, 3, 6, 6))])
def test_training_steps_match_the_eager_mode(ids, model, shape):
    net, ref, graphed, eager = _pair(model, ids)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.1)
    for step in range(4):
        x = torch.randn(*shape, device=f"cuda:{ids[0]}")
        out, out_ref = graphed(x), eager(x)
        torch.testing.assert_close(out, out_ref, msg=f"output of step {step}")
        out.square().mean().backward()
        out_ref.square().mean().backward()
        _assert_same_module_state(net, ref, rtol=1e-4, atol=1e-5)
        opt.step()
        opt_ref.step()
        opt.zero_grad(set_to_none=step % 2 == 0)
        opt_ref.zero_grad(set_to_none=step % 2 == 0)
    _assert_same_module_state(net, ref, rtol=1e-4, atol=1e-5)
    assert _graphed(graphed).captures_made == 1  # one signature, captured once
    if model is ConvBN:
        assert torch.equal(net.unused.weight.grad, torch.zeros(3, 3, device=f"cuda:{ids[0]}"))


def small_transformer():
    layer = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
    return nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)


@pytest.mark.parametrize("ids", device_lists())
@pytest.mark.parametrize("dtype", [None, torch.bfloat16], ids=["fp32", "bf16-autocast"])
def test_transformer_and_autocast_match_the_eager_mode(ids, dtype):
    net, ref, graphed, eager = _pair(small_transformer, ids)
    for step in range(2):
        x = torch.randn(6, 5, 16, device=f"cuda:{ids[0]}")
        net.zero_grad()
        ref.zero_grad()
        with torch.autocast("cuda", dtype=dtype or torch.float32, enabled=dtype is not None):
            out, out_ref = graphed(x), eager(x)
            assert out.dtype == out_ref.dtype
            torch.testing.assert_close(out, out_ref, msg=f"step {step}")
            out.float().square().mean().backward()
            out_ref.float().square().mean().backward()
        _assert_same_module_state(net, ref, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("ids", device_lists())
def test_dropout_runs_with_fresh_masks(ids):
    # Graph-safe random numbers: every replay draws new dropout masks (not the same as the eager
    # mode's, which consumes the generator differently), and training still works.
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(32, 32), nn.Dropout(0.5), nn.Linear(32, 1)).cuda(ids[0])
    graphed = torchdp.DataParallel(net, devices=_devices(ids), cuda_graphs=True)
    x = torch.randn(8, 32, device=f"cuda:{ids[0]}")
    outs = [graphed(x).detach() for _ in range(3)]
    assert not torch.equal(outs[0], outs[1]) and not torch.equal(outs[1], outs[2])
    graphed(x).sum().backward()
    assert all(torch.isfinite(p.grad).all() for p in net.parameters())


@pytest.mark.parametrize("ids", device_lists())
def test_structured_outputs_kwargs_and_eval(ids):
    net, ref, graphed, eager = _pair(TwoOutputs, ids)
    x = torch.randn(8, 6, device=f"cuda:{ids[0]}")
    out, out_ref = graphed(x, scale=2.0), eager(x, scale=2.0)
    assert out["tag"] == "kept" and out["cls"].dtype == torch.int64
    torch.testing.assert_close(out["h"], out_ref["h"])
    torch.testing.assert_close(out["cls"], out_ref["cls"])
    out["h"].sum().backward()
    out_ref["h"].sum().backward()
    _assert_same_module_state(net, ref)
    # Another constant is another signature; eval under no_grad is one more.
    graphed(x, scale=3.0)
    net.eval()
    ref.eval()
    with torch.no_grad():
        torch.testing.assert_close(graphed(x, scale=1.0)["h"], eager(x, scale=1.0)["h"])
    assert _graphed(graphed).captures_made == 3


@dataclasses.dataclass
class Result:
    logits: torch.Tensor


class ReturnsDataclass(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 3)
        self.bn = nn.BatchNorm1d(6)

    def forward(self, x):
        return Result(self.fc(self.bn(x)))


@pytest.mark.parametrize("ids", device_lists())
def test_outputs_a_replay_cannot_refresh_are_refused(ids):
    torch.manual_seed(0)
    net = ReturnsDataclass().cuda(ids[0])
    before = {k: v.clone() for k, v in net.state_dict().items()}
    graphed = torchdp.DataParallel(net, devices=_devices(ids), cuda_graphs=True)
    x = torch.randn(8, 6, device=f"cuda:{ids[0]}")
    with pytest.raises(TypeError) as info:
        graphed(x)
    message = str(info.value)
    assert "replica 0" in message and "ReturnsDataclass" not in message
    assert ".Result object" in message and "register_pytree_node" in message
    assert "cuda_graphs=False" in message
    # The failed call left the module as it was (warm-up updates of BatchNorm undone).
    for k, v in net.state_dict().items():
        torch.testing.assert_close(v, before[k], msg=k)
    assert _graphed(graphed).captures_made == 0


@pytest.mark.parametrize("ids", device_lists())
def test_input_gradients_and_gather_output_false(ids):
    net, ref, graphed, eager = _pair(mlp, ids, gather_output=False)
    x = torch.randn(8, 32, device=f"cuda:{ids[0]}", requires_grad=True)
    x_ref = x.detach().clone().requires_grad_(True)
    outs, outs_ref = graphed(x), eager(x_ref)
    assert [o.device for o in outs] == [o.device for o in outs_ref]
    # Each replica's output stays on its device: the loss gathers the scalars on the first.
    first = outs[0].device
    sum((o.sum() * (i + 1)).to(first) for i, o in enumerate(outs)).backward()
    sum((o.sum() * (i + 1)).to(first) for i, o in enumerate(outs_ref)).backward()
    torch.testing.assert_close(x.grad, x_ref.grad)
    _assert_same_module_state(net, ref)


@pytest.mark.parametrize("ids", device_lists())
def test_second_forward_before_backward_runs_eagerly(ids):
    net, ref, graphed, eager = _pair(mlp, ids)
    x1 = torch.randn(8, 32, device=f"cuda:{ids[0]}")
    x2 = torch.randn(8, 32, device=f"cuda:{ids[0]}")
    (graphed(x1).sum() + graphed(x2).square().sum()).backward()
    (eager(x1).sum() + eager(x2).square().sum()).backward()
    _assert_same_module_state(net, ref)


@pytest.mark.parametrize("ids", device_lists())
def test_backward_through_a_replayed_forward_raises(ids):
    _, _, graphed, _ = _pair(mlp, ids)
    x = torch.randn(8, 32, device=f"cuda:{ids[0]}")
    first = graphed(x).sum()
    first.backward(retain_graph=True)
    graphed(x).sum().backward()  # replays the same graphs
    with pytest.raises(RuntimeError, match="replayed by a later forward"):
        first.backward()
    # Without a replay in between, a second backward is refused too: the captured backward
    # freed its saved activations.
    again = graphed(x).sum()
    again.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="second backward pass through the same graphed"):
        again.backward()


@pytest.mark.parametrize("ids", device_lists())
def test_inference_mode_runs_eagerly_and_training_goes_on(ids):
    net, ref, graphed, eager = _pair(mlp, ids)
    x = torch.randn(8, 32, device=f"cuda:{ids[0]}")
    with torch.inference_mode():
        torch.testing.assert_close(graphed(x), eager(x))
    assert _graphed(graphed).captures_made == 0
    graphed(x).sum().backward()
    eager(x).sum().backward()
    _assert_same_module_state(net, ref)


@pytest.mark.parametrize("ids", device_lists())
def test_a_rebuild_while_a_backward_is_pending(ids):
    net, ref, graphed, eager = _pair(mlp, ids)
    x = torch.randn(8, 32, device=f"cuda:{ids[0]}")
    pending, pending_ref = graphed(x).sum(), eager(x).sum()
    # New storage for one weight: the next forward rebuilds; the pending backward still uses
    # the replicas and parameters of its own forward.
    with torch.no_grad():
        net[2].weight.data = net[2].weight.data.clone()
        ref[2].weight.data = ref[2].weight.data.clone()
    (graphed(x).square().sum() + pending).backward()
    (eager(x).square().sum() + pending_ref).backward()
    _assert_same_module_state(net, ref)


@pytest.mark.parametrize("ids", device_lists())
def test_replaced_parameters_are_picked_up(ids):
    net, ref, graphed, eager = _pair(mlp, ids)
    dev = f"cuda:{ids[0]}"
    graphed(torch.randn(8, 32, device=dev)).sum().backward()
    # A parameter with new storage: everything is rebuilt at the next forward.
    with torch.no_grad():
        net[0].weight.data = net[0].weight.data * 2
        ref[0].weight.data = ref[0].weight.data * 2
    net.zero_grad()
    x = torch.randn(8, 32, device=dev)
    graphed(x).sum().backward()
    eager(x).sum().backward()
    _assert_same_module_state(net, ref)


@pytest.mark.needs_cuda
def test_signatures_beyond_the_limit_run_eagerly():
    torch.manual_seed(0)
    net = mlp().cuda()
    ref = clone_module(net)
    graphed = torchdp.DataParallel(net, devices=_devices([0, 0]), cuda_graphs=2)
    eager = torchdp.DataParallel(ref, devices=_devices([0, 0]))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for batch in (4, 6, 8, 10):
            x = torch.randn(batch, 32, device="cuda")
            torch.testing.assert_close(graphed(x), eager(x))
    assert _graphed(graphed).captures_made == 2
    assert sum("input signatures are captured already" in str(w.message) for w in caught) == 1


def test_cuda_graphs_argument_checks():
    with pytest.raises(ValueError, match="cuda_graphs=True needs CUDA devices"):
        torchdp.DataParallel(nn.Linear(2, 2), devices=cpu_devices(2), cuda_graphs=True)
    for bad in ("yes", 0.5, -1):
        with pytest.raises(ValueError, match="cuda_graphs must be True, False or a positive"):
            torchdp.DataParallel(nn.Linear(2, 2), devices=cpu_devices(2), cuda_graphs=bad)
    # Without an accelerator and without devices=, DataParallel passes through, graphs or not.
    if not CUDA:
        dp = torchdp.DataParallel(nn.Linear(2, 2), cuda_graphs=True)
        assert dp(torch.ones(3, 2)).shape == (3, 2)


class WithPlainTensor(nn.Module):
    """A non-buffer tensor attribute (detectron2's pixel_mean): replicate shares it by reference."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.offset = torch.arange(4.0)

    def forward(self, x):
        return self.fc(x - self.offset)


@pytest.mark.needs_multi_gpu
def test_stale_attributes_move_applies_to_the_graphed_replicas():
    torch.manual_seed(0)
    net = WithPlainTensor()
    net.offset = net.offset.cuda(0)
    net.cuda(0)
    ref = clone_module(net)
    ref.offset = net.offset.clone()
    graphed = torchdp.DataParallel(
        net, devices=_devices([0, 1]), cuda_graphs=True, stale_attributes="move"
    )
    eager = torchdp.DataParallel(ref, devices=_devices([0, 1]), stale_attributes="move")
    x = torch.randn(8, 4, device="cuda:0")
    out, out_ref = graphed(x), eager(x)
    torch.testing.assert_close(out, out_ref)
    out.sum().backward()
    out_ref.sum().backward()
    _assert_same_module_state(net, ref)


class Aliased(nn.Module):
    """Plain attributes that alias registered tensors, directly and inside containers."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 6)
        self.bn = nn.BatchNorm1d(6)
        self.w = self.lin.weight
        self.parts = [self.lin.bias, {"mean": self.bn.running_mean}]

    def forward(self, x):
        return self.bn(x @ self.w.t() + self.parts[0]).relu()


def test_graphed_replicas_rebind_plain_aliases_of_registered_tensors():
    # Runs on the CPU: the replicas of this mode are built by pure Python code. A captured forward
    # reading a parameter through an alias would drop its gradient (the backward graph
    # differentiates with respect to the replica's own leaves), so aliases must be rebound.
    graphs = sys.modules["torchdp._graphs"]
    net = Aliased()
    params, buffers = list(net.parameters()), list(net.buffers())
    copies = torchdp.replicate(net, cpu_devices(2), detach=True)
    for j, copy in enumerate(copies):
        # What the engine hands replica j: storage of its own for the parameters, and (replica 0)
        # the module's own buffers or (others) copies.
        buffer_storage = buffers if j == 0 else [b.clone() for b in buffers]
        leaves = [torch.nn.Parameter(p.detach().clone()) for p in params]
        tensors = {id(p): leaf for p, leaf in zip(params, leaves, strict=True)}
        tensors.update({id(b): v for b, v in zip(buffers, buffer_storage, strict=True)})
        graphs._install(net, copy, tensors, j)
        m = copy
        assert m.lin.weight is leaves[0] and m.lin.weight.is_leaf
        assert m.w is m.lin.weight
        assert m.parts[0] is m.lin.bias
        assert m.parts[1]["mean"] is m.bn.running_mean
        assert m.bn.running_mean is buffer_storage[0]
    # The module's own attributes are left as they were.
    assert net.w is net.lin.weight and net.parts[0] is net.lin.bias
    assert net.parts[1]["mean"] is net.bn.running_mean


def test_graphed_replicas_refuse_unregistered_leaves_that_need_gradients():
    graphs = sys.modules["torchdp._graphs"]
    net = Aliased()
    graphs._refuse_unregistered_leaves(net)  # aliases of parameters are fine
    net.lin.cache = [torch.ones(2).requires_grad_()[0:1] * 2]  # not a leaf: an activation
    graphs._refuse_unregistered_leaves(net)
    net.lin.scale = {"s": torch.ones(6, requires_grad=True)}  # a leaf the backward cannot see
    with pytest.raises(RuntimeError, match=r"attribute \"scale\['s'\]\" of module 'lin'") as info:
        graphs._refuse_unregistered_leaves(net)
    assert "nn.Parameter" in str(info.value) and "cuda_graphs=False" in str(info.value)


@pytest.mark.parametrize("ids", device_lists())
def test_aliased_parameters_get_their_gradients(ids):
    net, ref, graphed, eager = _pair(Aliased, ids)
    for _ in range(3):
        x = torch.randn(8, 6, device=f"cuda:{ids[0]}")
        for m in (net, ref):
            m.zero_grad(set_to_none=True)
        graphed(x).pow(2).sum().backward()
        eager(x).pow(2).sum().backward()
        _assert_same_module_state(net, ref)
        with torch.no_grad():
            for m in (net, ref):
                for p in m.parameters():
                    p -= 0.1 * p.grad
    assert _graphed(graphed).captures_made == 1


class Syncing(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        y = self.fc(x)
        return y * float(y.abs().max().item() > 0)  # a synchronisation: not capturable


@pytest.mark.parametrize("ids", device_lists())
def test_a_failed_capture_leaves_device_and_streams_as_they_were(ids):
    torch.manual_seed(0)
    net = Syncing().cuda(ids[0])
    dp = torchdp.DataParallel(net, devices=_devices(ids), cuda_graphs=True)
    torch.cuda.set_device(ids[0])
    x = torch.randn(8, 4, device=f"cuda:{ids[0]}")
    streams = {d: torch.cuda.current_stream(d) for d in set(ids)}
    rng = {d: torch.cuda.get_rng_state(d) for d in set(ids)}
    with pytest.raises(RuntimeError, match="capturing the replicas' forward and backward"):
        dp(x)
    assert torch.cuda.current_device() == ids[0]
    assert {d: torch.cuda.current_stream(d) for d in set(ids)} == streams
    # The random number generators work and are where they were.
    for d in set(ids):
        assert torch.equal(torch.cuda.get_rng_state(d), rng[d])
        torch.randn(3, device=f"cuda:{d}")
    # The module still trains eagerly.
    eager = torchdp.DataParallel(net, devices=_devices(ids))
    eager(x).sum().backward()
    assert all(p.grad is not None for p in net.parameters())


class OutputElsewhere(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        return self.fc(x).cpu()


@pytest.mark.parametrize("ids", device_lists())
def test_outputs_on_another_device_are_refused(ids):
    torch.manual_seed(0)
    net = OutputElsewhere().cuda(ids[0])
    dp = torchdp.DataParallel(net, devices=_devices(ids), cuda_graphs=True)
    with pytest.raises(RuntimeError, match=r"returned a tensor on cpu; in this mode each replica"):
        dp(torch.randn(8, 4, device=f"cuda:{ids[0]}"))
    assert _graphed(dp).captures_made == 0


class PinsMidForward(nn.Module):
    """Another thread allocates pinned host memory while the forward runs (a DataLoader's
    pin-memory thread doing so during a capture)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.pinned: list[torch.Tensor] = []  # kept, so no cached block is free for the next

    def forward(self, x):
        errors = []

        def pin():
            try:
                self.pinned.append(torch.empty(1 << 16, dtype=torch.uint8, pin_memory=True))
            except Exception as e:
                errors.append(e)

        thread = threading.Thread(target=pin)
        thread.start()
        thread.join()
        if errors:
            raise errors[0]
        return self.fc(x)


@pytest.mark.parametrize("ids", device_lists())
def test_other_threads_cuda_calls_do_not_break_a_capture(ids):
    # Captures use the thread-local capture mode: in the global mode the other thread's pinned
    # allocation would invalidate the capture (and fail in that thread).
    net, ref, graphed, eager = _pair(PinsMidForward, ids)
    x = torch.randn(8, 4, device=f"cuda:{ids[0]}")
    graphed(x).sum().backward()
    eager(x).sum().backward()
    _assert_same_module_state(net, ref)
    assert _graphed(graphed).captures_made == 1


class Sized(nn.Module):
    """Returns a constant that depends on the input's shape."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        return {"out": self.lin(x), "rows": x.shape[0]}


@pytest.mark.parametrize("ids", device_lists())
def test_each_signature_keeps_its_own_output_constants(ids):
    # The constants of the outputs are kept per captured signature: two batch sizes, captured
    # one after the other, each replay gives its own.
    _net, _ref, graphed, eager = _pair(Sized, ids, gather_output=False)
    for rows in (8, 12, 8, 12):
        x = torch.randn(rows, 4, device=f"cuda:{ids[0]}")
        got, want = graphed(x), eager(x)
        assert [o["rows"] for o in got] == [o["rows"] for o in want] == [rows // 2] * 2
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(g["out"], w["out"])
    assert _graphed(graphed).captures_made == 2
