"""Markdown report and plots of a torchdp benchmark results file.

Usage::

    python benchmarks/report.py RESULTS.json [MORE.json ...] --md OUT.md --plots OUT_PREFIX

RESULTS.json is a merged results file (``{"machine": ..., "records": [...]}``, see common.py);
further files are merged into it (their records appended, their machine blocks shown as extra
machine entries, e.g. the C++ benchmark's). Writes:

* OUT.md: the machine block, the targets judged on the two-GPU records (targets.py), the tables
  that have records (train steps, memory, replicate, replicate curve, C++), then the configurations that failed or were skipped, with their message;
* OUT_PREFIX-speedup.png: speedup over one GPU per model/dtype (grouped bars, one per mode, the C++
  models included), dashed lines at 1.0 and at the GPU count;
* OUT_PREFIX-replicate.png: replicate time vs module count (log-log, one line per mode).
* OUT_PREFIX-scaling.png: speedup against the GPU count, one panel per model, over every results
  file given (so 2-, 4- and 8-GPU runs share the panels).

Defaults: OUT.md = RESULTS with the suffix .md, OUT_PREFIX = RESULTS without its suffix. Missing
sections are left out (smoke results have few records); a plot with no data is not written.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections import OrderedDict
from collections.abc import Iterable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common
import targets
from common import failed, fmt_x, num

Record = dict[str, Any]

# Display order of modes; unknown modes come after, in order of appearance.
MODE_ORDER = [
    "single",
    "single_graphs",
    "single_shard",
    "torch_dp",
    "torch_dp_balanced",
    "libtorch_dp",
    "torchdp",
    "torchdp_serial",
    "torchdp_new_replicas",
    "torchdp_graphs",
    "torchdp_balanced",
    "torchdp_functional",
    "ddp",
    "torch_replicate",
    "libtorch_replicate",
    "torchdp_replicate",
]
DTYPE_ORDER = ["fp32", "tf32", "bf16", "fp16"]
CPP_BENCHES = ("cpp_train_step", "cpp_replicate")
# bench_threads.py: CPU replicas, shown with their CPU time and threads, not as training steps.
THREAD_BENCHES = ("threads",)
REPLICATE_BENCHES = ("replicate", "replicate_curve", "cpp_replicate")


# ---- loading ------------------------------------------------------------------------------------


def load_results(
    paths: list[str],
) -> tuple[dict[str, Any], list[dict[str, Any]], list[Record], list[str]]:
    """(main machine block, further machine blocks, records, warnings)."""
    machine: dict[str, Any] = {}
    extra_machines: list[dict[str, Any]] = []
    records: list[Record] = []
    warnings: list[str] = []
    for i, path in enumerate(paths):
        try:
            data = common.load(path)
        except ValueError as e:
            # Keep going with what is readable; invalid records are listed as such.
            warnings.append(f"{path}: {e}")
            data = json.loads(Path(path).read_text())
            if not isinstance(data, dict):
                raise SystemExit(f"{path}: not a torchdp benchmark results file") from e
        m = data.get("machine") or {}
        if i == 0:
            machine = _cpp_only_machine(m) if m.get("source") == "cpp" else m
        else:
            extra_machines.append(m)
        for r in data.get("records") or []:
            if not isinstance(r, dict):
                continue
            try:
                common.validate_record(r)
            except ValueError as e:
                r = dict(r)
                r.setdefault("error", f"invalid record: {e}")
            records.append(r)
    # A merged file may carry the C++ benchmark's machine block inside the main one.
    for key in ("cpp", "cpp_machine"):
        if isinstance(machine.get(key), dict):
            extra_machines.append(machine[key])
    return machine, extra_machines, records, warnings


# ---- formatting ---------------------------------------------------------------------------------


def fmt_ms(v: Any) -> str:
    f = num(v)
    if f is None:
        return "—"
    if f >= 100:
        return f"{f:.0f}"
    if f >= 10:
        return f"{f:.1f}"
    return f"{f:.2f}"


def fmt_gib(values: Any) -> str:
    if not isinstance(values, (list, tuple)) or not values:
        return "—"
    return "[" + ", ".join(f"{float(v):.2f}" for v in values if num(v) is not None) + "]"


def cell(text: Any) -> str:
    s = "—" if text is None else str(text)
    return s.replace("|", "\\|").replace("\n", " ")


def one_line(text: Any) -> str:
    return " ".join(str(text).split())


def table(headers: list[str], rows: list[list[Any]]) -> list[str]:
    out = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    out += ["| " + " | ".join(cell(c) for c in row) + " |" for row in rows]
    return out + [""]


def mode_key(mode: str, seen: list[str]) -> tuple[int, int]:
    if mode in MODE_ORDER:
        return (0, MODE_ORDER.index(mode))
    if mode not in seen:
        seen.append(mode)
    return (1, seen.index(mode))


def ordered(records: Iterable[Record]) -> list[Record]:
    """Records sorted by model (first appearance), dtype, gpus and mode."""
    records = list(records)
    models: list[str] = []
    for r in records:
        if r.get("model") not in models:
            models.append(r.get("model"))
    seen: list[str] = []

    def dtype_key(d: Any) -> tuple[int, str]:
        d = str(d)
        return (DTYPE_ORDER.index(d), "") if d in DTYPE_ORDER else (len(DTYPE_ORDER), d)

    return sorted(
        records,
        key=lambda r: (
            models.index(r.get("model")),
            dtype_key(r.get("dtype")),
            num(r.get("gpus")) or 0,
            mode_key(str(r.get("mode")), seen),
        ),
    )


def time_of(r: Record) -> float | None:
    return num(r.get("step_ms_median", r.get("replicate_ms_median")))


def spread(r: Record, prefix: str) -> str:
    lo, hi = num(r.get(f"{prefix}_p10")), num(r.get(f"{prefix}_p90"))
    if lo is None or hi is None:
        return "—"
    return f"{fmt_ms(lo)}–{fmt_ms(hi)}"


def gpus_cell(r: Record) -> str:
    """The GPU count; smoke runs record 0 GPUs and their CPU replicas separately."""
    g, replicas = r.get("gpus"), r.get("replicas")
    if num(g) == 0 and replicas:
        return f"0 ({replicas} CPU replica{'s' if num(replicas) != 1 else ''})"
    return "—" if g is None else str(g)


def speedup_cell(r: Record) -> str:
    """The speedup over one GPU; for single_shard the ideal speedup of its GPU count."""
    ideal = num(r.get("ideal_speedup_vs_single"))
    if ideal is not None:
        return f"ideal {fmt_x(ideal)} ({r.get('shards')} GPUs)"
    return fmt_x(r.get("speedup_vs_single"))


def is_ddp(mode: str) -> bool:
    return "ddp" in mode.lower() or "distributed" in mode.lower()


def grads_cell(r: Record) -> str:
    """bench_train_step's gradient check of torchdp against torch.nn.DataParallel."""
    diff = num(r.get("grads_max_abs_diff"))
    detail = f" (max abs diff {diff:.1e})" if diff is not None else ""
    for key in ("grads_match_torch_dp", "grads_match"):
        v = r.get(key)
        if isinstance(v, bool):
            return ("yes" if v else "**no**") + detail
    if r.get("grads_check_error"):
        return "check failed"
    return "—"


# ---- sections -----------------------------------------------------------------------------------


def _cpp_only_machine(machine: dict[str, Any]) -> dict[str, Any]:
    """The machine block of a file written by the C++ benchmark alone, in the Python blocks' keys
    (older C++ files name neither the GPUs nor the date: they stay unknown, not "CPU")."""
    out = dict(machine)
    out["torch"] = f"libtorch {machine.get('libtorch') or '?'}"
    out["torchdp"] = machine.get("torchdp_version")
    out["torchdp_has_cuda"] = machine.get("torchdp_with_cuda")
    out["torchdp_has_nccl"] = machine.get("torchdp_with_nccl")
    return out


def machine_section(machine: dict[str, Any], extra: list[dict[str, Any]]) -> list[str]:
    gpus = machine.get("gpus") or []
    gpu_text = (
        f"{len(gpus)}x {gpus[0]}"
        if gpus and len(set(gpus)) == 1
        else (", ".join(gpus) if gpus else "none (CPU)")
    )
    if not gpus and machine.get("cuda_devices"):
        gpu_text = f"{machine['cuda_devices']} CUDA device(s), names not recorded"
    rev = str(machine.get("torchdp_git_revision") or "—")
    rows = [
        ("GPUs", gpu_text),
        ("Driver", machine.get("driver")),
        ("torch", machine.get("torch")),
        ("CUDA", machine.get("cuda")),
        ("cuDNN", machine.get("cudnn")),
        ("NCCL", machine.get("nccl")),
        ("torchvision", machine.get("torchvision")),
        (
            "torchdp",
            f"{machine.get('torchdp') or '—'} (CUDA {machine.get('torchdp_has_cuda')}, "
            f"NCCL {machine.get('torchdp_has_nccl')})"
            if machine
            else None,
        ),
        ("torchdp revision", rev[:12] if len(rev) == 40 else rev),
        ("Python", machine.get("python")),
        ("Platform", machine.get("platform")),
        ("CPU cores", machine.get("cpu_count")),
        ("Date", machine.get("date")),
    ]
    lines = ["## Machine", ""]
    lines += table(["", ""], [[k, v if v not in (None, "") else "—"] for k, v in rows])
    topo = machine.get("gpu_topology")
    if topo:
        lines += ["GPU topology (`nvidia-smi topo -m`, first lines):", "", "```"]
        lines += [str(t) for t in topo] + ["```", ""]
    for m in extra:
        if not m:
            continue
        label = "C++ benchmark" if m.get("source") == "cpp" else "Further file"
        items = ", ".join(f"{k}: {v}" for k, v in m.items() if not isinstance(v, (dict, list)))
        lines += [f"{label}: {items}", ""]
    return lines


def train_section(records: list[Record]) -> list[str]:
    train = [
        r
        for r in records
        if "step_ms_median" in r and r.get("bench") not in (*CPP_BENCHES, *THREAD_BENCHES)
    ]
    ok = [r for r in train if not failed(r)]
    if not ok:
        return []
    # DDP reference per (bench, model, dtype, gpus).
    ddp: dict[tuple, float] = {}
    for r in ok:
        t = time_of(r)
        if is_ddp(str(r.get("mode"))) and t:
            ddp[(r.get("bench"), r.get("model"), r.get("dtype"), r.get("gpus"))] = t
    lines = [
        "## Training steps",
        "",
        (
            "Median of the timed steps (zero_grad, forward, loss, backward, optimizer step); "
            "p10–p90 spread; speedup = one-GPU time / time; vs DDP = DDP time / time "
            "(above 1: faster than DDP, below 1: slower). `single_shard`: the plain model on one "
            'GPU with batch / g (one replica\'s share of a g-GPU run); its "ideal" speedup = '
            "one-GPU time / its time, what g GPUs would reach with no communication and perfect "
            "overlap."
        ),
        "",
    ]
    rows = []
    for r in ordered(ok):
        ratio = num(r.get("ratio_to_ddp"))
        if ratio is None:
            ref = ddp.get((r.get("bench"), r.get("model"), r.get("dtype"), r.get("gpus")))
            t = time_of(r)
            ratio = ref / t if ref and t and not is_ddp(str(r.get("mode"))) else None
        ratio = "—" if ratio is None or is_ddp(str(r.get("mode"))) else f"{ratio:.2f}"
        rows.append(
            [
                r.get("model"),
                r.get("dtype"),
                r.get("mode"),
                gpus_cell(r),
                fmt_ms(r.get("step_ms_median")),
                spread(r, "step_ms"),
                speedup_cell(r),
                ratio,
                fmt_gib(r.get("peak_mem_gib")),
                grads_cell(r),
            ]
        )
    lines += table(
        [
            "model",
            "dtype",
            "mode",
            "gpus",
            "median ms",
            "p10–p90 ms",
            "speedup vs single",
            "vs DDP",
            "peak GiB per GPU",
            "grads match",
        ],
        rows,
    )
    return lines


def threads_section(records: list[Record]) -> list[str]:
    """bench_threads.py: CPU replicas with wall and CPU time per step, threads and the GIL."""
    ok = [r for r in records if r.get("bench") in THREAD_BENCHES and not failed(r)]
    if not ok:
        return []
    lines = [
        "## CPU replicas: threads and the GIL",
        "",
        (
            "Median wall and CPU ms per training step (CPU: `time.process_time`, every thread of "
            "the process); intra-op: torch's default thread count, `1` from the start, or "
            "`1-after` a first step at the default; OS threads of the process after the mode."
        ),
        "",
    ]
    rows = [
        [
            r.get("model"),
            r.get("batch"),
            r.get("intra_op"),
            r.get("mode"),
            r.get("replicas"),
            "on" if r.get("gil_enabled", True) else "off",
            fmt_ms(r.get("step_ms_median")),
            fmt_ms(r.get("cpu_ms_median")),
            speedup_cell(r),
            r.get("os_threads"),
        ]
        for r in ok
    ]
    headers = ["model", "batch", "intra-op", "mode", "replicas", "GIL", "wall ms", "CPU ms"]
    return lines + table([*headers, "speedup vs single", "OS threads"], rows)


def memory_section(records: list[Record]) -> list[str]:
    mem = [
        r
        for r in records
        if not failed(r)
        and isinstance(r.get("peak_mem_gib"), list)
        and r["peak_mem_gib"]
        and r.get("bench") not in REPLICATE_BENCHES
    ]
    if not mem:
        return []
    lines = [
        "## Peak memory",
        "",
        (
            "Peak allocated memory per GPU (GiB) during the timed steps; GPU0/GPU1 > 1 means the "
            "first GPU carries more (gathered outputs, the original module)."
        ),
        "",
    ]
    rows = []
    for r in ordered(mem):
        peaks = [num(v) for v in r["peak_mem_gib"]]
        ratio = num(r.get("mem_ratio_gpu0_gpu1"))
        if ratio is None and len(peaks) >= 2 and peaks[0] is not None and peaks[1]:
            ratio = peaks[0] / peaks[1]
        ratio = "—" if ratio is None else f"{ratio:.2f}"
        rows.append(
            [
                r.get("bench"),
                r.get("model"),
                r.get("dtype"),
                r.get("mode"),
                gpus_cell(r),
                fmt_gib(r["peak_mem_gib"]),
                ratio,
            ]
        )
    lines += table(
        ["bench", "model", "dtype", "mode", "gpus", "peak GiB per GPU", "GPU0/GPU1"], rows
    )
    return lines


def pivot(records: list[Record], bench: str) -> OrderedDict[tuple, dict[str, Record]]:
    """{(model, gpus): {mode: record}} of one bench, in order of appearance."""
    groups: OrderedDict[tuple, dict[str, Record]] = OrderedDict()
    for r in records:
        if r.get("bench") != bench:
            continue
        groups.setdefault((r.get("model"), r.get("gpus")), {})[str(r.get("mode"))] = r
    return groups


# The leading columns of both replicate tables (one torch / torchdp pair per row).
REPLICATE_COLUMNS = ["model", "gpus", "modules", "torch ms", "torchdp ms", "speedup"]


def _replicate_pair(modes: dict[str, Record]) -> tuple[Record, Record, Any]:
    """torch's and torchdp's replicate records of one configuration, and torchdp's speedup."""
    t, d = modes.get("torch_replicate", {}), modes.get("torchdp_replicate", {})
    speed = d.get("speedup_vs_torch")
    if speed is None and time_of(t) and time_of(d):
        speed = time_of(t) / time_of(d)
    return t, d, speed


def replicate_section(records: list[Record]) -> list[str]:
    lines: list[str] = []
    groups = pivot(records, "replicate")
    rows = []
    for (model, gpus), modes in groups.items():
        t, d, speed = _replicate_pair(modes)
        if time_of(t) is None and time_of(d) is None:
            continue
        floor = num(d.get("broadcast_ms_median", t.get("broadcast_ms_median")))
        bound = num(d.get("bound_vs_torch", t.get("bound_vs_torch")))
        rows.append(
            [
                model,
                gpus,
                d.get("modules", t.get("modules")),
                fmt_ms(time_of(t)),
                fmt_ms(time_of(d)),
                fmt_x(speed),
                fmt_ms(floor),
                fmt_x(bound),
            ]
        )
    if rows:
        lines += [
            "## Replicate",
            "",
            (
                "One differentiable `replicate()` onto all GPUs (median ms): "
                "`torch.nn.parallel.replicate` vs `torchdp.replicate`; speedup = torch / torchdp. "
                "Broadcast only: the parameters and buffers broadcast alone, the transfer every "
                "replicate pays; bound = torch / broadcast only, the most any replicate could "
                "gain over torch's here."
            ),
            "",
        ]
        headers = [*REPLICATE_COLUMNS, "broadcast only ms", "bound"]
        lines += table(headers, rows)

    groups = pivot(records, "replicate_curve")
    rows = []
    for (model, gpus), modes in sorted(groups.items(), key=lambda kv: _modules(kv[1])):
        t, d, speed = _replicate_pair(modes)
        if time_of(t) is None and time_of(d) is None:
            continue
        mods = _modules(modes)
        per_t = f"{1e3 * time_of(t) / mods:.1f}" if time_of(t) and mods else "—"
        per_d = f"{1e3 * time_of(d) / mods:.1f}" if time_of(d) and mods else "—"
        rows.append(
            [
                model,
                gpus,
                mods or "—",
                fmt_ms(time_of(t)),
                fmt_ms(time_of(d)),
                fmt_x(speed),
                per_t,
                per_d,
            ]
        )
    if rows:
        lines += [
            "## Replicate time vs module count",
            "",
            "`nn.Sequential` of k `Linear(16, 16)`; modules = len(list(net.modules())).",
            "",
        ]
        lines += table(
            [*REPLICATE_COLUMNS, "torch µs/module", "torchdp µs/module"],
            rows,
        )
    return lines


def _modules(modes: dict[str, Record]) -> int:
    for r in modes.values():
        m = num(r.get("modules"))
        if m:
            return int(m)
    return 0


def cpp_section(records: list[Record]) -> list[str]:
    train = [r for r in records if r.get("bench") == "cpp_train_step" and not failed(r)]
    rep = [r for r in records if r.get("bench") == "cpp_replicate" and not failed(r)]
    if not train and not rep:
        return []
    lines = ["## C++ (LibTorch)", ""]
    if train:
        lines += [
            (
                "Training steps: one device, LibTorch's `torch::nn::parallel::data_parallel`, "
                "`torchdp::DataParallel` and `torchdp::data_parallel`. First-step loss: the same "
                "value across modes means the same computation (BatchNorm models differ under "
                "data parallelism: per-replica batch statistics)."
            ),
            "",
        ]
        rows = [
            [
                r.get("model"),
                r.get("mode"),
                r.get("gpus"),
                fmt_ms(r.get("step_ms_median")),
                spread(r, "step_ms"),
                speedup_cell(r),
                fmt_x(r.get("speedup_vs_libtorch")),
                fmt_gib(r.get("peak_mem_gib")),
                f"{num(r['loss_first']):.6g}" if num(r.get("loss_first")) is not None else "—",
            ]
            for r in ordered(train)
        ]
        lines += table(
            [
                "model",
                "mode",
                "gpus",
                "median ms",
                "p10–p90 ms",
                "speedup vs single",
                "vs LibTorch",
                "peak GiB per GPU",
                "first-step loss",
            ],
            rows,
        )
    if rep:
        lines += [
            (
                "Replicate: one differentiable `replicate()` onto all devices "
                "(`torch::nn::parallel::replicate` deep-clones; `torchdp::replicate` refreshes "
                "cached replicas)."
            ),
            "",
        ]
        rows = [
            [
                r.get("model"),
                r.get("mode"),
                r.get("gpus"),
                r.get("modules", "—"),
                fmt_ms(r.get("replicate_ms_median")),
                spread(r, "replicate_ms"),
                fmt_x(r.get("speedup_vs_libtorch")),
            ]
            for r in ordered(rep)
        ]
        lines += table(
            ["model", "mode", "gpus", "modules", "median ms", "p10–p90 ms", "vs LibTorch"], rows
        )
    return lines


def problems_section(
    records: list[Record], warnings: list[str], run_failures: list[Any]
) -> list[str]:
    errors = [r for r in records if r.get("error")]
    skipped = [r for r in records if r.get("skipped") and not r.get("error")]
    lines: list[str] = []
    if errors or warnings or run_failures:
        lines += ["## Failed configurations", ""]
        lines += [f"- run: {one_line(f)}" for f in run_failures]
        lines += [f"- report: {one_line(w)}" for w in warnings]
        lines += [
            f"- {r.get('bench')} / {r.get('model')} / {r.get('dtype')} / {r.get('mode')} / "
            f"{r.get('gpus')} GPUs: {one_line(r.get('error'))}"
            for r in errors
        ]
        lines.append("")
    if skipped:
        lines += ["## Skipped configurations", ""]
        lines += [
            f"- {r.get('bench')} / {r.get('model')} / {r.get('mode')}: {one_line(r.get('skipped'))}"
            for r in skipped
        ]
        lines.append("")
    return lines


# ---- plots --------------------------------------------------------------------------------------


# The chart shows one bar per way of training: PyTorch's and LibTorch's data parallelism, torchdp,
# DDP. A model measured with the loss per replica (`*_balanced`) shows that variant.
CHART_MODES = {
    "torch_dp": "nn.DataParallel",
    "libtorch_dp": "LibTorch data_parallel",
    "torchdp": "torchdp",
    "torchdp_graphs": "torchdp, CUDA graphs",
    "ddp": "DDP (one process per GPU)",
}


def plot_speedup(records: list[Record], machine: dict[str, Any], path: str) -> str | None:
    values: dict[tuple[str, str], float] = {}
    balanced: set[str] = set()  # models measured with the loss per replica
    groups: list[str] = []
    for r in ordered(records):
        mode = str(r.get("mode"))
        base = mode.removesuffix("_balanced")
        speedup = num(r.get("speedup_vs_single"))
        if failed(r) or speedup is None or "step_ms_median" not in r or base not in CHART_MODES:
            continue
        group = f"{r.get('model')} {r.get('dtype')}"
        if group not in groups:
            groups.append(group)
        if mode != base:
            balanced.add(group)
            values[(group, base)] = float(speedup)
        elif group not in balanced or (group, base) not in values:
            values.setdefault((group, base), float(speedup))
    if not values:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = [m for m in CHART_MODES if any((g, m) in values for g in groups)]
    n_gpus = int(machine.get("gpu_count") or 0)
    row = 0.22  # inches per bar
    heights = [sum((g, m) in values for m in modes) for g in groups]
    fig, ax = plt.subplots(figsize=(8.0, 2.0 + row * (sum(heights) + len(groups))))
    palette = {"torch_dp": 7, "libtorch_dp": 5, "torchdp": 3, "torchdp_graphs": 1, "ddp": 0}
    colors = {m: plt.get_cmap("tab10")(palette[m]) for m in modes}
    y, ticks, labelled = 0.0, [], set()
    for g in groups:
        present = [m for m in modes if (g, m) in values]
        ticks.append(y + (len(present) - 1) / 2)
        for m in present:
            v = values[(g, m)]
            ax.barh(y, v, 0.85, color=colors[m], label=None if m in labelled else CHART_MODES[m])
            labelled.add(m)
            ax.annotate(f"{v:.2f}x", (v, y), xytext=(3, 0), textcoords="offset points",
                        va="center", fontsize=8)  # fmt: skip
            y += 1
        y += 1
    ax.set_yticks(ticks)
    ax.set_yticklabels([f"{g}\nloss per replica" if g in balanced else g for g in groups], fontsize=9)
    ax.invert_yaxis()
    ax.axvline(1.0, color="black", linestyle="--", linewidth=1)
    if n_gpus > 1:
        ax.axvline(float(n_gpus), color="gray", linestyle=":", linewidth=1)
    ax.set_xlim(0, max([n_gpus * 1.1, 1.3] + [v * 1.15 for v in values.values()]))
    ax.set_xlabel("speedup over one GPU (dashed: one GPU; dotted: ideal)", fontsize=9)
    ax.set_title(f"Training-step speedup{machine_name_text(machine)}", fontsize=11)
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.09), ncol=3, frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_replicate(records: list[Record], machine: dict[str, Any], path: str) -> str | None:
    curve = [
        r
        for r in records
        if r.get("bench") == "replicate_curve"
        and not failed(r)
        and time_of(r)
        and num(r.get("modules"))
    ]
    if not curve:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4.8))
    seen: list[str] = []
    modes = sorted({str(r.get("mode")) for r in curve}, key=lambda m: mode_key(m, seen))
    for m in modes:
        pts = sorted(
            (
                num(r["modules"]),
                time_of(r),
                num(r.get("replicate_ms_p10")),
                num(r.get("replicate_ms_p90")),
            )
            for r in curve
            if str(r.get("mode")) == m
        )
        xs = [p[0] for p in pts]
        ys = [p[1] for p in pts]
        ax.plot(xs, ys, marker="o", label=m)
        lo = [p[2] if p[2] is not None else p[1] for p in pts]
        hi = [p[3] if p[3] is not None else p[1] for p in pts]
        ax.fill_between(xs, lo, hi, alpha=0.2)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("modules in the network")
    ax.set_ylabel("replicate() time, ms (median, p10–p90 band)")
    ax.set_title(f"Replicate time vs module count{machine_name_text(machine)}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_scaling(records: list[Record], machine: dict[str, Any], path: str) -> str | None:
    """Speedup over one GPU against the GPU count (1, 2, 4, 8, ...), one panel per model and dtype
    of the train-step benchmark, one line per multi-GPU mode, with the ideal speedup dashed."""
    train = [
        r
        for r in records
        if r.get("bench") == "train_step"
        and not failed(r)
        and num(r.get("speedup_vs_single")) is not None
        and not r.get("smoke")
    ]
    panels: OrderedDict[tuple[str, str], dict[str, dict[int, float]]] = OrderedDict()
    shard_label = "one GPU at batch / g (no communication)"
    for r in records:  # single_shard: the bound of every mode at each GPU count
        ideal, g = num(r.get("ideal_speedup_vs_single")), num(r.get("shards"))
        if r.get("bench") != "train_step" or failed(r) or r.get("smoke") or not ideal or not g:
            continue
        key = (str(r.get("model")), str(r.get("dtype")))
        panels.setdefault(key, {}).setdefault(shard_label, {1: 1.0})[int(g)] = ideal
    for r in train:
        key = (str(r.get("model")), str(r.get("dtype")))
        mode = str(r.get("mode"))
        gpus = int(r.get("gpus") or 1)
        panels.setdefault(key, {})
        if mode == "single":
            continue
        panels[key].setdefault(mode, {1: 1.0})[gpus] = float(r["speedup_vs_single"])
    panels = OrderedDict((k, v) for k, v in panels.items() if v)
    if not panels:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cols = min(3, len(panels))
    rows = (len(panels) + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.4 * rows), squeeze=False)
    top = max(g for modes in panels.values() for line in modes.values() for g in line)
    for ax, ((model, dtype), modes) in zip(axes.flat, panels.items()):
        counts = sorted({1, *(g for line in modes.values() for g in line)})
        ax.plot(counts, counts, "k--", linewidth=0.8, label="linear")
        for mode, line in modes.items():
            xs = sorted(line)
            style = {"linestyle": ":", "color": "grey"} if mode == shard_label else {}
            ax.plot(xs, [line[x] for x in xs], marker="o", label=mode, **style)
        ax.set_title(f"{model} {dtype}")
        ax.set_xticks(counts)
        ax.set_xlim(0.8, top + 0.2)
        ax.set_ylim(0, top + 0.2)
        ax.set_xlabel("GPUs")
        ax.set_ylabel("speedup over one GPU")
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(panels) :]:
        ax.axis("off")
    axes.flat[0].legend(fontsize=8)
    fig.suptitle(f"Scaling with the GPU count{machine_name_text(machine)}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_placeholder(path: str, text: str) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 2.0))
    ax.axis("off")
    ax.text(0.5, 0.5, text, ha="center", va="center")
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def machine_name_text(machine: dict[str, Any]) -> str:
    if not machine.get("gpus") and machine.get("cuda_devices"):
        return ""  # GPUs whose names the file does not record
    try:
        name = common.machine_name(machine)
    except Exception:  # noqa: BLE001
        return ""
    return f" ({name})" if name else ""


# ---- main ---------------------------------------------------------------------------------------


def render(paths: list[str], md_path: str, plot_prefix: str | None) -> str:
    machine, extra, records, warnings = load_results(paths)
    smoke = any(r.get("smoke") for r in records) or any(m.get("smoke") for m in extra)
    plots: list[tuple[str, str]] = []
    if plot_prefix:
        Path(plot_prefix).parent.mkdir(parents=True, exist_ok=True)
        for title, fn, suffix in (
            ("Speedup over one GPU", plot_speedup, "speedup"),
            ("Replicate time vs module count", plot_replicate, "replicate"),
            ("Scaling with the GPU count", plot_scaling, "scaling"),
        ):
            path = f"{plot_prefix}-{suffix}.png"
            try:
                out = fn(records, machine, path)
                if out is None:  # keep the file set of a run complete: a placeholder
                    out = plot_placeholder(path, f"{title}: no records in this run")
                    title += " (no records in this run)"
            except Exception as e:  # noqa: BLE001 - the tables still get written
                warnings.append(f"plot {suffix} failed: {type(e).__name__}: {e}")
                out = None
            if out:
                plots.append((title, out))

    lines = [f"# torchdp benchmarks{machine_name_text(machine)}", ""]
    if smoke:
        lines += [
            (
                "**Smoke run**: tiny models on CPU device lists; the timings check that "
                "everything runs and mean nothing."
            ),
            "",
        ]
    lines += [f"Source: {', '.join(f'`{p}`' for p in paths)}; {len(records)} records.", ""]
    lines += machine_section(machine, extra)
    lines += targets.section(records)
    sections = (train_section, threads_section, memory_section, replicate_section, cpp_section)
    for section in sections:
        lines += section(records)
    if plots:
        md_dir = Path(md_path).resolve().parent
        lines += ["## Plots", ""]
        for title, p in plots:
            rel = os.path.relpath(Path(p).resolve(), md_dir)
            lines += [f"![{title}]({rel})", ""]
    run_failures = machine.get("failures")
    lines += problems_section(
        records, warnings, run_failures if isinstance(run_failures, list) else []
    )
    text = "\n".join(lines).rstrip() + "\n"
    Path(md_path).parent.mkdir(parents=True, exist_ok=True)
    Path(md_path).write_text(text)
    return text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__.split("\n\n", 1)[1],
    )
    parser.add_argument(
        "results", nargs="+", help="results JSON file(s); the first is the main one"
    )
    parser.add_argument("--md", default=None, help="Markdown file to write (default: RESULTS.md)")
    parser.add_argument(
        "--plots", default=None, help="prefix of the PNG plots (default: RESULTS without suffix)"
    )
    parser.add_argument("--no-plots", action="store_true", help="write no plots")
    args = parser.parse_args(argv)
    first = Path(args.results[0])
    md = args.md or str(first.with_suffix(".md"))
    prefix = None if args.no_plots else (args.plots or str(first.with_suffix("")))
    render(args.results, md, prefix)
    common.progress(f"wrote {md}" + (f" and plots {prefix}-*.png" if prefix else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
