"""torchdp over several processes (one per host in real use), each driving its own devices with
``torchdp.DataParallel``: the gradients that torchdp has summed into each process's model are
averaged over the processes by its ``process_group`` option (``--sync process_group``, the
default) or by an enclosing DistributedDataParallel (``--sync ddp``).

Here the processes run on one machine and talk over gloo. Every process takes its share of each
global batch; at the end the weights of every process must equal those of one process training the
plain model on the whole batches.

Usage::

    python examples/python/train_multiprocess.py                     # 2 processes x [cpu, cpu]
    python examples/python/train_multiprocess.py --procs 2 --devices cuda:0,cuda:1 --steps 50
    python examples/python/train_multiprocess.py --sync ddp
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

import torchdp

BATCH = 64


def build_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 4)
    )


def batches(steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(7)
    return [
        (torch.randn(BATCH, 16, generator=g), torch.randn(BATCH, 4, generator=g))
        for _ in range(steps)
    ]


def worker(
    rank: int, procs: int, store: str, devices: list[str], steps: int, out_dir: str, sync: str
) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=procs)
    try:
        device_list = [torch.device(d) for d in devices]
        model = build_model().to(device_list[0])
        if sync == "process_group":
            ddp = torchdp.DataParallel(model, devices=device_list, process_group=dist.group.WORLD)
        else:
            ddp = nn.parallel.DistributedDataParallel(
                torchdp.DataParallel(model, devices=device_list)
            )
        opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
        started = time.perf_counter()
        for step, (x, y) in enumerate(batches(steps), 1):
            x = x.chunk(procs)[rank].to(device_list[0])
            y = y.chunk(procs)[rank].to(device_list[0])
            opt.zero_grad(set_to_none=True)
            loss = nn.functional.mse_loss(ddp(x), y)
            loss.backward()
            opt.step()
            if rank == 0 and (step % 10 == 0 or step == steps):
                rate = step / (time.perf_counter() - started)
                print(
                    f"step {step:4d}/{steps}  loss {loss.item():.4f}  {rate:6.1f} steps/s",
                    flush=True,
                )
        torch.save(
            [p.detach().cpu() for p in model.parameters()], os.path.join(out_dir, f"{rank}.pt")
        )
        dist.barrier()
    finally:
        dist.destroy_process_group()
    # gloo's teardown at interpreter exit can abort with some torch builds; the work is saved.
    sys.stdout.flush()
    os._exit(0)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--procs", type=int, default=2, help="processes (default 2)")
    parser.add_argument(
        "--devices", default="cpu,cpu", help="devices of each process's torchdp.DataParallel"
    )
    parser.add_argument("--steps", type=int, default=30, help="training steps (default 30)")
    parser.add_argument(
        "--sync",
        choices=["process_group", "ddp"],
        default="process_group",
        help="what averages the gradients over the processes: torchdp.DataParallel's "
        "process_group option or an enclosing DistributedDataParallel (default process_group)",
    )
    args = parser.parse_args()
    if args.procs < 1 or BATCH % args.procs:
        parser.error(f"--procs must divide the batch of {BATCH}, got {args.procs}")
    devices = [d.strip() for d in args.devices.split(",") if d.strip()]
    print(
        f"{args.procs} processes (gloo), each torchdp.DataParallel over {devices}, "
        f"{args.steps} steps of {BATCH} samples, gradients averaged by {args.sync}",
        flush=True,
    )
    with tempfile.TemporaryDirectory() as tmp:
        ctx = mp.get_context("spawn")
        procs = [
            ctx.Process(
                target=worker,
                args=(r, args.procs, f"{tmp}/store", devices, args.steps, tmp, args.sync),
            )
            for r in range(args.procs)
        ]
        for p in procs:
            p.start()
        for p in procs:
            p.join()
        if any(p.exitcode != 0 for p in procs):
            print(f"FAILED: worker exit codes {[p.exitcode for p in procs]}", file=sys.stderr)
            return 1
        reference = build_model()
        opt = torch.optim.SGD(reference.parameters(), lr=0.05)
        for x, y in batches(args.steps):
            opt.zero_grad(set_to_none=True)
            nn.functional.mse_loss(reference(x), y).backward()
            opt.step()
        worst = 0.0
        for rank in range(args.procs):
            trained = torch.load(os.path.join(tmp, f"{rank}.pt"))
            for got, want in zip(trained, reference.parameters(), strict=True):
                worst = max(worst, (got - want.detach()).abs().max().item())
    if worst > 1e-4:
        print(f"FAILED: weights differ from one-process training by {worst:.2e}", file=sys.stderr)
        return 1
    print(f"OK: every process's weights match one-process training (max abs diff {worst:.2e})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
