"""Probe: where the CPU time of one ``torchdp.replicate`` call goes, phase by phase.

torchdp's C++ marks its own work with profiler ranges (``csrc/torchdp/profiling.h``):
``torchdp.replicate.walk`` (the module walk and the checks), ``torchdp.replicate.transfer`` (the
broadcast and its autograd wiring, with ``torchdp.broadcast``, ``torchdp.broadcast.autograd`` and,
over NCCL, ``torchdp.nccl.broadcast_group`` inside), ``torchdp.replicate.build`` (the replica
modules) and ``torchdp.replicate.device_check``. This times the call unprofiled (median wall ms)
and prints each range's CPU ms per call under the profiler, for bench_train_step's models.

    python benchmarks/probe_replicate_phases.py [--device-ids 0,1] [--models resnet50,transformer]
    python benchmarks/probe_replicate_phases.py --smoke     # CPU, tiny models

Without GPUs (``--smoke``) the replicas go to two CPU devices.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_train_step

import torchdp

PREFIXES = ("torchdp.", "aten::empty")


def sync(devices: list[torch.device]) -> None:
    for d in {d for d in devices if d.type == "cuda"}:
        torch.cuda.synchronize(d)


def probe(name: str, devices: list[torch.device], calls: int, smoke: bool) -> str:
    net = bench_train_step.build_model(name, smoke).to(devices[0])
    for _ in range(5):
        torchdp.replicate(net, devices)
    sync(devices)
    wall = []
    for _ in range(calls):
        t0 = time.perf_counter()
        replicas = torchdp.replicate(net, devices)
        wall.append((time.perf_counter() - t0) * 1e3)
        del replicas
        sync(devices)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(calls):
            replicas = torchdp.replicate(net, devices)
            del replicas
        sync(devices)
    rows = []
    for e in prof.key_averages():
        if e.key.startswith(PREFIXES):
            rows.append((e.key, e.cpu_time_total / 1e3 / calls, e.count / calls))
    rows.sort(key=lambda r: -r[1])
    modules = sum(1 for _ in net.modules())
    tensors = sum(1 for _ in net.parameters()) + sum(1 for _ in net.buffers())
    head = (
        f"{name}: {modules} modules, {tensors} tensors, onto {[str(d) for d in devices]}: "
        f"median {statistics.median(wall):.3f} ms unprofiled (p10 "
        f"{sorted(wall)[len(wall) // 10]:.3f}, p90 {sorted(wall)[9 * len(wall) // 10]:.3f})"
    )
    lines = [head]
    lines += [f"    {k:40s} {ms:8.3f} ms/call  {n:6.1f} calls/call" for k, ms, n in rows]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device-ids", default=None, help="e.g. 0,1 (default: all GPUs)")
    parser.add_argument("--models", default="resnet50,transformer,mlp200")
    parser.add_argument("--calls", type=int, default=30)
    parser.add_argument("--smoke", action="store_true", help="tiny models on two CPU devices")
    args = parser.parse_args()
    if args.smoke:
        devices = [torch.device("cpu")] * 2
    else:
        if not torch.cuda.is_available():
            sys.exit("no CUDA device: run with --smoke on a machine without GPUs")
        ids = args.device_ids or ",".join(str(i) for i in range(torch.cuda.device_count()))
        devices = [torch.device("cuda", int(i)) for i in ids.split(",")]
    print(f"torch {torch.__version__}, torchdp {torchdp.__version__}, nccl {torchdp.has_nccl()}")
    for name in args.models.split(","):
        print(probe(name.strip(), devices, args.calls, args.smoke), flush=True)


if __name__ == "__main__":
    main()
