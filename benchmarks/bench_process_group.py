"""Benchmark: averaging gradients across processes, one process per device.

Side by side in one run, on bench_train_step's models, each process training its share of the
global batch on its own device (one GPU per process, or the CPU):

* ``ddp``: ``DistributedDataParallel`` on the plain module;
* ``torchdp_process_group``: ``torchdp.DataParallel(module, process_group=WORLD)`` (Note
  [Reducing across processes] in csrc/torchdp/process_group.cpp);
* ``ddp_over_torchdp``: ``DistributedDataParallel(torchdp.DataParallel(module))``;

and ``single``, one process training the whole batch alone on the first device (speedup =
single / mode). NCCL with CUDA, gloo without.

    python benchmarks/bench_process_group.py --out r.json                  # all GPUs, full size
    python benchmarks/bench_process_group.py --smoke --procs 2 --out r.json  # CPU, tiny models

Prints one line per mode; ``--out`` writes the records as JSON with the machine's description.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_train_step
import common

import torchdp

MODES = ("ddp", "torchdp_process_group", "ddp_over_torchdp")


def _device(kind: str, rank: int) -> torch.device:
    return torch.device("cuda", rank) if kind == "cuda" else torch.device("cpu")


def _wrap(mode: str, model: nn.Module, device: torch.device) -> nn.Module:
    ids = [device.index] if device.type == "cuda" else None
    if mode == "ddp":
        return nn.parallel.DistributedDataParallel(model, device_ids=ids)
    devices = [device]
    if mode == "torchdp_process_group":
        return torchdp.DataParallel(model, devices=devices, process_group=dist.group.WORLD)
    if mode == "ddp_over_torchdp":
        return nn.parallel.DistributedDataParallel(torchdp.DataParallel(model, devices=devices))
    raise ValueError(f"unknown mode {mode!r}")


def _worker(rank: int, world: int, store: str, args: dict[str, Any], out: str) -> None:
    code = 0
    try:
        for key, value in common.SAFE_ENV.items():
            os.environ.setdefault(key, value)
        backend = "nccl" if args["device"] == "cuda" else "gloo"
        dist.init_process_group(backend, init_method=f"file://{store}", rank=rank, world_size=world)
        try:
            device = _device(args["device"], rank)
            if device.type == "cuda":
                torch.cuda.set_device(device)
            name = args["model"]
            model = bench_train_step.build_model(name, args["smoke"]).to(device)
            x, target = bench_train_step.make_inputs(name, args["smoke"])
            x = x.chunk(world)[rank].to(device)
            target = None if target is None else target.chunk(world)[rank].to(device)
            wrapped = _wrap(args["mode"], model, device)
            opt = torch.optim.SGD(wrapped.parameters(), lr=1e-3)
            step = bench_train_step.make_step(name, wrapped, opt, x, target, "fp32", device.type)
            common.reset_peak_memory([device])
            times = common.time_steps(step, [device], args["warmup"], args["steps"])
            if rank == 0:
                Path(out).write_text(
                    json.dumps({"times": times, "peak": common.peak_memory_gib([device])})
                )
            dist.barrier()
        finally:
            dist.destroy_process_group()
    except BaseException:  # noqa: BLE001  printed; the exit code says it failed
        import traceback

        traceback.print_exc()
        code = 1
    # gloo's teardown at interpreter exit can abort with some torch builds; the results are saved.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def run_mode(
    mode: str, model: str, procs: int, smoke: bool, steps: int, warmup: int, device: str
) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rank0.json")
        ctx = mp.get_context("spawn")
        args = {
            "mode": mode,
            "model": model,
            "smoke": smoke,
            "steps": steps,
            "warmup": warmup,
            "device": device,
        }
        workers = [
            ctx.Process(target=_worker, args=(r, procs, f"{tmp}/store", args, out))
            for r in range(procs)
        ]
        for w in workers:
            w.start()
        for w in workers:
            w.join(timeout=900)
        codes = [w.exitcode for w in workers]
        for w in workers:
            if w.is_alive():
                w.kill()
        if codes != [0] * procs:
            raise RuntimeError(f"{mode} on {model}: worker exit codes {codes} (tracebacks above)")
        return json.loads(Path(out).read_text())


def run_single(model: str, smoke: bool, steps: int, warmup: int, kind: str) -> dict:
    device = _device(kind, 0)
    net = bench_train_step.build_model(model, smoke).to(device)
    x, target = bench_train_step.make_inputs(model, smoke)
    x = x.to(device)
    target = None if target is None else target.to(device)
    opt = torch.optim.SGD(net.parameters(), lr=1e-3)
    step = bench_train_step.make_step(model, net, opt, x, target, "fp32", device.type)
    common.reset_peak_memory([device])
    times = common.time_steps(step, [device], warmup, steps)
    return {"times": times, "peak": common.peak_memory_gib([device])}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="mlp200,resnet50,transformer")
    parser.add_argument(
        "--procs", type=int, default=None, help="processes (default: the GPUs, else 2)"
    )
    parser.add_argument("--smoke", action="store_true", help="tiny models, a few steps")
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--warmup", type=int, default=None)
    parser.add_argument(
        "--device",
        choices=("cuda", "cpu"),
        default=None,
        help="cuda: a GPU per process over NCCL; cpu: the CPU over gloo "
        "(default: cuda where CUDA is available)",
    )
    parser.add_argument("--out", default=None, help="JSON file for the records")
    args = parser.parse_args(argv)
    kind = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if kind == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: CUDA is not available here; use --device cpu")
    procs = args.procs or (torch.cuda.device_count() if kind == "cuda" else 2)
    if procs < 2:
        parser.error(f"--procs must be at least 2, got {procs}")
    if kind == "cuda" and procs > torch.cuda.device_count():
        parser.error(
            f"--procs {procs} needs as many GPUs, {torch.cuda.device_count()} visible "
            "(--device cpu runs the processes on the CPU over gloo)"
        )
    steps = args.steps or (3 if args.smoke else 20)
    warmup = args.warmup or (1 if args.smoke else 5)
    results = common.Results("process_group")
    for model in [m.strip() for m in args.models.split(",") if m.strip()]:
        common.progress(f"{model}: single (1 process, whole batch)")
        single = run_single(model, args.smoke, steps, warmup, kind)
        base = common.summarize(single["times"])["step_ms_median"]
        results.add(
            model=model,
            model_desc=bench_train_step.model_desc(model, args.smoke),
            mode="single",
            gpus=1,
            dtype="fp32",
            speedup_vs_single=1.0,
            peak_mem_gib=single["peak"],
            **common.summarize(single["times"]),
        )
        for mode in MODES:
            common.progress(f"{model}: {mode} ({procs} processes)")
            got = run_mode(mode, model, procs, args.smoke, steps, warmup, kind)
            stats = common.summarize(got["times"])
            record = results.add(
                model=model,
                model_desc=bench_train_step.model_desc(model, args.smoke),
                mode=mode,
                gpus=procs if kind == "cuda" else 0,
                processes=procs,
                backend="nccl" if kind == "cuda" else "gloo",
                dtype="fp32",
                speedup_vs_single=base / stats["step_ms_median"],
                peak_mem_gib=got["peak"],
                **stats,
            )
            print(
                f"{model:12s} {mode:22s} {record['step_ms_median']:8.2f} ms  "
                f"{record['speedup_vs_single']:.2f}x of one process",
                flush=True,
            )
    if args.out:
        results.write(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
