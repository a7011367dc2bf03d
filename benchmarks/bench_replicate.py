"""Replicate time: ``torchdp.replicate`` against ``torch.nn.parallel.replicate``.

Both replicate differentiably onto every GPU: models.py's models (records ``replicate``) and a
curve over the module count (``replicate_curve``, model ``seq{k}``: k ``Linear(16, 16)``), each
record with ``modules``. A model's records also carry ``broadcast_ms_median``, broadcasting its
tensors alone (the transfer any replicate pays), and ``bound_vs_torch`` = torch's time / that.
``--smoke``: tiny models onto ``[cpu, cpu]``, torch's replicate (CUDA only) recorded as skipped.

    python benchmarks/bench_replicate.py --out results/replicate.json [--gpus N] [--curve 10,100]
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common
import models
import torch
from torch import nn

import torchdp

MODES = ("torch_replicate", "torchdp_replicate")
CURVE = "10,30,100,300,1000,2000"
# torch's replicate is the slow one on many modules (~45 us per module on H200s): above this many
# modules it gets at most 5 steps, which keeps k = 2000 at about a second.
LARGE_MODULES = 1500


def main(argv: list[str] | None = None) -> int:
    parser = common.parser(__doc__, "default 2 and 10 calls (smoke 1 and 3)")
    parser.add_argument("--models", default=None, help="comma list of models.py's models")
    parser.add_argument("--curve", default=None, help=f"module counts (default {CURVE})")
    args = parser.parse_args(argv)
    run = common.start_run(args, warmup=(2, 1), steps=(10, 3), budget=600.0)
    devices = run.devices(max(run.counts) if not run.smoke else 2)
    where = ",".join(map(str, devices))
    names = common.parse_list(args.models, models.TRAIN_MODELS, "models")
    curve = [int(k) for k in (args.curve or ("10,30" if run.smoke else CURVE)).split(",") if k]
    results = common.Results("replicate")
    common.progress(f"replicate onto {where}: models {names}, curve {curve}, steps {run.steps}")

    def measure(bench: str, name: str, make: Callable[[], nn.Module]) -> None:
        """Times both modes on the network `make` builds, and adds their records."""
        base: dict[str, Any] = {"bench": bench, "model": name, "gpus": len(devices)}
        base |= {"dtype": "fp32", "devices": where, "speedup_vs_single": None, "peak_mem_gib": []}
        base |= {"smoke": True} if run.smoke else {}
        net, problem, floor = None, {}, None
        try:
            net = make().to(devices[0]).train()
            base["modules"] = len(list(net.modules()))
        except ModuleNotFoundError as e:  # torchvision is optional
            problem = {"skipped": f"{e.name or e} is not installed"}
        except Exception as e:  # noqa: BLE001
            problem = {"error": f"building the model failed: {common.error_text(e)}"}
        if net is not None and bench == "replicate" and len(devices) > 1:
            # The parameters and buffers broadcast alone: the transfer every replicate pays.
            tensors = [t.detach() for t in (*net.parameters(), *net.buffers())]

            def call():
                return torchdp._C.broadcast_coalesced(tensors, devices)

            with contextlib.suppress(RuntimeError):  # the replicate records still come
                times_ms = common.time_steps(call, devices, run.warmup, run.steps)
                floor = common.summarize(times_ms)["step_ms_median"]
        times: dict[str, float] = {}
        for mode in MODES:
            rec = {**base, "mode": mode, "replicate_ms_median": None}
            if mode == "torch_replicate" and devices[0].type != "cuda":
                rec["skipped"] = f"torch.nn.parallel.replicate needs CUDA devices ({where})"
            elif problem:
                rec.update(problem)
            elif net is not None and run.time_left() <= 0:
                rec["error"] = "skipped: time budget exhausted"
            elif net is not None:
                fn = torch.nn.parallel.replicate if mode == MODES[0] else torchdp.replicate
                steps = run.steps
                if base["modules"] > LARGE_MODULES and mode == "torch_replicate":
                    steps = max(3, min(steps, 5))
                started = time.perf_counter()
                try:

                    def call(fn=fn):
                        return fn(net, devices, detach=False)

                    times_ms = common.time_steps(call, devices, run.warmup, steps)
                    rec.update(common.summarize(times_ms, prefix="replicate_ms"))
                    rec["wall_s"] = round(time.perf_counter() - started, 3)
                    times[mode] = rec["replicate_ms_median"]
                except Exception as e:  # noqa: BLE001 - recorded, the run goes on
                    rec["error"] = common.error_text(e)
                common.free_memory()
            torch_ms, ours = times.get("torch_replicate"), times.get(mode)
            if mode == "torchdp_replicate":
                rec["speedup_vs_torch"] = torch_ms / ours if torch_ms and ours else None
            if floor is not None:
                rec["broadcast_ms_median"] = floor
                rec["bound_vs_torch"] = torch_ms / floor if torch_ms else None
            results.add(**rec)
            outcome = (
                rec.get("error") or rec.get("skipped") or f"{rec['replicate_ms_median']:.2f} ms"
            )
            common.progress(f"{bench} {name} {mode}: {outcome}")

    for name in names:
        measure("replicate", name, lambda name=name: models.build(name, run.smoke))
    for k in curve:
        measure("replicate_curve", f"seq{k}", lambda k=k: models.seq(k))
    results.write(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
