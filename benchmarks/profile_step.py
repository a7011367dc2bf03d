"""Profile of torchdp.DataParallel training steps: where each step's time goes.

For each model of ``bench_train_step.py`` (fp32, full batch) one ``torchdp.DataParallel`` over the
first ``--gpus`` GPUs runs a few warm-up steps, then ``--steps`` steps under ``torch.profiler``.
The phases of a step are marked with ``record_function`` (``DataParallel.replicate``, ``.scatter``,
``.parallel_apply``, ``.gather``, ``loss``, ``backward``, ``optimizer``) through overridden methods
of a DataParallel subclass, so the library itself is unchanged. Per model the JSON record holds the
median step time (from a separate synchronised timing), the CPU time of each phase per step, the
GPU kernel time per device per step, and the top operators by CPU time.

    python benchmarks/profile_step.py          # all GPUs (2 or more), ~1 min; `make bench` runs it
    python benchmarks/profile_step.py --out /tmp/p.json --smoke                        # CPU, seconds
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

_HERE = Path(__file__).resolve().parent
if str(_HERE) not in sys.path:
    sys.path.insert(0, str(_HERE))

import common
import torch
from bench_train_step import (
    MODELS,
    build_model,
    compute_loss,
    disable_dropout,
    make_inputs,
    mode_devices,
    parse_list,
)
from torch.profiler import ProfilerActivity, profile, record_function

import torchdp

PHASES = (
    "DataParallel.replicate",
    "DataParallel.scatter",
    "DataParallel.parallel_apply",
    "DataParallel.gather",
    "loss",
    "backward",
    "optimizer",
)


class MarkedDataParallel(torchdp.DataParallel):
    """torchdp.DataParallel with a profiler range around each overridable phase."""

    def replicate(self, module, device_ids):
        with record_function("DataParallel.replicate"):
            return super().replicate(module, device_ids)

    def scatter(self, inputs, kwargs, device_ids):
        with record_function("DataParallel.scatter"):
            return super().scatter(inputs, kwargs, device_ids)

    def parallel_apply(self, replicas, inputs, kwargs):
        with record_function("DataParallel.parallel_apply"):
            return super().parallel_apply(replicas, inputs, kwargs)

    def gather(self, outputs, output_device):
        with record_function("DataParallel.gather"):
            return super().gather(outputs, output_device)


def profile_model(name: str, smoke: bool, gpus: int, steps: int) -> dict[str, Any]:
    devices = mode_devices(smoke, gpus)
    dev0 = devices[0]
    model = build_model(name, smoke)
    disable_dropout(model)
    model = model.to(dev0)
    x, target = make_inputs(name, smoke)
    x = x.to(dev0)
    target = target.to(dev0) if target is not None else None
    dp = (
        MarkedDataParallel(model, devices=devices)
        if smoke
        else MarkedDataParallel(model, device_ids=list(range(gpus)))
    )
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        out = dp(x)
        with record_function("loss"):
            loss = compute_loss(name, out, target)
        with record_function("backward"):
            loss.backward()
        with record_function("optimizer"):
            opt.step()

    times = common.time_steps(step, devices, warmup=3, steps=steps)
    activities = [ProfilerActivity.CPU]
    if dev0.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    with profile(activities=activities) as prof:
        for _ in range(steps):
            step()
        common.synchronize(devices)
    phases: dict[str, float] = defaultdict(float)
    gpu_us: dict[int, float] = defaultdict(float)
    for event in prof.events():
        if event.name in PHASES:
            phases[event.name] += event.cpu_time_total
        if event.device_type == torch.autograd.DeviceType.CUDA:
            gpu_us[event.device_index] += event.device_time
    top = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)[:12]
    return {
        "model": name,
        "dtype": "fp32",
        "gpus": len(devices),
        "devices": [str(d) for d in devices],
        "step_ms_median": round(statistics.median(times), 2),
        "phase_cpu_ms_per_step": {p: round(phases[p] / steps / 1e3, 3) for p in PHASES},
        "gpu_kernel_ms_per_step": {
            f"cuda:{i}": round(us / steps / 1e3, 2) for i, us in sorted(gpu_us.items())
        },
        "top_ops_self_cpu_ms_per_step": [
            [e.key, round(e.self_cpu_time_total / steps / 1e3, 3), e.count // steps] for e in top
        ],
    }


def markdown(records: list[dict[str, Any]]) -> str:
    """The records as a Markdown table: step time, CPU ms per phase, GPU kernel ms per device."""
    short = [p.removeprefix("DataParallel.") for p in PHASES]
    lines = [
        "# torchdp.DataParallel step profile",
        "",
        "CPU ms per step spent in each phase (profiler ranges, wall time on the calling thread; the "
        "backward's device threads run in parallel with it) and GPU kernel ms per step per device.",
        "",
        "| model | devices | step ms | " + " | ".join(short) + " | GPU kernel ms |",
        "|---|---|---|" + "---|" * len(short) + "---|",
    ]
    for r in records:
        phases = " | ".join(f"{r['phase_cpu_ms_per_step'][p]:.2f}" for p in PHASES)
        gpu = ", ".join(f"{d} {v}" for d, v in r["gpu_kernel_ms_per_step"].items()) or "—"
        lines.append(f"| {r['model']} | {r['gpus']} | {r['step_ms_median']} | {phases} | {gpu} |")
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--out",
        default=None,
        help="JSON file to write (default benchmarks/results/<date>-<machine>-profile-step.json)",
    )
    parser.add_argument("--smoke", action="store_true", help="tiny models on two CPU devices")
    parser.add_argument("--gpus", type=int, default=None, help="GPU count (default: all visible)")
    parser.add_argument("--steps", type=int, default=3, help="profiled steps (default 3)")
    parser.add_argument("--models", default=None, help=f"comma list of {', '.join(MODELS)}")
    args = parser.parse_args(argv)
    visible = torch.cuda.device_count()
    if args.smoke:
        args.gpus = 2
    elif args.gpus is None:
        if visible < 2:
            common.progress(f"profile_step: needs at least 2 GPUs, {visible} visible; skipped")
            return 0
        args.gpus = visible
    elif visible < args.gpus:
        parser.error(f"needs {args.gpus} CUDA devices, {visible} visible")
    if args.out is None:
        info = common.machine_info()
        stamp = info["date"][:10]
        args.out = str(_HERE / "results" / f"{stamp}-{common.machine_name(info)}-profile-step.json")
    records = []
    for name in parse_list(args.models, MODELS, "model"):
        common.progress(f"profiling {name} (torchdp.DataParallel, {args.gpus} devices)")
        rec = profile_model(name, args.smoke, args.gpus, args.steps)
        phases = ", ".join(
            f"{p.removeprefix('DataParallel.')} {v:.2f}"
            for p, v in rec["phase_cpu_ms_per_step"].items()
        )
        common.progress(
            f"{name}: step {rec['step_ms_median']} ms; CPU ms per step: {phases}; GPU kernel ms "
            f"per step: {rec['gpu_kernel_ms_per_step']}"
        )
        records.append(rec)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    out = common.write_plain(args.out, "profile_step", records)
    md = out.with_suffix(".md")
    md.write_text(markdown(records))
    common.progress(f"wrote {md}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
