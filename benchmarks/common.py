"""Shared helpers of the torchdp benchmarks: machine metadata, timing, records, progress lines.

Every benchmark script writes one JSON file::

    {"machine": {...machine_info()...}, "records": [{...}, ...]}

Each record has at least ``bench``, ``model``, ``mode``, ``gpus``, ``dtype``, one of
``step_ms_median`` / ``replicate_ms_median``, ``speedup_vs_single`` (None where it does not apply)
and ``peak_mem_gib`` (one value per GPU used, or [] on the CPU). ``run_all.py`` merges the files of
one run into ``results/<machine>.json`` and renders the Markdown table and plots.
"""

from __future__ import annotations

import datetime as _dt
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

import torch

REQUIRED_KEYS = ("bench", "model", "mode", "gpus", "dtype", "speedup_vs_single", "peak_mem_gib")
TIME_KEYS = ("step_ms_median", "replicate_ms_median")
REPO = Path(__file__).resolve().parent.parent

# NVLink multicast must stay off on the shared multi-GPU machines, also in processes we spawn.
SAFE_ENV = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}
os.environ.update(SAFE_ENV)


def progress(message: str) -> None:
    """One progress line, flushed at once (benchmarks run for minutes)."""
    stamp = time.strftime("%H:%M:%S")
    print(f"[bench {stamp}] {message}", flush=True)


def _run(cmd: Sequence[str]) -> str:
    try:
        return subprocess.run(
            cmd, capture_output=True, text=True, timeout=20, cwd=REPO
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def git_revision() -> str:
    return os.environ.get("TORCHDP_GIT_REV") or _run(["git", "rev-parse", "HEAD"]) or "unknown"


def machine_info() -> dict[str, Any]:
    """Everything needed to interpret the figures: software versions, GPUs, driver, revision."""
    info: dict[str, Any] = {
        "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
        "gpu_count": torch.cuda.device_count() if torch.cuda.is_available() else 0,
        "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        if torch.cuda.is_available()
        else [],
        "torchdp_git_revision": git_revision(),
    }
    try:
        info["nccl"] = ".".join(map(str, torch.cuda.nccl.version())) if info["gpu_count"] else None
    except Exception:  # noqa: BLE001 - NCCL is optional
        info["nccl"] = None
    smi = _run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"])
    info["driver"] = smi.splitlines()[0].strip() if smi else None
    topo = _run(["nvidia-smi", "topo", "-m"])
    info["gpu_topology"] = topo.splitlines()[:4] if topo else None
    try:
        import torchdp

        info["torchdp"] = torchdp.__version__
        info["torchdp_has_cuda"] = torchdp.has_cuda()
        info["torchdp_has_nccl"] = torchdp.has_nccl()
    except ImportError:
        info["torchdp"] = None
    try:
        import torchvision

        info["torchvision"] = torchvision.__version__
    except ImportError:
        info["torchvision"] = None
    return info


def machine_name(info: dict[str, Any]) -> str:
    """A short file-name tag such as ``2xH200`` or ``cpu``."""
    gpus = info.get("gpus") or []
    if not gpus:
        return "cpu"
    name = gpus[0].replace("NVIDIA ", "").replace(" ", "-")
    return f"{len(gpus)}x{name}"


def synchronize(devices: Iterable[torch.device]) -> None:
    for d in devices:
        if d.type == "cuda":
            torch.cuda.synchronize(d)


def time_steps(
    step: Callable[[], Any], devices: Sequence[torch.device], warmup: int, steps: int
) -> list[float]:
    """Milliseconds of each of `steps` calls of `step` after `warmup` calls, synchronising every
    device in `devices` around each call."""
    for _ in range(warmup):
        step()
    synchronize(devices)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        step()
        synchronize(devices)
        times.append((time.perf_counter() - start) * 1e3)
    return times


def summarize(times_ms: Sequence[float], prefix: str = "step_ms") -> dict[str, float]:
    """Median and spread of a list of timings."""
    ordered = sorted(times_ms)

    def quantile(q: float) -> float:
        return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]

    return {
        f"{prefix}_median": statistics.median(ordered),
        f"{prefix}_p10": quantile(0.10),
        f"{prefix}_p90": quantile(0.90),
        f"{prefix}_min": ordered[0],
        f"{prefix}_max": ordered[-1],
        f"{prefix}_count": len(ordered),
    }


def reset_peak_memory(devices: Iterable[torch.device]) -> None:
    for d in devices:
        if d.type == "cuda":
            torch.cuda.reset_peak_memory_stats(d)


def peak_memory_gib(devices: Iterable[torch.device]) -> list[float]:
    """Peak allocated memory per CUDA device since the last reset, in GiB ([] on the CPU)."""
    return [
        round(torch.cuda.max_memory_allocated(d) / 2**30, 3) for d in devices if d.type == "cuda"
    ]


def validate_record(record: dict[str, Any]) -> None:
    missing = [k for k in REQUIRED_KEYS if k not in record]
    if missing or not any(k in record for k in TIME_KEYS):
        raise ValueError(f"benchmark record lacks {missing or list(TIME_KEYS)}: {record}")


class Results:
    """Collects records and writes the JSON file of one benchmark script."""

    def __init__(self, bench: str) -> None:
        self.bench = bench
        self.records: list[dict[str, Any]] = []

    def add(self, **record: Any) -> dict[str, Any]:
        record.setdefault("bench", self.bench)
        validate_record(record)
        self.records.append(record)
        return record

    def write(self, path: str | os.PathLike[str]) -> Path:
        out = Path(path)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({"machine": machine_info(), "records": self.records}, indent=1))
        progress(f"wrote {len(self.records)} records to {out}")
        return out


def load(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Reads and validates a results file."""
    data = json.loads(Path(path).read_text())
    if not isinstance(data, dict) or "machine" not in data or "records" not in data:
        raise ValueError(f"{path}: not a torchdp benchmark results file")
    for record in data["records"]:
        validate_record(record)
    return data


def default_devices(smoke: bool) -> list[torch.device]:
    """All visible GPUs; in smoke mode (CI, no GPU) two CPU devices."""
    if not smoke and torch.cuda.is_available():
        return [torch.device("cuda", i) for i in range(torch.cuda.device_count())]
    return [torch.device("cpu"), torch.device("cpu")]


def add_common_args(parser) -> None:
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="tiny CPU run (CI): a few steps on small inputs, checks it all runs",
    )
    parser.add_argument("--out", required=True, help="JSON file to write")
    parser.add_argument(
        "--gpus",
        default=None,
        help="comma-separated GPU counts to compare, e.g. 1,2 (default: all)",
    )


def add_timing_args(
    parser, *, warmup: tuple[int, int], steps: tuple[int, int], budget: tuple[float, float]
) -> None:
    """--warmup, --steps and --time-budget; each default is given as (full run, --smoke)."""
    parser.add_argument(
        "--warmup", type=int, default=None, help=f"warm-up steps ({warmup[0]}; smoke {warmup[1]})"
    )
    parser.add_argument(
        "--steps", type=int, default=None, help=f"timed steps ({steps[0]}; smoke {steps[1]})"
    )
    parser.add_argument(
        "--time-budget",
        type=float,
        default=None,
        help="seconds; configurations left after it are recorded as skipped "
        f"(default {budget[0]:.0f}; smoke {budget[1]:.0f})",
    )


@dataclass
class RunSettings:
    """What a timing script's command line resolves to (see start_run)."""

    smoke: bool
    warmup: int
    steps: int
    budget: float
    started: float  # time.monotonic() at start_run
    deadline: float  # time.monotonic() value after which configurations are skipped
    multi: list[int]  # the GPU counts above one to compare
    dev0: torch.device  # where the single-device mode and the inputs live


def start_run(
    args, *, warmup: tuple[int, int], steps: tuple[int, int], budget: tuple[float, float]
) -> RunSettings:
    """Resolves --smoke/--gpus/--warmup/--steps/--time-budget (defaults as (full, smoke)) and
    exits with a clear message when a full run finds no CUDA device."""
    smoke = bool(args.smoke)
    pick = 1 if smoke else 0
    if not smoke and not torch.cuda.is_available():
        sys.exit("no CUDA device: run with --smoke on a machine without GPUs")
    available = 2 if smoke else torch.cuda.device_count()
    counts = gpu_counts(args.gpus, available)
    chosen_budget = args.time_budget if args.time_budget is not None else budget[pick]
    started = time.monotonic()
    return RunSettings(
        smoke=smoke,
        warmup=args.warmup if args.warmup is not None else warmup[pick],
        steps=args.steps if args.steps is not None else steps[pick],
        budget=chosen_budget,
        started=started,
        deadline=started + chosen_budget,
        multi=[g for g in counts if g > 1],
        dev0=torch.device("cpu") if smoke else torch.device("cuda", 0),
    )


def write_plain(path: str | os.PathLike[str], bench: str, records: list[dict[str, Any]]) -> Path:
    """Writes {"machine", "bench", "records"} for scripts whose records are not timing records
    of the suite (the profiles)."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps({"machine": machine_info(), "bench": bench, "records": records}, indent=1) + "\n"
    )
    progress(f"wrote {out}")
    return out


def gpu_counts(arg: str | None, available: int) -> list[int]:
    if not arg:
        return [available] if available > 1 else [max(available, 1)]
    counts = sorted({int(x) for x in arg.split(",") if x.strip()})
    too_many = [c for c in counts if c > max(available, 1)]
    if too_many:
        sys.exit(f"--gpus asks for {too_many} GPUs but {available} are visible")
    return counts


# ---- reading results (report.py, targets.py) ----------------------------------------------------


def num(v: Any) -> float | None:
    """A finite number from a record field, else None (booleans, missing values, NaN)."""
    if isinstance(v, bool) or v is None:
        return None
    try:
        f = float(v)
    except (TypeError, ValueError):
        return None
    return f if math.isfinite(f) else None


def fmt_x(v: Any) -> str:
    """A ratio as "1.23x" ("—" when unknown)."""
    f = num(v)
    return "—" if f is None else f"{f:.2f}x"


def failed(r: dict[str, Any]) -> bool:
    """Whether a record is of a configuration that failed or was skipped."""
    return bool(r.get("error")) or bool(r.get("skipped"))
