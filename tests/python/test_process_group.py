"""torchdp.DataParallel(process_group=...): gradients averaged over processes (Note [Reducing
across processes]). Two processes on one machine, each driving its own devices with torchdp,
must train like one process on the whole batch."""

from __future__ import annotations

import dataclasses
import datetime
import os
import sys
import traceback

import pytest
import torch
import torch.distributed as dist
from dp_testing import exit_process, run_processes
from torch import nn

import torchdp

try:
    # The C++ DataParallel's side of these tests (tests/python/torchdp_testing.cpp): make test
    # builds it into build/tests/python, puts that on PYTHONPATH and requires it.
    import torchdp_testing
except ImportError:
    if os.environ.get("TORCHDP_TEST_EXTENSION") == "required":
        raise
    torchdp_testing = None

_CPP = torchdp_testing is not None and torchdp_testing.has_process_group

WORLD = 2
STEPS = 3
BATCH = 16  # the global batch: each process takes BATCH / WORLD rows


def _mlp(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 4)
    )


class _Branchy(nn.Module):
    """``extra`` takes part only when the forward is asked to use it."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(5)
        self.body = nn.Linear(8, 4)
        self.extra = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor, use_extra: bool = False) -> torch.Tensor:
        y = self.body(x)
        return y + self.extra(x) if use_extra else y


@dataclasses.dataclass
class _Out:
    value: torch.Tensor


class _DataclassOut(nn.Module):
    """Returns an unregistered dataclass (not a pytree node)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(6)
        self.fc = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> _Out:
        return _Out(self.fc(x))


class _SparseEmbedding(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(7)
        self.emb = nn.Embedding(6, 3, sparse=True)
        self.fc = nn.Linear(3, 3)

    def forward(self, ids: torch.Tensor, use: bool = True) -> torch.Tensor:
        h = self.fc.weight.sum() * torch.ones((*ids.shape, 3), device=ids.device)
        return h + self.emb(ids) if use else h


class _ReturnsWeight(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight


class _FailsInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("this backward fails on purpose")


class _MaybeFails(nn.Module):
    """Its backward fails when the forward is asked to."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor, fail: bool = False) -> torch.Tensor:
        y = self.fc(x)
        return _FailsInBackward.apply(y) if fail else y


def _bn(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Tanh(), nn.Linear(16, 4))


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [
        (torch.randn(BATCH, 8, generator=g), torch.randn(BATCH, 4, generator=g))
        for _ in range(STEPS)
    ]


def _wrap(model: nn.Module, devices: list[str] | None, **kwargs) -> torchdp.DataParallel:
    if devices is None:  # no device list: the wrapper's default (a passthrough without GPUs)
        return torchdp.DataParallel(model, **kwargs)
    device_list = [torch.device(d) for d in devices]
    # Small buckets: several reductions run inside each pass, and the average must wait for all.
    kwargs.setdefault("bucket_cap_mb", 0.001)
    return torchdp.DataParallel(model.to(device_list[0]), devices=device_list, **kwargs)


def _input_device(devices: list[str] | None) -> torch.device:
    if devices:
        return torch.device(devices[0])
    return torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")


def _train(rank: int, devices: list[str] | None, accumulate: bool) -> list[torch.Tensor]:
    """Each process starts from its own initialisation (rank 0's is taken at the first
    forward) and trains on its half of every batch."""
    dev = _input_device(devices)
    dp = _wrap(_mlp(seed=rank), devices, process_group=dist.group.WORLD)
    opt = torch.optim.SGD(dp.parameters(), lr=0.1)
    for x, y in _batches():
        x, y = x.chunk(WORLD)[rank].to(dev), y.chunk(WORLD)[rank].to(dev)
        opt.zero_grad(set_to_none=True)
        if accumulate:
            (xa, xb), (ya, yb) = x.chunk(2), y.chunk(2)
            with dp.no_sync():
                (nn.functional.mse_loss(dp(xa), ya) / 2).backward()
            (nn.functional.mse_loss(dp(xb), yb) / 2).backward()
        else:
            nn.functional.mse_loss(dp(x), y).backward()
        opt.step()
    return [p.detach().cpu() for p in dp.module.parameters()]


def _scenarios(rank: int, devices: list[str] | None) -> dict:
    dev = _input_device(devices)
    out: dict = {
        "trained": _train(rank, devices, False),
        "accumulated": _train(rank, devices, True),
    }

    # The C++ DataParallel with DataParallelOptions::process_group over this backend.
    if _CPP:
        init = [p.detach() for p in _mlp(seed=rank).parameters()]
        shares = [(x.chunk(WORLD)[rank], y.chunk(WORLD)[rank]) for x, y in _batches()]
        cpp_devices = devices or [str(dev)]
        for key, accumulate in (("cpp_trained", False), ("cpp_accumulated", True)):
            out[key] = torchdp_testing.train_mlp(
                dist.group.WORLD, init, shares, cpp_devices, 0.1, accumulate
            )

    # Per-replica outputs and losses (gather_output=False): the hooks are on every replica's
    # output; one reduction per pass all the same.
    dp = _wrap(_mlp(seed=rank), devices, process_group=dist.group.WORLD, gather_output=False)
    x, y = (t.chunk(WORLD)[rank].to(dev) for t in _batches()[0])
    torchdp.DataParallelCriterion(nn.MSELoss())(dp(x), y).backward()
    out["per_replica_grads"] = [p.grad.cpu() for p in dp.module.parameters()]

    # A parameter used in one process only: both get the average, zeros counted for the other.
    x = torch.randn(6, 8, generator=torch.Generator().manual_seed(10 + rank)).to(dev)
    dp = _wrap(_Branchy(), devices, process_group=dist.group.WORLD)
    dp(x, use_extra=rank == 1).sum().backward()
    out["extra_grad"] = dp.module.extra.weight.grad.cpu()
    local = _Branchy()
    local(x.cpu(), use_extra=rank == 1).sum().backward()
    out["local_extra_grad"] = local.extra.weight.grad

    # A parameter that no process used keeps None, as with DDP, where torchdp leaves it None
    # (a passthrough); with device lists the replicas give it zeros (as nn.DataParallel does),
    # and the average of those zeros is what it gets.
    unused = _wrap(_Branchy(), devices, process_group=dist.group.WORLD)
    unused(x).sum().backward()
    out["unused"] = _cpu_or_none(unused.module.extra.weight.grad)
    alone = _wrap(_Branchy(), devices)
    alone(x).sum().backward()
    out["unused_alone"] = _cpu_or_none(alone.module.extra.weight.grad)
    out["unused_body"] = unused.module.body.weight.grad.cpu()

    # backward(inputs=[...]): the gradients that torchdp alone leaves None stay None; the
    # input's is averaged.
    subset = _wrap(_mlp(seed=0), devices, process_group=dist.group.WORLD)
    subset(x).sum().backward(inputs=[subset.module[0].weight])
    alone = _wrap(_mlp(seed=0), devices)
    alone(x).sum().backward(inputs=[alone.module[0].weight])
    out["subset_none"] = [p.grad is None for p in subset.parameters()]
    out["subset_none_alone"] = [p.grad is None for p in alone.parameters()]
    out["subset_input"] = subset.module[0].weight.grad.cpu()
    out["subset_input_alone"] = alone.module[0].weight.grad.cpu()

    # torch.autograd.grad of the input: no parameter gradient appears, nothing is reduced.
    dp.zero_grad(set_to_none=True)
    xi = x.clone().requires_grad_()
    (gx,) = torch.autograd.grad(dp(xi).sum(), xi)
    out["grad_of_input_param_grads"] = [p.grad for p in dp.parameters()]
    out["grad_of_input"] = gx.cpu()

    # A pass's id is forgotten at its end (also for torch.autograd.grad); a failed pass's, which
    # no callback ends, once max_passes newer passes came.
    dp = _wrap(_MaybeFails(), devices, process_group=dist.group.WORLD)
    engine = sys.modules["torchdp.data_parallel"]._SYNCS[dp].engine
    remembered = []
    dp(x).sum().backward()
    remembered.append(engine.remembered_passes)
    xi = x.clone().requires_grad_()
    torch.autograd.grad(dp(xi).sum(), xi)
    remembered.append(engine.remembered_passes)
    engine.max_passes = 4
    failures = 0
    for _ in range(6):
        try:
            dp(x, fail=True).sum().backward()
        except RuntimeError as exc:
            failures += "fails on purpose" in str(exc)
    remembered.append(engine.remembered_passes)
    dp(x).sum().backward()
    remembered.append(engine.remembered_passes)
    out["remembered_passes"] = remembered
    out["failed_passes"] = failures

    # Buffers: rank 0's at every forward with grad mode on, unless broadcast_buffers=False.
    for broadcast in (True, False):
        bn = _wrap(
            _bn(seed=3), devices, process_group=dist.group.WORLD, broadcast_buffers=broadcast
        )
        for x, _ in _batches():
            bn(x.chunk(WORLD)[rank].to(dev))
        bn.eval()
        bn(x.to(dev))  # grad mode on: takes rank 0's running statistics first (when broadcasting)
        out[f"running_mean_{broadcast}"] = bn.module[1].running_mean.cpu()

    # A module that returns its parameter: a leaf output gets no hook (it would outlive the step).
    leaf = _wrap(_ReturnsWeight(), devices, process_group=dist.group.WORLD)
    for _ in range(2):
        leaf(x.to(dev)).sum().backward()
    out["leaf_hooks"] = len(leaf.module.weight._backward_hooks or {})

    # Gradients with respect to the parameters from torch.autograd.grad: returned, not averaged,
    # and .grad stays None.
    dp = _wrap(_mlp(seed=rank), devices, process_group=dist.group.WORLD)
    params = list(dp.parameters())
    grads = torch.autograd.grad(dp(x.to(dev)).sum(), params)
    out["autograd_grad_params"] = (
        [p.grad for p in params],
        all(g is not None and g.abs().sum() > 0 for g in grads),
    )

    # An output torch.utils._pytree cannot take apart (an unregistered dataclass): its tensors
    # are found all the same. Two forwards, one backward: one reduction.
    # gather cannot take the dataclass apart either: per-replica outputs.
    dp = _wrap(_DataclassOut(), devices, process_group=dist.group.WORLD, gather_output=False)
    xr = torch.randn(4, 8, generator=torch.Generator().manual_seed(20 + rank)).to(dev)
    loss = sum(o.value.sum() for o in dp(xr)) + sum(o.value.sum() for o in dp(xr * 2))
    loss.backward()
    out["dataclass_grad"] = dp.module.fc.weight.grad.cpu()
    out["dataclass_reductions"] = sys.modules["torchdp.data_parallel"]._SYNCS[dp].engine.reductions
    plain = _DataclassOut()
    (plain(xr.cpu()).value.sum() + plain(xr.cpu() * 2).value.sum()).backward()
    out["dataclass_local_grad"] = plain.fc.weight.grad

    # A sparse embedding used in one process only: its gradient is all-reduced as a sparse
    # tensor in both (an empty one where unused), with no mismatch between them.
    dp = _wrap(_SparseEmbedding(), devices, process_group=dist.group.WORLD)
    ids = torch.tensor([[1, 2], [3, 4]], device=dev)
    dp(ids, use=rank == 1).sum().backward()
    out["sparse_grad"] = dp.module.emb.weight.grad.cpu().to_dense()
    out["sparse_layout"] = dp.module.emb.weight.grad.layout
    plain = _SparseEmbedding()
    plain(ids.cpu(), use=rank == 1).sum().backward()
    out["sparse_local"] = (
        None if plain.emb.weight.grad is None else plain.emb.weight.grad.to_dense()
    )
    # Used in no process: None where torchdp alone leaves it None.
    dp = _wrap(_SparseEmbedding(), devices, process_group=dist.group.WORLD)
    dp(ids, use=False).sum().backward()
    out["sparse_unused"] = _cpu_or_none(dp.module.emb.weight.grad)
    alone = _wrap(_SparseEmbedding(), devices)
    alone(ids, use=False).sum().backward()
    out["sparse_unused_alone"] = _cpu_or_none(alone.module.emb.weight.grad)

    # The module changes after the first forward (a new head, alike in every process, but with
    # each process's own initialisation): the next forward takes rank 0's again.
    dp = _wrap(_mlp(seed=0), devices, process_group=dist.group.WORLD)
    dp(x.to(dev))
    torch.manual_seed(100 + rank)
    dp.module[4] = nn.Linear(32, 4).to(dev)
    dp(x.to(dev))
    out["new_head"] = dp.module[4].weight.detach().cpu()

    # A conversion after the first forward keeps the Parameter objects but gives them new
    # AccumulateGrad nodes: the next forward follows them, and the gradients are averaged.
    conv = _wrap(_mlp(seed=0), devices, process_group=dist.group.WORLD)
    xc = torch.randn(4, 8, generator=torch.Generator().manual_seed(30 + rank)).to(dev)
    conv(xc).sum().backward()
    conv.module.double()
    conv.zero_grad(set_to_none=True)
    conv(xc.double()).sum().backward()
    out["converted_grads"] = [p.grad.cpu() for p in conv.module.parameters()]

    # A process whose module has nothing to compare (an empty one) meets the others' check.
    try:
        module = nn.Linear(8, 4) if rank == 0 else nn.Identity()
        _wrap(module, devices, process_group=dist.group.WORLD)(x.to(dev))
        out["empty_mismatch"] = None
    except RuntimeError as exc:
        out["empty_mismatch"] = str(exc)

    # Modules that differ between processes are refused by both.
    try:
        _wrap(nn.Linear(8, 4 + rank), devices, process_group=dist.group.WORLD)(x.to(dev))
        out["mismatch"] = None
    except RuntimeError as exc:
        out["mismatch"] = str(exc)
    return out


def _cpu_or_none(grad: torch.Tensor | None) -> torch.Tensor | None:
    if grad is None:
        return None
    return (grad.to_dense() if grad.layout != torch.strided else grad).cpu()


def _worker(rank: int, backend: str, store: str, out_dir: str, devices: list[list[str] | None]):
    code = 0
    try:
        # A collective that one process never joins fails in two minutes instead of gloo's 30.
        dist.init_process_group(
            backend,
            init_method=f"file://{store}",
            rank=rank,
            world_size=WORLD,
            timeout=datetime.timedelta(seconds=120),
        )
        try:
            torch.save(_scenarios(rank, devices[rank]), os.path.join(out_dir, f"{rank}.pt"))
            dist.barrier()
        finally:
            dist.destroy_process_group()
    except BaseException:
        traceback.print_exc()
        code = 1
    exit_process(code)


def _run(tmp_path, devices: list[list[str] | None], backend: str = "gloo") -> list[dict]:
    store = str(tmp_path / "store")
    run_processes(_worker, lambda r: (r, backend, store, str(tmp_path), devices), WORLD)
    return [torch.load(tmp_path / f"{r}.pt") for r in range(WORLD)]


def _reference(accumulate: bool) -> list[torch.Tensor]:
    """Rank 0's model trained by one process on the whole batches."""
    model = _mlp(seed=0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for x, y in _batches():
        opt.zero_grad(set_to_none=True)
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    return [p.detach() for p in model.parameters()]


def _check(results: list[dict]) -> None:
    keys = [("trained", False), ("accumulated", True)]
    if _CPP:
        keys += [("cpp_trained", False), ("cpp_accumulated", True)]
    for key, accumulate in keys:
        want = _reference(accumulate)
        for rank, res in enumerate(results):
            for got, ref in zip(res[key], want, strict=True):
                torch.testing.assert_close(
                    got,
                    ref,
                    rtol=1e-5,
                    atol=1e-6,
                    msg=lambda m, k=key, r=rank: f"{k}, rank {r}: {m}",
                )

    model = _mlp(seed=0)
    x, y = _batches()[0]
    nn.functional.mse_loss(model(x), y).backward()
    for res in results:
        for got, p in zip(res["per_replica_grads"], model.parameters(), strict=True):
            torch.testing.assert_close(got, p.grad, rtol=1e-5, atol=1e-6)

    half = results[1]["local_extra_grad"] / 2
    assert results[0]["local_extra_grad"] is None
    for res in results:
        torch.testing.assert_close(res["extra_grad"], half)

    body = (results[0]["unused_body"] + results[1]["unused_body"]) / 2
    for res in results:
        torch.testing.assert_close(res["unused_body"], body)
        for key in ("unused", "sparse_unused"):
            alone = res[f"{key}_alone"]
            if alone is None:
                assert res[key] is None, key
            else:
                torch.testing.assert_close(res[key], torch.zeros_like(alone), msg=key)
                torch.testing.assert_close(alone, torch.zeros_like(alone), msg=key)

    subset_mean = (results[0]["subset_input_alone"] + results[1]["subset_input_alone"]) / 2
    for res in results:
        assert res["subset_none"] == res["subset_none_alone"]
        assert res["subset_none"][0] is False
        torch.testing.assert_close(res["subset_input"], subset_mean)

    for a, b in zip(results[0]["converted_grads"], results[1]["converted_grads"], strict=True):
        assert a.dtype == torch.float64
        torch.testing.assert_close(a, b)
    for res in results:
        msg = res["empty_mismatch"]
        assert msg is not None and "wrap different modules" in msg
        assert "group rank 1 has 0 parameters (0 elements) and 0 buffers" in msg

    for res in results:
        assert res["remembered_passes"] == [0, 0, 4, 3]
        assert res["failed_passes"] == 6

    for res in results:
        assert res["grad_of_input_param_grads"] == [None] * 4
        assert res["grad_of_input"].abs().sum() > 0

    torch.testing.assert_close(results[0]["running_mean_True"], results[1]["running_mean_True"])
    assert not torch.equal(results[0]["running_mean_False"], results[1]["running_mean_False"])

    for res in results:
        assert res["leaf_hooks"] == 0
        param_grads, returned = res["autograd_grad_params"]
        assert param_grads == [None] * 6 and returned
        assert res["dataclass_reductions"] == 1
        assert res["sparse_layout"] == torch.sparse_coo
    dataclass_mean = (results[0]["dataclass_local_grad"] + results[1]["dataclass_local_grad"]) / 2
    assert results[0]["sparse_local"] is None and results[1]["sparse_local"] is not None
    for res in results:
        torch.testing.assert_close(res["dataclass_grad"], dataclass_mean)
        torch.testing.assert_close(res["sparse_grad"], results[1]["sparse_local"] / 2)
    torch.testing.assert_close(results[0]["new_head"], results[1]["new_head"])
    for res in results:
        msg = res["mismatch"]
        assert msg is not None and "torchdp.DataParallel" in msg
        assert "wrap different modules" in msg
        assert "group rank 1 has 2 parameters (45 elements)" in msg
        assert "group rank 0 has 2 parameters (36 elements)" in msg


def test_two_processes_on_cpu_device_lists_match_whole_batch_training(tmp_path):
    _check(_run(tmp_path, [["cpu", "cpu"], ["cpu", "cpu"]]))


def test_two_processes_with_default_wrappers(tmp_path):
    # No device list: a passthrough without GPUs (CI), torchdp over every GPU with them.
    results = _run(tmp_path, [None, None])
    _check(results)
    if not torch.cuda.is_available():  # the passthrough: DDP's None for what no process used
        for res in results:
            assert res["unused"] is None and res["sparse_unused"] is None


@pytest.mark.needs_cuda
def test_two_processes_on_one_gpu(tmp_path):
    _check(_run(tmp_path, [["cuda:0", "cuda:0"], ["cuda:0", "cuda:0"]]))


@pytest.mark.needs_multi_gpu
def test_two_processes_on_their_own_gpu_over_nccl(tmp_path):
    _check(_run(tmp_path, [["cuda:0", "cuda:0"], ["cuda:1", "cuda:1"]], backend="nccl"))


# -- one process -------------------------------------------------------------------------------


@pytest.fixture
def world_of_one(tmp_path):
    dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1
    )
    yield dist.group.WORLD
    dist.destroy_process_group()


def test_process_group_needs_an_initialised_default_group():
    assert not dist.is_initialized()
    with pytest.raises(
        RuntimeError,
        match=r"torchdp.DataParallel: process_group was given but "
        r"torch.distributed is not initialized; call torch.distributed",
    ):
        torchdp.DataParallel(nn.Linear(2, 2), process_group=object())


def test_process_group_type_and_cuda_graphs_are_checked(world_of_one):
    with pytest.raises(
        TypeError,
        match=r"process_group must be a torch.distributed.ProcessGroup "
        r".*got 'world' \(str\)",
    ):
        torchdp.DataParallel(nn.Linear(2, 2), process_group="world")
    with pytest.raises(ValueError, match="not a member of the process_group"):
        torchdp.DataParallel(nn.Linear(2, 2), process_group=dist.GroupMember.NON_GROUP_MEMBER)
    with pytest.raises(ValueError, match="process_group cannot be combined with cuda_graphs"):
        torchdp.DataParallel(nn.Linear(2, 2), cuda_graphs=True, process_group=world_of_one)
    # Switched on after construction: refused at the forward.
    dp = torchdp.DataParallel(nn.Linear(2, 2), process_group=world_of_one)
    dp.cuda_graphs = 8
    with pytest.raises(ValueError, match="process_group cannot be combined with cuda_graphs"):
        dp(torch.randn(2, 2))
    # The conflict is named before anything about the module, here its placement.
    misplaced = torchdp.DataParallel(
        nn.Linear(2, 2, device="meta"),
        devices=[torch.device("cpu")] * 2,
        process_group=world_of_one,
    )
    misplaced.cuda_graphs = 8
    with pytest.raises(ValueError, match="process_group cannot be combined with cuda_graphs"):
        misplaced(torch.randn(2, 2))


def test_bad_bucket_cap_is_refused_before_the_module_runs(world_of_one):
    dp = torchdp.DataParallel(nn.BatchNorm1d(3), process_group=world_of_one)
    dp.bucket_cap_mb = -1
    with pytest.raises(ValueError, match="bucket_cap_mb"):
        dp(torch.randn(4, 3))
    assert dp.module.num_batches_tracked.item() == 0
    torch.testing.assert_close(dp.module.running_mean, torch.zeros_like(dp.module.running_mean))


def test_process_group_attribute_and_copies(world_of_one):
    import copy
    import pickle

    dp = torchdp.DataParallel(
        nn.Linear(2, 2), devices=[torch.device("cpu")] * 2, process_group=world_of_one
    )
    assert dp.process_group is world_of_one
    assert torchdp.DataParallel(nn.Linear(2, 2)).process_group is None
    # The group travels neither with copies nor with pickles; the rest of the wrapper does.
    clone = copy.deepcopy(dp)
    assert clone.process_group is None and clone.broadcast_buffers is True
    assert pickle.loads(pickle.dumps(dp)).process_group is None
    dp.process_group = None
    assert dp.process_group is None
    dp.process_group = world_of_one
    assert dp.process_group is world_of_one


def test_group_of_one_trains_as_plain_module(world_of_one):
    model = _mlp(seed=0)
    dp = torchdp.DataParallel(model, devices=[torch.device("cpu")] * 2, process_group=world_of_one)
    plain = _mlp(seed=0)
    x, y = _batches()[0]
    nn.functional.mse_loss(dp(x), y).backward()
    nn.functional.mse_loss(plain(x), y).backward()
    for got, want in zip(model.parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(got.grad, want.grad, rtol=1e-5, atol=1e-6)
    with dp.no_sync():
        assert dp.require_backward_grad_sync is False
    assert dp.require_backward_grad_sync is True
