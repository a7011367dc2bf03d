"""Probe: what keeping the replicas between forwards saves (``torchdp.DataParallel``'s
``cache_replicas``, Note [Kept replicas] in csrc/python/replicate_py.cpp).

Times training steps of one model with ``cache_replicas=True`` (kept replicas, the default) and
``cache_replicas=False`` (new replica modules at every forward, as ``torch.nn.DataParallel``
builds them), in alternating rounds so that both see the same machine state. One step is
``zero_grad(set_to_none=True)``, forward, ``out.square().mean()``, backward, SGD step, then a
synchronisation of every device. Next to the wall times it counts the garbage collector's
collections per step (``gc.callbacks``), the work that the objects of new replicas bring.

The models have bench_train_step's module structure (``mlp200``: 401 modules, ``transformer``:
12 encoder layers, ``resnet50`` with torchvision); ``--width small`` makes their tensors tiny
(the CPU time of the structure without the arithmetic), ``--width full`` is bench_train_step's
size (GPUs).

    python benchmarks/probe_kept_replicas.py --devices cpu,cpu --width small --out r.json
    python benchmarks/probe_kept_replicas.py --devices cuda:0,cuda:1 --width full --out r.json

Prints one line per model and way (median, mean and 90th percentile step ms, collections per
step) and the saving; ``--out`` writes them as JSON with the machine's description.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Self

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common

import torchdp

MODELS = ("mlp200", "transformer", "resnet50")


def build(name: str, full: bool) -> tuple[nn.Module, torch.Tensor]:
    """The model and one input batch (on the CPU)."""
    torch.manual_seed(0)
    if name == "mlp200":
        width, batch = (256, 512) if full else (8, 4)
        layers: list[nn.Module] = []
        for _ in range(200):
            layers += [nn.Linear(width, width), nn.ReLU()]
        return nn.Sequential(*layers), torch.randn(batch, width)
    if name == "transformer":
        d, heads, ff, batch, seq = (768, 12, 3072, 64, 128) if full else (16, 2, 16, 4, 8)
        layer = nn.TransformerEncoderLayer(d, heads, ff, batch_first=True)
        net = nn.TransformerEncoder(layer, num_layers=12, enable_nested_tensor=False)
        return net, torch.randn(batch, seq, d)
    if name == "resnet50":
        import torchvision

        batch, size = (256, 224) if full else (4, 32)
        return torchvision.models.resnet50(), torch.randn(batch, 3, size, size)
    raise ValueError(f"unknown model {name!r}")


class _Collections:
    """Counts garbage collections (all generations) while active."""

    def __init__(self) -> None:
        self.count = 0

    def __call__(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self.count += 1

    def __enter__(self) -> Self:
        gc.callbacks.append(self)
        return self

    def __exit__(self, *exc: object) -> None:
        gc.callbacks.remove(self)


def make_step(
    net: nn.Module, x: torch.Tensor, devices: list[torch.device], kept: bool
) -> Callable[[], None]:
    dp = torchdp.DataParallel(net, devices=devices, cache_replicas=kept)
    opt = torch.optim.SGD(net.parameters(), lr=1e-4)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        dp(x).square().mean().backward()
        opt.step()
        common.synchronize(devices)

    return step


def probe(
    name: str, devices: list[torch.device], full: bool, rounds: int, steps: int
) -> list[dict[str, object]]:
    net, x = build(name, full)
    net, x = net.to(devices[0]), x.to(devices[0])
    ways = {"kept": make_step(net, x, devices, True), "new": make_step(net, x, devices, False)}
    times: dict[str, list[float]] = {w: [] for w in ways}
    collections = dict.fromkeys(ways, 0)
    for step in ways.values():  # warm-up
        for _ in range(3):
            step()
    for r in range(rounds):
        for way, step in ways.items():
            with _Collections() as counter:
                for _ in range(steps):
                    t0 = time.perf_counter()
                    step()
                    times[way].append((time.perf_counter() - t0) * 1e3)
            collections[way] += counter.count
        common.progress(f"{name}: round {r + 1}/{rounds}")
    records = []
    for way, ts in times.items():
        ordered = sorted(ts)
        records.append(
            {
                "bench": "kept_replicas",
                "model": name,
                "width": "full" if full else "small",
                "devices": [str(d) for d in devices],
                "way": way,
                "modules": sum(1 for _ in net.modules()),
                "steps": len(ts),
                "step_ms_median": statistics.median(ts),
                "step_ms_mean": statistics.fmean(ts),
                "step_ms_p90": ordered[9 * len(ordered) // 10],
                "gc_collections_per_step": collections[way] / len(ts),
            }
        )
    return records


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--devices", default="cpu,cpu", help="e.g. cpu,cpu or cuda:0,cuda:1")
    parser.add_argument("--models", default="mlp200,transformer")
    parser.add_argument("--width", choices=("small", "full"), default="small")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=40, help="steps per way and round")
    parser.add_argument("--out", default=None, help="JSON file for the records")
    args = parser.parse_args()
    devices = [torch.device(d.strip()) for d in args.devices.split(",") if d.strip()]
    if len(devices) < 2:
        sys.exit("--devices needs at least two devices (a device may repeat)")
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    unknown = [m for m in models if m not in MODELS]
    if unknown:
        sys.exit(f"unknown models {unknown}; choose from {list(MODELS)}")
    records = []
    for name in models:
        rows = probe(name, devices, args.width == "full", args.rounds, args.steps)
        records += rows
        for r in rows:
            print(
                f"{name} ({r['modules']} modules, {args.width}) onto {r['devices']}, {r['way']} "
                f"replicas: median {r['step_ms_median']:.3f} ms, mean {r['step_ms_mean']:.3f}, "
                f"p90 {r['step_ms_p90']:.3f}; {r['gc_collections_per_step']:.2f} collections "
                "per step",
                flush=True,
            )
        kept, new = rows
        print(
            f"{name}: kept replicas save {new['step_ms_median'] - kept['step_ms_median']:.3f} ms "
            f"(median) / {new['step_ms_mean'] - kept['step_ms_mean']:.3f} ms (mean) per step",
            flush=True,
        )
    if args.out:
        out = {"machine": common.machine_info(), "records": records}
        Path(args.out).write_text(json.dumps(out, indent=1))
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
