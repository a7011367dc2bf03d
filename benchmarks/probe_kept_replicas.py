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
step) and the saving; ``--out`` writes them as JSON with the machine's description, ``--plot`` a
bar chart (``--from-json FILE --plot PNG`` redraws one from saved records).
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
from typing import Any, Self

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_train_step
import common

import torchdp

MODELS = ("mlp200", "transformer", "resnet50")


def build(name: str, full: bool) -> tuple[nn.Module, torch.Tensor]:
    """The model and one input batch (on the CPU): bench_train_step's at full size, otherwise
    its module structure with tiny tensors (bench_train_step's smoke models are smaller nets)."""
    if full:
        return bench_train_step.build_model(name, False), bench_train_step.make_inputs(name, False)[
            0
        ]
    torch.manual_seed(0)
    if name == "mlp200":
        layers: list[nn.Module] = []
        for _ in range(200):
            layers += [nn.Linear(8, 8), nn.ReLU()]
        return nn.Sequential(*layers), torch.randn(4, 8)
    if name == "transformer":
        layer = nn.TransformerEncoderLayer(16, 2, 16, batch_first=True)
        net = nn.TransformerEncoder(layer, num_layers=12, enable_nested_tensor=False)
        return net, torch.randn(4, 8, 16)
    if name == "resnet50":
        import torchvision

        return torchvision.models.resnet50(), torch.randn(4, 3, 32, 32)
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


def plot(records: list[dict[str, Any]], path: str, title: str) -> None:
    """Median step ms per model, kept vs new replicas, with the p90 as a mark."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(dict.fromkeys(r["model"] for r in records))
    fig, ax = plt.subplots(figsize=(2.2 + 1.6 * len(models), 3.4))
    for k, way in enumerate(("kept", "new")):
        rows = [next(r for r in records if r["model"] == m and r["way"] == way) for m in models]
        xs = [i + (k - 0.5) * 0.38 for i in range(len(models))]
        ax.bar(xs, [r["step_ms_median"] for r in rows], width=0.36, label=f"{way} replicas")
        ax.scatter(xs, [r["step_ms_p90"] for r in rows], marker="_", color="black", s=120)
    ax.set_xticks(range(len(models)), models)
    ax.set_ylabel("training step, median ms (p90: dash)")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--devices", default="cpu,cpu", help="e.g. cpu,cpu or cuda:0,cuda:1")
    parser.add_argument("--models", default="mlp200,transformer")
    parser.add_argument("--width", choices=("small", "full"), default="small")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=40, help="steps per way and round")
    parser.add_argument("--out", default=None, help="JSON file for the records")
    parser.add_argument("--plot", default=None, help="PNG of the step times, kept vs new")
    parser.add_argument(
        "--from-json", default=None, help="no run: plot the records of this JSON file (--plot)"
    )
    args = parser.parse_args()
    if args.from_json:
        if not args.plot:
            sys.exit("--from-json needs --plot")
        data = json.loads(Path(args.from_json).read_text())
        machine = data["machine"]
        plot(
            data["records"],
            args.plot,
            f"{common.machine_name(machine)}, {data['records'][0]['devices']}, torchdp "
            f"{machine.get('torchdp_git_revision', '?')}",
        )
        print(f"wrote {args.plot}")
        return
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
    machine = common.machine_info()
    if args.out:
        Path(args.out).write_text(json.dumps({"machine": machine, "records": records}, indent=1))
        print(f"wrote {args.out}")
    if args.plot:
        title = f"{common.machine_name(machine)}, {[str(d) for d in devices]}"
        plot(records, args.plot, title + f", torchdp {machine['torchdp_git_revision']}")
        print(f"wrote {args.plot}")


if __name__ == "__main__":
    main()
