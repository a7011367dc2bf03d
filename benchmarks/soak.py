"""Soak test: many training steps through torchdp.DataParallel, watching for growth.

Trains a small model with BatchNorm and a masked linear layer (a registered mask buffer, as
cplxmodule's LinearMasked) for ``--steps`` steps on any device list, and every ``--every`` steps
prints the process's resident memory, its thread count and, on CUDA devices, the memory the
caching allocator has handed out. The first report (after the warm-up steps) is the baseline; the
run exits with status 1 as soon as a later report exceeds it by more than the stated bounds.

    python benchmarks/soak.py                           # 2,000 steps on cuda:0,cuda:0 or cpu,cpu
    python benchmarks/soak.py --devices cpu,cpu,cpu --steps 200
    python benchmarks/soak.py --devices cuda:0,cuda:0 --cuda-graphs
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torchdp
from torch import nn


class MaskedLinear(nn.Linear):
    """A linear layer whose weight is multiplied by a fixed mask buffer."""

    def __init__(self, n_in: int, n_out: int) -> None:
        super().__init__(n_in, n_out)
        self.register_buffer("mask", (torch.rand(n_out, n_in) > 0.3).float())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(x, self.weight * self.mask, self.bias)


def make_model(width: int) -> nn.Module:
    return nn.Sequential(
        MaskedLinear(width, width),
        nn.BatchNorm1d(width),
        nn.ReLU(),
        MaskedLinear(width, width),
        nn.BatchNorm1d(width),
        nn.ReLU(),
        nn.Linear(width, 10),
    )


def _status_field(name: str) -> int:
    """A number from /proc/self/status (kB for memory fields); 0 where there is none."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(name + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def measure(devices: list[torch.device]) -> dict[str, float]:
    """RSS (MiB), threads and CUDA memory handed out (MiB, summed over the CUDA devices used)."""
    cuda = sorted({d.index for d in devices if d.type == "cuda"})
    cuda_mb = sum(torch.cuda.memory_allocated(i) for i in cuda) / 2**20
    return {
        "rss_mb": _status_field("VmRSS") / 1024,
        "threads": float(_status_field("Threads") or len(os.listdir("/proc/self/task"))),
        "cuda_mb": cuda_mb,
    }


def default_devices() -> str:
    return "cuda:0,cuda:0" if torch.cuda.is_available() else "cpu,cpu"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=2000, help="training steps (default 2000)")
    parser.add_argument("--devices", default=default_devices(), help="comma-separated device list")
    parser.add_argument("--batch", type=int, default=64, help="global batch size")
    parser.add_argument("--width", type=int, default=128, help="hidden width")
    parser.add_argument("--every", type=int, default=100, help="report every N steps")
    parser.add_argument("--warmup", type=int, default=100, help="steps before the baseline")
    parser.add_argument("--cuda-graphs", action="store_true", help="cuda_graphs=True")
    parser.add_argument("--rss-bound-mb", type=float, default=64.0, help="allowed RSS growth (MiB)")
    parser.add_argument(
        "--threads-bound", type=int, default=0, help="allowed growth of the thread count"
    )
    parser.add_argument(
        "--cuda-bound-mb", type=float, default=8.0, help="allowed CUDA memory growth (MiB)"
    )
    args = parser.parse_args(argv)
    if args.steps <= args.warmup:
        parser.error(f"--steps ({args.steps}) must be larger than --warmup ({args.warmup})")

    devices = [torch.device(d.strip()) for d in args.devices.split(",")]
    torch.manual_seed(0)
    model = make_model(args.width).to(devices[0])
    dp = torchdp.DataParallel(model, devices=devices, cuda_graphs=args.cuda_graphs)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    x = torch.randn(args.batch, args.width, device=devices[0])
    y = torch.randint(0, 10, (args.batch,), device=devices[0])
    loss_fn = nn.CrossEntropyLoss()

    print(
        f"soak: {args.steps} steps on {[str(d) for d in devices]}, batch {args.batch}, "
        f"bounds: RSS +{args.rss_bound_mb} MiB, threads +{args.threads_bound}, "
        f"CUDA +{args.cuda_bound_mb} MiB (baseline at step {args.warmup})",
        flush=True,
    )
    baseline: dict[str, float] | None = None
    bounds = {
        "rss_mb": args.rss_bound_mb,
        "threads": float(args.threads_bound),
        "cuda_mb": args.cuda_bound_mb,
    }
    start = time.perf_counter()
    for step in range(1, args.steps + 1):
        optimizer.zero_grad(set_to_none=True)
        loss = loss_fn(dp(x), y)
        loss.backward()
        optimizer.step()
        if step % args.every and step != args.warmup:
            continue
        if any(d.type == "cuda" for d in devices):
            torch.cuda.synchronize()
        now = measure(devices)
        if step == args.warmup:
            baseline = now
        growth = {k: now[k] - baseline[k] for k in now} if baseline else None
        print(
            f"step {step:6d}  loss {loss.item():.4f}  RSS {now['rss_mb']:.1f} MiB  "
            f"threads {int(now['threads'])}  CUDA {now['cuda_mb']:.1f} MiB  "
            f"({(time.perf_counter() - start) / step * 1e3:.2f} ms/step)",
            flush=True,
        )
        if growth is None:
            continue
        over = [k for k in growth if growth[k] > bounds[k]]
        if over:
            for k in over:
                print(
                    f"soak: FAILED at step {step}: {k} grew by {growth[k]:.1f} since step "
                    f"{args.warmup} (bound {bounds[k]})",
                    file=sys.stderr,
                )
            return 1
    calls = int(model[1].num_batches_tracked.item())
    if calls != args.steps:
        print(
            f"soak: FAILED: BatchNorm counted {calls} batches for {args.steps} steps",
            file=sys.stderr,
        )
        return 1
    print(f"soak: passed ({args.steps} steps, every bound held)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
