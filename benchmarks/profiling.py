"""Where the time of torchdp's training steps goes: the phases of a step, profiled.

``step``: for each training-step model of models.py (fp32, full batch) one ``torchdp.DataParallel``
over the first ``--gpus`` GPUs runs a few warm-up steps, then ``--steps`` steps under
``torch.profiler``. The phases are marked with ``record_function`` (``DataParallel.replicate``,
``.scatter``, ``.parallel_apply``, ``.gather`` through overridden methods of a subclass, then
``loss``, ``backward``, ``optimizer``); torchdp's own ranges (``csrc/torchdp/profiling.h``: walk,
transfer, build, device_check, park) are read back too. Per model the record holds the median step
time, the CPU time of each phase per step, the GPU kernel time per device per step, each GPU's idle
time per step with its largest gaps (and the phase they began in), the top operators by CPU time,
and, without the profiler, the wall time of each phase on the calling thread next to the same
phases of the plain model on one device. ``--device-ids 0,0`` puts two replicas on one GPU: the GPU
time is then shared, but the CPU side costs what it costs on two GPUs.

    python benchmarks/profiling.py step                 # all GPUs (2 or more); `make bench` runs it
    python benchmarks/profiling.py step --device-ids 0,0 --models mlp200   # one GPU, 2 replicas
    python benchmarks/profiling.py step --smoke --out /tmp/p.json           # CPU, seconds
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common
import models
import torch
import torchdp
from report import table
from torch.profiler import ProfilerActivity, profile, record_function

PHASES = tuple(f"DataParallel.{p}" for p in ("replicate", "scatter", "parallel_apply", "gather"))
PHASES += ("loss", "backward", "optimizer")
# torchdp's own ranges inside the forward (profiling.h): replicate's phases, and taking the kept
# replicas back after parallel_apply, which no overridable method contains. CPU time only.
INNER = ("walk", "transfer", "build", "device_check", "park")
CPU_PHASES = PHASES + tuple(f"torchdp.replicate.{p}" for p in INNER)
ONE_DEVICE_PHASES = ("forward", "loss", "backward", "optimizer")

CPU_TEXT = (
    "CPU ms per step spent in each phase (profiler ranges, wall time on the calling thread; the "
    "backward's device threads run in parallel with it; walk, transfer, build, device_check: "
    "inside replicate; `park`: taking the kept replicas back at the end of the forward) and "
    "GPU kernel ms per step per device."
)
IDLE_TEXT = (
    "GPU idle ms per step under the profiler (no kernel or copy running, from the first to "
    "the last device activity of the profiled steps), and the largest gaps with the phase "
    "the calling thread was in when each began."
)
WALL_TEXT = (
    "Wall-clock ms per step of each phase on the calling thread, without the profiler (median "
    "of the timed steps; `forward` is the whole DataParallel call, which contains replicate to "
    "gather). Next to it, the plain model on the first device with the full batch."
)


def short_name(phase: str) -> str:
    return phase.removeprefix("DataParallel.").removeprefix("torchdp.replicate.")


class PhaseClock:
    """Wall-clock milliseconds per phase, summed over a step (while `on`)."""

    def __init__(self) -> None:
        self.on = False
        self.steps: list[dict[str, float]] = [defaultdict(float)]

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """A profiler range named `name`, its wall time added to the step's."""
        start = time.perf_counter()
        with record_function(name):
            yield
        if self.on:
            self.steps[-1][name] += (time.perf_counter() - start) * 1e3

    def end_step(self) -> None:
        if self.on:
            self.steps.append(defaultdict(float))

    def medians(self, names: tuple[str, ...]) -> dict[str, float]:
        done = self.steps[:-1]
        return {n: round(statistics.median(s[n] for s in done), 3) if done else 0.0 for n in names}


class MarkedDataParallel(torchdp.DataParallel):
    """torchdp.DataParallel with a profiler range and a wall clock around each overridable phase."""

    clock: PhaseClock

    def replicate(self, module, device_ids):
        with self.clock.phase("DataParallel.replicate"):
            return super().replicate(module, device_ids)

    def scatter(self, inputs, kwargs, device_ids):
        with self.clock.phase("DataParallel.scatter"):
            return super().scatter(inputs, kwargs, device_ids)

    def parallel_apply(self, replicas, inputs, kwargs):
        with self.clock.phase("DataParallel.parallel_apply"):
            return super().parallel_apply(replicas, inputs, kwargs)

    def gather(self, outputs, output_device):
        with self.clock.phase("DataParallel.gather"):
            return super().gather(outputs, output_device)


def timed_steps(name: str, smoke: bool, devices: list, wrap: Callable, steps: int) -> tuple:
    """(step, clock, step times in ms): one SGD step of model `name` on devices[0] called through
    `wrap(model, clock)`, timed after 3 warm-up steps with its phase clock on."""
    model = models.without_dropout(models.build(name, smoke)).to(devices[0])
    x, target = (t if t is None else t.to(devices[0]) for t in models.inputs(name, smoke))
    clock = PhaseClock()
    net = wrap(model, clock)
    opt = torch.optim.SGD(model.parameters(), lr=models.LR)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        with clock.phase("forward"):
            out = net(x)
        with clock.phase("loss"):
            loss = models.loss(out, target)
        with clock.phase("backward"):
            loss.backward()
        with clock.phase("optimizer"):
            opt.step()
        clock.end_step()

    common.time_steps(step, devices, 3, 0)
    clock.on = True
    times = common.time_steps(step, devices, 0, max(steps, 10))
    clock.on = False
    return step, clock, times


def gpu_idle(busy: dict, phases: list[tuple[str, float, float]], steps: int, top: int = 3) -> dict:
    """Idle time of each GPU while the profiled steps ran, from the kernels' and copies' intervals
    (microseconds, per device index) and the calling thread's phase ranges.

    The window runs from the first to the last device activity of any GPU, so a device that starts
    late or finishes early is idle for that time too. Per device: idle milliseconds per step, and
    the `top` largest gaps, each with the innermost phase running on the calling thread when the
    gap began ("between phases" when none was).
    """
    spans = [iv for ivs in busy.values() for iv in ivs]
    if not spans or steps <= 0:
        return {}
    start, end = min(a for a, _ in spans), max(b for _, b in spans)

    def phase_at(t: float) -> str:
        inside = [(b - a, n) for n, a, b in phases if a <= t < b]
        return min(inside)[1] if inside else "between phases"

    result = {}
    for device, intervals in sorted(busy.items()):
        gaps, reached = [], start  # (length, start)
        for a, b in sorted(intervals) + [(end, end)]:
            if a > reached:
                gaps.append((a - reached, reached))
            reached = max(reached, b)
        result[f"cuda:{device}"] = {
            "idle_ms_per_step": round(sum(g for g, _ in gaps) / steps / 1e3, 2),
            "largest_gaps": [
                [round(g / 1e3, 2), phase_at(at)] for g, at in sorted(gaps)[::-1][:top]
            ],
        }
    return result


def profile_model(name: str, smoke: bool, devices: list, steps: int) -> dict[str, Any]:
    def wrap(model, clock):
        dp = MarkedDataParallel(model, devices=devices)
        dp.clock = clock
        return dp

    step, clock, times = timed_steps(name, smoke, devices, wrap, steps)
    activities = [ProfilerActivity.CPU]
    activities += [ProfilerActivity.CUDA] if devices[0].type == "cuda" else []
    with profile(activities=activities) as prof:
        common.time_steps(step, devices, 0, steps)
    phases: dict[str, float] = defaultdict(float)
    gpu_us: dict[int, float] = defaultdict(float)
    busy: dict[int, list[tuple[float, float]]] = defaultdict(list)
    ranges = []
    for event in prof.events():
        if event.name in CPU_PHASES:
            phases[event.name] += event.cpu_time_total
            ranges.append((event.name, event.time_range.start, event.time_range.end))
        if event.device_type == torch.autograd.DeviceType.CUDA:
            gpu_us[event.device_index] += event.device_time
            busy[event.device_index].append((event.time_range.start, event.time_range.end))
    top = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)[:12]
    _, one, one_times = timed_steps(name, smoke, devices[:1], lambda m, _: m, steps)
    return {
        "model": name,
        "dtype": "fp32",
        "gpus": len(devices),
        "devices": [str(d) for d in devices],
        "step_ms_median": round(statistics.median(times), 2),
        "phase_wall_ms_per_step": clock.medians(("forward", *PHASES)),
        "single_device": {
            "step_ms_median": round(statistics.median(one_times), 2),
            "phase_wall_ms_per_step": one.medians(ONE_DEVICE_PHASES),
        },
        "phase_cpu_ms_per_step": {p: round(phases[p] / steps / 1e3, 3) for p in CPU_PHASES},
        "gpu_kernel_ms_per_step": {
            f"cuda:{i}": round(us / steps / 1e3, 2) for i, us in sorted(gpu_us.items())
        },
        "gpu_idle": gpu_idle(busy, ranges, steps),
        "top_ops_self_cpu_ms_per_step": [
            [e.key, round(e.self_cpu_time_total / steps / 1e3, 3), e.count // steps] for e in top
        ],
    }


def markdown(records: list[dict[str, Any]]) -> str:
    """The records as Markdown tables: CPU and wall ms per phase, GPU kernel and idle ms."""
    lines = ["# torchdp.DataParallel step profile", ""]
    lines += [CPU_TEXT, ""]
    head = ["model", "devices", "step ms"]

    def row(r: dict[str, Any]) -> list:
        return [r["model"], ", ".join(r["devices"]), r["step_ms_median"]]

    rows = [
        row(r)
        + [f"{r['phase_cpu_ms_per_step'].get(p, 0.0):.2f}" for p in CPU_PHASES]
        + [", ".join(f"{d} {v}" for d, v in r["gpu_kernel_ms_per_step"].items()) or "—"]
        for r in records
    ]
    lines += table(head + [short_name(p) for p in CPU_PHASES] + ["GPU kernel ms"], rows)
    idle = [
        [
            r["model"],
            device,
            v["idle_ms_per_step"],
            "; ".join(f"{ms} {p}" for ms, p in v["largest_gaps"]),
        ]
        for r in records
        for device, v in r.get("gpu_idle", {}).items()
    ]
    if idle:
        lines += [IDLE_TEXT, ""]
        lines += table(["model", "device", "idle ms per step", "largest gaps (ms, phase)"], idle)
    wall = ("forward", *PHASES)
    lines += [WALL_TEXT, ""]
    rows = [
        row(r)
        + [f"{r['phase_wall_ms_per_step'][p]:.2f}" for p in wall]
        + [r["single_device"]["step_ms_median"]]
        + [f"{r['single_device']['phase_wall_ms_per_step'][p]:.2f}" for p in ONE_DEVICE_PHASES]
        for r in records
    ]
    one = ["one device: step ms", *ONE_DEVICE_PHASES]
    return "\n".join(lines + table(head + [short_name(p) for p in wall] + one, rows))


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
