"""Probe: what the buffer copy of every replicated forward costs (Note [Buffers of failed
forwards] in csrc/torchdp/replicate.h).

``torchdp.DataParallel`` and ``torchdp.data_parallel`` copy the module's buffers before they
replicate it, so that a failed forward can write them back. This times that copy,
on bench_train_step's models, both ways it is made: the copy a DataParallel keeps from step to
step and refreshes in place (``BufferSnapshot.take`` of the same buffers, one ``_foreach_copy_``
per device and dtype: what the kept-replica cache does inside replicate, from the walk replicate
makes anyway), and a new copy with its own walk (``torchdp._C.snapshot_buffers(model)``: the
paths without a cache). CPU time per call, and for the refresh the wall time of many calls
between CUDA events (the GPU's time only where the GPU, not the CPU, is the slower), next to
``torchdp.replicate`` onto two replicas for scale.

    python benchmarks/probe_buffer_snapshot.py --device cuda:0 --out r.json
    python benchmarks/probe_buffer_snapshot.py --device cpu --models mlp200 --calls 50

Prints one line per model; ``--out`` writes the records as JSON with the machine's description.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_train_step
import common

import torchdp

MODELS = ("mlp200", "transformer", "resnet50")


def cpu_us(fn, calls: int, device: torch.device) -> list[float]:
    """Microseconds of CPU per call of ``fn`` (the device synchronised before, not inside)."""
    out = []
    for _ in range(calls):
        common.synchronize([device])
        start = time.perf_counter()
        fn()
        out.append((time.perf_counter() - start) * 1e6)
    common.synchronize([device])
    return out


def gpu_us(fn, calls: int, device: torch.device) -> float | None:
    """Microseconds of GPU time per call, measured with CUDA events around ``calls`` calls."""
    if device.type != "cuda":
        return None
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(calls):
        fn()
    end.record()
    torch.cuda.synchronize(device)
    return start.elapsed_time(end) * 1e3 / calls


def probe(name: str, device: torch.device, calls: int) -> dict[str, Any]:
    model = bench_train_step.build_model(name, device.type != "cuda").to(device)
    buffers = list(model.buffers())
    snapshot = lambda: torchdp._C.snapshot_buffers(model)
    kept = torchdp._C.BufferSnapshot()
    refresh = lambda: kept.take(buffers)
    replicate = lambda: torchdp.replicate(model, [device, device])
    for _ in range(5):
        snapshot()
        refresh()
        replicate()
    snap = common.summarize(cpu_us(snapshot, calls, device), "snapshot_cpu_us")
    kept_copy = common.summarize(cpu_us(refresh, calls, device), "refresh_cpu_us")
    rep = common.summarize(cpu_us(replicate, calls, device), "replicate_cpu_us")
    return {
        "model": name,
        "device": str(device),
        "modules": sum(1 for _ in model.modules()),
        "buffers": len(buffers),
        "buffer_bytes": sum(b.numel() * b.element_size() for b in buffers),
        "refresh_gpu_us": gpu_us(refresh, calls, device),
        **snap,
        **kept_copy,
        **rep,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda:0" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--out")
    args = parser.parse_args()
    device = torch.device(args.device)
    models = [m for m in args.models.split(",") if m]
    unknown = [m for m in models if m not in MODELS]
    if unknown:
        sys.exit(f"unknown models {unknown}; choose from {list(MODELS)}")
    records = []
    for name in models:
        try:
            r = probe(name, device, args.calls)
        except ImportError as e:  # resnet50 needs torchvision
            print(f"{name}: skipped ({e})", flush=True)
            continue
        records.append(r)
        gpu = r["refresh_gpu_us"]
        print(
            f"{name} on {r['device']}: {r['buffers']} buffers, {r['buffer_bytes'] / 1024:.1f} KiB; "
            f"kept copy refreshed: CPU median {r['refresh_cpu_us_median']:.1f} us"
            + (f" (events {gpu:.1f} us)" if gpu is not None else "")
            + f"; new copy with its walk: CPU median {r['snapshot_cpu_us_median']:.1f} us"
            + f"; replicate onto two replicas: CPU median {r['replicate_cpu_us_median']:.1f} us",
            flush=True,
        )
    if args.out:
        common.write_plain(args.out, "buffer_snapshot", records)


if __name__ == "__main__":
    main()
