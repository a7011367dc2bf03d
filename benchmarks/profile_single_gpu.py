"""Where a training step's time goes on ONE GPU: the share of the step the GPU is busy and the CPU
time to issue one forward pass, for the train-step models of ``bench_train_step.py``.

Data parallelism from one process can only approach N x one GPU when the single-GPU step is bound
by the GPU: every replica issues as many kernels as the whole model does on one GPU, the Python
part of the replicas' forwards shares one GIL, and each device's backward runs on its own autograd
thread. A model whose one-GPU step leaves the GPU mostly idle (the 200-layer MLP) is bound by the
CPU work of issuing kernels, which data parallelism multiplies instead of dividing.

Per model (fp32, the full batch of bench_train_step): ``step_ms`` (median of 5 synchronised steps),
``gpu_kernel_ms`` (kernel time per step from torch.profiler over 3 steps), ``gpu_busy`` (their
ratio) and ``forward_issue_ms`` (the CPU time of one forward call, median of 5, without waiting for
the GPU).

    python benchmarks/profile_single_gpu.py --out results/<date>-1xH200-profile.json   # ~1 min
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path

_HERE = Path(__file__).resolve().parent
if str(_HERE) not in sys.path:
    sys.path.insert(0, str(_HERE))

import common
import torch
from bench_train_step import MODELS, build_model, make_inputs, make_step, parse_list
from torch.profiler import ProfilerActivity, profile


def measure(name: str, device: torch.device) -> dict:
    model = build_model(name, False).to(device)
    x, target = make_inputs(name, False)
    x = x.to(device)
    target = target.to(device) if target is not None else None
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    step = make_step(name, model, opt, x, target, "fp32", "cuda")
    times = common.time_steps(step, [device], warmup=3, steps=5)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            step()
        torch.cuda.synchronize(device)
    kernel_us = sum(
        e.self_device_time_total
        for e in prof.key_averages()
        if e.device_type == torch.autograd.DeviceType.CUDA
    )
    issue = []
    for _ in range(5):
        torch.cuda.synchronize(device)
        start = time.perf_counter()
        out = model(x)
        issue.append((time.perf_counter() - start) * 1e3)
        del out
    torch.cuda.synchronize(device)
    step_ms = statistics.median(times)
    kernel_ms = kernel_us / 3 / 1e3
    return {
        "model": name,
        "dtype": "fp32",
        "step_ms": round(step_ms, 2),
        "gpu_kernel_ms": round(kernel_ms, 2),
        "gpu_busy": round(kernel_ms / step_ms, 3),
        "forward_issue_ms": round(statistics.median(issue), 2),
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="JSON file to write")
    parser.add_argument("--models", default=None, help=f"comma list of {', '.join(MODELS)}")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("needs a CUDA device")
    models = parse_list(args.models, MODELS, "model")
    device = torch.device("cuda", 0)
    records = []
    for name in models:
        common.progress(f"profiling {name} on one GPU")
        rec = measure(name, device)
        common.progress(
            f"{name}: step {rec['step_ms']} ms, GPU busy {rec['gpu_busy']:.0%}, "
            f"forward issue {rec['forward_issue_ms']} ms"
        )
        records.append(rec)
        torch.cuda.empty_cache()
    common.write_plain(args.out, "profile_single_gpu", records)
    return 0


if __name__ == "__main__":
    sys.exit(main())
