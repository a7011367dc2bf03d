"""CPU replicas: wall and CPU time per training step, intra-op threads, OS threads, GIL or not.

Two replicas on the CPU (``devices=["cpu", "cpu"]``) of 200 x (``Linear(64, 64)``, ``ReLU``):
Python-bound at batch 16, kernel-bound at batch 512. Modes: ``single`` (the module alone),
``torchdp`` (``torchdp.DataParallel``, replica 1 on a worker thread) and ``torchdp_serial``
(``serial_forward=True``). Each intra-op setting runs in a fresh process:

* ``default``: torch's default thread count;
* ``1``: ``torch.set_num_threads(1)`` first;
* ``1-after``: ``torch.set_num_threads(1)`` after a first step at the default (a worker that
  kept its first setting would go on with the default team).

A step is zero_grad, forward, ``out.pow(2).mean()``, backward, SGD. Each record carries the median
wall ms and the median CPU ms (``time.process_time``, all threads of the process) per step, the OS
threads of the process after the mode, and whether the GIL was on (run it with a free-threaded
Python for the GIL-off figures)::

    python benchmarks/bench_threads.py --out benchmarks/results/cpu-threads.json
    python benchmarks/bench_threads.py --out /tmp/threads.json --smoke
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import sysconfig
import time
from pathlib import Path
from typing import Any

_HERE = Path(__file__).resolve().parent
if str(_HERE) not in sys.path:
    sys.path.insert(0, str(_HERE))

import common
import torch
from torch import nn

try:
    import torchdp
except ImportError:  # not installed: use the in-place build of the repository
    sys.path.append(str(common.REPO / "python"))
    import torchdp

SETTINGS = ("default", "1", "1-after")
MODES = ("single", "torchdp", "torchdp_serial")
BATCHES = (16, 512)


def gil_enabled() -> bool:
    is_enabled = getattr(sys, "_is_gil_enabled", None)
    return True if is_enabled is None else bool(is_enabled())


def os_threads() -> int | None:
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return None


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[m for _ in range(200) for m in (nn.Linear(64, 64), nn.ReLU())])


def wrap(mode: str, net: nn.Module) -> nn.Module:
    if mode == "single":
        return net
    cpu = [torch.device("cpu")] * 2
    return torchdp.DataParallel(net, devices=cpu, serial_forward=mode == "torchdp_serial")


def time_mode(mode: str, batch: int, setting: str, warmup: int, steps: int) -> dict[str, Any]:
    net = model()
    wrapped = wrap(mode, net)
    opt = torch.optim.SGD(net.parameters(), lr=1e-3)
    x = torch.randn(batch, 64)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        wrapped(x).pow(2).mean().backward()
        opt.step()

    step()
    if setting == "1-after":
        torch.set_num_threads(1)
    for _ in range(warmup):
        step()
    wall, cpu = [], []
    for _ in range(steps):
        w, c = time.perf_counter(), time.process_time()
        step()
        cpu.append((time.process_time() - c) * 1e3)
        wall.append((time.perf_counter() - w) * 1e3)
    return {
        **common.summarize(wall),
        **common.summarize(cpu, prefix="cpu_ms"),
        "intra_op_threads": torch.get_num_threads(),
        "os_threads": os_threads(),
    }


def child(setting: str, warmup: int, steps: int) -> list[dict[str, Any]]:
    """One setting, in this (fresh) process: every batch and mode."""
    default = torch.get_num_threads()
    if setting == "1":
        torch.set_num_threads(1)
    records = []
    for batch in BATCHES:
        for mode in MODES:
            if setting == "1-after":
                torch.set_num_threads(default)  # time_mode sets 1 after the first step
            rec = {
                "bench": "threads",
                "model": "mlp200x64",
                "mode": mode,
                "gpus": 0,
                "dtype": "fp32",
                "batch": batch,
                "replicas": 1 if mode == "single" else 2,
                "intra_op": setting,
                "gil_enabled": gil_enabled(),
                "free_threaded": bool(sysconfig.get_config_var("Py_GIL_DISABLED")),
                "peak_mem_gib": [],
                "speedup_vs_single": None,
                **time_mode(mode, batch, setting, warmup, steps),
            }
            records.append(rec)
            common.progress(
                f"{setting:>7} batch {batch:>3} {mode:<14} {rec['step_ms_median']:8.2f} ms wall, "
                f"{rec['cpu_ms_median']:8.2f} ms CPU, {rec['os_threads']} OS threads"
            )
    single = {r["batch"]: r["step_ms_median"] for r in records if r["mode"] == "single"}
    for r in records:
        r["speedup_vs_single"] = single[r["batch"]] / r["step_ms_median"]
    return records


def main(argv: list[str] | None = None) -> int:
    parser = common.parser(__doc__, "5 warm-up and 30 timed steps; smoke 1 and 3")
    parser.add_argument("--settings", default=",".join(SETTINGS), help="comma list of settings")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    warmup = args.warmup if args.warmup is not None else (1 if args.smoke else 5)
    steps = args.steps if args.steps is not None else (3 if args.smoke else 30)
    if args.child:
        Path(args.out).write_text(json.dumps(child(args.child, warmup, steps)))
        return 0
    settings = [s.strip() for s in args.settings.split(",") if s.strip()]
    unknown = sorted(set(settings) - set(SETTINGS))
    if unknown:
        parser.error(f"unknown settings {unknown}; choose from {list(SETTINGS)}")
    results = common.Results(bench="threads")
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    env["PYTHONPATH"] = os.pathsep.join(
        filter(None, [str(Path(torchdp.__file__).parent.parent), env.get("PYTHONPATH")])
    )
    for setting in settings:
        part = Path(args.out).with_suffix(f".{setting}.part")
        cmd = [sys.executable, __file__, "--child", setting, "--out", str(part)]
        cmd += ["--warmup", str(warmup), "--steps", str(steps)]
        rc = subprocess.call(cmd, env=env)
        if rc != 0:
            sys.exit(f"bench_threads: setting {setting} failed with exit status {rc}")
        for rec in json.loads(part.read_text()):
            results.add(**rec, smoke=args.smoke)
        part.unlink()
    results.write(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
