"""Soak test: many training steps through torchdp.DataParallel, watching for growth.

Trains a small model with BatchNorm and a masked linear layer (a registered mask buffer, as
cplxmodule's LinearMasked) for ``--steps`` steps on any device list, and every ``--every`` steps
prints the process's resident memory, its thread count and, on CUDA devices, the memory the
caching allocator has handed out. The report after the warm-up steps is the baseline; the run exits
with status 1 as soon as a later report exceeds it by more than the bounds.

    python tests/python/soak.py                           # 2,000 steps on cuda:0,cuda:0 or cpu,cpu
    python tests/python/soak.py --devices cpu,cpu,cpu --steps 200
    python tests/python/soak.py --devices cuda:0,cuda:0 --cuda-graphs
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
from torch import nn

import torchdp


class MaskedLinear(nn.Linear):
    """A linear layer whose weight is multiplied by a fixed mask buffer."""

    def __init__(self, n_in: int, n_out: int) -> None:
        super().__init__(n_in, n_out)
        self.register_buffer("mask", (torch.rand(n_out, n_in) > 0.3).float())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(x, self.weight * self.mask, self.bias)


def status(name: str) -> int:
    """A number from /proc/self/status (kB for memory fields); 0 where there is none."""
    try:
        with open("/proc/self/status") as f:
            return next((int(line.split()[1]) for line in f if line.startswith(name + ":")), 0)
    except OSError:
        return 0


def measure(devices: list[torch.device]) -> dict[str, float]:
    """RSS (MiB), threads and CUDA memory handed out (MiB, summed over the CUDA devices used)."""
    cuda = {d.index for d in devices if d.type == "cuda"}
    return {
        "rss_mb": status("VmRSS") / 1024,
        "threads": float(status("Threads") or len(os.listdir("/proc/self/task"))),
        "cuda_mb": sum(torch.cuda.memory_allocated(i) for i in cuda) / 2**20,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    default = "cuda:0,cuda:0" if torch.cuda.is_available() else "cpu,cpu"
    parser.add_argument("--steps", type=int, default=2000, help="training steps (default 2000)")
    parser.add_argument("--devices", default=default, help="comma-separated device list")
    parser.add_argument("--batch", type=int, default=64, help="global batch size")
    parser.add_argument("--width", type=int, default=128, help="hidden width")
    parser.add_argument("--every", type=int, default=100, help="report every N steps")
    parser.add_argument("--warmup", type=int, default=100, help="steps before the baseline")
    parser.add_argument("--cuda-graphs", action="store_true", help="cuda_graphs=True")
    parser.add_argument("--rss-bound-mb", type=float, default=64.0, help="allowed RSS growth")
    parser.add_argument("--threads-bound", type=int, default=0, help="allowed thread growth")
    parser.add_argument("--cuda-bound-mb", type=float, default=8.0, help="allowed CUDA growth")
    args = parser.parse_args(argv)
    if args.steps <= args.warmup:
        parser.error(f"--steps ({args.steps}) must be larger than --warmup ({args.warmup})")
    bounds = {"rss_mb": args.rss_bound_mb, "threads": args.threads_bound}
    bounds["cuda_mb"] = args.cuda_bound_mb

    devices = [torch.device(d.strip()) for d in args.devices.split(",")]
    torch.manual_seed(0)
    w = args.width
    blocks = [MaskedLinear(w, w), nn.BatchNorm1d(w), nn.ReLU(), MaskedLinear(w, w)]
    model = nn.Sequential(*blocks, nn.BatchNorm1d(w), nn.ReLU(), nn.Linear(w, 10)).to(devices[0])
    dp = torchdp.DataParallel(model, devices=devices, cuda_graphs=args.cuda_graphs)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    x = torch.randn(args.batch, w, device=devices[0])
    y = torch.randint(0, 10, (args.batch,), device=devices[0])
    print(
        f"soak: {args.steps} steps on {[str(d) for d in devices]}, batch {args.batch}, bounds: "
        f"RSS +{args.rss_bound_mb} MiB, threads +{args.threads_bound}, CUDA "
        f"+{args.cuda_bound_mb} MiB (baseline at step {args.warmup})",
        flush=True,
    )
    baseline: dict[str, float] = {}
    start = time.perf_counter()
    for step in range(1, args.steps + 1):
        optimizer.zero_grad(set_to_none=True)
        loss = nn.functional.cross_entropy(dp(x), y)
        loss.backward()
        optimizer.step()
        if step % args.every and step != args.warmup:
            continue
        if any(d.type == "cuda" for d in devices):
            torch.cuda.synchronize()
        now = measure(devices)
        baseline = now if step == args.warmup else baseline
        print(
            f"step {step:6d}  loss {loss.item():.4f}  RSS {now['rss_mb']:.1f} MiB  threads "
            f"{int(now['threads'])}  CUDA {now['cuda_mb']:.1f} MiB  "
            f"({(time.perf_counter() - start) / step * 1e3:.2f} ms/step)",
            flush=True,
        )
        over = [k for k in baseline if now[k] - baseline[k] > bounds[k]]
        for k in over:
            print(
                f"soak: FAILED at step {step}: {k} grew by {now[k] - baseline[k]:.1f} since step "
                f"{args.warmup} (bound {bounds[k]})",
                file=sys.stderr,
            )
        if over:
            return 1
    calls = int(model[1].num_batches_tracked.item())
    if calls != args.steps:
        print(
            f"soak: FAILED: BatchNorm counted {calls} batches in {args.steps} steps",
            file=sys.stderr,
        )
        return 1
    print(f"soak: passed ({args.steps} steps, every bound held)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
