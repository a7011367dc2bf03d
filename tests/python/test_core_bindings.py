"""Smoke tests of the core section of torchdp._C (csrc/python/bind_core.cpp, python/torchdp/_C.pyi)
on CPU device lists: runtime queries, the comm/autograd transport, parallel_apply and error
translation."""

from __future__ import annotations

import threading

import pytest
import torch

import torchdp
from torchdp import _C, _version

CPU = torch.device("cpu")


def test_runtime_queries():
    # has_cuda(): built with the CUDA fast paths *and* a CUDA device visible now; has_nccl(): built
    # with the NCCL transport, whatever the machine has. A CUDA + NCCL build on a machine without
    # a GPU (a CUDA wheel of torch on a CPU runner) answers has_nccl() True, has_cuda() False.
    assert isinstance(_C.has_cuda(), bool)
    assert isinstance(_C.has_nccl(), bool)
    assert isinstance(_C.cuda_device_count(), int)
    if not torch.cuda.is_available():
        assert not _C.has_cuda()
        assert _C.cuda_device_count() == 0
    elif _C.has_nccl():  # NCCL is built only with the CUDA fast paths
        assert _C.has_cuda()


def test_version_matches_package():
    assert isinstance(_C.__version__, str)
    assert _C.__version__ == _version.__version__
    assert torchdp.__version__ == _C.__version__


def test_normalize_devices():
    out = _C.normalize_devices([torch.device("cpu", 0), CPU, torch.device("meta")], "torchdp.test")
    assert out == [CPU, CPU, torch.device("meta")]
    with pytest.raises(RuntimeError, match="torchdp.test"):
        _C.normalize_devices([], "torchdp.test")


@pytest.mark.parametrize("differentiable", [False, True])
def test_broadcast_coalesced_cpu(differentiable):
    a = torch.randn(3, 4)
    b = torch.arange(5)
    out = _C.broadcast_coalesced([a, b], [CPU, CPU], differentiable=differentiable)
    assert len(out) == 2 and all(len(per_device) == 2 for per_device in out)
    # devices[0]'s outputs are the inputs (differentiable: tensors sharing their storage).
    for original, first in zip([a, b], out[0], strict=True):
        assert first.data_ptr() == original.data_ptr()
        if not differentiable:
            assert first is original
    # every other copy has its own storage and equal values.
    for original, copy in zip([a, b], out[1], strict=True):
        assert torch.equal(copy, original)
        assert copy.untyped_storage().data_ptr() != original.untyped_storage().data_ptr()


def test_broadcast_coalesced_small_buckets_and_bad_size():
    tensors = [torch.randn(10) for _ in range(4)]
    out = _C.broadcast_coalesced(tensors, [CPU, CPU, CPU], buffer_size=16)
    for copies in out[1:]:
        for original, copy in zip(tensors, copies, strict=True):
            assert torch.equal(original, copy)
    with pytest.raises(ValueError, match="buffer_size"):
        _C.broadcast_coalesced(tensors, [CPU, CPU], buffer_size=0)


def test_broadcast_then_reduce_add_gradient():
    w = torch.randn(4, requires_grad=True)
    copies = _C.broadcast_coalesced([w], [CPU, CPU, CPU], differentiable=True)
    total = _C.reduce_add_coalesced(copies, CPU, differentiable=True)[0]
    assert torch.allclose(total, 3 * w)
    total.sum().backward()
    assert torch.allclose(w.grad, torch.full_like(w, 3.0))


def test_reduce_add_coalesced_cpu():
    per_device = [[torch.ones(2, 3), torch.arange(4)], [torch.ones(2, 3), torch.arange(4)]]
    out = _C.reduce_add_coalesced(per_device, CPU)
    assert torch.equal(out[0], torch.full((2, 3), 2.0))
    assert torch.equal(out[1], 2 * torch.arange(4))
    for result, first in zip(out, per_device[0], strict=True):
        assert result.data_ptr() != first.data_ptr()


def test_scatter_gather_round_trip_with_gradient():
    x = torch.randn(7, 3, requires_grad=True)
    chunks = _C.scatter(x, [CPU, CPU, CPU])
    assert [c.shape[0] for c in chunks] == [3, 3, 1]
    assert all(c.requires_grad for c in chunks)
    y = _C.gather([c * (i + 1) for i, c in enumerate(chunks)], CPU)
    assert y.shape == x.shape
    y.sum().backward()
    expected = torch.cat(
        [torch.full((3, 3), 1.0), torch.full((3, 3), 2.0), torch.full((1, 3), 3.0)]
    )
    assert torch.equal(x.grad, expected)


def test_scatter_chunk_sizes_dim_and_fewer_chunks():
    x = torch.arange(12.0).reshape(2, 6)
    chunks = _C.scatter(x, [CPU, CPU], chunk_sizes=[2, 4], dim=1, differentiable=False)
    assert [c.shape for c in chunks] == [torch.Size([2, 2]), torch.Size([2, 4])]
    assert torch.equal(_C.gather(chunks, CPU, dim=1, differentiable=False), x)
    # a batch of 5 on 4 devices gives 3 chunks, as tensor.chunk does.
    assert len(_C.scatter(torch.randn(5), [CPU] * 4)) == 3


def test_gather_scalars_warns_and_returns_vector():
    scalars = [torch.tensor(1.0, requires_grad=True), torch.tensor(2.0, requires_grad=True)]
    with pytest.warns(UserWarning, match="all input tensors were scalars"):
        out = _C.gather(scalars, CPU)
    assert torch.equal(out.detach(), torch.tensor([1.0, 2.0]))
    out.sum().backward()
    assert scalars[0].grad.item() == 1.0 and scalars[1].grad.item() == 1.0


def test_parallel_apply_runs_in_order():
    fns = [lambda i=i: (i, threading.get_ident()) for i in range(4)]
    out = _C.parallel_apply(fns, [CPU] * 4)
    assert [r[0] for r in out] == [0, 1, 2, 3]
    assert out[0][1] == threading.get_ident()  # fn 0 runs on the calling thread
    assert _C.parallel_apply([], []) == []


def test_parallel_apply_returns_arbitrary_objects_and_tensors():
    x = torch.randn(3)
    out = _C.parallel_apply([lambda: None, lambda: {"y": x * 2}, lambda: x + 1], [CPU] * 3)
    assert out[0] is None
    assert torch.equal(out[1]["y"], x * 2)
    assert torch.equal(out[2], x + 1)


def test_parallel_apply_carries_grad_mode():
    def probe():
        return torch.is_grad_enabled()

    with torch.no_grad():
        assert _C.parallel_apply([probe] * 3, [CPU] * 3) == [False, False, False]
    assert _C.parallel_apply([probe] * 3, [CPU] * 3) == [True, True, True]


def test_parallel_apply_reraises_python_exception_as_is():
    class Boom(ValueError):
        pass

    def ok():
        return 1

    def fail():
        raise Boom("fn 1 failed")

    def other():
        raise KeyError("fn 2 failed")

    with pytest.raises(ValueError, match="fn 1 failed") as info:
        _C.parallel_apply([ok, fail, other], [CPU] * 3)
    assert type(info.value) is Boom
    # the traceback reaches the frame that raised.
    assert any(entry.name == "fail" for entry in info.traceback)


def test_parallel_apply_lowest_index_error_wins():
    def fail(i):
        def fn():
            raise RuntimeError(f"error {i}")

        return fn

    with pytest.raises(RuntimeError, match="error 1"):
        _C.parallel_apply([lambda: 0, fail(1), fail(2), fail(3)], [CPU] * 4)


def test_parallel_apply_length_mismatch():
    with pytest.raises(ValueError, match="torchdp.parallel_apply"):
        _C.parallel_apply([lambda: 0, lambda: 1], [CPU])


def test_parallel_apply_releases_gil_for_nested_threads():
    # Each fn waits for all the others: this only finishes if the workers really run concurrently
    # and every waiting worker gives the GIL back.
    barrier = threading.Barrier(3, timeout=30)

    def fn():
        barrier.wait()
        return True

    assert _C.parallel_apply([fn] * 3, [CPU] * 3) == [True, True, True]


def test_cpp_error_becomes_runtime_error():
    with pytest.raises(RuntimeError, match="torchdp::comm::scatter"):
        _C.scatter(torch.randn(4), [])
    with pytest.raises(RuntimeError, match="torchdp::comm::scatter"):
        _C.scatter(torch.randn(4), [], differentiable=False)


@pytest.mark.needs_cuda
def test_cuda_transport_round_trip():
    devices = [torch.device("cuda", i) for i in range(torch.cuda.device_count())]
    x = torch.randn(2 * len(devices), 3, device=devices[0], requires_grad=True)
    chunks = _C.scatter(x, devices)
    assert [c.device for c in chunks] == devices
    y = _C.gather([c * 2 for c in chunks], devices[0])
    y.sum().backward()
    assert torch.equal(x.grad, torch.full_like(x, 2.0))
    copies = _C.broadcast_coalesced([x.detach()], devices)
    assert [c[0].device for c in copies] == devices
    total = _C.reduce_add_coalesced(copies, devices[0])[0]
    assert torch.allclose(total, len(devices) * x.detach())


@pytest.mark.needs_cuda
def test_parallel_apply_sets_the_current_cuda_device_and_stream():
    devices = [torch.device("cuda", i) for i in range(torch.cuda.device_count())]
    streams = [torch.cuda.Stream(device=d) for d in devices]

    def probe():
        return torch.cuda.current_device(), torch.cuda.current_stream()

    contexts = [torch.cuda.stream(s) for s in streams]
    for ctx in contexts:
        ctx.__enter__()
    try:
        out = _C.parallel_apply([probe] * len(devices), devices)
    finally:
        for ctx in reversed(contexts):
            ctx.__exit__(None, None, None)
    assert [o[0] for o in out] == [d.index for d in devices]
    assert [o[1] for o in out] == streams


def test_torch_mismatch_suggests_an_installable_torch():
    # The ImportError on a torch mismatch names a command an index serves: no local tag in "==".
    assert torchdp._torch_install_command("2.13.0") == "pip install torch==2.13.0"
    assert torchdp._torch_install_command("2.14.1+cu130") == (
        "pip install torch==2.14.1 --index-url https://download.pytorch.org/whl/cu130"
    )
