"""Uneven shares of the batch (Note [Uneven shares] in csrc/torchdp/shares.h): the rows each
device gets, the split of scatter, DataParallel and data_parallel, and results equal to the
module on one device."""

from __future__ import annotations

import pytest
import torch
from dp_testing import clone_module, cpu_devices
from torch import nn

import torchdp
from torchdp import _C


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 5))


def _assert_same_grads(net: nn.Module, ref: nn.Module) -> None:
    for (name, p), q in zip(net.named_parameters(), ref.parameters(), strict=True):
        assert p.grad is not None, name
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize(
    ("shares", "rows", "expected"),
    [
        ([1, 2, 2, 2], 14, [2, 4, 4, 4]),  # exact quotas
        ([1, 2, 2, 2], 16, [2, 5, 5, 4]),  # leftovers to the largest remainders, earlier on ties
        ([1, 2, 2, 2], 3, [0, 1, 1, 1]),  # a batch smaller than the devices
        ([1, 3], 4, [1, 3]),  # row counts that add up to the batch: taken as they are
        ([3, 5, 0], 8, [3, 5, 0]),
        ([0.5, 0.5], 5, [3, 2]),
        ([0, 1, 1], 7, [0, 4, 3]),  # a share of 0: no rows
        ([1, 1000], 10, [0, 10]),
        ([2, 1], 0, [0, 0]),
    ],
)
def test_share_rows_adds_up_to_the_batch(shares, rows, expected):
    counts = _C.share_rows(shares, rows, len(shares), "t")
    assert counts == expected
    assert sum(counts) == rows


@pytest.mark.parametrize(
    ("shares", "match"),
    [
        ([1, 2], r"t: shares \[1, 2\] has 2 entries but there are 3 devices; give one share"),
        ([1, -1, 1], r"has -1 for device 1; every share must be a finite number >= 0"),
        ([1, float("nan"), 1], r"has nan for device 1"),
        ([1, float("inf"), 1], r"has inf for device 1"),
        ([0, 0, 0], r"are all zero, so no device would get any rows; give at least one device"),
    ],
)
def test_shares_that_do_not_fit_are_refused(shares, match):
    with pytest.raises(ValueError, match=match):
        _C.share_rows(shares, 6, 3, "t")


def test_scatter_splits_every_tensor_by_the_same_rows():
    x, y = torch.randn(7, 3), torch.arange(7)
    chunks = torchdp.scatter((x, {"y": y}, "tag"), cpu_devices(3), shares=[1, 2, 2])
    assert [c[0].shape[0] for c in chunks] == [1, 3, 3]
    torch.testing.assert_close(torch.cat([c[0] for c in chunks]), x)
    assert torch.equal(torch.cat([c[1]["y"] for c in chunks]), y)
    assert all(c[2] == "tag" for c in chunks)
    # a bare tensor, along dim 1, and devices that get no rows get no chunk
    parts = torchdp.scatter(torch.randn(2, 5), cpu_devices(3), 1, shares=[0, 2, 3])
    assert [p.shape for p in parts] == [torch.Size([2, 2]), torch.Size([2, 3])]


def test_scatter_kwargs_splits_both_sides_by_the_same_rows():
    args, kws = torchdp.scatter_kwargs(
        (torch.randn(5, 2),), {"mask": torch.ones(5), "n": 3}, cpu_devices(2), shares=[4, 1]
    )
    assert [a[0].shape[0] for a in args] == [4, 1]
    assert [k["mask"].shape[0] for k in kws] == [4, 1]
    assert [k["n"] for k in kws] == [3, 3]


def test_scatter_with_shares_refuses_other_sizes_and_bad_shares():
    with pytest.raises(ValueError, match=r"tensor 0 of the input has 6 rows but tensor 1 .* has 5"):
        torchdp.scatter((torch.randn(6, 2), torch.randn(5, 2)), cpu_devices(2), shares=[1, 1])
    with pytest.raises(ValueError, match=r"torchdp.scatter: shares \[1, 1, 1\] has 3 entries"):
        torchdp.scatter(torch.randn(6, 2), cpu_devices(2), shares=[1, 1, 1])
    with pytest.raises(TypeError, match=r"torchdp.scatter: shares must be a sequence of numbers"):
        torchdp.scatter(torch.randn(6, 2), cpu_devices(2), shares="12")
    with pytest.raises(TypeError, match=r"shares must be a sequence of numbers"):
        torchdp.scatter(torch.randn(6, 2), cpu_devices(2), shares=[True, 1])


def test_one_row_per_device_is_a_value_per_replica():
    x, per_replica = torch.randn(9, 2), torch.tensor([10.0, 20.0, 30.0])
    chunks = torchdp.scatter((x, per_replica), cpu_devices(3), shares=[0, 1, 2])
    assert [c[0].shape[0] for c in chunks] == [3, 6]
    assert [c[1].tolist() for c in chunks] == [[20.0], [30.0]]


@pytest.mark.parametrize("shares", [[1, 2, 2], [0, 3, 4], [2, 5, 0], [1, 0, 1]])
def test_data_parallel_with_shares_equals_one_device(shares):
    net = _net()
    ref = clone_module(net)
    dp = torchdp.DataParallel(net, devices=cpu_devices(3), shares=shares)
    assert dp.shares == [float(s) for s in shares]
    x, y = torch.randn(7, 6), torch.randint(0, 5, (7,))
    seen: list[int] = []
    hook = net[0].register_forward_hook(lambda m, i, o: seen.append(i[0].shape[0]))
    out = dp(x)
    hook.remove()
    counts = _C.share_rows([float(s) for s in shares], 7, 3, "t")
    assert sorted(seen) == sorted(c for c in counts if c)  # devices without rows did not run
    torch.testing.assert_close(out, ref(x))
    loss = nn.functional.cross_entropy(out, y)
    expected = nn.functional.cross_entropy(ref(x), y)
    torch.testing.assert_close(loss, expected)
    loss.backward()
    expected.backward()
    _assert_same_grads(net, ref)


def test_data_parallel_with_shares_keyword_inputs_and_small_batches():
    class Scaled(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 2)

        def forward(self, x: torch.Tensor, *, scale: torch.Tensor) -> torch.Tensor:
            return self.lin(x) * scale[:, None]

    net = Scaled()
    ref = clone_module(net)
    dp = torchdp.DataParallel(net, devices=cpu_devices(4), shares=[1, 2, 2, 2])
    for rows in (3, 1, 16):
        x, scale = torch.randn(rows, 4), torch.rand(rows)
        torch.testing.assert_close(dp(x, scale=scale), ref(x, scale=scale))


def test_data_parallel_functional_with_shares():
    net = _net()
    ref = clone_module(net)
    x = torch.randn(9, 6)
    out = torchdp.data_parallel(net, x, devices=cpu_devices(3), shares=[0, 1, 2])
    torch.testing.assert_close(out, ref(x))
    out.sum().backward()
    ref(x).sum().backward()
    _assert_same_grads(net, ref)
    with pytest.raises(ValueError, match=r"torchdp.data_parallel: shares \[1\] has 1 entries"):
        torchdp.data_parallel(net, x, devices=cpu_devices(3), shares=[1])


def test_data_parallel_shares_errors_leave_the_module_as_it_was():
    with pytest.raises(ValueError, match=r"torchdp.DataParallel: shares \[1, 2\] has 2 entries"):
        torchdp.DataParallel(_net(), devices=cpu_devices(3), shares=[1, 2])
    with pytest.raises(ValueError, match=r"are all zero"):
        torchdp.DataParallel(_net(), devices=cpu_devices(2), shares=[0, 0])
    net = nn.Sequential(nn.Linear(6, 5), nn.BatchNorm1d(5))
    before = {k: v.clone() for k, v in net.state_dict().items()}
    dp = torchdp.DataParallel(net, devices=cpu_devices(2), shares=[1, 1])
    x = torch.randn(6, 6)
    with pytest.raises(ValueError, match=r"positional argument|tensor 1 of the input has 5"):
        dp(x, torch.randn(5, 6))
    for k, v in net.state_dict().items():
        assert torch.equal(v, before[k]), k
    assert all(p.grad is None for p in net.parameters())


def test_batchnorm_statistics_with_a_first_share_of_zero():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))
    ref = clone_module(net)
    dp = torchdp.DataParallel(net, devices=cpu_devices(2), shares=[0, 1])
    x = torch.randn(8, 3)
    torch.testing.assert_close(dp(x), ref(x))  # one replica, on the whole batch
    torch.testing.assert_close(net[1].running_mean, ref[1].running_mean)
    torch.testing.assert_close(net[1].running_var, ref[1].running_var)


def test_criterion_with_uneven_outputs_is_the_row_weighted_mean():
    net = _net()
    ref = clone_module(net)
    dp = torchdp.DataParallel(net, devices=cpu_devices(3), gather_output=False, shares=[1, 3, 3])
    crit = torchdp.DataParallelCriterion(nn.CrossEntropyLoss())
    x, y = torch.randn(7, 6), torch.randint(0, 5, (7,))
    outs = dp(x)
    assert [o.shape[0] for o in outs] == [1, 3, 3]
    loss = crit(outs, y)
    expected = nn.CrossEntropyLoss()(ref(x), y)
    torch.testing.assert_close(loss, expected)
    loss.backward()
    expected.backward()
    _assert_same_grads(net, ref)


def test_cuda_graphs_and_shares_are_refused_together():
    with pytest.raises(ValueError, match=r"shares and cuda_graphs cannot be combined"):
        torchdp.DataParallel(_net(), devices=cpu_devices(2), shares=[1, 1], cuda_graphs=True)
