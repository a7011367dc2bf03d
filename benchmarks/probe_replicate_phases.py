"""Probe: where the CPU time of one ``torchdp.replicate`` call goes, phase by phase.

torchdp's C++ marks its own work with profiler ranges (``csrc/torchdp/profiling.h``):
``torchdp.replicate.walk`` (the module walk and the checks), ``torchdp.replicate.transfer`` (the
broadcast and its autograd wiring, with ``torchdp.broadcast``, ``torchdp.broadcast.autograd`` and,
over NCCL, ``torchdp.nccl.broadcast_group`` inside), ``torchdp.replicate.build`` (the replica
modules) and ``torchdp.replicate.device_check``. This times the call unprofiled (median wall ms)
and prints each range's CPU ms per call under the profiler, for bench_train_step's models.
With ``--in-step`` the calls are the ones ``torchdp.DataParallel`` makes inside training steps
(zero_grad, forward, loss, backward, SGD step, then a synchronisation, as the benchmarks time a
step), with its kept replicas and with new ones at every step (``cache_replicas=False``), each
with the median step time, next to the isolated calls: a phase that costs more there than alone shows what the step
around it adds (a busy allocator, cold caches, work still queued on the GPU). ``--conditions``
times the isolated calls under conditions a training step brings (the CPU caches flushed, the
CPU idle for a few ms first, automatic garbage collection off, a forward pass in between) next to
the in-step calls, wall time only, to tell which of them makes the difference.

    python benchmarks/probe_replicate_phases.py [--device-ids 0,1] [--models resnet50,transformer]
    python benchmarks/probe_replicate_phases.py --smoke     # CPU, tiny models
    python benchmarks/probe_replicate_phases.py --in-step --device-ids 0,0 --models resnet50

Without GPUs (``--smoke``) the replicas go to two CPU devices.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_train_step

import torchdp

PREFIXES = ("torchdp.", "aten::empty")


def sync(devices: list[torch.device]) -> None:
    for d in {d for d in devices if d.type == "cuda"}:
        torch.cuda.synchronize(d)


def probe(name: str, devices: list[torch.device], calls: int, smoke: bool) -> str:
    net = bench_train_step.build_model(name, smoke).to(devices[0])
    for _ in range(5):
        torchdp.replicate(net, devices)
    sync(devices)
    wall = []
    for _ in range(calls):
        t0 = time.perf_counter()
        replicas = torchdp.replicate(net, devices)
        wall.append((time.perf_counter() - t0) * 1e3)
        del replicas
        sync(devices)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(calls):
            replicas = torchdp.replicate(net, devices)
            del replicas
        sync(devices)
    return report(name, net, devices, calls, wall, prof, "isolated calls")


def report(
    name: str,
    net: torch.nn.Module,
    devices: list[torch.device],
    calls: int,
    wall: list[float],
    prof: profile,
    what: str,
) -> str:
    # Inside a step the allocations of the whole step show up too: only torchdp's ranges there.
    prefixes = PREFIXES if what == "isolated calls" else ("torchdp.",)
    rows = []
    for e in prof.key_averages():
        if e.key.startswith(prefixes):
            rows.append((e.key, e.cpu_time_total / 1e3 / calls, e.count / calls))
    rows.sort(key=lambda r: -r[1])
    modules = sum(1 for _ in net.modules())
    tensors = sum(1 for _ in net.parameters()) + sum(1 for _ in net.buffers())
    head = (
        f"{name}: {modules} modules, {tensors} tensors, onto {[str(d) for d in devices]}, "
        f"{what}: median {statistics.median(wall):.3f} ms unprofiled (p10 "
        f"{sorted(wall)[len(wall) // 10]:.3f}, p90 {sorted(wall)[9 * len(wall) // 10]:.3f})"
    )
    lines = [head]
    lines += [f"    {k:40s} {ms:8.3f} ms/call  {n:6.1f} calls/call" for k, ms, n in rows]
    return "\n".join(lines)


class _TimedReplicate(torchdp.DataParallel):
    """DataParallel whose replicate() calls are timed (wall ms appended to `times`)."""

    times: list[float]

    def replicate(self, module, device_ids):  # type: ignore[no-untyped-def]
        t0 = time.perf_counter()
        replicas = super().replicate(module, device_ids)
        self.times.append((time.perf_counter() - t0) * 1e3)
        return replicas


def _training_step(
    name: str, devices: list[torch.device], smoke: bool, cache_replicas: bool = True
) -> tuple[torch.nn.Module, torch.Tensor, _TimedReplicate, Callable[[], None]]:
    """The model, its input, a _TimedReplicate over it and one synchronised training step
    (zero_grad, forward, loss, backward, SGD step), as the benchmarks time a step."""
    net = bench_train_step.build_model(name, smoke).to(devices[0])
    dp = _TimedReplicate(net, devices=devices, cache_replicas=cache_replicas)
    dp.times = []
    opt = torch.optim.SGD(net.parameters(), lr=1e-3)
    x, target = bench_train_step.make_inputs(name, smoke)
    x = x.to(devices[0])
    target = None if target is None else target.to(devices[0])

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        bench_train_step.compute_loss(name, dp(x), target).backward()
        opt.step()
        sync(devices)

    return net, x, dp, step


@contextmanager
def _gc_off() -> Iterator[None]:
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def probe_in_step(
    name: str, devices: list[torch.device], calls: int, smoke: bool, cache_replicas: bool = True
) -> str:
    """The replicate() calls of DataParallel training steps, each step synchronised at its end,
    with kept replicas (the default) or new ones at every step; also the median step time."""
    net, _, dp, step = _training_step(name, devices, smoke, cache_replicas)
    for _ in range(3):
        step()
    dp.times.clear()
    steps = []
    for _ in range(calls):
        t0 = time.perf_counter()
        step()
        steps.append((time.perf_counter() - t0) * 1e3)
    wall = list(dp.times)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(calls):
            step()
    what = "inside training steps" + ("" if cache_replicas else " (new replicas every step)")
    text = report(name, net, devices, calls, wall, prof, what)
    return (
        text
        + f"\n    step: median {statistics.median(steps):.3f} ms (p90 "
        + (f"{sorted(steps)[9 * len(steps) // 10]:.3f})")
    )


def probe_conditions(name: str, devices: list[torch.device], calls: int, smoke: bool) -> str:
    """Median wall ms of replicate() alone under several conditions, and inside steps."""
    net, x, dp, step = _training_step(name, devices, smoke)
    junk = torch.empty(256 << 20, dtype=torch.uint8)  # larger than the CPU's last-level cache

    def isolated(before: Callable[[int], object]) -> float:
        wall = []
        for i in range(calls + 3):
            before(i)
            sync(devices)
            t0 = time.perf_counter()
            replicas = torchdp.replicate(net, devices)
            dt = (time.perf_counter() - t0) * 1e3
            del replicas
            sync(devices)
            if i >= 3:
                wall.append(dt)
        return statistics.median(wall)

    def forward(_: int) -> None:
        with torch.no_grad():
            net(x)

    def in_steps() -> float:
        dp.times.clear()
        for _ in range(calls + 3):
            step()
        return statistics.median(dp.times[3:])

    rows = [
        ("alone, back to back", isolated(lambda i: None)),
        ("alone, CPU caches flushed first", isolated(lambda i: junk.fill_(i & 0xFF))),
        ("alone, CPU idle 20 ms first", isolated(lambda i: time.sleep(0.02))),
        ("alone, after a forward pass", isolated(forward)),
    ]
    with _gc_off():
        rows.append(("alone, gc disabled", isolated(lambda i: None)))
    rows.append(("inside training steps", in_steps()))
    with _gc_off():
        rows.append(("inside training steps, gc disabled", in_steps()))
    lines = [f"{name} onto {[str(d) for d in devices]}: replicate() median wall ms"]
    lines += [f"    {what:40s} {ms:8.3f}" for what, ms in rows]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device-ids", default=None, help="e.g. 0,1 (default: all GPUs)")
    parser.add_argument("--models", default="resnet50,transformer,mlp200")
    parser.add_argument("--calls", type=int, default=30)
    parser.add_argument("--smoke", action="store_true", help="tiny models on two CPU devices")
    parser.add_argument(
        "--in-step",
        action="store_true",
        help="also time DataParallel's replicate() calls inside training steps",
    )
    parser.add_argument(
        "--conditions",
        action="store_true",
        help="wall time alone under a step's conditions and inside steps (no profiler)",
    )
    args = parser.parse_args()
    if args.smoke:
        devices = [torch.device("cpu")] * 2
    else:
        if not torch.cuda.is_available():
            sys.exit("no CUDA device: run with --smoke on a machine without GPUs")
        ids = args.device_ids or ",".join(str(i) for i in range(torch.cuda.device_count()))
        devices = [torch.device("cuda", int(i)) for i in ids.split(",")]
    print(f"torch {torch.__version__}, torchdp {torchdp.__version__}, nccl {torchdp.has_nccl()}")
    for name in args.models.split(","):
        print(probe(name.strip(), devices, args.calls, args.smoke), flush=True)
        if args.in_step:
            for kept in (True, False):
                print(
                    probe_in_step(name.strip(), devices, args.calls, args.smoke, kept), flush=True
                )
        if args.conditions:
            print(probe_conditions(name.strip(), devices, args.calls, args.smoke), flush=True)


if __name__ == "__main__":
    main()
