"""Shared helpers of the torchdp benchmarks: machine metadata, timing, records, the command line.

Every benchmark script writes ``{"machine": machine_info(), "records": [...]}``. Each record has at
least ``bench``, ``model``, ``mode``, ``gpus``, ``dtype``, ``step_ms_median`` or
``replicate_ms_median``, ``speedup_vs_single`` (None where it does not apply) and ``peak_mem_gib``
(one value per GPU used, [] on the CPU). run_all.py merges the files of one run.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import gc
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

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
    print(f"[bench {time.strftime('%H:%M:%S')}] {message}", flush=True)


def error_text(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}".strip()
    return text if len(text) <= 2000 else text[:2000] + " ..."


def free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _run(cmd: Sequence[str]) -> str:
    try:
        return subprocess.run(
            cmd, capture_output=True, text=True, timeout=20, cwd=REPO, check=False
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return ""


def git_revision() -> str:
    return os.environ.get("TORCHDP_GIT_REV") or _run(["git", "rev-parse", "HEAD"]).strip() or "?"


def _version(module: str) -> str | None:
    with contextlib.suppress(ImportError):
        return __import__(module).__version__
    return None


def machine_info() -> dict[str, Any]:
    """Everything needed to interpret the figures: software versions, GPUs, driver, revision."""
    gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    info: dict[str, Any] = {
        "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
        "gpu_count": len(gpus),
        "gpus": gpus,
        "torchdp_git_revision": git_revision(),
        "nccl": None,
        "torchdp": _version("torchdp"),
        "torchvision": _version("torchvision"),
    }
    with contextlib.suppress(Exception):  # NCCL is optional
        info["nccl"] = ".".join(map(str, torch.cuda.nccl.version())) if gpus else None
    driver = _run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"]).split()
    info["driver"] = driver[0] if driver else None
    info["gpu_topology"] = _run(["nvidia-smi", "topo", "-m"]).splitlines()[:4] or None
    if info["torchdp"]:
        import torchdp

        info["torchdp_has_cuda"] = torchdp.has_cuda()
        info["torchdp_has_nccl"] = torchdp.has_nccl()
    return info


def machine_name(info: dict[str, Any]) -> str:
    """A short file-name tag such as ``2xH200`` or ``cpu``."""
    gpus = info.get("gpus") or []
    if not gpus:
        return "cpu"
    return f"{len(gpus)}x" + gpus[0].replace("NVIDIA ", "").replace(" ", "-")


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
        return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]

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
    unique = sorted({d for d in devices if d.type == "cuda"}, key=lambda d: d.index or 0)
    return [round(torch.cuda.max_memory_allocated(d) / 2**30, 3) for d in unique]


def autocast(dtype: str, device_type: str):
    """A fresh context manager for one step: autocast to bfloat16, or nothing for fp32."""
    if dtype not in ("fp32", "bf16"):
        raise ValueError(f"unknown dtype {dtype!r}")
    return torch.autocast(device_type, torch.bfloat16, enabled=dtype == "bf16")


def make_step(
    forward_loss: Callable[[], torch.Tensor], opt: torch.optim.Optimizer, dtype: str, where: str
) -> Callable[[], None]:
    """One training step: zero_grad, the forward and loss under autocast, backward, opt.step."""

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        with autocast(dtype, where):
            loss = forward_loss()
        loss.backward()
        opt.step()

    return step


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

    def write(self, path: str | os.PathLike[str], **extra: Any) -> Path:
        return write_json(path, {"machine": machine_info(), **extra, "records": self.records})


def dumps(data: dict[str, Any]) -> str:
    """A results file's text: one line per top-level key and one per record, so that a results
    file stays short and a new run's diff reads record by record."""
    lines = [
        f" {json.dumps(key)}: {json.dumps(value)}"
        for key, value in data.items()
        if key != "records"
    ]
    records = ",\n".join(f"  {json.dumps(r)}" for r in data.get("records", []))
    lines.append(f' "records": [\n{records}\n ]' if records else ' "records": []')
    return "{\n" + ",\n".join(lines) + "\n}\n"


def write_json(path: str | os.PathLike[str], data: dict[str, Any]) -> Path:
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(dumps(data))
    progress(f"wrote {len(data.get('records', []))} records to {out}")
    return out


def load(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Reads and validates a results file."""
    data = json.loads(Path(path).read_text())
    if not isinstance(data, dict) or "machine" not in data or "records" not in data:
        raise ValueError(f"{path}: not a torchdp benchmark results file")
    for record in data["records"]:
        validate_record(record)
    return data


def load_results(paths: list[str]) -> tuple[dict[str, Any], list[dict], list[dict], list[str]]:
    """Results files merged: (main machine block, further machine blocks, records, warnings).
    Invalid records are kept, marked with an ``error``; the C++ benchmark's machine block, alone
    or inside a merged file, is one of the further blocks."""
    machine: dict[str, Any] = {}
    extra: list[dict[str, Any]] = []
    records: list[dict[str, Any]] = []
    warnings: list[str] = []
    for i, path in enumerate(paths):
        data = json.loads(Path(path).read_text())
        if not isinstance(data, dict) or not isinstance(data.get("records"), list):
            raise SystemExit(f"{path}: not a torchdp benchmark results file")
        m = data.get("machine") or {}
        if i == 0:
            machine = _cpp_only_machine(m) if m.get("source") == "cpp" else m
        else:
            extra.append(m)
        for r in data["records"]:
            if not isinstance(r, dict):
                continue
            try:
                validate_record(r)
            except ValueError as e:
                warnings.append(f"{path}: {e}")
                r = {**r, "error": r.get("error") or f"invalid record: {e}"}
            records.append(r)
    extra += [machine[k] for k in ("cpp", "cpp_machine") if isinstance(machine.get(k), dict)]
    return machine, extra, records, warnings


def _cpp_only_machine(machine: dict[str, Any]) -> dict[str, Any]:
    """The machine block of a file written by the C++ benchmark alone, in the Python keys."""
    return {
        **machine,
        "torch": f"libtorch {machine.get('libtorch') or '?'}",
        "torchdp": machine.get("torchdp_version"),
        "torchdp_has_cuda": machine.get("torchdp_with_cuda"),
        "torchdp_has_nccl": machine.get("torchdp_with_nccl"),
    }


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


@dataclass
class RunSettings:
    """What a timing script's command line resolves to (see start_run)."""

    smoke: bool
    warmup: int
    steps: int
    deadline: float  # time.monotonic() value after which configurations are skipped
    counts: list[int]  # the GPU counts to compare
    dev0: torch.device  # where the one-device modes and the inputs live

    @property
    def multi(self) -> list[int]:
        return [g for g in self.counts if g > 1]

    def devices(self, count: int) -> list[torch.device]:
        """The devices of a mode over `count` GPUs (in smoke runs, `count` CPU devices)."""
        if self.smoke:
            return [torch.device("cpu")] * count
        return [torch.device("cuda", i) for i in range(count)]

    def time_left(self) -> float:
        return self.deadline - time.monotonic()


def parser(doc: str, defaults: str) -> argparse.ArgumentParser:
    """--smoke, --out, --gpus, --warmup, --steps, --time-budget; `defaults` says their defaults."""
    p = argparse.ArgumentParser(
        description=doc.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--smoke", action="store_true", help="tiny CPU run (CI): checks it all runs")
    p.add_argument("--out", required=True, help="JSON file to write")
    p.add_argument("--gpus", default=None, help="GPU counts to compare, e.g. 1,2 (default: all)")
    p.add_argument("--warmup", type=int, default=None, help="warm-up steps; " + defaults)
    p.add_argument("--steps", type=int, default=None, help="timed steps")
    p.add_argument("--time-budget", type=float, default=None, help="seconds; configurations "
                   "left after it are recorded as skipped")  # fmt: skip
    return p


def start_run(
    args: argparse.Namespace, warmup: tuple[int, int], steps: tuple[int, int], budget: float
) -> RunSettings:
    """Resolves the common options (defaults as (full run, smoke)) and exits with a clear message
    when a full run finds no CUDA device. Smoke runs take at most 55 s."""
    smoke = bool(args.smoke)
    if not smoke and not torch.cuda.is_available():
        sys.exit("no CUDA device: run with --smoke on a machine without GPUs")
    if smoke:
        torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    available = 2 if smoke else torch.cuda.device_count()
    counts = sorted({int(x) for x in (args.gpus or str(available)).split(",") if x.strip()})
    if max(counts) > available:
        sys.exit(f"--gpus asks for {max(counts)} GPUs but {available} are visible")
    budget = args.time_budget if args.time_budget is not None else 55.0 if smoke else budget
    return RunSettings(
        smoke=smoke,
        warmup=args.warmup if args.warmup is not None else warmup[smoke],
        steps=args.steps if args.steps is not None else steps[smoke],
        deadline=time.monotonic() + budget,
        counts=counts,
        dev0=torch.device("cpu") if smoke else torch.device("cuda", 0),
    )


def parse_list(arg: str | None, allowed: Sequence[str], what: str) -> list[str]:
    """A comma list checked against `allowed`, in allowed's order; all of them when empty."""
    items = [x.strip() for x in (arg or "").split(",") if x.strip()] or list(allowed)
    unknown = [x for x in items if x not in allowed]
    if unknown:
        sys.exit(f"unknown {what} {unknown}; choose from {list(allowed)}")
    return [x for x in allowed if x in items]
