"""Where the time of torchdp's training steps goes, in two views (one subcommand each).

``step``: for each model of ``bench_train_step.py`` (fp32, full batch) one
``torchdp.DataParallel`` over the first ``--gpus`` GPUs runs a few warm-up steps, then ``--steps``
steps under ``torch.profiler``. The phases of a step are marked with ``record_function``
(``DataParallel.replicate``, ``.scatter``, ``.parallel_apply``, ``.gather``, ``loss``,
``backward``, ``optimizer``) through overridden methods of a DataParallel subclass; torchdp's
own ranges (``csrc/torchdp/profiling.h``: walk, transfer, build, device_check, park) are read back
too. Per model the JSON record holds the median step time, the CPU time of each phase per step,
the GPU kernel time per device per step, each GPU's idle time per step with its largest gaps (and
the phase they began in), the top operators by CPU time, and, without the profiler, the wall time
of each phase on the calling thread next to the same phases of the plain model on one GPU.
``--device-ids 0,0`` puts two replicas on one GPU: the GPU time is then shared, but the CPU side
(replicate, scatter, the forwards under one GIL, gather) costs what it costs on two GPUs.
``--trace DIR`` also writes gzipped Chrome traces (``DIR/<model>-trace.json.gz``).

``single-gpu``: the plain model on one GPU: the share of the step the GPU is busy and the CPU time
to issue one forward. A model whose one-GPU step leaves the GPU mostly idle is bound by the CPU
work of issuing kernels, which data parallelism from one process multiplies instead of dividing.

What kept replicas save (``cache_replicas``) is a mode of the suite:
``bench_train_step.py --modes torchdp,torchdp_new_replicas``.

    python benchmarks/profiling.py step                 # all GPUs (2 or more); `make bench` runs it
    python benchmarks/profiling.py step --device-ids 0,0 --models mlp200   # one GPU, 2 replicas
    python benchmarks/profiling.py step --smoke --out /tmp/p.json           # CPU, seconds
    python benchmarks/profiling.py single-gpu --out /tmp/one.json
"""

from __future__ import annotations

import argparse
import gzip
import shutil
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
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
    make_step,
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
# torchdp's own ranges inside the forward (profiling.h): replicate's phases, and taking the kept
# replicas back after parallel_apply, which no overridable method contains. CPU time only.
INNER_PHASES = (
    "torchdp.replicate.walk",
    "torchdp.replicate.transfer",
    "torchdp.replicate.build",
    "torchdp.replicate.device_check",
    "torchdp.replicate.park",
)
CPU_PHASES = PHASES + INNER_PHASES


def short_name(phase: str) -> str:
    return phase.removeprefix("DataParallel.").removeprefix("torchdp.replicate.")


class PhaseClock:
    """Wall-clock milliseconds per phase, summed over a step (`on` switches it on)."""

    def __init__(self) -> None:
        self.on = False
        self.step: dict[str, float] = defaultdict(float)
        self.steps: list[dict[str, float]] = []

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """A profiler range named `name`, its wall time added to the step's (when on)."""
        start = time.perf_counter()
        with record_function(name):
            yield
        if self.on:
            self.step[name] += (time.perf_counter() - start) * 1e3

    def end_step(self) -> None:
        if self.on:
            self.steps.append(dict(self.step))
        self.step = defaultdict(float)

    def medians(self, names: Sequence[str]) -> dict[str, float]:
        return {
            n: round(statistics.median(s.get(n, 0.0) for s in self.steps), 3) if self.steps else 0.0
            for n in names
        }


class MarkedDataParallel(torchdp.DataParallel):
    """torchdp.DataParallel with a profiler range and a wall clock around each overridable phase
    (the clock is set on the instance)."""

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


def timed_steps(step, clock: PhaseClock, devices, steps: int) -> list[float]:
    """Synchronised step times (ms) with the phase clock on; warm-up steps first."""
    for _ in range(3):
        step()
        clock.end_step()
    common.synchronize(devices)
    clock.on = True
    times = []
    for _ in range(max(steps, 10)):
        start = time.perf_counter()
        step()
        common.synchronize(devices)
        times.append((time.perf_counter() - start) * 1e3)
        clock.end_step()
    clock.on = False
    return times


def training_step(
    name: str, smoke: bool, dev0: torch.device, clock: PhaseClock, wrap: Callable[[Any], Any]
) -> Callable[[], None]:
    """One SGD step of bench_train_step's model `name` (on dev0, called through `wrap(model)`),
    its phases timed by `clock`."""
    model = build_model(name, smoke)
    disable_dropout(model)
    model = model.to(dev0)
    x, target = make_inputs(name, smoke)
    x = x.to(dev0)
    target = target.to(dev0) if target is not None else None
    net = wrap(model)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        with clock.phase("forward"):
            out = net(x)
        with clock.phase("loss"):
            loss = compute_loss(name, out, target)
        with clock.phase("backward"):
            loss.backward()
        with clock.phase("optimizer"):
            opt.step()

    return step


def single_gpu_phases(name: str, smoke: bool, dev0: torch.device, steps: int) -> dict[str, Any]:
    """The plain model on devices[0] with the full batch: step time and wall ms per phase."""
    clock = PhaseClock()
    times = timed_steps(training_step(name, smoke, dev0, clock, lambda m: m), clock, [dev0], steps)
    return {
        "step_ms_median": round(statistics.median(times), 2),
        "phase_wall_ms_per_step": clock.medians(("forward", "loss", "backward", "optimizer")),
    }


def gpu_idle(
    busy: dict[int, list[tuple[float, float]]],
    phases: list[tuple[str, float, float]],
    steps: int,
    top: int = 3,
) -> dict[str, dict[str, Any]]:
    """Idle time of each GPU while the profiled steps ran, from the kernels' and copies'
    intervals (microseconds, per device index) and the calling thread's phase ranges.

    The window runs from the first to the last device activity of any GPU, so a device that
    starts late or finishes early is idle for that time too. Per device: idle milliseconds per
    step, and the `top` largest gaps, each with the innermost phase running on the calling
    thread when the gap began ("between phases" when none was).
    """
    spans = [iv for ivs in busy.values() for iv in ivs]
    if not spans or steps <= 0:
        return {}
    start = min(a for a, _ in spans)
    end = max(b for _, b in spans)

    def phase_at(t: float) -> str:
        inside = [(b - a, n) for n, a, b in phases if a <= t < b]
        return min(inside)[1] if inside else "between phases"

    result: dict[str, dict[str, Any]] = {}
    for device, intervals in sorted(busy.items()):
        gaps: list[tuple[float, float]] = []  # (length, start)
        reached = start
        for a, b in sorted(intervals):
            if a > reached:
                gaps.append((a - reached, reached))
            reached = max(reached, b)
        if end > reached:
            gaps.append((end - reached, reached))
        idle = sum(length for length, _ in gaps)
        largest = sorted(gaps, reverse=True)[:top]
        result[f"cuda:{device}"] = {
            "idle_ms_per_step": round(idle / steps / 1e3, 2),
            "largest_gaps": [[round(length / 1e3, 2), phase_at(at)] for length, at in largest],
        }
    return result


def write_trace(prof: Any, directory: str, name: str) -> Path:
    """The profiler's Chrome trace of `name`'s steps, gzipped, into `directory`."""
    folder = Path(directory)
    folder.mkdir(parents=True, exist_ok=True)
    plain = folder / f"{name}-trace.json"
    prof.export_chrome_trace(str(plain))
    packed = plain.with_name(plain.name + ".gz")
    with open(plain, "rb") as src, gzip.open(packed, "wb") as dst:
        shutil.copyfileobj(src, dst)
    plain.unlink()
    return packed


def profile_model(
    name: str,
    smoke: bool,
    gpus: int,
    steps: int,
    device_ids: list[int] | None = None,
    trace_dir: str | None = None,
) -> dict[str, Any]:
    devices = (
        [torch.device("cuda", i) for i in device_ids] if device_ids else mode_devices(smoke, gpus)
    )
    dev0 = devices[0]
    clock = PhaseClock()

    def wrap(model):
        dp = (
            MarkedDataParallel(model, devices=devices)
            if smoke
            else MarkedDataParallel(model, device_ids=[d.index for d in devices])
        )
        dp.clock = clock
        return dp

    step = training_step(name, smoke, dev0, clock, wrap)
    times = timed_steps(step, clock, devices, steps)
    wall = clock.medians(("forward", *PHASES))
    activities = [ProfilerActivity.CPU]
    if dev0.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    with profile(activities=activities) as prof:
        for _ in range(steps):
            step()
        common.synchronize(devices)
    if trace_dir is not None:
        common.progress(f"{name}: trace in {write_trace(prof, trace_dir, name)}")
    phases: dict[str, float] = defaultdict(float)
    gpu_us: dict[int, float] = defaultdict(float)
    busy: dict[int, list[tuple[float, float]]] = defaultdict(list)
    ranges: list[tuple[str, float, float]] = []
    for event in prof.events():
        if event.name in CPU_PHASES:
            phases[event.name] += event.cpu_time_total
            ranges.append((event.name, event.time_range.start, event.time_range.end))
        if event.device_type == torch.autograd.DeviceType.CUDA:
            gpu_us[event.device_index] += event.device_time
            busy[event.device_index].append((event.time_range.start, event.time_range.end))
    top = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)[:12]
    return {
        "model": name,
        "dtype": "fp32",
        "gpus": len(devices),
        "devices": [str(d) for d in devices],
        "step_ms_median": round(statistics.median(times), 2),
        "phase_wall_ms_per_step": wall,
        "single_device": single_gpu_phases(name, smoke, dev0, steps),
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
    """The records as a Markdown table: step time, CPU ms per phase, GPU kernel ms per device."""
    short = [short_name(p) for p in CPU_PHASES]
    lines = [
        "# torchdp.DataParallel step profile",
        "",
        "CPU ms per step spent in each phase (profiler ranges, wall time on the calling thread; "
        "the backward's device threads run in parallel with it; walk, transfer, build, "
        "device_check: inside replicate; `park`: taking the kept replicas back at the end of the "
        "forward) and GPU kernel ms per step per device.",
        "",
        "| model | devices | step ms | " + " | ".join(short) + " | GPU kernel ms |",
        "|---|---|---|" + "---|" * len(short) + "---|",
    ]
    for r in records:
        phases = " | ".join(f"{r['phase_cpu_ms_per_step'].get(p, 0.0):.2f}" for p in CPU_PHASES)
        gpu = ", ".join(f"{d} {v}" for d, v in r["gpu_kernel_ms_per_step"].items()) or "—"
        devices = ", ".join(r["devices"])
        lines.append(f"| {r['model']} | {devices} | {r['step_ms_median']} | {phases} | {gpu} |")
    if any(r.get("gpu_idle") for r in records):
        lines += [
            "",
            "GPU idle ms per step under the profiler (no kernel or copy running, from the first to "
            "the last device activity of the profiled steps), and the largest gaps with the phase "
            "the calling thread was in when each began.",
            "",
            "| model | device | idle ms per step | largest gaps (ms, phase) |",
            "|---|---|---|---|",
        ]
        for r in records:
            for device, idle in r.get("gpu_idle", {}).items():
                gaps = "; ".join(f"{ms} {phase}" for ms, phase in idle["largest_gaps"])
                lines.append(
                    f"| {r['model']} | {device} | {idle['idle_ms_per_step']} | {gaps or '—'} |"
                )
    wall_names = ("forward", *PHASES)
    lines += [
        "",
        "Wall-clock ms per step of each phase on the calling thread, without the profiler (median "
        "of the timed steps; `forward` is the whole DataParallel call, which contains replicate to "
        "gather). Next to it, the plain model on the first device with the full batch.",
        "",
        "| model | devices | step ms | "
        + " | ".join(p.removeprefix("DataParallel.") for p in wall_names)
        + " | one device: step ms | forward | loss | backward | optimizer |",
        "|---|---|---|" + "---|" * len(wall_names) + "---|---|---|---|---|",
    ]
    for r in records:
        wall = " | ".join(f"{r['phase_wall_ms_per_step'][p]:.2f}" for p in wall_names)
        one = r["single_device"]
        one_phases = " | ".join(
            f"{one['phase_wall_ms_per_step'][p]:.2f}"
            for p in ("forward", "loss", "backward", "optimizer")
        )
        lines.append(
            f"| {r['model']} | {', '.join(r['devices'])} | {r['step_ms_median']} | {wall} | "
            f"{one['step_ms_median']} | {one_phases} |"
        )
    return "\n".join(lines) + "\n"


def single_gpu(name: str, device: torch.device) -> dict[str, Any]:
    """The plain model on one GPU: step time, GPU kernel time per step, their ratio, and the CPU
    time of one forward call without waiting for the GPU."""
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


def parse_device_ids(parser: argparse.ArgumentParser, text: str, visible: int) -> list[int]:
    try:
        device_ids = [int(i) for i in text.split(",")]
    except ValueError:
        parser.error(f"--device-ids takes comma-separated integers, got {text!r}")
    bad = [i for i in device_ids if not 0 <= i < visible]
    if bad or len(device_ids) < 2:
        parser.error(
            f"--device-ids needs at least 2 entries among the {visible} visible CUDA devices "
            f"(0..{visible - 1}), got {text!r}"
        )
    return device_ids


def run_step(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    visible = torch.cuda.device_count()
    device_ids = None
    if args.device_ids is not None:
        if args.smoke or args.gpus is not None:
            parser.error("--device-ids replaces --gpus and --smoke")
        device_ids = parse_device_ids(parser, args.device_ids, visible)
        args.gpus = len(device_ids)
    elif args.smoke:
        args.gpus = 2
    elif args.gpus is None:
        if visible < 2:
            common.progress(f"profile step: needs at least 2 GPUs, {visible} visible; skipped")
            return 0
        args.gpus = visible
    elif visible < args.gpus:
        parser.error(f"needs {args.gpus} CUDA devices, {visible} visible")
    if args.out is None:
        info = common.machine_info()
        args.out = str(_HERE / "results" / f"{common.machine_name(info)}-profile.json")
    records = []
    for name in parse_list(args.models, MODELS, "model"):
        where = f"device ids {device_ids}" if device_ids else f"{args.gpus} devices"
        common.progress(f"profiling {name} (torchdp.DataParallel, {where})")
        rec = profile_model(name, args.smoke, args.gpus, args.steps, device_ids, args.trace)
        cpu = rec["phase_cpu_ms_per_step"]
        phases = ", ".join(f"{short_name(p)} {v:.2f}" for p, v in cpu.items())
        common.progress(
            f"{name}: step {rec['step_ms_median']} ms; CPU ms per step: {phases}; GPU kernel ms "
            f"per step: {rec['gpu_kernel_ms_per_step']}; one device: {rec['single_device']}"
        )
        records.append(rec)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    out = common.write_plain(args.out, "profile_step", records)
    md = out.with_suffix(".md")
    md.write_text(markdown(records))
    common.progress(f"wrote {md}")
    return 0


def run_single_gpu(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    if not torch.cuda.is_available():
        parser.error("single-gpu needs a CUDA device")
    records = []
    for name in parse_list(args.models, MODELS, "model"):
        rec = single_gpu(name, torch.device("cuda", 0))
        common.progress(
            f"{name}: step {rec['step_ms']} ms, GPU busy {rec['gpu_busy']:.0%}, "
            f"forward issue {rec['forward_issue_ms']} ms"
        )
        records.append(rec)
        torch.cuda.empty_cache()
    common.write_plain(args.out, "profile_single_gpu", records)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="view", required=True)
    models = f"comma list of {', '.join(MODELS)}"
    step = sub.add_parser("step", help="phases of torchdp.DataParallel steps")
    step.add_argument(
        "--out", default=None, help="JSON file (default results/<machine>-profile.json)"
    )
    step.add_argument("--smoke", action="store_true", help="tiny models on two CPU devices")
    step.add_argument("--gpus", type=int, default=None, help="GPU count (default: all visible)")
    step.add_argument(
        "--device-ids",
        default=None,
        help="comma list of CUDA device indices, repeats allowed (0,0: two replicas on one GPU)",
    )
    step.add_argument("--steps", type=int, default=3, help="profiled steps (default 3)")
    step.add_argument("--models", default=None, help=models)
    step.add_argument("--trace", default=None, help="folder for gzipped Chrome traces")
    one = sub.add_parser("single-gpu", help="GPU busy share of the plain model on one GPU")
    one.add_argument("--out", required=True, help="JSON file to write")
    one.add_argument("--models", default=None, help=models)
    args = parser.parse_args(argv)
    run = {"step": run_step, "single-gpu": run_single_gpu}[args.view]
    return run(sub.choices[args.view], args)


if __name__ == "__main__":
    sys.exit(main())
