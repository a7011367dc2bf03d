"""Training steps side by side: one GPU, torch.nn.DataParallel, torchdp.DataParallel and DDP.

One step is zero_grad, forward, loss, backward and an SGD step, for the training-step models of
models.py, in fp32 and under bf16 autocast, every mode from the same weights and inputs. Modes:

* ``single``: the model on the first GPU; ``single_shard``: the same at batch / g (g: each GPU
  count compared, 2 on one GPU), whose ``ideal_speedup_vs_single`` is what g GPUs would reach
  with perfect overlap and no communication, the bound of every data-parallel mode;
* ``torch_dp``: ``torch.nn.DataParallel``; ``torchdp``: ``torchdp.DataParallel``, replicas kept
  (its outputs and gradients after one step are first compared with torch.nn.DataParallel's);
  ``torchdp_serial``: ``serial_forward=True``; ``torchdp_new_replicas``: ``cache_replicas=False``;
  ``torchdp_graphs``: ``cuda_graphs=True``, with its one-GPU baseline ``single_graphs`` (GPUs);
* ``ddp``: DistributedDataParallel, one process per GPU (batch / gpus each, a step's time the
  slowest rank's); likewise ``torchdp_process_group`` (``torchdp.DataParallel(process_group=
  WORLD)``) and ``ddp_over_torchdp`` (DDP around torchdp.DataParallel);
* ``single_compiled``: ``torch.compile(model)`` on the first GPU; ``torchdp_compiled``:
  ``torch.compile(torchdp.DataParallel(model))`` (each replica's forward compiled);
  ``torchdp_compiled_inside``: ``torchdp.DataParallel(torch.compile(model))`` (inductor, the
  warm-up steps compile).

``torchdp_new_replicas``, ``torchdp_process_group``, ``ddp_over_torchdp`` and the compiled modes
run only when ``--modes`` names them. ``--memory``: the memory run (records ``memory``) of
models.py's language model with a 50k-token output layer, fp32, peak memory per GPU and ``mem_ratio_gpu0_gpu1``; besides
``single``, ``torch_dp``, ``torchdp`` and ``ddp`` (the loss on GPU 0) it times the loss per
replica: ``torchdp_balanced`` (``gather_output=False`` with ``DataParallelCriterion``) and
``torch_dp_balanced`` (model and loss in one module, each replica returning its loss).
``--shares 1,2`` gives the torchdp modes uneven shares of the batch (``DataParallel(shares=)``,
recorded as ``shares``), a smaller first share for a smaller GPU 0 peak; ``--device-ids 0,0`` runs
the data-parallel modes on those GPUs (a GPU may repeat: two replicas on one GPU; ``cpu`` puts a
replica on the CPU, so ``0,cpu`` shows GPU 0's own peak with one GPU; nn.DataParallel takes no CPU
replica, so name the torchdp modes).

    python benchmarks/bench_train_step.py --out results/train_step.json         # 2 H200: ~1.5 min
    python benchmarks/bench_train_step.py --memory --out results/memory.json    # 2 H200: ~1 min
    python benchmarks/bench_train_step.py --memory --device-ids 0,0 --shares 1,2 --out /tmp/m.json
    python benchmarks/bench_train_step.py --memory --device-ids 0,cpu --shares 1,3 \
        --modes single,torchdp,torchdp_balanced --out /tmp/m.json              # 1 GPU
    python benchmarks/bench_train_step.py --smoke --out /tmp/ts.json            # CPU, < 60 s
    python benchmarks/bench_train_step.py --modes single,single_compiled,torchdp,torchdp_compiled,\
        torchdp_compiled_inside --device-ids 0,0 --out results/compiled.json   # eager vs compiled
"""

from __future__ import annotations

import copy
import datetime
import math
import queue as queue_mod
import socket
import sys
import time
import warnings
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common
import models
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

import torchdp

DTYPES = ("fp32", "bf16")
MODES = (
    "single", "single_graphs", "single_shard", "torch_dp", "torchdp", "torchdp_serial",
    "torchdp_new_replicas", "torchdp_graphs", "ddp", "torchdp_process_group", "ddp_over_torchdp",
    "single_compiled", "torchdp_compiled", "torchdp_compiled_inside",
)  # fmt: skip
MEMORY_MODES = ("single", "torch_dp", "torchdp", "torchdp_balanced", "torch_dp_balanced", "ddp")
COMPILE_MODES = ("single_compiled", "torchdp_compiled", "torchdp_compiled_inside")
OPT_IN_MODES = ("torchdp_new_replicas", "torchdp_process_group", "ddp_over_torchdp", *COMPILE_MODES)
GRAPH_MODES = ("single_graphs", "torchdp_graphs")  # CUDA only
ONE_GPU_MODES = ("single", "single_graphs", "single_shard", "single_compiled")
PROCESS_MODES = ("ddp", "torchdp_process_group", "ddp_over_torchdp")
SKIPPED = "skipped: time budget exhausted"
NOTES = {
    "single_graphs": "torchdp.DataParallel(cuda_graphs=True) on the first GPU alone",
    "single_shard": "the plain model on the first GPU with one replica's share of the batch",
    "torchdp_serial": "serial_forward=True: replicas issued in order on the calling thread",
    "torchdp_new_replicas": "cache_replicas=False: new replica modules at every forward",
    "torchdp_graphs": "cuda_graphs=True: kept replicas, forward and backward replayed as graphs",
    "torchdp_balanced": "gather_output=False + DataParallelCriterion: loss on each replica's GPU",
    "torch_dp_balanced": "loss computed inside each replica",
    "single_compiled": "torch.compile(model) on the first GPU alone",
    "torchdp_compiled": "torch.compile(torchdp.DataParallel(model)): each replica compiled",
    "torchdp_compiled_inside": "torchdp.DataParallel(torch.compile(model))",
}
TORCH_DP_NOTES = {
    "cpu": "CPU: torch.nn.DataParallel is a passthrough without CUDA (the whole batch runs "
    "unwrapped on one device)",
    "bf16": "torch.nn.DataParallel forwards only autocast's enabled flag to its worker threads and "
    "the autocast dtype is thread-local, so its replicas run at the thread default dtype",
}
_GATHER_SCALARS = ".*Was asked to gather along dimension 0, but all input tensors were scalars.*"


class LossInReplica(nn.Module):
    """Model and loss in one module: forward(x, target) returns the replica's loss (0-dim)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor, target: torch.Tensor | None) -> torch.Tensor:
        return models.loss(self.model(x), target)


def wrap(
    mode: str, model: nn.Module, devices: list[torch.device], shares: list[float] | None = None
) -> nn.Module:
    """The data-parallel module of a one-process mode over `devices` (torchdp's with `shares`)."""
    if mode.startswith("torch_dp"):
        if mode == "torch_dp_balanced":
            model = LossInReplica(model)
        if devices[0].type == "cpu":  # what torch.nn.DataParallel is without CUDA
            return model
        return nn.DataParallel(model, device_ids=[d.index for d in devices])
    options = {
        "serial_forward": mode == "torchdp_serial",
        "cache_replicas": mode != "torchdp_new_replicas",
        "cuda_graphs": mode in GRAPH_MODES,
        "gather_output": mode != "torchdp_balanced",
        "shares": shares,
    }
    if mode == "torchdp_compiled_inside":
        model = torch.compile(model)
    dp = torchdp.DataParallel(model, devices=devices, **options)
    return torch.compile(dp) if mode == "torchdp_compiled" else dp


def grad_check(master: nn.Module, x, target, dtype: str, devices: list) -> dict[str, Any]:
    """One forward and backward through torch.nn.DataParallel and torchdp.DataParallel from the
    same weights and inputs: do the outputs and the gradients agree?"""
    got = {}
    for mode in ("torch_dp", "torchdp"):
        model = models.without_dropout(copy.deepcopy(master)).to(x.device)
        with common.autocast(dtype, x.device.type):
            out = wrap(mode, model, devices)(x)
            loss = models.loss(out, target)
        loss.backward()
        grads = [torch.zeros_like(p) if p.grad is None else p.grad for p in model.parameters()]
        got[mode] = [t.detach().float() for t in (out, *grads)]
    ours, ref = got["torchdp"], got["torch_dp"]
    diffs = [(a - b) for a, b in zip(ours[1:], ref[1:], strict=True)]
    norm = math.sqrt(sum(float(b.pow(2).sum()) for b in ref[1:])) or 1.0
    rel = math.sqrt(sum(float(d.pow(2).sum()) for d in diffs)) / norm
    result: dict[str, Any] = {
        "grads_max_abs_diff": max((float(d.abs().max()) for d in diffs if d.numel()), default=0.0),
        "grads_rel_l2_diff": rel,
        "outputs_max_abs_diff": float((ours[0] - ref[0]).abs().max()),
        "grads_check": "outputs and gradients, assert_close(rtol=1e-5, atol=1e-5) as the parity "
        "tests, dropout off",
    }
    if dtype != "fp32":
        loose = "loose: relative L2 difference <= 5e-2, dropout off (bf16 autocast: "
        result["grads_check"] = loose + "torch.nn.DataParallel's replicas may run float16)"
        return {**result, "grads_match_torch_dp": rel <= 5e-2}
    try:
        torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5)
        result["grads_match_torch_dp"] = True
    except AssertionError as exc:
        result["grads_match_torch_dp"] = False
        result["grads_mismatch"] = str(exc).strip().splitlines()[0][:300]
    return result


def run_local(
    mode: str, master: nn.Module, x, target, dtype: str, devices: list, run, shares=None
) -> dict:
    """Times one mode in this process over `devices`; the record's fields (raises on failure)."""
    model = copy.deepcopy(master).to(x.device)
    if mode == "single_shard":
        share = x.shape[0] // len(devices)
        x, target = x[:share], None if target is None else target[:share]
        devices = devices[:1]
    net = model if mode in ("single", "single_shard") else wrap(mode, model, devices, shares)
    if mode == "single_compiled":
        net, devices = torch.compile(model), devices[:1]
    if net is model or (mode.startswith("torch_dp") and devices[0].type == "cpu"):
        devices = devices[:1]  # the plain model, or torch.nn.DataParallel's passthrough
    if mode == "torchdp_balanced":
        criterion = torchdp.DataParallelCriterion(models.loss)

        def forward_loss() -> torch.Tensor:
            return criterion(net(x), target)  # the logits stay on their GPUs

    elif mode == "torch_dp_balanced":

        def forward_loss() -> torch.Tensor:
            return net(x, target).mean()  # one loss per replica, gathered

    else:

        def forward_loss() -> torch.Tensor:
            return models.loss(net(x), target)

    opt = torch.optim.SGD(model.parameters(), lr=models.LR)
    step = common.make_step(forward_loss, opt, dtype, x.device.type)
    common.free_memory()
    common.reset_peak_memory(devices)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_GATHER_SCALARS)
        times = common.time_steps(step, devices, run.warmup, run.steps)
    fields = {**common.summarize(times), "replicas": len(devices)}
    return {**fields, "peak_mem_gib": common.peak_memory_gib(devices)}


def process_job(job: dict[str, Any], rank: int, world: int, device: torch.device) -> dict:
    """One configuration of a process mode, on one rank."""
    model = models.build(job["model"], job["smoke"]).to(device)
    if job["mode"] == "torchdp_process_group":
        net = torchdp.DataParallel(model, devices=[device], process_group=dist.group.WORLD)
    elif job["mode"] == "ddp_over_torchdp":
        net = nn.parallel.DistributedDataParallel(torchdp.DataParallel(model, devices=[device]))
    else:
        ids = [device.index] if device.type == "cuda" else None
        net = nn.parallel.DistributedDataParallel(model, device_ids=ids)
    x, target = models.inputs(job["model"], job["smoke"])
    x = x.chunk(world)[rank].to(device)
    target = None if target is None else target.chunk(world)[rank].to(device)
    opt = torch.optim.SGD(net.parameters(), lr=models.LR)
    step = common.make_step(lambda: models.loss(net(x), target), opt, job["dtype"], device.type)
    common.reset_peak_memory([device])
    for _ in range(job["warmup"]):
        step()
    times = []
    for _ in range(job["steps"]):  # each step starts after a barrier
        dist.barrier()
        common.synchronize([device])
        start = time.perf_counter()
        step()
        common.synchronize([device])
        times.append((time.perf_counter() - start) * 1e3)
    slowest = torch.tensor(times, dtype=torch.float64, device=device)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    peak = common.peak_memory_gib([device])
    return {"times": slowest.tolist(), "peak": peak[0] if peak else None, "batch": len(x)}


def _rank(rank: int, world: int, init: str, jobs: list[dict], results, deadline: float) -> None:
    """One spawned process: runs every job; rank 0 sends each job's result, all ranks merged."""
    smoke = jobs[0]["smoke"]
    device = torch.device("cpu") if smoke else torch.device("cuda", rank)
    if smoke:
        torch.set_num_threads(1)
    else:
        torch.cuda.set_device(device)
    timeout = datetime.timedelta(seconds=300)
    backend = "gloo" if smoke else "nccl"
    dist.init_process_group(backend, init_method=init, rank=rank, world_size=world, timeout=timeout)
    for index, job in enumerate(jobs):
        late = torch.tensor([float(time.time() > deadline)], device=device)
        dist.all_reduce(late, op=dist.ReduceOp.MAX)  # every rank skips, or none
        try:
            out = {"error": SKIPPED} if late.item() else process_job(job, rank, world, device)
        except Exception as exc:  # noqa: BLE001 - recorded, the run goes on
            out = {"error": common.error_text(exc)}
        common.free_memory()
        outs: list[Any] = [None] * world
        dist.all_gather_object(outs, out)
        errors = sorted({o["error"] for o in outs if "error" in o})
        if errors:
            out = {"error": "; ".join(errors)}
        else:
            out["peak_mem_gib"] = [o["peak"] for o in outs if o["peak"] is not None]
        if rank == 0:
            results.put((index, out))
    dist.destroy_process_group()


def run_processes(jobs: list[dict], world: int, run: common.RunSettings) -> list[dict[str, Any]]:
    """Runs `jobs` on `world` spawned ranks: per job {"times", "peak_mem_gib", "batch"} or
    {"error"}. A rank that dies, or silence for 90 s (60 s in smoke runs), ends them all."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        init = f"tcp://127.0.0.1:{s.getsockname()[1]}"
    deadline = time.time() + run.time_left()
    procs = [
        ctx.Process(target=_rank, args=(rank, world, init, jobs, results, deadline))
        for rank in range(world)
    ]
    for p in procs:
        p.start()
    outs: dict[int, dict[str, Any]] = {}
    heard, why = time.monotonic(), ""
    try:
        while len(outs) < len(jobs) and not why:
            try:
                index, outs[index] = results.get(timeout=1.0)
                heard = time.monotonic()
            except queue_mod.Empty:
                if any(p.exitcode not in (None, 0) for p in procs):
                    why = "exit codes " + ", ".join(str(p.exitcode) for p in procs)
                elif time.monotonic() - heard > (60.0 if run.smoke else 90.0):
                    why = "no message from the ranks in time"
    finally:
        for p in procs:
            p.join(timeout=10.0 if not why else 1.0)
            if p.is_alive():
                p.kill()
                p.join()
    return [outs.get(i, {"error": f"no result from the ranks ({why})"}) for i in range(len(jobs))]


def device_ids_and_shares(args: Any) -> tuple[list[torch.device] | None, list[float] | None]:
    """--device-ids as devices and --shares as numbers (None when not given); exits on bad
    values. A ``cpu`` entry puts that replica on the CPU (``0,cpu``: GPU 0's peak with one GPU)."""
    try:
        ids = None
        if args.device_ids:
            ids = [
                torch.device("cpu") if x.strip() == "cpu" else torch.device("cuda", int(x))
                for x in args.device_ids.split(",")
            ]
        shares = [float(x) for x in args.shares.split(",")] if args.shares else None
    except ValueError:
        sys.exit("--device-ids and --shares take comma lists, e.g. 0,0 (or 0,cpu) and 1,2")
    if ids is not None and (len(ids) < 2 or args.gpus):
        sys.exit("--device-ids needs two or more devices (e.g. 0,0) and replaces --gpus")
    return ids, shares


def main(argv: list[str] | None = None) -> int:
    parser = common.parser(__doc__, "default 3 and 10 steps (--memory 2 and 5; smoke 1 and 2)")
    parser.add_argument("--memory", action="store_true", help="the memory run (see above)")
    parser.add_argument("--models", default=None, help="comma list of models.py's models")
    parser.add_argument("--dtypes", default=None, help="comma list of fp32,bf16")
    parser.add_argument("--modes", default=None, help="comma list of the modes above")
    parser.add_argument("--shares", default=None, help="torchdp's shares per device, e.g. 1,2")
    parser.add_argument(
        "--device-ids", default=None, help="devices of the parallel modes, e.g. 0,0 or 0,cpu"
    )
    args = parser.parse_args(argv)
    ids, shares = device_ids_and_shares(args)
    memory = args.memory
    if memory:
        run = common.start_run(args, warmup=(2, 1), steps=(5, 1), budget=120.0)
    else:
        run = common.start_run(args, warmup=(3, 1), steps=(10, 2), budget=200.0)
    if ids is not None and not run.smoke:
        run.counts = [1, len(ids)]  # the one-GPU modes, and the parallel ones on those GPUs
    if shares is not None and any(g != len(shares) for g in run.multi or [2]):
        sys.exit(f"--shares {args.shares}: give one share per GPU of the run ({run.multi or [2]})")
    suite = [
        n for n, spec in models.MODELS.items() if spec.suite == ("memory" if memory else "train")
    ]
    names = common.parse_list(args.models, list(models.MODELS), "models") if args.models else suite
    dtypes = common.parse_list(args.dtypes or ("fp32" if memory else None), DTYPES, "dtypes")
    all_modes = MEMORY_MODES if memory else MODES
    modes = common.parse_list(args.modes, all_modes, "modes")
    if not args.modes:
        modes = [m for m in modes if m not in OPT_IN_MODES and not (run.smoke and m in GRAPH_MODES)]
        if ids is not None:  # one process per GPU: not on a list of repeated GPUs
            modes = [m for m in modes if m not in PROCESS_MODES]
    results = common.Results("memory" if memory else "train_step")
    singles: dict[tuple[str, str], float] = {}
    common.progress(
        f"{results.bench}: models={names} dtypes={dtypes} modes={modes} gpus={run.multi or [1]} "
        f"warmup={run.warmup} steps={run.steps} smoke={run.smoke}"
    )

    def record(name: str, dtype: str, mode: str, g: int) -> dict[str, Any]:
        sizes = models.MODELS[name].sizes(run.smoke)
        one = mode in ONE_GPU_MODES
        batch = sizes["batch"] // g if mode == "single_shard" else sizes["batch"]
        rec = {
            "model": name,
            "mode": mode,
            "gpus": 0 if run.smoke else 1 if one else g,
            "dtype": dtype,
            "batch": batch,
            "input_shape": [batch, *sizes["shape"]],
            "model_desc": models.describe(name, run.smoke),
            "device_type": run.dev0.type,
            "replicas": 1 if one else g,
            "warmup": run.warmup,
            "steps": run.steps,
            "speedup_vs_single": None,
            "peak_mem_gib": [],
        }
        notes = [NOTES.get(mode)]
        if mode.startswith("torch_dp") and g > 1:
            notes += [TORCH_DP_NOTES["cpu"] if run.smoke else TORCH_DP_NOTES.get(dtype)]
        if mode in PROCESS_MODES:
            rec["backend"] = "gloo" if run.smoke else "nccl"
        if mode == "single_shard":
            rec.update(shards=g, ideal_speedup_vs_single=None)
        if any(notes):
            rec["note"] = "; ".join(n for n in notes if n)
        return rec

    def add(rec: dict[str, Any], fields: dict[str, Any] | None = None, error: str = "") -> None:
        rec.update(fields or {"step_ms_median": None, "error": error})
        med, key = rec.get("step_ms_median"), (rec["model"], rec["dtype"])
        if med and rec["mode"] == "single":
            singles[key] = med
        if med and key in singles:
            shard = rec["mode"] == "single_shard"
            rec["ideal_speedup_vs_single" if shard else "speedup_vs_single"] = singles[key] / med
        peaks = rec["peak_mem_gib"]
        if memory and rec["mode"] != "single":
            ratio = peaks[0] / peaks[1] if len(peaks) >= 2 and peaks[1] else None
            rec["mem_ratio_gpu0_gpu1"] = None if ratio is None else round(ratio, 3)
        results.add(**rec)
        label = f"{rec['model']} {rec['dtype']} {rec['mode']} x{rec['replicas']}"
        if error:
            common.progress(f"{label}: ERROR {error[:300]}")
            return
        speedup = common.fmt_x(rec.get("speedup_vs_single") or rec.get("ideal_speedup_vs_single"))
        grads = f", grads match: {rec['grads_match_torch_dp']}" if "grads_check" in rec else ""
        common.progress(f"{label}: median {med:.2f} ms, {speedup}, peak GiB {peaks}{grads}")

    def counts_of(mode: str) -> list[int]:
        """The GPU counts of a mode's records; single_shard's are the shares it takes."""
        if mode in ("single", "single_graphs", "single_compiled"):
            return [1]
        return run.multi or [2] if mode == "single_shard" else run.multi

    local = [m for m in modes if m not in PROCESS_MODES]
    for name in names if local else []:
        try:
            master = models.build(name, run.smoke)
            x, target = (t if t is None else t.to(run.dev0) for t in models.inputs(name, run.smoke))
            setup_error = ""
        except Exception as exc:  # noqa: BLE001 - recorded, the run goes on
            setup_error = "setup: " + common.error_text(exc)
        for dtype in dtypes:
            for mode in local:
                for g in counts_of(mode):
                    rec = record(name, dtype, mode, g)
                    if setup_error or run.time_left() <= 0:
                        add(rec, error=setup_error or SKIPPED)
                        continue
                    devices = [run.dev0] * g if mode == "single_shard" else run.devices(g)
                    if ids is not None and not run.smoke and mode not in ONE_GPU_MODES:
                        devices = ids
                        rec["devices"] = [str(d) for d in ids]
                    sharing = shares if mode.startswith("torchdp") and g > 1 else None
                    if sharing:
                        rec["shares"] = sharing
                    if mode == "torchdp" and not memory:
                        try:
                            rec.update(grad_check(master, x, target, dtype, devices))
                        except Exception as exc:  # noqa: BLE001 - the check failed, not the mode
                            rec.update(grads_match_torch_dp=None, grads_check_error=str(exc))
                    try:
                        add(rec, run_local(mode, master, x, target, dtype, devices, run, sharing))
                    except Exception as exc:  # noqa: BLE001 - recorded, the run goes on
                        add(rec, error=common.error_text(exc))
                    common.free_memory()
        master = x = target = None
        results.write(args.out)  # partial results, in case the run is cut short

    for g in run.multi:
        settings = {"smoke": run.smoke, "warmup": run.warmup, "steps": run.steps}
        jobs = [
            {"model": n, "dtype": d, "mode": m, **settings}
            for m in modes
            if m in PROCESS_MODES
            for n in names
            for d in dtypes
        ]
        if not jobs:
            break
        outs = (
            run_processes(jobs, g, run) if run.time_left() > 5 else [{"error": SKIPPED}] * len(jobs)
        )
        for job, out in zip(jobs, outs, strict=True):
            rec = record(job["model"], job["dtype"], job["mode"], g)
            if "error" in out:
                add(rec, error=out["error"])
                continue
            fields = {**common.summarize(out["times"]), "peak_mem_gib": out["peak_mem_gib"]}
            add(rec, {**fields, "batch_per_rank": out["batch"]})

    ddp = {
        (r["model"], r["dtype"], r["gpus"]): r["step_ms_median"]
        for r in results.records
        if r["mode"] == "ddp" and r.get("step_ms_median")
    }
    for r in results.records:
        ref = ddp.get((r["model"], r["dtype"], r["gpus"]))
        if r["mode"] != "single" and ref and r.get("step_ms_median") and not memory:
            r["ratio_to_ddp"] = ref / r["step_ms_median"]
    results.write(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
