"""Where the time of torchdp's training steps goes: the phases of a step, profiled.

``step``: for each training-step model of models.py (fp32, full batch) one torchdp.DataParallel
over the first ``--gpus`` GPUs: the median step time after warm-up, then ``--steps`` steps under
``torch.profiler`` with the phases marked (``forward``; ``DataParallel.replicate``, ``.scatter``,
``.parallel_apply``, ``.gather`` through a subclass; ``loss``, ``backward``, ``optimizer``; and
torchdp's own ranges of csrc/torchdp/profiling.h): the ms per step of each phase and of each GPU's
kernels, and the same for the plain model on one device. ``--device-ids 0,0`` puts two replicas on
one GPU: the GPU time is shared, the CPU side costs what it costs on two GPUs.

    python benchmarks/profiling.py step                 # all GPUs (2 or more); `make bench` runs it
    python benchmarks/profiling.py step --device-ids 0,0 --models mlp200   # one GPU, 2 replicas
    python benchmarks/profiling.py step --smoke --out /tmp/p.json           # CPU, seconds
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common
import models
import torch
from report import table
from torch.profiler import ProfilerActivity, profile, record_function

import torchdp

OVERRIDES = ("replicate", "scatter", "parallel_apply", "gather")
PHASES = ("forward", *(f"DataParallel.{p}" for p in OVERRIDES), "loss", "backward", "optimizer")
# torchdp's own ranges inside the forward (profiling.h): replicate's phases, and taking the kept
# replicas back after parallel_apply, which no overridable method contains.
INNER = ("walk", "transfer", "build", "device_check", "park")
CPU_PHASES = PHASES + tuple(f"torchdp.replicate.{p}" for p in INNER)
ONE_DEVICE_PHASES = ("forward", "loss", "backward", "optimizer")
TEXT = (
    "Milliseconds per step of each phase on the calling thread (profiler ranges; the backward's "
    "device threads run in parallel with it; `forward` is the whole DataParallel call, which "
    "contains replicate to gather; walk, transfer, build, device_check: inside replicate; `park`: "
    "taking the kept replicas back at the end of the forward), the GPU kernel ms per step per "
    "device, and the plain model on the first device with the full batch."
)


def short_name(phase: str) -> str:
    return phase.removeprefix("DataParallel.").removeprefix("torchdp.replicate.")


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


def profile_steps(name: str, smoke: bool, devices: list, wrap: Callable, steps: int) -> dict:
    """SGD steps of model `name` on devices[0] called through `wrap(model)`: the median step time
    of 10 steps or more after 3 warm-up steps, then `steps` profiled steps: ms per step of each
    phase and of each GPU's kernels."""
    model = models.without_dropout(models.build(name, smoke)).to(devices[0])
    x, target = (t if t is None else t.to(devices[0]) for t in models.inputs(name, smoke))
    net = wrap(model)
    opt = torch.optim.SGD(model.parameters(), lr=models.LR)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        with record_function("forward"):
            out = net(x)
        with record_function("loss"):
            loss = models.loss(out, target)
        with record_function("backward"):
            loss.backward()
        with record_function("optimizer"):
            opt.step()

    times = common.time_steps(step, devices, 3, max(steps, 10))
    activities = [ProfilerActivity.CPU]
    activities += [ProfilerActivity.CUDA] if devices[0].type == "cuda" else []
    with profile(activities=activities) as prof:
        common.time_steps(step, devices, 0, steps)
    phases: dict[str, float] = defaultdict(float)
    gpu_us: dict[int, float] = defaultdict(float)
    for event in prof.events():
        if event.name in CPU_PHASES:
            phases[event.name] += event.cpu_time_total
        if event.device_type == torch.autograd.DeviceType.CUDA:
            gpu_us[event.device_index] += event.device_time
    return {
        "step_ms_median": round(statistics.median(times), 2),
        "phase_cpu_ms_per_step": {p: round(phases[p] / steps / 1e3, 3) for p in CPU_PHASES},
        "gpu_kernel_ms_per_step": {
            f"cuda:{i}": round(us / steps / 1e3, 2) for i, us in sorted(gpu_us.items())
        },
    }


def profile_model(name: str, smoke: bool, devices: list, steps: int) -> dict[str, Any]:
    ours = profile_steps(
        name, smoke, devices, lambda m: MarkedDataParallel(m, devices=devices), steps
    )
    one = profile_steps(name, smoke, devices[:1], lambda m: m, steps)
    one["phase_cpu_ms_per_step"] = {p: one["phase_cpu_ms_per_step"][p] for p in ONE_DEVICE_PHASES}
    where = {"gpus": len(devices), "devices": [str(d) for d in devices]}
    return {"model": name, "dtype": "fp32", **where, **ours, "single_device": one}


def markdown(records: list[dict[str, Any]]) -> str:
    """The records as a Markdown table."""

    def row(r: dict[str, Any]) -> list:
        phases, one = r["phase_cpu_ms_per_step"], r["single_device"]
        return [
            r["model"],
            ", ".join(r["devices"]),
            r["step_ms_median"],
            *(f"{phases[p]:.2f}" for p in CPU_PHASES),
            ", ".join(f"{d} {v}" for d, v in r["gpu_kernel_ms_per_step"].items()) or "—",
            one["step_ms_median"],
            *(f"{one['phase_cpu_ms_per_step'][p]:.2f}" for p in ONE_DEVICE_PHASES),
        ]

    headers = ["model", "devices", "step ms", *map(short_name, CPU_PHASES), "GPU kernel ms"]
    headers += ["one device: step ms", *ONE_DEVICE_PHASES]
    lines = ["# torchdp.DataParallel step profile", "", TEXT, ""]
    return "\n".join(lines + table(headers, [row(r) for r in records]))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    step = parser.add_subparsers(dest="view", required=True).add_parser("step", help="phases")
    step.add_argument("--out", default=None, help="JSON file (default results/<machine>-profile)")
    step.add_argument("--smoke", action="store_true", help="tiny models on two CPU devices")
    step.add_argument("--gpus", type=int, default=None, help="GPU count (default: all visible)")
    step.add_argument("--device-ids", default=None, help="CUDA indices, repeats allowed (0,0)")
    step.add_argument("--steps", type=int, default=3, help="profiled steps (default 3)")
    step.add_argument("--models", default=None, help="comma list of models.py's models")
    args = parser.parse_args(argv)
    visible = torch.cuda.device_count()
    if args.device_ids is not None:
        if args.smoke or args.gpus is not None:
            step.error("--device-ids replaces --gpus and --smoke")
        try:
            ids = [int(i) for i in args.device_ids.split(",")]
        except ValueError:
            step.error(f"--device-ids takes comma-separated integers, got {args.device_ids!r}")
        if len(ids) < 2 or not all(0 <= i < visible for i in ids):
            step.error(
                f"--device-ids needs at least 2 entries among the {visible} visible CUDA devices, "
                f"got {args.device_ids!r}"
            )
        devices = [torch.device("cuda", i) for i in ids]
    elif args.smoke:
        devices = [torch.device("cpu")] * 2
    elif (args.gpus or visible) < 2 or visible < (args.gpus or 0):
        common.progress(f"profile step: needs at least 2 GPUs, {visible} visible; skipped")
        return 0
    else:
        devices = [torch.device("cuda", i) for i in range(args.gpus or visible)]
    machine = common.machine_info()
    out = args.out or str(Path(__file__).parent / "results" / f"{common.machine_name(machine)}")
    out += "-profile.json" if args.out is None else ""
    records = []
    for name in common.parse_list(args.models, models.TRAIN_MODELS, "models"):
        common.progress(f"profiling {name} (torchdp.DataParallel over {devices})")
        records.append(profile_model(name, args.smoke, devices, args.steps))
        cpu = records[-1]["phase_cpu_ms_per_step"]
        common.progress(", ".join(f"{short_name(p)} {v:.2f}" for p, v in cpu.items()))
        common.free_memory()
    data = {"machine": machine, "bench": "profile_step", "records": records}
    common.write_json(out, data).with_suffix(".md").write_text(markdown(records))
    return 0


if __name__ == "__main__":
    sys.exit(main())
