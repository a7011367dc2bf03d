"""Full training steps: single GPU vs torch.nn.DataParallel vs torchdp.DataParallel vs DDP.

Modes: ``single``, ``torch_dp``, ``torchdp``, ``torchdp_serial`` (``torchdp.DataParallel`` with
``serial_forward=True``), ``torchdp_new_replicas`` (``torchdp.DataParallel(cache_replicas=False)``:
new replica modules at every forward, as ``torch.nn.DataParallel`` builds them; only when
``--modes`` names it), ``torchdp_graphs`` (``torchdp.DataParallel(cuda_graphs=True)``: persistent
replicas replayed as CUDA graphs) with its one-GPU baseline ``single_graphs`` (the same on the first GPU
alone; not in smoke runs), ``ddp``, and ``single_shard``: the plain model on the first GPU with one
replica's share of the batch (batch / g for each GPU count g, or the counts of ``--shards``). Its
``ideal_speedup_vs_single`` = one-GPU time / its time is what a g-GPU run would reach with perfect
overlap and no communication at all: the bound of every data-parallel mode at that batch size
(a GPU is less efficient on smaller batches), measurable on a one-GPU machine.

One step is ``optimizer.zero_grad(set_to_none=True)``, forward, loss, backward, SGD step, for

* ``resnet50``: torchvision ResNet-50, batch 256 x 3x224x224, cross-entropy on random labels;
* ``transformer``: 12 x ``nn.TransformerEncoderLayer(768, 12, 3072, batch_first=True)``, batch
  64 x 128 tokens, loss ``out.pow(2).mean()``;
* ``mlp200``: 200 x (``Linear(256, 256)``, ``ReLU``), batch 512, loss ``out.pow(2).mean()``;

in fp32 and under ``torch.autocast("cuda", dtype=torch.bfloat16)``. Every mode starts from the same
weights (deep copies of one model built with a fixed seed) and uses the same inputs. Before timing
``torchdp`` its gradients after one step are compared with ``torch.nn.DataParallel``'s.

DDP runs one process per GPU (NCCL), spawned once for all models and dtypes of a GPU count; every
rank gets ``batch / gpus`` samples and a step's time is the maximum over the ranks (each step starts
after a barrier).

    python benchmarks/bench_train_step.py --out results/train_step.json            # 2 H200: ~1.5 min
    python benchmarks/bench_train_step.py --out /tmp/ts.json --smoke               # CPU, < 60 s

The DDP harness (``run_ddp``, ``ddp_time_steps``) is also used by ``bench_memory.py``.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import datetime
import gc
import importlib
import math
import os
import queue as queue_mod
import socket
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, ClassVar

_HERE = Path(__file__).resolve().parent
if str(_HERE) not in sys.path:
    sys.path.insert(0, str(_HERE))

import common
import torch
import torch.nn.functional as F
from torch import nn

try:
    import torchdp
except ImportError:  # not installed: use the in-place build of the repository
    sys.path.append(str(common.REPO / "python"))
    import torchdp

# PyTorch's own class, even if someone called torchdp.patch_torch() (which replaces the name
# torch.nn.DataParallel): the module attribute torch.nn.parallel.data_parallel is the function.
TorchDataParallel = importlib.import_module("torch.nn.parallel.data_parallel").DataParallel

SEED = 1234
INPUT_SEED = 4321
LR = 1e-3

MODELS = ("resnet50", "transformer", "mlp200")
DTYPES = ("fp32", "bf16")
MODES = (
    "single",
    "single_graphs",
    "single_shard",
    "torch_dp",
    "torchdp",
    "torchdp_serial",
    "torchdp_new_replicas",
    "torchdp_graphs",
    "ddp",
)
# torchdp.DataParallel(cuda_graphs=True): over the GPUs, and over the first GPU alone (the one-GPU
# baseline with the same CUDA graphs). CUDA only, so not in smoke runs.
GRAPH_MODES = ("single_graphs", "torchdp_graphs")
# Modes timed only when --modes names them: torchdp_new_replicas shows what kept replicas save.
OPT_IN_MODES = ("torchdp_new_replicas",)
# Modes that run on the first GPU alone (their records carry gpus = 1).
ONE_GPU_MODES = ("single", "single_graphs", "single_shard")

# (batch, per-sample input shape, classes or None) -- full size and --smoke
SHAPES = {
    "resnet50": ((256, (3, 224, 224), 1000), (4, (3, 32, 32), 10)),
    "transformer": ((64, (128, 768), None), (4, (8, 32), None)),
    "mlp200": ((512, (256,), None), (8, (16,), None)),
}

TORCH_DP_BF16_NOTE = (
    "torch.nn.DataParallel forwards only autocast's enabled flag to its worker threads and the "
    "autocast dtype is thread-local, so its replicas run at the thread default dtype; see "
    "replica_autocast_dtypes"
)


# ---------------------------------------------------------------------------------------------
# Small helpers shared with bench_memory.py
# ---------------------------------------------------------------------------------------------


def error_text(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}".strip()
    return text if len(text) <= 2000 else text[:2000] + " ..."


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def autocast_context(dtype: str, device_type: str):
    """A fresh context manager for one step: autocast to bfloat16, or nothing for fp32."""
    if dtype == "bf16":
        return torch.autocast(device_type, dtype=torch.bfloat16)
    if dtype == "fp32":
        return contextlib.nullcontext()
    raise ValueError(f"unknown dtype {dtype!r}")


def parse_list(arg: str | None, allowed: Sequence[str], what: str) -> list[str]:
    if not arg:
        return list(allowed)
    items = [x.strip() for x in arg.split(",") if x.strip()]
    unknown = [x for x in items if x not in allowed]
    if unknown:
        sys.exit(f"unknown {what} {unknown}; choose from {list(allowed)}")
    return [x for x in allowed if x in items]  # canonical order, no duplicates


def time_left(deadline: float) -> float:
    return deadline - time.monotonic()


def mode_devices(smoke: bool, gpus: int) -> list[torch.device]:
    if smoke:
        return [torch.device("cpu")] * gpus
    return [torch.device("cuda", i) for i in range(gpus)]


def wrap_data_parallel(
    impl: str, module: nn.Module, smoke: bool, gpus: int
) -> tuple[nn.Module, str | None]:
    """(wrapper, note): torch.nn.DataParallel or torchdp.DataParallel over `gpus` devices (on the
    CPU in smoke mode: torchdp over [cpu] * gpus, torch.nn.DataParallel as its passthrough)."""
    if impl == "torch_dp":
        if smoke:
            note = (
                "CPU: torch.nn.DataParallel is a passthrough without CUDA (the whole batch "
                "runs unwrapped on one device)"
            )
            if torch.cuda.is_available():  # it would run on the GPUs: emulate the passthrough
                return _Passthrough(module), note
            return TorchDataParallel(module), note
        return TorchDataParallel(module, device_ids=list(range(gpus))), None
    if impl == "torchdp_graphs":
        return (
            torchdp.DataParallel(module, device_ids=list(range(gpus)), cuda_graphs=True),
            "cuda_graphs=True: persistent replicas, forward and backward replayed as CUDA graphs",
        )
    if impl in ("torchdp", "torchdp_serial", "torchdp_new_replicas"):
        options = {
            "serial_forward": impl == "torchdp_serial",
            "cache_replicas": impl != "torchdp_new_replicas",
        }
        note = {
            "torchdp_serial": "serial_forward=True: replicas issued in order on the calling thread",
            "torchdp_new_replicas": "cache_replicas=False: new replica modules at every forward",
        }.get(impl)
        if smoke:
            return torchdp.DataParallel(module, devices=mode_devices(True, gpus), **options), note
        return torchdp.DataParallel(module, device_ids=list(range(gpus)), **options), note
    raise ValueError(impl)


class _Passthrough(nn.Module):
    """What torch.nn.DataParallel is without CUDA; used by --smoke on a machine with GPUs."""

    device_ids: ClassVar[list[int]] = []

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)


class _AutocastProbe(nn.Module):
    """Returns, per sample, a code of the dtype its replica's matmul ran in under autocast."""

    CODES: ClassVar[dict[torch.dtype, float]] = {
        torch.float32: 0.0,
        torch.float16: 1.0,
        torch.bfloat16: 2.0,
    }
    NAMES: ClassVar[dict[int, str]] = {0: "float32", 1: "float16", 2: "bfloat16"}

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x)
        code = self.CODES.get(y.dtype, -1.0)
        return torch.full((x.shape[0], 1), code, device=x.device, dtype=torch.float32)


def probe_replica_autocast(impl: str, smoke: bool, gpus: int) -> list[str] | str:
    """The dtype each replica of `impl` computes a Linear in under bfloat16 autocast."""
    try:
        dev = mode_devices(smoke, 1)[0]
        probe = _AutocastProbe().to(dev)
        wrapped, _ = wrap_data_parallel(impl, probe, smoke, gpus)
        x = torch.randn(2 * gpus, 8, device=dev)
        with torch.no_grad(), autocast_context("bf16", dev.type):
            codes = wrapped(x).flatten().tolist()
        per_replica = codes[::2] if wrapped.device_ids else codes[:1]
        return [_AutocastProbe.NAMES.get(int(c), "unknown") for c in per_replica]
    except Exception as exc:  # noqa: BLE001 - a probe only
        return f"probe failed: {error_text(exc)}"


# ---------------------------------------------------------------------------------------------
# DDP harness: worker processes spawned once, jobs run in order, results through a Queue
# ---------------------------------------------------------------------------------------------


def ddp_time_steps(
    step: Callable[[], Any], device: torch.device, warmup: int, steps: int
) -> list[float]:
    """Milliseconds of each timed step, the maximum over the ranks. Each step starts after a
    barrier, so a step's time is that of the slowest rank. Collective: all ranks call it."""
    import torch.distributed as dist

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    for _ in range(warmup):
        step()
    sync()
    times = []
    for _ in range(steps):
        dist.barrier()
        sync()
        start = time.perf_counter()
        step()
        sync()
        times.append((time.perf_counter() - start) * 1e3)
    t = torch.tensor(times, dtype=torch.float64, device=device if device.type == "cuda" else "cpu")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.cpu().tolist()


def _ddp_worker(
    rank: int,
    world: int,
    init_method: str,
    backend: str,
    job_fn: Callable,
    jobs: list[Any],
    results: Any,
    env: dict[str, str],
    deadline_wall: float,
    pg_timeout_s: float,
    threads: int | None,
) -> None:
    """One DDP rank: runs job_fn(job, rank, world, device) for every job; each returns a dict
    (``times`` from ddp_time_steps, ``peak_gib`` this rank's peak). Errors are sent, not raised."""
    os.environ.update(env)
    if threads:
        torch.set_num_threads(threads)
    try:
        import torch.distributed as dist

        if backend == "nccl":
            torch.cuda.set_device(rank)
            device = torch.device("cuda", rank)
        else:
            device = torch.device("cpu")
        kwargs: dict[str, Any] = {
            "backend": backend,
            "init_method": init_method,
            "rank": rank,
            "world_size": world,
            "timeout": datetime.timedelta(seconds=pg_timeout_s),
        }
        if backend == "nccl":
            kwargs["device_id"] = device
        try:
            dist.init_process_group(**kwargs)
        except TypeError:  # an older torch without device_id
            kwargs.pop("device_id", None)
            dist.init_process_group(**kwargs)
    except Exception as exc:  # noqa: BLE001
        results.put(("fatal", rank, error_text(exc)))
        return
    flag_device = device if backend == "nccl" else torch.device("cpu")
    for index, job in enumerate(jobs):
        # All ranks agree on skipping: any rank past the deadline skips for all.
        flag = torch.tensor([1.0 if time.time() > deadline_wall else 0.0], device=flag_device)
        try:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        except Exception as exc:  # noqa: BLE001 - a peer died
            results.put(("fatal", rank, f"before job {index}: {error_text(exc)}"))
            return
        if flag.item() > 0:
            results.put(("result", rank, index, {"error": "skipped: time budget exhausted"}))
            continue
        try:
            payload = job_fn(job, rank, world, device)
        except Exception as exc:  # noqa: BLE001 - recorded, the run goes on
            payload = {"error": error_text(exc)}
            if rank == 0:
                traceback.print_exc()
        free_memory()
        results.put(("result", rank, index, payload))
        try:
            dist.barrier()
        except Exception as exc:  # noqa: BLE001
            results.put(("fatal", rank, f"barrier after job {index}: {error_text(exc)}"))
            return
    with contextlib.suppress(Exception):
        dist.destroy_process_group()
    results.put(("done", rank))


def run_ddp(
    job_fn: Callable,
    jobs: list[dict[str, Any]],
    world: int,
    backend: str,
    deadline: float,
    stall_timeout_s: float = 90.0,
    threads: int | None = None,
) -> list[dict[str, Any]]:
    """Spawns `world` ranks once, runs every job on them; per job: ``{"times": [...],
    "peak_mem_gib": [rank0, rank1, ...]}`` (plus rank 0's other keys) or ``{"error": ...}``.
    A dead or silent (stall_timeout_s) rank, or the deadline, ends the workers; jobs left get an
    error."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    init_method = f"tcp://127.0.0.1:{free_port()}"
    env = dict(common.SAFE_ENV)
    budget = max(time_left(deadline), 1.0)
    deadline_wall = time.time() + budget
    per_rank: list[dict[int, dict[str, Any]]] = [{} for _ in jobs]
    procs = []
    failure = None
    for rank in range(world):
        p = ctx.Process(
            target=_ddp_worker,
            name=f"ddp-rank{rank}",
            args=(
                rank,
                world,
                init_method,
                backend,
                job_fn,
                jobs,
                results,
                env,
                deadline_wall,
                stall_timeout_s,
                threads,
            ),
        )
        p.start()
        procs.append(p)
    done: set[int] = set()
    last = time.monotonic()
    hard_deadline = deadline + 60.0  # ranks check the deadline themselves between jobs
    try:
        while len(done) < world:
            try:
                msg = results.get(timeout=1.0)
            except queue_mod.Empty:
                dead = [
                    (i, p.exitcode)
                    for i, p in enumerate(procs)
                    if p.exitcode is not None and i not in done
                ]
                if dead:
                    # give its last messages a moment to arrive
                    try:
                        msg = results.get(timeout=2.0)
                    except queue_mod.Empty:
                        failure = "; ".join(f"rank {i} exited with code {c}" for i, c in dead)
                        break
                elif time.monotonic() - last > stall_timeout_s:
                    failure = f"no message from the DDP ranks for {stall_timeout_s:.0f} s"
                    break
                elif time.monotonic() > hard_deadline:
                    failure = "time budget exhausted while DDP ran"
                    break
                else:
                    continue
            last = time.monotonic()
            kind = msg[0]
            if kind == "result":
                _, rank, index, payload = msg
                per_rank[index][rank] = payload
                if len(per_rank[index]) == world:
                    _report_ddp_job(jobs[index], per_rank[index])
            elif kind == "done":
                done.add(msg[1])
            elif kind == "fatal":
                failure = f"rank {msg[1]}: {msg[2]}"
                break
    finally:
        for p in procs:
            p.join(timeout=10.0 if failure is None else 1.0)
        for p in procs:
            if p.is_alive():
                p.terminate()
                p.join(timeout=5.0)
            if p.is_alive():
                p.kill()
                p.join(timeout=5.0)
        with contextlib.suppress(Exception):
            results.close()
    out = []
    for index, ranks in enumerate(per_rank):
        errors = [f"rank {r}: {ranks[r]['error']}" for r in sorted(ranks) if "error" in ranks[r]]
        if len(ranks) < world:
            errors.append(
                f"missing ranks {sorted(set(range(world)) - set(ranks))}"
                + (f" ({failure})" if failure else "")
            )
        if errors:
            out.append({"error": "; ".join(errors)})
            continue
        merged = {k: v for k, v in ranks[0].items() if k != "peak_gib"}
        merged["peak_mem_gib"] = [
            ranks[r].get("peak_gib") for r in range(world) if ranks[r].get("peak_gib") is not None
        ]
        out.append(merged)
    return out


def record_ddp_jobs(
    job_fn: Callable[..., dict],
    jobs: list[dict[str, Any]],
    gpus: int,
    backend: str,
    deadline: float,
    smoke: bool,
    make_record: Callable[[dict[str, Any]], dict[str, Any]],
    failed: Callable[[dict[str, Any], str], None],
    add: Callable[[dict[str, Any]], None],
) -> None:
    """Runs `jobs` under DDP on `gpus` ranks (run_ddp) and records one result per job:
    make_record(job) gives the record's fixed fields; failures and a spent time budget are recorded
    through `failed`, timings through `add`."""
    if time_left(deadline) <= 5:
        for job in jobs:
            failed(make_record(job), "skipped: time budget exhausted")
        return
    free_memory()
    common.progress(f"ddp: spawning {gpus} ranks ({backend}) for {len(jobs)} configurations")
    try:
        outs = run_ddp(
            job_fn,
            jobs,
            gpus,
            backend,
            deadline,
            stall_timeout_s=40.0 if smoke else 90.0,
            threads=1 if smoke else None,
        )
    except Exception as exc:  # noqa: BLE001
        outs = [{"error": f"ddp harness: {error_text(exc)}"}] * len(jobs)
    for job, out in zip(jobs, outs):
        rec = make_record(job)
        rec["backend"] = backend
        if "error" in out:
            failed(rec, out["error"])
            continue
        rec.update(common.summarize(out["times"]))
        rec["peak_mem_gib"] = out["peak_mem_gib"]
        rec["batch_per_rank"] = out.get("batch_per_rank")
        if smoke:
            rec["note"] = "CPU smoke: gloo backend, one process per CPU 'device'"
        add(rec)


def _report_ddp_job(job: dict[str, Any], ranks: dict[int, dict[str, Any]]) -> None:
    errors = [r for r in ranks.values() if "error" in r]
    name = job.get("label", str(job))
    if errors:
        common.progress(f"{name} ddp: error: {errors[0]['error'][:200]}")
    else:
        times = ranks[0].get("times") or []
        if times:
            med = sorted(times)[len(times) // 2]
            common.progress(f"{name} ddp: done (about {med:.1f} ms/step)")


# ---------------------------------------------------------------------------------------------
# Models, inputs, losses
# ---------------------------------------------------------------------------------------------


class TinyConvNet(nn.Module):
    """Stands in for ResNet-50 in --smoke when torchvision is missing: conv + BatchNorm + ReLU."""

    def __init__(self, classes: int = 10) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1),
            nn.BatchNorm2d(8),
            nn.ReLU(),
            nn.Conv2d(8, 16, 3, stride=2, padding=1),
            nn.BatchNorm2d(16),
            nn.ReLU(),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
        )
        self.fc = nn.Linear(16, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.features(x))


def _have_torchvision() -> bool:
    try:
        import torchvision  # noqa: F401
    except ImportError:
        return False
    return True


def model_desc(name: str, smoke: bool) -> str:
    if name == "resnet50":
        if not smoke:
            return "torchvision resnet50"
        return (
            "torchvision resnet18 (smoke)"
            if _have_torchvision()
            else ("TinyConvNet (smoke, no torchvision)")
        )
    if name == "transformer":
        d, nhead, ff, layers = (32, 4, 64, 2) if smoke else (768, 12, 3072, 12)
        return f"TransformerEncoder {layers}L d{d} h{nhead} ff{ff}"
    if name == "mlp200":
        n, width = (4, 16) if smoke else (200, 256)
        return f"{n} x (Linear({width},{width}), ReLU)"
    return name


def build_model(name: str, smoke: bool) -> nn.Module:
    """The model on the CPU, built with the fixed seed (the same weights in every process)."""
    torch.manual_seed(SEED)
    if name == "resnet50":
        if smoke and not _have_torchvision():
            return TinyConvNet(SHAPES[name][1][2])
        import torchvision

        if smoke:
            return torchvision.models.resnet18(num_classes=SHAPES[name][1][2])
        return torchvision.models.resnet50()
    if name == "transformer":
        d, nhead, ff, layers = (32, 4, 64, 2) if smoke else (768, 12, 3072, 12)
        layer = nn.TransformerEncoderLayer(
            d_model=d, nhead=nhead, dim_feedforward=ff, batch_first=True
        )
        return nn.TransformerEncoder(layer, num_layers=layers, enable_nested_tensor=False)
    if name == "mlp200":
        n, width = (4, 16) if smoke else (200, 256)
        layers: list[nn.Module] = []
        for _ in range(n):
            layers += [nn.Linear(width, width), nn.ReLU()]
        return nn.Sequential(*layers)
    raise ValueError(f"unknown model {name!r}")


def make_inputs(name: str, smoke: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The full batch (and labels), on the CPU, from a fixed seed."""
    batch, shape, classes = SHAPES[name][1 if smoke else 0]
    g = torch.Generator().manual_seed(INPUT_SEED)
    x = torch.randn((batch, *shape), generator=g)
    target = torch.randint(0, classes, (batch,), generator=g) if classes else None
    return x, target


def compute_loss(name: str, out: torch.Tensor, target: torch.Tensor | None) -> torch.Tensor:
    if name == "resnet50":
        return F.cross_entropy(out, target)
    return out.pow(2).mean()


def make_step(
    name: str,
    model: nn.Module,
    opt: torch.optim.Optimizer,
    x: torch.Tensor,
    target: torch.Tensor | None,
    dtype: str,
    device_type: str,
) -> Callable[[], None]:
    def step() -> None:
        opt.zero_grad(set_to_none=True)
        with autocast_context(dtype, device_type):
            out = model(x)
            loss = compute_loss(name, out, target)
        loss.backward()
        opt.step()

    return step


def disable_dropout(model: nn.Module) -> None:
    """Dropout off (BatchNorm stays in training mode): the gradient check must not depend on
    random masks."""
    for m in model.modules():
        if isinstance(m, nn.modules.dropout._DropoutNd):
            m.p = 0.0
        if isinstance(m, nn.MultiheadAttention):
            m.dropout = 0.0


# ---------------------------------------------------------------------------------------------
# DDP job of this benchmark (runs in the worker processes)
# ---------------------------------------------------------------------------------------------


def train_ddp_job(job: dict[str, Any], rank: int, world: int, device: torch.device) -> dict:
    from torch.nn.parallel import DistributedDataParallel as DDP

    name, dtype, smoke = job["model"], job["dtype"], job["smoke"]
    model = build_model(name, smoke).to(device)
    ddp = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    x, target = make_inputs(name, smoke)
    per_rank = x.shape[0] // world
    sl = slice(rank * per_rank, (rank + 1) * per_rank)
    x = x[sl].to(device)
    target = target[sl].to(device) if target is not None else None
    step = make_step(name, ddp, opt, x, target, dtype, device.type)
    common.reset_peak_memory([device])
    times = ddp_time_steps(step, device, job["warmup"], job["steps"])
    peak = common.peak_memory_gib([device])
    del step, opt, ddp, model, x, target
    return {"times": times, "peak_gib": peak[0] if peak else None, "batch_per_rank": per_rank}


# ---------------------------------------------------------------------------------------------
# The benchmark
# ---------------------------------------------------------------------------------------------


def grad_check(
    name: str,
    master: nn.Module,
    x: torch.Tensor,
    target: torch.Tensor | None,
    dtype: str,
    smoke: bool,
    gpus: int,
) -> dict[str, Any]:
    """One forward/backward with torch.nn.DataParallel and with torchdp.DataParallel from the
    same weights and inputs (dropout off); compares the outputs and the gradients."""
    grads: dict[str, list[torch.Tensor]] = {}
    outputs: dict[str, torch.Tensor] = {}
    dev0 = x.device
    for impl in ("torch_dp", "torchdp"):
        torch.manual_seed(SEED)
        model = copy.deepcopy(master)
        disable_dropout(model)
        model.to(dev0)
        wrapped, _ = wrap_data_parallel(impl, model, smoke, gpus)
        model.zero_grad(set_to_none=True)
        with autocast_context(dtype, dev0.type):
            out = wrapped(x)
            loss = compute_loss(name, out, target)
        outputs[impl] = out.detach().float().clone()
        del out
        loss.backward()
        grads[impl] = [
            torch.zeros_like(p, dtype=torch.float32)
            if p.grad is None
            else p.grad.detach().float().clone()
            for p in model.parameters()
        ]
        del wrapped, model, loss
    ref, got = grads["torch_dp"], grads["torchdp"]
    max_abs = max((float((a - b).abs().max()) for a, b in zip(got, ref) if a.numel()), default=0.0)
    num = math.sqrt(sum(float((a - b).pow(2).sum()) for a, b in zip(got, ref)))
    den = math.sqrt(sum(float(b.pow(2).sum()) for b in ref))
    rel = num / den if den > 0 else num
    result: dict[str, Any] = {"grads_max_abs_diff": max_abs, "grads_rel_l2_diff": rel}
    result["outputs_max_abs_diff"] = float((outputs["torchdp"] - outputs["torch_dp"]).abs().max())
    if dtype == "fp32":
        # The parity tests' tolerance, on the outputs and on the gradients.
        try:
            torch.testing.assert_close(
                outputs["torchdp"], outputs["torch_dp"], rtol=1e-5, atol=1e-5
            )
            torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
            result["grads_match_torch_dp"] = True
        except AssertionError as exc:
            result["grads_match_torch_dp"] = False
            result["grads_mismatch"] = str(exc).strip().splitlines()[0][:300]
        result["grads_check"] = (
            "outputs and gradients, assert_close(rtol=1e-5, atol=1e-5) as the parity tests, "
            "dropout off"
        )
    else:
        result["grads_match_torch_dp"] = bool(rel <= 5e-2)
        result["grads_check"] = (
            "loose: relative L2 difference <= 5e-2, dropout off (bf16 "
            "autocast; torch.nn.DataParallel's replicas may run float16)"
        )
    if smoke:
        result["grads_check"] += (
            "; CPU: the reference is torch.nn.DataParallel's passthrough "
            "(whole batch), so BatchNorm models differ by design"
        )
    del grads, ref, got, outputs
    return result


def run_local_mode(
    mode: str,
    name: str,
    dtype: str,
    master: nn.Module,
    x: torch.Tensor,
    target: torch.Tensor | None,
    smoke: bool,
    gpus: int,
    warmup: int,
    steps: int,
) -> dict[str, Any]:
    """Times one in-process mode; returns the record's fields (raises on failure)."""
    dev0 = x.device
    model = copy.deepcopy(master).to(dev0)
    note = None
    if mode == "single":
        wrapped: nn.Module = model
        devices = [dev0]
    elif mode == "single_graphs":
        wrapped = torchdp.DataParallel(model, devices=[dev0], cuda_graphs=True)
        devices = [dev0]
        note = "torchdp.DataParallel(cuda_graphs=True) on the first GPU alone"
    elif mode == "single_shard":
        # One replica's share of the batch (gpus = the count it is the share of), on one GPU.
        share = x.shape[0] // gpus
        x = x[:share]
        target = target[:share] if target is not None else None
        wrapped = model
        devices = [dev0]
        note = f"the plain model on the first GPU with batch / {gpus} (one replica's share)"
    else:
        wrapped, note = wrap_data_parallel(mode, model, smoke, gpus)
        devices = mode_devices(smoke, gpus)
        if not wrapped.device_ids:  # torch.nn.DataParallel's passthrough (no CUDA)
            devices = [dev0]
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    step = make_step(name, wrapped, opt, x, target, dtype, dev0.type)
    free_memory()
    common.reset_peak_memory(devices)
    times = common.time_steps(step, devices, warmup, steps)
    used = sorted(set(devices), key=lambda d: (d.type, d.index or 0))
    fields: dict[str, Any] = {
        **common.summarize(times),
        "replicas": len(devices),
        "peak_mem_gib": common.peak_memory_gib(used),
    }
    if note:
        fields["note"] = note
    del step, opt, wrapped, model
    return fields


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    common.add_common_args(parser)
    parser.add_argument("--models", default=None, help=f"comma list of {','.join(MODELS)}")
    parser.add_argument("--dtypes", default=None, help=f"comma list of {','.join(DTYPES)}")
    parser.add_argument("--modes", default=None, help=f"comma list of {','.join(MODES)}")
    common.add_timing_args(parser, warmup=(3, 1), steps=(10, 2), budget=(200.0, 55.0))
    parser.add_argument(
        "--shards",
        default=None,
        help="comma list of GPU counts g for single_shard (batch / g on one GPU; default: the "
        "GPU counts compared, so on a one-GPU machine give e.g. --shards 2)",
    )
    parser.add_argument(
        "--no-grad-check",
        action="store_true",
        help="skip the torchdp vs torch.nn.DataParallel gradient check",
    )
    args = parser.parse_args(argv)

    models = parse_list(args.models, MODELS, "models")
    dtypes = parse_list(args.dtypes, DTYPES, "dtypes")
    modes = parse_list(args.modes, MODES, "modes")
    run = common.start_run(args, warmup=(3, 1), steps=(10, 2), budget=(200.0, 55.0))
    smoke, warmup, steps, budget = run.smoke, run.warmup, run.steps, run.budget
    if args.modes is None:
        modes = [m for m in modes if m not in OPT_IN_MODES and not (smoke and m in GRAPH_MODES)]
    deadline, multi, dev0 = run.deadline, run.multi, run.dev0
    shards = multi
    if args.shards:
        try:
            shards = sorted({int(v) for v in args.shards.split(",") if v.strip()})
        except ValueError:
            sys.exit(f"--shards takes comma-separated GPU counts, got {args.shards!r}")
        if any(g < 2 for g in shards):
            sys.exit(f"--shards counts must be >= 2 (batch / g on one GPU), got {args.shards!r}")

    def counts_of(mode: str) -> list[int]:
        """The GPU counts a mode runs for (one record each)."""
        if mode == "single_shard":
            return shards
        return [1] if mode in ONE_GPU_MODES else multi

    if smoke:
        torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    patched = TorchDataParallel is torchdp.DataParallel or issubclass(
        TorchDataParallel, torchdp.DataParallel
    )

    results = common.Results(bench="train_step")
    common.progress(
        f"train_step: models={models} dtypes={dtypes} modes={modes} gpus={multi or [1]} "
        f"warmup={warmup} steps={steps} smoke={smoke} budget={budget:.0f}s"
    )

    def gpus_field(g: int) -> int:
        return 0 if smoke else g

    def base(name: str, dtype: str, mode: str, g: int, desc: str) -> dict[str, Any]:
        batch, shape, _ = SHAPES[name][1 if smoke else 0]
        return {
            "model": name,
            "mode": mode,
            "gpus": gpus_field(g),
            "dtype": dtype,
            "batch": batch,
            "input_shape": [batch, *shape],
            "model_desc": desc,
            "device_type": dev0.type,
            "replicas": g,
            "warmup": warmup,
            "steps": steps,
            "speedup_vs_single": None,
            "ratio_to_ddp": None,
        }

    def shard_base(name: str, dtype: str, mode: str, g: int, desc: str) -> dict[str, Any]:
        """base(), and for single_shard: one GPU, one replica's share of a g-GPU run's batch."""
        if mode != "single_shard":
            return base(name, dtype, mode, g, desc)
        rec = base(name, dtype, mode, 1, desc)
        rec["batch"] = rec["batch"] // g
        rec["input_shape"][0] = rec["batch"]
        rec.update(shards=g, ideal_speedup_vs_single=None, speedup_vs_single=None)
        return rec

    singles: dict[tuple[str, str], float] = {}

    def add(rec: dict[str, Any]) -> None:
        med = rec.get("step_ms_median")
        single = singles.get((rec["model"], rec["dtype"]))
        if rec["mode"] == "single_shard":
            if med and single:
                rec["ideal_speedup_vs_single"] = single / med
        elif med and single:
            rec["speedup_vs_single"] = single / med
        rec.setdefault("peak_mem_gib", [])
        results.add(**rec)
        label = f"{rec['model']} {rec['dtype']} {rec['mode']} x{rec['replicas']}"
        if rec.get("error"):
            common.progress(f"{label}: ERROR {rec['error'][:300]}")
        else:
            sp = rec["speedup_vs_single"]
            extra = ""
            if rec.get("ideal_speedup_vs_single"):
                extra = (
                    f", ideal speedup of {rec['shards']} GPUs {rec['ideal_speedup_vs_single']:.2f}x"
                )
            if "grads_match_torch_dp" in rec:
                extra = (
                    f", grads_match_torch_dp={rec['grads_match_torch_dp']} "
                    f"(max abs diff {rec.get('grads_max_abs_diff', float('nan')):.3g})"
                )
            common.progress(
                f"{label}: median {med:.2f} ms, speedup "
                f"{'-' if sp is None else f'{sp:.2f}x'}, peak GiB "
                f"{rec['peak_mem_gib']}{extra}"
            )

    def failed(rec: dict[str, Any], message: str) -> None:
        rec.update(step_ms_median=None, peak_mem_gib=[], error=message)
        add(rec)

    probes: dict[tuple[str, int], Any] = {}

    # ---- in-process modes: single, torch_dp, torchdp ------------------------------------
    local_modes = [m for m in modes if m != "ddp"]
    for name in models:
        if not local_modes:
            break
        master = x = target = None
        desc = model_desc(name, smoke)
        try:
            master = build_model(name, smoke)
            xc, tc = make_inputs(name, smoke)
            x = xc.to(dev0)
            target = tc.to(dev0) if tc is not None else None
            del xc, tc
        except Exception as exc:  # noqa: BLE001
            for dtype in dtypes:
                for mode in local_modes:
                    for g in counts_of(mode):
                        failed(shard_base(name, dtype, mode, g, desc), f"setup: {error_text(exc)}")
            continue
        for dtype in dtypes:
            for mode in local_modes:
                for g in counts_of(mode):
                    rec = shard_base(name, dtype, mode, g, desc)
                    if time_left(deadline) <= 0:
                        failed(rec, "skipped: time budget exhausted")
                        continue
                    if mode == "torchdp" and not args.no_grad_check:
                        try:
                            rec.update(grad_check(name, master, x, target, dtype, smoke, g))
                        except Exception as exc:  # noqa: BLE001
                            rec.update(grads_match_torch_dp=None, grads_check_error=error_text(exc))
                        free_memory()
                    if dtype == "bf16" and mode in ("torch_dp", "torchdp") and g > 1:
                        key = (mode, g)
                        if key not in probes:
                            probes[key] = probe_replica_autocast(mode, smoke, g)
                        rec["replica_autocast_dtypes"] = probes[key]
                        if mode == "torch_dp" and not smoke:
                            rec["note"] = TORCH_DP_BF16_NOTE
                    if mode == "torch_dp" and patched:
                        rec["note"] = "torch.nn.DataParallel is patched to torchdp's class"
                    try:
                        fields = run_local_mode(
                            mode, name, dtype, master, x, target, smoke, g, warmup, steps
                        )
                        if "note" in fields and "note" in rec:
                            fields["note"] = rec["note"] + "; " + fields["note"]
                        rec.update(fields)
                        if mode == "single":
                            singles[(name, dtype)] = rec["step_ms_median"]
                            rec["speedup_vs_single"] = 1.0
                        add(rec)
                    except Exception as exc:  # noqa: BLE001 - recorded, the run goes on
                        failed(rec, error_text(exc))
                    free_memory()
        del master, x, target
        free_memory()
        with contextlib.suppress(Exception):
            results.write(args.out)  # partial results, in case the run is cut short

    # ---- DDP: one process per device, spawned once per GPU count --------------------------
    if "ddp" in modes:
        backend = "gloo" if smoke else "nccl"
        for g in multi:
            jobs = [
                {
                    "model": n,
                    "dtype": d,
                    "smoke": smoke,
                    "warmup": warmup,
                    "steps": steps,
                    "label": f"{n} {d}",
                }
                for n in models
                for d in dtypes
            ]
            descs = {n: model_desc(n, smoke) for n in models}
            record_ddp_jobs(
                train_ddp_job,
                jobs,
                g,
                backend,
                deadline,
                smoke,
                lambda job: base(job["model"], job["dtype"], "ddp", g, descs[job["model"]]),
                failed,
                add,
            )

    # ---- ratios to DDP --------------------------------------------------------------------
    ddp_medians = {
        (r["model"], r["dtype"], r["gpus"]): r["step_ms_median"]
        for r in results.records
        if r["mode"] == "ddp" and r.get("step_ms_median")
    }
    for r in results.records:
        ref = ddp_medians.get((r["model"], r["dtype"], r["gpus"]))
        if r["mode"] != "single" and ref and r.get("step_ms_median"):
            r["ratio_to_ddp"] = ref / r["step_ms_median"]

    results.write(args.out)
    common.progress(f"train_step finished in {time.monotonic() - run.started:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
