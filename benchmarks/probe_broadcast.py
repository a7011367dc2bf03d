"""Probe: how fast can a model's parameters and buffers get from the first GPU to the others?

The transformer's replicate is bounded by its broadcast (340 MB: 1.20 ms in run 4, about 283 GB/s
over NVLink, which caps replicate at 4.8x of torch's where issue 5 asks for 5x). This probe times
other transports side by side on the same tensors, each call synchronised on every GPU, fresh
output buffers per call (as replicate allocates them):

* ``nccl``: torchdp's broadcast (``torchdp._C.broadcast_coalesced``: NCCL, every tensor broadcast
  from where it lives, one group);
* ``ce<k>``: copy-engine peer copies (``Tensor.copy_``), tensors dealt round-robin onto k streams
  of each target GPU;
* ``ce-flat``: the tensors packed into one flat buffer on the first GPU, one peer copy per target;
* ``hybrid``: the first half of the bytes over NCCL while the rest goes by copy engine on a side
  stream;
* ``peer<k>`` / ``peer-flat<k>``: the driver's ``cuMemcpyAsync`` per tensor on k streams, or the
  packed buffer cut into k pieces on k streams (no per-copy events: several copy engines at once).

Each NCCL setting in ``--nccl-env`` (comma-separated; ``default`` or ``VAR=value[+VAR=value]``)
runs in a child process of its own, since NCCL reads its environment when the communicator is
made; the copy-engine methods run with the default setting only. ``NCCL_PROTO=Simple`` is among
the defaults because run 3's trace showed the broadcast kernel of the whole group running the LL
protocol (``ncclDevKernel_Broadcast_RING_LL``), which carries a flag with every piece of data;
the transformer's large tensors may move faster with the Simple protocol.

    python benchmarks/probe_broadcast.py [--model transformer] [--device-ids 0,1] [--calls 20]
        [--methods nccl,ce1,ce4,ce-flat,hybrid] [--nccl-env default,NCCL_MIN_NCHANNELS=32]

Prints one line per method: median and 10th-90th percentile in ms, and GB/s of payload per target.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_replicate

import torchdp
from torchdp import _C

# Never NVLink multicast (also in the child processes, which inherit this environment).
SAFE_ENV = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}


def time_calls(
    fn: Callable[[], object], devices: Sequence[torch.device], calls: int
) -> list[float]:
    for _ in range(3):
        fn()
    out = []
    for _ in range(calls):
        for d in devices:
            torch.cuda.synchronize(d)
        start = time.perf_counter()
        result = fn()
        for d in devices:
            torch.cuda.synchronize(d)
        out.append((time.perf_counter() - start) * 1e3)
        del result
    return out


def nccl(tensors: list[torch.Tensor], devices: list[torch.device]) -> object:
    return _C.broadcast_coalesced(tensors, devices, 10 * 1024 * 1024, False)


def copy_engine(
    tensors: list[torch.Tensor], devices: list[torch.device], streams: dict[torch.device, list]
) -> object:
    # A copy between GPUs runs on the source device's current stream (ATen's device-to-device
    # copy), so the k streams per target are streams of the first GPU.
    outs = []
    source = torch.cuda.current_stream(devices[0])
    for d in devices[1:]:
        pool = streams[d]
        for s in pool:
            s.wait_stream(source)
        copies = []
        for i, t in enumerate(tensors):
            c = torch.empty_like(t, device=d)
            with torch.cuda.stream(pool[i % len(pool)]):
                c.copy_(t, non_blocking=True)
            copies.append(c)
        for s in pool:
            source.wait_stream(s)
        outs.append(copies)
    return outs


def copy_flat(tensors: list[torch.Tensor], devices: list[torch.device]) -> object:
    flat = torch.cat([t.reshape(-1) for t in tensors])
    return [flat.to(d, non_blocking=True) for d in devices[1:]]


class _Driver:
    """``cuMemcpyAsync`` of the CUDA driver: with unified addressing a copy between two GPUs' pointers
    is a peer copy by the copy engines, without the two events per copy that ATen's copy_ adds
    (which also chain the copies one after the other, whatever their streams)."""

    def __init__(self) -> None:
        lib = ctypes.CDLL("libcuda.so.1")
        self._copy = lib.cuMemcpyAsync
        self._copy.argtypes = [ctypes.c_uint64, ctypes.c_uint64, ctypes.c_size_t, ctypes.c_void_p]
        self._copy.restype = ctypes.c_int

    def copy(self, dst: torch.Tensor, src: torch.Tensor, stream: torch.cuda.Stream) -> None:
        nbytes = src.numel() * src.element_size()
        rc = self._copy(dst.data_ptr(), src.data_ptr(), nbytes, stream.cuda_stream)
        if rc != 0:
            raise RuntimeError(f"cuMemcpyAsync returned CUresult {rc}")


def peer(
    driver: _Driver,
    tensors: list[torch.Tensor],
    devices: list[torch.device],
    streams: dict[torch.device, list],
    flat: bool,
) -> object:
    # Copies issued on streams of the first GPU (the current device there), each target's current
    # stream waiting for them at the end. flat: one packed buffer, cut into one piece per stream.
    outs = []
    source = torch.cuda.current_stream(devices[0])
    sources = [torch.cat([t.reshape(-1) for t in tensors])] if flat else tensors
    for d in devices[1:]:
        pool = streams[d]
        target = torch.cuda.current_stream(d)
        for s in pool:
            s.wait_stream(source)
            s.wait_stream(target)
        copies = [torch.empty_like(t, device=d) for t in sources]
        with torch.cuda.device(devices[0]):
            if flat:
                pieces = list(zip(copies[0].chunk(len(pool)), sources[0].chunk(len(pool))))
            else:
                pieces = list(zip(copies, sources))
            for i, (dst, src) in enumerate(pieces):
                driver.copy(dst, src, pool[i % len(pool)])
        for s in pool:
            target.wait_stream(s)
        outs.append(copies)
    return outs


def hybrid(
    tensors: list[torch.Tensor], devices: list[torch.device], streams: dict[torch.device, list]
) -> object:
    total = sum(t.numel() * t.element_size() for t in tensors)
    half, running = [], 0
    for t in tensors:
        if running >= total / 2:
            break
        half.append(t)
        running += t.numel() * t.element_size()
    rest = tensors[len(half) :]
    ce = copy_engine(rest, devices, streams)  # queued first: runs on side streams
    return nccl(half, devices), ce


def child(args: argparse.Namespace) -> None:
    ids = [int(i) for i in args.device_ids.split(",")]
    devices = [torch.device("cuda", i) for i in ids]
    net = bench_replicate.build_model(args.model, False).to(devices[0])
    tensors = [p.detach() for p in net.parameters()] + [b.detach() for b in net.buffers()]
    payload = sum(t.numel() * t.element_size() for t in tensors)
    # Per target: four streams of the first GPU (ce1, ce2 and ce4 take the first k).
    streams = {d: [torch.cuda.Stream(devices[0]) for _ in range(4)] for d in devices[1:]}
    methods: dict[str, Callable[[], object]] = {
        "nccl": lambda: nccl(tensors, devices),
        "ce1": lambda: copy_engine(tensors, devices, {d: s[:1] for d, s in streams.items()}),
        "ce2": lambda: copy_engine(tensors, devices, {d: s[:2] for d, s in streams.items()}),
        "ce4": lambda: copy_engine(tensors, devices, streams),
        "ce-flat": lambda: copy_flat(tensors, devices),
        "hybrid": lambda: hybrid(tensors, devices, {d: s[:2] for d, s in streams.items()}),
    }
    try:
        driver = _Driver()
    except OSError as e:
        print(f"  (no libcuda for the peer methods: {e})", flush=True)
    else:
        # ATen enables peer access between the GPUs on its first copy between them.
        for d in devices[1:]:
            torch.ones(1, device=devices[0]).to(d)
        for k in (1, 2, 4):
            sub = {d: s[:k] for d, s in streams.items()}
            methods[f"peer{k}"] = lambda sub=sub: peer(driver, tensors, devices, sub, False)
            methods[f"peer-flat{k}"] = lambda sub=sub: peer(driver, tensors, devices, sub, True)
    label = args.nccl_env
    print(
        f"{args.model}: {len(tensors)} tensors, {payload / 1e6:.1f} MB, devices {ids}, "
        f"NCCL env {label}, torchdp NCCL {torchdp.has_nccl()}",
        flush=True,
    )
    for name in args.methods.split(","):
        if name not in methods:
            print(f"  {name}: unknown method ({', '.join(methods)})", flush=True)
            continue
        if label != "default" and name != "nccl" and name != "hybrid":
            continue  # copy engines do not read NCCL's environment
        try:
            times = sorted(time_calls(methods[name], devices, args.calls))
        except Exception as e:  # noqa: BLE001 - one failing method does not stop the probe
            print(f"  {name}: failed: {type(e).__name__}: {e}", flush=True)
            continue
        med = statistics.median(times)
        p10, p90 = times[len(times) // 10], times[(len(times) * 9) // 10]
        print(
            f"  {name:8s} median {med:.3f} ms (p10-p90 {p10:.3f}-{p90:.3f}), "
            f"{payload / med / 1e6:.0f} GB/s per target",
            flush=True,
        )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="transformer", choices=bench_replicate.DEFAULT_MODELS)
    parser.add_argument("--device-ids", default="0,1")
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument(
        "--methods",
        default="nccl,ce1,ce4,ce-flat,hybrid,peer1,peer2,peer4,peer-flat1,peer-flat2,peer-flat4",
    )
    parser.add_argument("--nccl-env", default="default,NCCL_MIN_NCHANNELS=32,NCCL_PROTO=Simple")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("probe_broadcast: needs CUDA devices (--device-ids, default 0,1)", file=sys.stderr)
        return 1
    if args.child:
        child(args)
        return 0
    status = 0
    for setting in args.nccl_env.split(","):
        env = dict(os.environ, **SAFE_ENV)
        if setting != "default":
            for item in setting.split("+"):
                key, _, value = item.partition("=")
                env[key] = value
        cmd = [sys.executable, __file__, "--child", "--model", args.model]
        cmd += ["--device-ids", args.device_ids, "--calls", str(args.calls)]
        cmd += ["--methods", args.methods, "--nccl-env", setting]
        status |= subprocess.run(cmd, env=env, check=False).returncode
    return status


if __name__ == "__main__":
    sys.exit(main())
