"""Probe: step time of the 200-layer MLP (bench_train_step's mlp200; ``--model transformer``: its
12-layer transformer without dropout) with and without
torchdp.DataParallel(cuda_graphs=True), on the GPUs given (default: two replicas on cuda:0, the
one-GPU view of the CPU side; ``--device-ids 0,1`` on two GPUs).

    python benchmarks/probe_cuda_graphs.py [--model mlp200] [--device-ids 0,0] [--steps 30]

Prints one line per mode: median and 10th-90th percentile of synchronised step times (ms), and
how far the first step's gradients are from the eager single-device run's.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch
from torch import nn

import torchdp


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[m for _ in range(200) for m in (nn.Linear(256, 256), nn.ReLU())])


def transformer() -> nn.Module:
    # bench_train_step's transformer, dropout off (graphs draw other dropout masks than eager).
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(768, 12, 3072, dropout=0.0, batch_first=True)
    return nn.TransformerEncoder(layer, 12, enable_nested_tensor=False)


def run(
    model: nn.Module, wrapped: nn.Module, xs: list[torch.Tensor], warmup: int
) -> tuple[list[float], torch.Tensor]:
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    wrapped(xs[0]).pow(2).mean().backward()  # the first step's gradients, for the comparison
    grads = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
    times = []
    for i, x in enumerate(xs):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        wrapped(x).pow(2).mean().backward()
        opt.step()
        torch.cuda.synchronize()
        if i >= warmup:
            times.append((time.perf_counter() - t0) * 1e3)
    return times, grads


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device-ids", default="0,0")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--batch", type=int, default=None, help="default: 512 (mlp200), 64")
    parser.add_argument("--model", choices=("mlp200", "transformer"), default="mlp200")
    args = parser.parse_args()
    build = mlp if args.model == "mlp200" else transformer
    batch = args.batch or (512 if args.model == "mlp200" else 64)
    shape = (batch, 256) if args.model == "mlp200" else (batch, 128, 768)
    ids = [int(i) for i in args.device_ids.split(",")]
    devices = [torch.device("cuda", i) for i in ids]
    torch.manual_seed(1)
    xs = [torch.randn(*shape, device=devices[0]) for _ in range(args.warmup + args.steps)]
    base = build().to(devices[0])
    print(f"{args.model}, batch {batch}, devices {ids}", flush=True)
    modes = {
        "single eager": lambda m: m,
        "single cuda_graphs": lambda m: torchdp.DataParallel(
            m, devices=devices[:1], cuda_graphs=True
        ),
        f"torchdp eager {ids}": lambda m: torchdp.DataParallel(m, devices=devices),
        f"torchdp cuda_graphs {ids}": lambda m: torchdp.DataParallel(
            m, devices=devices, cuda_graphs=True
        ),
    }
    reference = None
    for name, wrap in modes.items():
        model = copy.deepcopy(base)
        times, grads = run(model, wrap(model), xs, args.warmup)
        q = statistics.quantiles(times, n=10)
        if reference is None:
            reference = grads
        diff = ((grads - reference).abs().max() / reference.abs().max()).item()
        print(
            f"{name:32s} median {statistics.median(times):7.2f} ms  p10-p90 {q[0]:.2f}-{q[-1]:.2f}"
            f"  first-step gradients: max |g - g_single_eager| / max |g| = {diff:.1e}",
            flush=True,
        )


if __name__ == "__main__":
    main()
