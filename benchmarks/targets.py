"""The performance targets of the two-GPU benchmark run, judged from results files.

    python benchmarks/targets.py RESULTS.json [MORE.json ...]

prints a Markdown table (report.py puts it in every report with two-GPU records): each target of
`make bench` on two GPUs (README, "Performance"; the training targets are models.py's), what the
run measured and a verdict: "met", "met with <option>" when only an opt-in mode reaches it, "not
met", or "not measured". Only two-GPU records (and the one-GPU baselines) are judged, not those of
replicas sharing a GPU; failed or skipped configurations count as not measured.
"""

from __future__ import annotations

import argparse
import functools
import math
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import failed, fmt_x, load_results, num
from models import CPP_TARGET_MODELS, MEMORY_MODEL, MODELS, TRAIN_MODELS

Record = dict[str, Any]

GPUS = 2
MET, NOT_MET, NOT_MEASURED = "met", "not met", "not measured"
# A replicate curve counts as linear when a straight line explains this much of its variance,
LINEAR_R2 = 0.98
# ... and time grows no faster than modules^1.1 (a constant part makes the exponent below 1).
MAX_GROWTH_EXPONENT = 1.1
# The fields of the ratios: the record's own figure, else the medians' ratio.
REPLICATE = ("speedup_vs_torch", "replicate_ms_median")
VS_LIBTORCH = ("libtorch_dp", "speedup_vs_libtorch", "step_ms_median")
CPP_MODES = ("torchdp", "torchdp_graphs")


@dataclass
class Verdict:
    figure: str
    target: str
    measured: str
    verdict: str


def _shares_a_device(r: Record) -> bool:
    """Whether the record's replicas share a device (``devices`` "cuda:0,cuda:0", a one-GPU
    probe of the CPU side): such records say nothing about two GPUs."""
    devices = r.get("devices")
    if isinstance(devices, str):
        devices = [d.strip() for d in devices.split(",") if d.strip()]
    return isinstance(devices, list) and len(set(map(str, devices))) < len(devices)


class Run:
    """Lookups over one run's usable records."""

    def __init__(self, records: Iterable[Record]):
        self.records = [
            r for r in records if isinstance(r, dict) and not failed(r) and not _shares_a_device(r)
        ]

    def find(self, bench: str, model: str, mode: str, gpus: int = GPUS, dtype: str | None = None):
        for r in self.records:
            if (r.get("bench"), r.get("model"), r.get("mode")) == (bench, model, mode) and (
                num(r.get("gpus")) == gpus and dtype in (None, r.get("dtype"))
            ):
                return r
        return None

    def time(self, *key: Any, **kw: Any) -> float | None:
        return num((self.find(*key, **kw) or {}).get("step_ms_median"))

    def speedup(self, bench: str, model: str, mode: str, dtype: str | None = None):
        """Speedup over the one-GPU run of the same model: the record's own figure, or the ratio
        of the medians."""
        r = self.find(bench, model, mode, dtype=dtype)
        if r is None:
            return None
        t, t1 = num(r.get("step_ms_median")), self.time(bench, model, "single", 1, dtype)
        s = num(r.get("speedup_vs_single"))
        return s if s is not None else t1 / t if t and t1 else None

    def ratio(self, bench: str, model: str, mode: str, base_mode: str, field: str, time_key: str):
        """How many times faster `mode` is than `base_mode` (both on two GPUs): the record's own
        `field`, or the ratio of the medians."""
        r = self.find(bench, model, mode)
        if r is None:
            return None
        s = num(r.get(field))
        if s is None:
            a = num((self.find(bench, model, base_mode) or {}).get(time_key))
            b = num(r.get(time_key))
            s = a / b if a and b else None
        return s

    def ideal(self, model: str, dtype: str = "fp32", bench: str = "train_step") -> float | None:
        """single_shard's bound: one-GPU time / one GPU's time at batch / 2."""
        for r in self.records:
            if (r.get("bench"), r.get("model"), r.get("dtype")) == (bench, model, dtype) and (
                r.get("mode") == "single_shard" and num(r.get("shards")) == GPUS
            ):
                return num(r.get("ideal_speedup_vs_single"))
        return None


def _verdict(default_ok: bool | None, options_ok: list[str]) -> str:
    if default_ok is None:
        return NOT_MEASURED
    if default_ok:
        return MET
    return "met with " + ", ".join(options_ok) if options_ok else NOT_MET


def _train_target(run: Run, model: str) -> Verdict:
    spec = MODELS[model]
    goal, vs_ddp = spec.target or 0.0, spec.vs_ddp
    target = f">= {goal:.2f}x" + (", and >= DDP's in the same run" if vs_ddp else "")
    figure = f"torchdp.DataParallel speedup over one GPU, {spec.label}"
    bench, dtype = "train_step", "fp32"
    ddp = run.speedup(bench, model, "ddp", dtype) if vs_ddp else None

    def ok(s: float | None) -> bool | None:
        return None if s is None else s >= goal and (ddp is None or s >= ddp)

    s = run.speedup(bench, model, "torchdp", dtype)
    parts, options_ok = [f"torchdp {fmt_x(s)}"], []
    graphs = run.speedup(bench, model, "torchdp_graphs", dtype)
    if graphs is not None:
        # One GPU can replay CUDA graphs too: the graphed replicas are judged against the graphed
        # one-GPU step (single_graphs), and only shown against the eager one.
        parts.append(f"cuda_graphs=True {fmt_x(graphs)} (vs one GPU eager)")
        tg = run.time(bench, model, "torchdp_graphs", dtype=dtype)
        t1g = run.time(bench, model, "single_graphs", 1, dtype)
        if tg and t1g:
            parts.append(f"cuda_graphs=True vs one GPU graphed {fmt_x(t1g / tg)}")
            options_ok += ["cuda_graphs=True"] if ok(t1g / tg) else []
    if vs_ddp:
        parts.append(f"DDP {fmt_x(ddp)}")
    ideal = run.ideal(model, dtype)
    if ideal is not None:
        parts.append(f"bound {fmt_x(ideal)} (one GPU at half the batch)")
    if vs_ddp and ddp is None and s is not None:
        return Verdict(figure, target, "; ".join(parts) + " (no DDP record)", NOT_MEASURED)
    return Verdict(figure, target, "; ".join(parts), _verdict(ok(s), options_ok))


def _replicate_target(run: Run) -> Verdict:
    figure = "torchdp.replicate vs torch.nn.parallel.replicate, each model"
    in_run = [
        r for r in run.records if r.get("bench") == "replicate" and num(r.get("gpus")) == GPUS
    ]
    models = list(dict.fromkeys(r.get("model") for r in in_run))
    if not models:
        return Verdict(figure, ">= 5x", "—", NOT_MEASURED)
    parts, default_ok, missing = [], True, []
    for model in models:
        s = run.ratio(*("replicate", model, "torchdp_replicate", "torch_replicate"), *REPLICATE)
        bound = num((run.find("replicate", model, "torchdp_replicate") or {}).get("bound_vs_torch"))
        text = f"{model} {fmt_x(s)}"
        if bound is not None and s is not None and s < 5.0:
            text += f", broadcast alone bounds it at {fmt_x(bound)}"
        parts.append(text)
        if s is None:
            missing.append(model)
        else:
            default_ok = default_ok and s >= 5.0
    if missing and default_ok:  # nothing failed; some model has no torchdp figure
        parts.append("no torchdp_replicate record: " + ", ".join(missing))
        return Verdict(figure, ">= 5x", "; ".join(parts), NOT_MEASURED)
    return Verdict(figure, ">= 5x", "; ".join(parts), _verdict(default_ok, []))


def linear_fit(points: list[tuple[float, float]]) -> tuple[float, float, float]:
    """(slope, intercept, R²) of the least-squares line through (x, y) points."""
    n = len(points)
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    sxx = sum((x - mx) ** 2 for x, _ in points)
    sxy = sum((x - mx) * (y - my) for x, y in points)
    syy = sum((y - my) ** 2 for _, y in points)
    slope = sxy / sxx if sxx else 0.0
    r2 = (sxy * sxy) / (sxx * syy) if sxx and syy else 1.0
    return slope, my - slope * mx, r2


def _slope_target(run: Run) -> Verdict:
    figure = "replicate time growth over module count"
    target = "linear, and the smallest slope of the modes"
    curves: dict[str, list[tuple[float, float]]] = {}
    for r in run.records:
        m, t = num(r.get("modules")), num(r.get("replicate_ms_median"))
        if (
            r.get("bench") == "replicate_curve"
            and num(r.get("gpus")) == GPUS
            and m
            and t is not None
        ):
            curves.setdefault(str(r.get("mode")), []).append((m, t))
    fits = {mode: linear_fit(pts) for mode, pts in curves.items() if len({x for x, _ in pts}) >= 3}
    if "torchdp_replicate" not in fits:
        return Verdict(figure, target, "—", NOT_MEASURED)
    parts = [
        f"{mode} {1e3 * slope:.1f} µs/module (R² {r2:.3f})"
        for mode, (slope, _, r2) in sorted(fits.items(), key=lambda kv: kv[1][0])
    ]
    slope, _, r2 = fits["torchdp_replicate"]
    # R² alone cannot tell a line from mild superlinear growth over these module counts (x^1.3
    # still gives 0.99): the exponent of a power law through the points must not exceed 1.
    points = [(math.log(m), math.log(t)) for m, t in curves["torchdp_replicate"] if m > 0 and t > 0]
    exponent = linear_fit(points)[0]
    parts.append(f"torchdp_replicate growth exponent {exponent:.2f}")
    smallest = all(slope <= s for s, _, _ in fits.values())
    ok = r2 >= LINEAR_R2 and exponent <= MAX_GROWTH_EXPONENT and smallest
    return Verdict(figure, target, "; ".join(parts), MET if ok else NOT_MET)


def _is_reference_convnet(r: Record) -> bool:
    """cpp_convnet records of the VGG-plan net (model_desc names its max pooling). Runs before
    2026-12-02 used that name for a flat net, without a description: they are not judged."""
    return r.get("model") != "cpp_convnet" or "MaxPool2d" in str(r.get("model_desc", ""))


def _cpp_vs_libtorch_target(run: Run) -> Verdict:
    figure = "C++ torchdp::DataParallel vs LibTorch data_parallel, both C++ models"
    run = Run([r for r in run.records if _is_reference_convnet(r)])
    models = []
    for r in run.records:
        baseline = r.get("bench") == "cpp_train_step" and r.get("mode") == "libtorch_dp"
        if baseline and num(r.get("gpus")) == GPUS and r.get("model") not in models:
            models.append(r.get("model"))
    if not models:
        return Verdict(figure, ">= 10x", "—", NOT_MEASURED)
    parts, default_ok, graphs_ok, any_graphs = [], True, True, False
    for model in models:
        s, g = (run.ratio("cpp_train_step", model, mode, *VS_LIBTORCH) for mode in CPP_MODES)
        text = f"{model} {fmt_x(s)}" + (f" (cuda_graphs {fmt_x(g)})" if g is not None else "")
        if model not in CPP_TARGET_MODELS:
            parts.append(text + " (not judged: not one of the reference models)")
            continue
        any_graphs = any_graphs or g is not None
        parts.append(text)
        default_ok = default_ok and s is not None and s >= 10.0
        graphs_ok = graphs_ok and ((s is not None and s >= 10.0) or (g is not None and g >= 10.0))
    judged = [m for m in models if m in CPP_TARGET_MODELS]
    if len(judged) < len(CPP_TARGET_MODELS):
        parts.append(", ".join(m for m in CPP_TARGET_MODELS if m not in judged) + " not measured")
        # A measured model that misses the target fails it whatever the missing one gives.
        failed_one = not default_ok and not (any_graphs and graphs_ok)
        return Verdict(figure, ">= 10x", "; ".join(parts), NOT_MET if failed_one else NOT_MEASURED)
    options = ["cuda_graphs"] if any_graphs and graphs_ok and not default_ok else []
    return Verdict(figure, ">= 10x", "; ".join(parts), _verdict(default_ok, options))


def _cpp_conv_target(run: Run) -> Verdict:
    figure = "C++ torchdp::DataParallel speedup over one GPU, conv net"
    older = any(
        r.get("model") == "cpp_convnet" and not _is_reference_convnet(r) for r in run.records
    )
    run = Run([r for r in run.records if _is_reference_convnet(r)])
    s = run.speedup("cpp_train_step", "cpp_convnet", "torchdp")
    if s is None and older:
        measured = (
            "— (this run's cpp_convnet is the flat net of runs before 2026-12-02, not the "
            "reference's VGG-plan net)"
        )
        return Verdict(figure, ">= 1.70x", measured, NOT_MEASURED)
    measured = f"torchdp {fmt_x(s)}"
    ideal = run.ideal("cpp_convnet", bench="cpp_train_step")
    if ideal is not None:
        measured += f"; bound {fmt_x(ideal)} (one GPU at half the batch)"
    return Verdict(figure, ">= 1.70x", measured, _verdict(None if s is None else s >= 1.7, []))


def _mem_ratio(r: Record | None) -> float | None:
    ratio, peaks = num((r or {}).get("mem_ratio_gpu0_gpu1")), (r or {}).get("peak_mem_gib")
    if ratio is None and isinstance(peaks, list) and len(peaks) >= 2:
        ratio = (
            num(peaks[0]) / num(peaks[1]) if num(peaks[0]) is not None and num(peaks[1]) else None
        )
    return ratio


def _memory_target(run: Run) -> Verdict:
    figure = "peak memory GPU 0 / GPU 1, 50k-vocab LM, loss per replica"
    balanced = _mem_ratio(run.find("memory", MEMORY_MODEL, "torchdp_balanced"))
    stock = _mem_ratio(run.find("memory", MEMORY_MODEL, "torch_dp"))
    measured = f"torchdp balanced {balanced:.2f}" if balanced is not None else "—"
    if stock is not None:
        measured += f"; nn.DataParallel {stock:.2f}"
    verdict = _verdict(None if balanced is None else balanced <= 1.2, [])
    return Verdict(figure, "<= 1.2", measured, verdict)


def _grads_target(run: Run) -> Verdict:
    figure = "gradients after one step, torchdp vs torch.nn.DataParallel"
    two = [r for r in run.records if r.get("bench") == "train_step" and num(r.get("gpus")) == GPUS]
    checked = [r for r in two if isinstance(r.get("grads_match_torch_dp"), bool)]
    fp32 = [r for r in checked if r.get("dtype") == "fp32"]
    # A check that raised (grads_match_torch_dp None) fails the target; a model whose check is
    # missing (its torchdp record failed, or the run skipped the checks) leaves it unmeasured.
    errored = [
        f"{r.get('model')}/{r.get('mode')}"
        for r in two
        if r.get("dtype") == "fp32" and "grads_match_torch_dp" in r
        if r["grads_match_torch_dp"] is None
    ]
    if not fp32 and not errored:
        return Verdict(figure, "equal (fp32)", "—", NOT_MEASURED)
    bad = [f"{r.get('model')}/{r.get('mode')}" for r in fp32 if not r["grads_match_torch_dp"]]
    bad += [f"{e} (the check raised)" for e in errored]
    worst = max((num(r.get("grads_max_abs_diff")) or 0.0) for r in fp32) if fp32 else 0.0
    measured = f"fp32: {len(fp32) - len(bad)} of {len(fp32)} match, max abs diff {worst:.1e}"
    measured += " (differ: " + ", ".join(bad) + ")" if bad else ""
    other = [r for r in checked if r.get("dtype") != "fp32"]
    if other:
        n = sum(1 for r in other if r["grads_match_torch_dp"])
        measured += (
            "; low precision (not judged: nn.DataParallel's replicas may run float16 under bf16 "
            f"autocast): {n} of {len(other)} within the loose check"
        )
    missing = [m for m in TRAIN_MODELS if not any(r.get("model") == m for r in fp32)]
    if missing and not bad:
        measured += "; not checked: " + ", ".join(missing)
        return Verdict(figure, "equal (fp32)", measured, NOT_MEASURED)
    return Verdict(figure, "equal (fp32)", measured, NOT_MET if bad else MET)


TARGETS: list[Callable[[Run], Verdict]] = [
    *(functools.partial(_train_target, model=n) for n in TRAIN_MODELS if MODELS[n].target),
    _replicate_target,
    _slope_target,
    _cpp_vs_libtorch_target,
    _cpp_conv_target,
    _memory_target,
    _grads_target,
]


def judge(records: Iterable[Record]) -> list[Verdict]:
    run = Run(records)
    return [target(run) for target in TARGETS]


def section(records: list[Record]) -> list[str]:
    """The report's "Targets" section; empty when no record ran on two distinct GPUs."""
    if not any(num(r.get("gpus")) == GPUS and not _shares_a_device(r) for r in records):
        return []
    verdicts = judge(records)
    met = sum(1 for v in verdicts if v.verdict == MET)
    lines = [
        "## Targets (two GPUs)",
        "",
        (
            f"The project's targets for this run's two-GPU records: {met} of {len(verdicts)} met "
            'by the default modes. "met with X": only the opt-in X reaches it. Computed by '
            "`benchmarks/targets.py`."
        ),
        "",
        "| figure | target | measured | verdict |",
        "|---|---|---|---|",
    ]
    for v in verdicts:
        verdict = f"**{v.verdict}**" if v.verdict == MET else v.verdict
        cells = [v.figure, v.target, v.measured, verdict]
        lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return [*lines, ""]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("results", nargs="+", help="results JSON file(s), merged")
    args = parser.parse_args(argv)
    _, _, records, warnings = load_results(args.results)
    for w in warnings:
        print(f"warning: {w}", file=sys.stderr)
    lines = section(records)
    if not lines:
        print("no two-GPU records: the targets are not judged", file=sys.stderr)
        return 1
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
