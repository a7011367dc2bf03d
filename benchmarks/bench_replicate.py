"""Replicate time: ``torchdp.replicate`` vs ``torch.nn.parallel.replicate``.

Both replicate differentiably (``detach=False``) onto all GPUs. Two parts:

* the three models of the train-step benchmark (torchvision ``resnet50``; ``transformer``: a
  12-layer ``nn.TransformerEncoder`` of ``TransformerEncoderLayer(768, 12, 3072,
  batch_first=True)``; ``mlp200``: ``nn.Sequential`` of 200 x (Linear(256, 256), ReLU)) ->
  records ``bench="replicate"``, modes ``torch_replicate`` / ``torchdp_replicate``;
  Each model's records also carry ``broadcast_ms_median``: the time of broadcasting its
  parameters and buffers alone (``torchdp._C.broadcast_coalesced``, no autograd, no modules),
  the transfer that any replicate pays, and ``bound_vs_torch`` = torch's replicate time / that
  time, the largest speedup over torch that a replicate could reach on this machine;
* a curve over module count: ``nn.Sequential`` of k ``Linear(16, 16)`` for k in 10 ... 2000 ->
  records ``bench="replicate_curve"``, ``model=f"seq{k}"``, ``modules`` = len(list(net.modules())).

Every timing synchronises all devices before and after the call (common.time_steps). A failing
configuration becomes a record with ``"error"`` and the run continues.

Usage::

    python benchmarks/bench_replicate.py --out results/replicate.json [--smoke] [--gpus N]
        [--steps 10] [--warmup 2] [--curve 10,30,100,300,1000,2000] [--models resnet50,transformer,mlp200]

``--smoke`` (no GPU needed): tiny models, torchdp on two CPU devices ``[cpu, cpu]``, torch's
replicate recorded as skipped (it needs CUDA), curve k in 10, 30.
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common

try:
    import torchdp
except ImportError:  # not installed: the in-place build of the repository
    sys.path.append(str(common.REPO / "python"))
    try:
        import torchdp
    except ImportError as e:  # recorded per configuration below
        torchdp = None
        _TORCHDP_IMPORT_ERROR = f"import torchdp failed: {e}"
    else:
        _TORCHDP_IMPORT_ERROR = ""
else:
    _TORCHDP_IMPORT_ERROR = ""

MODES = ("torch_replicate", "torchdp_replicate")
DEFAULT_CURVE = (10, 30, 100, 300, 1000, 2000)
SMOKE_CURVE = (10, 30)
DEFAULT_MODELS = ("resnet50", "transformer", "mlp200")
# Above this many modules the slower mode gets fewer steps, so the curve stays within budget.
LARGE_MODULES = 1500


# ---- models -------------------------------------------------------------------------------------


def mlp(layers: int, width: int) -> nn.Module:
    blocks: list[nn.Module] = []
    for _ in range(layers):
        blocks += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*blocks)


def transformer(layers: int, d_model: int, heads: int, ff: int) -> nn.Module:
    layer = nn.TransformerEncoderLayer(d_model, heads, ff, batch_first=True)
    # enable_nested_tensor=False: the nested-tensor fast path is for inference only and warns.
    return nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)


def resnet(smoke: bool) -> nn.Module:
    import torchvision  # the GPU machine has it; a missing package becomes an error record

    return torchvision.models.resnet18() if smoke else torchvision.models.resnet50()


def build_model(name: str, smoke: bool) -> nn.Module:
    if name == "resnet50":
        return resnet(smoke)
    if name == "transformer":
        return transformer(2, 64, 4, 128) if smoke else transformer(12, 768, 12, 3072)
    if name == "mlp200":
        return mlp(8, 32) if smoke else mlp(200, 256)
    raise ValueError(f"unknown model {name!r} (choose from {', '.join(DEFAULT_MODELS)})")


def seq(k: int) -> nn.Module:
    return nn.Sequential(*[nn.Linear(16, 16) for _ in range(k)])


# ---- timing -------------------------------------------------------------------------------------


def replicate_fn(mode: str, devices: list[torch.device]) -> Callable[[nn.Module], Any]:
    if mode == "torch_replicate":
        return lambda net: torch.nn.parallel.replicate(net, devices, detach=False)
    if torchdp is None:
        raise RuntimeError(_TORCHDP_IMPORT_ERROR)
    return lambda net: torchdp.replicate(net, devices, detach=False)


def error_text(e: BaseException) -> str:
    text = f"{type(e).__name__}: {e}"
    return text if len(text) <= 1500 else text[:1500] + " [...]"


def free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


class Runner:
    def __init__(self, args: argparse.Namespace, devices: list[torch.device]) -> None:
        self.args = args
        self.devices = devices
        self.results = common.Results("replicate")
        self.failures = 0

    def base(self, bench: str, model: str, mode: str) -> dict[str, Any]:
        record: dict[str, Any] = {
            "bench": bench,
            "model": model,
            "mode": mode,
            "gpus": len(self.devices),
            "dtype": "fp32",
            "devices": ",".join(str(d) for d in self.devices),
            "speedup_vs_single": None,
            "peak_mem_gib": [],
        }
        if self.args.smoke:
            record["smoke"] = True
        return record

    def measure(
        self,
        bench: str,
        model_name: str,
        net: nn.Module | None,
        build_error: str,
        modules: int | None,
        steps_for: Callable[[str], int],
    ) -> None:
        """Times both modes on `net` (already on devices[0]) and adds their records."""
        medians: dict[str, float] = {}
        floor = self.broadcast_floor(model_name, net) if bench == "replicate" else None
        for mode in MODES:
            record = self.base(bench, model_name, mode)
            if modules is not None:
                record["modules"] = modules
            if mode == "torch_replicate" and any(d.type != "cuda" for d in self.devices):
                record["replicate_ms_median"] = None
                record["skipped"] = (
                    f"torch.nn.parallel.replicate needs CUDA devices (devices: {record['devices']})"
                )
                self.results.add(**record)
                common.progress(f"{bench} {model_name} {mode}: skipped ({record['skipped']})")
                continue
            if net is None:
                record["replicate_ms_median"] = None
                if build_error.startswith("skipped: "):
                    record["skipped"] = build_error[len("skipped: ") :]
                    common.progress(f"{bench} {model_name} {mode}: {build_error}")
                else:
                    record["error"] = build_error
                    self.failures += 1
                    common.progress(f"{bench} {model_name} {mode}: FAILED: {build_error}")
                self.results.add(**record)
                continue
            try:
                fn = replicate_fn(mode, self.devices)
                steps = steps_for(mode)
                started = time.perf_counter()
                times = common.time_steps(
                    lambda fn=fn: fn(net), self.devices, self.args.warmup, steps
                )
                record.update(common.summarize(times, prefix="replicate_ms"))
                record["wall_s"] = round(time.perf_counter() - started, 3)
                medians[mode] = record["replicate_ms_median"]
            except Exception as e:  # noqa: BLE001 - recorded, the run continues
                self.failures += 1
                record["replicate_ms_median"] = None
                record["error"] = error_text(e)
                common.progress(f"{bench} {model_name} {mode}: FAILED: {record['error']}")
                if self.args.verbose:
                    traceback.print_exc()
            finally:
                free_memory()
            if mode == "torchdp_replicate":
                torch_ms = medians.get("torch_replicate")
                ours = medians.get(mode)
                record["speedup_vs_torch"] = torch_ms / ours if torch_ms and ours else None
            if floor is not None:
                record["broadcast_ms_median"] = floor
                torch_ms = medians.get("torch_replicate")
                record["bound_vs_torch"] = torch_ms / floor if torch_ms else None
            self.results.add(**record)
            if record.get("replicate_ms_median") is not None:
                extra = (
                    f", {record['speedup_vs_torch']:.2f}x vs torch"
                    if record.get("speedup_vs_torch")
                    else ""
                )
                common.progress(
                    f"{bench} {model_name} {mode}: "
                    f"{record['replicate_ms_median']:.2f} ms "
                    f"(p10 {record['replicate_ms_p10']:.2f}, "
                    f"p90 {record['replicate_ms_p90']:.2f}){extra}"
                )

    def broadcast_floor(self, model_name: str, net: nn.Module | None) -> float | None:
        """Median ms of broadcasting `net`'s parameters and buffers to the devices, or None."""
        if net is None or torchdp is None or len(self.devices) < 2:
            return None
        tensors = [t.detach() for t in (*net.parameters(), *net.buffers())]
        try:
            times = common.time_steps(
                lambda: torchdp._C.broadcast_coalesced(tensors, self.devices),
                self.devices,
                self.args.warmup,
                self.args.steps,
            )
        except Exception as e:  # noqa: BLE001 - the replicate records still come
            common.progress(f"replicate {model_name} broadcast floor: FAILED: {error_text(e)}")
            return None
        finally:
            free_memory()
        floor = common.summarize(times, prefix="b")["b_median"]
        common.progress(f"replicate {model_name} broadcast floor: {floor:.2f} ms")
        return floor

    def build(self, make: Callable[[], nn.Module]) -> tuple[nn.Module | None, str, int | None]:
        try:
            net = make().to(self.devices[0])
            net.train()
            return net, "", len(list(net.modules()))
        except ModuleNotFoundError as e:  # torchvision is optional
            return None, f"skipped: {e.name or e} is not installed", None
        except Exception as e:  # noqa: BLE001
            if self.args.verbose:
                traceback.print_exc()
            return None, f"building the model failed: {error_text(e)}", None

    def run_models(self) -> None:
        for name in self.args.models:
            net, err, modules = self.build(lambda name=name: build_model(name, self.args.smoke))
            self.measure("replicate", name, net, err, modules, lambda mode: self.args.steps)
            del net
            free_memory()

    def run_curve(self) -> None:
        for k in self.args.curve:
            net, err, modules = self.build(lambda k=k: seq(k))

            def steps_for(mode: str, modules: int | None = modules) -> int:
                # torch's replicate is the slow one on many modules (~45 us per module measured
                # on H200s): fewer steps keep k=2000 at about a second.
                if (modules or 0) > LARGE_MODULES and mode == "torch_replicate":
                    return max(3, min(self.args.steps, 5))
                return self.args.steps

            self.measure("replicate_curve", f"seq{k}", net, err, modules, steps_for)
            del net
            free_memory()


def parse_ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    common.add_common_args(parser)
    parser.add_argument(
        "--steps",
        type=int,
        default=None,
        help="timed replicate() calls per configuration (default 10; smoke 3)",
    )
    parser.add_argument(
        "--warmup", type=int, default=None, help="warm-up calls (default 2; smoke 1)"
    )
    parser.add_argument(
        "--curve",
        type=parse_ints,
        default=None,
        help="comma-separated module counts k of the curve "
        f"(default {','.join(map(str, DEFAULT_CURVE))}; smoke "
        f"{','.join(map(str, SMOKE_CURVE))}; empty: no curve)",
    )
    parser.add_argument(
        "--models",
        default=",".join(DEFAULT_MODELS),
        help="comma-separated models (default: %(default)s; empty: none)",
    )
    parser.add_argument("--verbose", action="store_true", help="print tracebacks of failures")
    parser.add_argument(
        "--strict",
        action="store_true",
        help="exit 1 when a configuration failed (default: record it, exit 0)",
    )
    args = parser.parse_args(argv)
    args.steps = args.steps if args.steps is not None else (3 if args.smoke else 10)
    args.warmup = args.warmup if args.warmup is not None else (1 if args.smoke else 2)
    if args.curve is None:
        args.curve = list(SMOKE_CURVE if args.smoke else DEFAULT_CURVE)
    args.models = [m.strip() for m in args.models.split(",") if m.strip()]
    if args.steps < 1:
        parser.error("--steps must be at least 1")

    devices = common.default_devices(args.smoke)
    if not args.smoke:
        if not torch.cuda.is_available():
            parser.error("no CUDA device visible; use --smoke for a CPU run")
        # --gpus N: the first N GPUs (one count; replicate has no "single" baseline).
        counts = common.gpu_counts(args.gpus, len(devices))
        devices = devices[: max(counts)]

    torch.manual_seed(0)
    runner = Runner(args, devices)
    common.progress(
        f"replicate benchmark on {','.join(map(str, devices))}: models "
        f"{','.join(args.models) or '-'}, curve {args.curve}, steps {args.steps}, "
        f"warm-up {args.warmup}"
    )
    started = time.perf_counter()
    try:
        runner.run_models()
        runner.run_curve()
    finally:
        runner.results.write(args.out)
        common.progress(
            f"replicate benchmark done in {time.perf_counter() - started:.1f} s"
            + (f" ({runner.failures} failed)" if runner.failures else "")
        )
    return 1 if args.strict and runner.failures else 0


if __name__ == "__main__":
    sys.exit(main())
