"""torchdp inside DistributedDataParallel: one process per host (here: two processes on one machine,
gloo backend), torchdp.DataParallel over the process's devices, gradients all-reduced across the
processes by DDP. Training must match one process training the plain module on the whole batch."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from dp_testing import exit_process, run_processes
from torch import nn

import torchdp

WORLD = 2
STEPS = 3
BATCH = 16  # the global batch: each process takes BATCH / WORLD rows


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 4)
    )


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [
        (torch.randn(BATCH, 8, generator=g), torch.randn(BATCH, 4, generator=g))
        for _ in range(STEPS)
    ]


def _worker(rank: int, store: str, out_dir: str, devices: list[str], accumulate: bool) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD)
    try:
        device_list = [torch.device(d) for d in devices]
        model = _model().to(device_list[0])
        # Small torchdp buckets: DDP's hooks fire while torchdp's buckets are still being reduced.
        dp = torchdp.DataParallel(model, devices=device_list, bucket_cap_mb=0.001)
        ddp = nn.parallel.DistributedDataParallel(dp)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
        for x, y in _batches():
            x = x.chunk(WORLD)[rank].to(device_list[0])
            y = y.chunk(WORLD)[rank].to(device_list[0])
            opt.zero_grad(set_to_none=True)
            if accumulate:
                # Two micro-batches: the first without the all-reduce (DDP's no_sync), the
                # second with it; the loss halves so the sum is the mean over both.
                (xa, xb), (ya, yb) = x.chunk(2), y.chunk(2)
                with ddp.no_sync():
                    (nn.functional.mse_loss(ddp(xa), ya) / 2).backward()
                (nn.functional.mse_loss(ddp(xb), yb) / 2).backward()
            else:
                nn.functional.mse_loss(ddp(x), y).backward()
            opt.step()
        torch.save(
            [p.detach().cpu() for p in model.parameters()], os.path.join(out_dir, f"{rank}.pt")
        )
        dist.barrier()
    finally:
        dist.destroy_process_group()
    exit_process(0)


def _run(tmp_path, devices: list[str], accumulate: bool = False) -> None:
    store = str(tmp_path / "store")
    run_processes(_worker, lambda r: (r, store, str(tmp_path), devices, accumulate), WORLD)

    reference = _model()
    opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    for x, y in _batches():
        opt.zero_grad(set_to_none=True)
        nn.functional.mse_loss(reference(x), y).backward()
        opt.step()
    for rank in range(WORLD):
        trained = torch.load(tmp_path / f"{rank}.pt")
        for got, want in zip(trained, reference.parameters(), strict=True):
            torch.testing.assert_close(got, want.detach(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("accumulate", [False, True], ids=["step", "no_sync"])
def test_ddp_over_torchdp_on_cpu_matches_whole_batch_training(tmp_path, accumulate):
    _run(tmp_path, ["cpu", "cpu"], accumulate)


@pytest.mark.needs_cuda
def test_ddp_over_torchdp_on_one_gpu(tmp_path):
    _run(tmp_path, ["cuda:0", "cuda:0"])


@pytest.mark.needs_multi_gpu
def test_ddp_over_torchdp_on_two_gpus(tmp_path):
    _run(tmp_path, ["cuda:0", "cuda:1"])
