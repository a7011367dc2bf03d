"""Markdown report and plots of torchdp benchmark results files.

    python benchmarks/report.py RESULTS.json [MORE.json ...] [--md OUT.md] [--plots PREFIX]

Further files add their records (and machine blocks). Writes OUT.md (default RESULTS.md): the
machine, the targets judged on the two-GPU records (targets.py), a table per benchmark with records
and the configurations that failed or were skipped; and PREFIX-speedup.png (speedup over one GPU),
PREFIX-replicate.png (replicate time against the module count) and PREFIX-scaling.png (speedup
against the GPU count, over every file given); PREFIX defaults to RESULTS without its suffix.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections import OrderedDict
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common
import targets
from common import failed, fmt_x, num

Record = dict[str, Any]

# Display order of modes; unknown modes come after, in order of appearance.
MODE_ORDER = [
    "single", "single_graphs", "single_shard", "torch_dp", "torch_dp_balanced", "libtorch_dp",
    "torchdp", "torchdp_serial", "torchdp_new_replicas", "torchdp_graphs", "torchdp_balanced",
    "torchdp_functional", "ddp", "torchdp_process_group", "ddp_over_torchdp", "torch_replicate",
    "libtorch_replicate", "torchdp_replicate",
]  # fmt: skip
DTYPE_ORDER = ["fp32", "tf32", "bf16", "fp16"]
CPP_BENCHES = ("cpp_train_step", "cpp_replicate")
# bench_threads.py: CPU replicas, shown with their CPU time and threads, not as training steps.
THREAD_BENCHES = ("threads",)
REPLICATE_BENCHES = ("replicate", "replicate_curve", "cpp_replicate")


def fmt_ms(v: Any) -> str:
    f = num(v)
    if f is None:
        return "—"
    return f"{f:.0f}" if f >= 100 else f"{f:.1f}" if f >= 10 else f"{f:.2f}"


def fmt_gib(values: Any) -> str:
    if not isinstance(values, (list, tuple)) or not values:
        return "—"
    return "[" + ", ".join(f"{float(v):.2f}" for v in values if num(v) is not None) + "]"


def cell(text: Any) -> str:
    return ("—" if text is None else str(text)).replace("|", "\\|").replace("\n", " ")


def one_line(text: Any) -> str:
    return " ".join(str(text).split())


def table(headers: list[str], rows: list[list[Any]]) -> list[str]:
    out = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    return out + ["| " + " | ".join(cell(c) for c in row) + " |" for row in rows] + [""]


def columns(records: Iterable[Record], headers: str, **cells: Callable[[Record], Any]) -> list:
    """A table of `records`, one row each; `headers` names the columns (";"-separated), their
    values come from CELLS or, under the header's name in snake case, from `cells`."""
    names = [h.strip() for h in headers.split(";")]
    get = [
        cells.get(h.replace(" ", "_")) or CELLS.get(h) or (lambda r, h=h: r.get(h)) for h in names
    ]
    return table(names, [[value(r) for value in get] for r in records])


def mode_key(mode: str, seen: list[str]) -> tuple[int, int]:
    if mode in MODE_ORDER:
        return (0, MODE_ORDER.index(mode))
    if mode not in seen:
        seen.append(mode)
    return (1, seen.index(mode))


def ordered(records: Iterable[Record]) -> list[Record]:
    """Records sorted by model (first appearance), dtype, gpus and mode."""
    records = list(records)
    models = list(dict.fromkeys(r.get("model") for r in records))
    seen: list[str] = []

    def dtype_key(d: Any) -> tuple[int, str]:
        d = str(d)
        return (DTYPE_ORDER.index(d), "") if d in DTYPE_ORDER else (len(DTYPE_ORDER), d)

    def key(r: Record) -> tuple:
        mode = mode_key(str(r.get("mode")), seen)
        return (
            models.index(r.get("model")),
            dtype_key(r.get("dtype")),
            num(r.get("gpus")) or 0,
            mode,
        )

    return sorted(records, key=key)


def time_of(r: Record) -> float | None:
    return num(r.get("step_ms_median", r.get("replicate_ms_median")))


def spread(r: Record) -> str:
    prefix = "step_ms" if "step_ms_median" in r else "replicate_ms"
    lo, hi = num(r.get(f"{prefix}_p10")), num(r.get(f"{prefix}_p90"))
    return "—" if lo is None or hi is None else f"{fmt_ms(lo)}–{fmt_ms(hi)}"


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
        if isinstance(r.get(key), bool):
            return ("yes" if r[key] else "**no**") + detail
    return "check failed" if r.get("grads_check_error") else "—"


CELLS: dict[str, Callable[[Record], Any]] = {
    "gpus": gpus_cell,
    "median ms": lambda r: fmt_ms(time_of(r)),
    "p10–p90 ms": spread,
    "speedup vs single": speedup_cell,
    "vs LibTorch": lambda r: fmt_x(r.get("speedup_vs_libtorch")),
    "peak GiB per GPU": lambda r: fmt_gib(r.get("peak_mem_gib")),
    "grads match": grads_cell,
    "first-step loss": lambda r: (
        "—" if num(r.get("loss_first")) is None else f"{num(r['loss_first']):.6g}"
    ),
}


def machine_name_text(machine: dict[str, Any]) -> str:
    if not machine.get("gpus") and machine.get("cuda_devices"):
        return ""  # GPUs whose names the file does not record
    return f" ({common.machine_name(machine)})"


def machine_section(machine: dict[str, Any], extra: list[dict[str, Any]]) -> list[str]:
    gpus = machine.get("gpus") or []
    if gpus:
        gpu_text = f"{len(gpus)}x {gpus[0]}" if len(set(gpus)) == 1 else ", ".join(gpus)
    elif machine.get("cuda_devices"):
        gpu_text = f"{machine['cuda_devices']} CUDA device(s), names not recorded"
    else:
        gpu_text = "none (CPU)"
    rev = str(machine.get("torchdp_git_revision") or "—")
    torchdp = f"{machine.get('torchdp') or '—'} (CUDA {machine.get('torchdp_has_cuda')}, NCCL "
    rows = [("GPUs", gpu_text)]
    rows += [(k, machine.get(k.lower())) for k in ("Driver", "torch", "CUDA", "cuDNN", "NCCL")]
    rows += [
        ("torchvision", machine.get("torchvision")),
        ("torchdp", torchdp + f"{machine.get('torchdp_has_nccl')})" if machine else None),
        ("torchdp revision", rev[:12] if len(rev) == 40 else rev),
        ("Python", machine.get("python")),
        ("Platform", machine.get("platform")),
        ("CPU cores", machine.get("cpu_count")),
        ("Date", machine.get("date")),
    ]
    lines = ["## Machine", ""]
    lines += table(["", ""], [[k, v if v not in (None, "") else "—"] for k, v in rows])
    if machine.get("gpu_topology"):
        lines += ["GPU topology (`nvidia-smi topo -m`, first lines):", "", "```"]
        lines += [str(t) for t in machine["gpu_topology"]] + ["```", ""]
    for m in filter(None, extra):
        label = "C++ benchmark" if m.get("source") == "cpp" else "Further file"
        items = ", ".join(f"{k}: {v}" for k, v in m.items() if not isinstance(v, (dict, list)))
        lines += [f"{label}: {items}", ""]
    return lines


TRAIN_TEXT = (
    "Median of the timed steps (zero_grad, forward, loss, backward, optimizer step); p10–p90 "
    "spread; speedup = one-GPU time / time; vs DDP = DDP time / time (above 1: faster than DDP, "
    "below 1: slower). `single_shard`: the plain model on one GPU with batch / g (one replica's "
    'share of a g-GPU run); its "ideal" speedup = one-GPU time / its time, what g GPUs would '
    "reach with no communication and perfect overlap."
)


def train_section(records: list[Record]) -> list[str]:
    train = [
        r
        for r in records
        if "step_ms_median" in r and r.get("bench") not in (*CPP_BENCHES, *THREAD_BENCHES)
    ]
    ok = [r for r in train if not failed(r)]
    if not ok:
        return []
    ddp = {  # the DDP reference per (bench, model, dtype, gpus)
        (r.get("bench"), r.get("model"), r.get("dtype"), r.get("gpus")): time_of(r)
        for r in ok
        if is_ddp(str(r.get("mode"))) and time_of(r)
    }

    def vs_ddp(r: Record) -> str:
        if is_ddp(str(r.get("mode"))):
            return "—"
        ratio = num(r.get("ratio_to_ddp"))
        ref = ddp.get((r.get("bench"), r.get("model"), r.get("dtype"), r.get("gpus")))
        if ratio is None and ref and time_of(r):
            ratio = ref / time_of(r)
        return "—" if ratio is None else f"{ratio:.2f}"

    headers = "model; dtype; mode; gpus; median ms; p10–p90 ms; speedup vs single; vs DDP; "
    headers += "peak GiB per GPU; grads match"
    return ["## Training steps", "", TRAIN_TEXT, "", *columns(ordered(ok), headers, vs_DDP=vs_ddp)]


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

    def ratio(r: Record) -> str:
        value, peaks = num(r.get("mem_ratio_gpu0_gpu1")), [num(v) for v in r["peak_mem_gib"]]
        if value is None and len(peaks) >= 2 and peaks[0] is not None and peaks[1]:
            value = peaks[0] / peaks[1]
        return "—" if value is None else f"{value:.2f}"

    text = (
        "Peak allocated memory per GPU (GiB) during the timed steps; GPU0/GPU1 > 1 means the "
        "first GPU carries more (gathered outputs, the original module)."
    )
    if not mem:
        return []
    headers = "bench; model; dtype; mode; gpus; peak GiB per GPU; GPU0/GPU1"
    return ["## Peak memory", "", text, "", *columns(ordered(mem), headers, **{"GPU0/GPU1": ratio})]


def pairs(records: list[Record], bench: str) -> list[tuple[Any, Any, Record, Record, Any]]:
    """(model, gpus, torch's record, torchdp's record, speedup) of the replicate records of
    `bench`, in order of appearance; configurations without either time are left out."""
    groups: OrderedDict[tuple, dict[str, Record]] = OrderedDict()
    for r in records:
        if r.get("bench") == bench:
            groups.setdefault((r.get("model"), r.get("gpus")), {})[str(r.get("mode"))] = r
    out = []
    for (model, gpus), modes in groups.items():
        t, d = modes.get("torch_replicate", {}), modes.get("torchdp_replicate", {})
        speed = d.get("speedup_vs_torch")
        if speed is None and time_of(t) and time_of(d):
            speed = time_of(t) / time_of(d)
        modules = next((int(num(r["modules"])) for r in modes.values() if num(r.get("modules"))), 0)
        if time_of(t) is not None or time_of(d) is not None:
            out.append((model, gpus, modules, t, d, speed))
    return out


# The leading columns of both replicate tables (one torch / torchdp pair per row).
REPLICATE_COLUMNS = ["model", "gpus", "modules", "torch ms", "torchdp ms", "speedup"]
REPLICATE_TEXT = (
    "One differentiable `replicate()` onto all GPUs (median ms): `torch.nn.parallel.replicate` vs "
    "`torchdp.replicate`; speedup = torch / torchdp. Broadcast only: the parameters and buffers "
    "broadcast alone, the transfer every replicate pays; bound = torch / broadcast only, the most "
    "any replicate could gain over torch's here."
)


def replicate_section(records: list[Record]) -> list[str]:
    lines: list[str] = []
    rows = []
    for model, gpus, _, t, d, speed in pairs(records, "replicate"):
        floor = num(d.get("broadcast_ms_median", t.get("broadcast_ms_median")))
        bound = num(d.get("bound_vs_torch", t.get("bound_vs_torch")))
        modules = d.get("modules", t.get("modules"))
        times = [fmt_ms(time_of(t)), fmt_ms(time_of(d)), fmt_x(speed)]
        rows.append([model, gpus, modules, *times, fmt_ms(floor), fmt_x(bound)])
    if rows:
        lines += ["## Replicate", "", REPLICATE_TEXT, ""]
        lines += table([*REPLICATE_COLUMNS, "broadcast only ms", "bound"], rows)
    rows = []
    for model, gpus, mods, t, d, speed in sorted(
        pairs(records, "replicate_curve"), key=lambda p: p[2]
    ):
        per = [f"{1e3 * time_of(r) / mods:.1f}" if time_of(r) and mods else "—" for r in (t, d)]
        rows.append(
            [model, gpus, mods or "—", fmt_ms(time_of(t)), fmt_ms(time_of(d)), fmt_x(speed), *per]
        )
    if rows:
        lines += ["## Replicate time vs module count", ""]
        lines += ["`nn.Sequential` of k `Linear(16, 16)`; modules = len(list(net.modules())).", ""]
        lines += table([*REPLICATE_COLUMNS, "torch µs/module", "torchdp µs/module"], rows)
    return lines


CPP_TRAIN_TEXT = (
    "Training steps: one device, LibTorch's `torch::nn::parallel::data_parallel`, "
    "`torchdp::DataParallel` and `torchdp::data_parallel`. First-step loss: the same value across "
    "modes means the same computation (BatchNorm models differ under data parallelism: "
    "per-replica batch statistics)."
)
CPP_REPLICATE_TEXT = (
    "Replicate: one differentiable `replicate()` onto all devices "
    "(`torch::nn::parallel::replicate` deep-clones; `torchdp::replicate` refreshes cached "
    "replicas)."
)


def cpp_section(records: list[Record]) -> list[str]:
    train = [r for r in records if r.get("bench") == "cpp_train_step" and not failed(r)]
    rep = [r for r in records if r.get("bench") == "cpp_replicate" and not failed(r)]
    lines = ["## C++ (LibTorch)", ""] if train or rep else []
    if train:
        headers = "model; mode; gpus; median ms; p10–p90 ms; speedup vs single; vs LibTorch; "
        headers += "peak GiB per GPU; first-step loss"
        lines += [CPP_TRAIN_TEXT, "", *columns(ordered(train), headers)]
    if rep:
        headers = "model; mode; gpus; modules; median ms; p10–p90 ms; vs LibTorch"
        lines += [CPP_REPLICATE_TEXT, "", *columns(ordered(rep), headers)]
    return lines


def problems_section(records: list[Record], warnings: list[str], run_failures: list) -> list[str]:
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


def pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


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
    ax.set_yticklabels(
        [f"{g}\nloss per replica" if g in balanced else g for g in groups], fontsize=9
    )
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
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.5, 4.8))
    seen: list[str] = []
    for m in sorted({str(r.get("mode")) for r in curve}, key=lambda m: mode_key(m, seen)):
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
        xs, ys = [p[0] for p in pts], [p[1] for p in pts]
        ax.plot(xs, ys, marker="o", label=m)
        lo = [p[1] if p[2] is None else p[2] for p in pts]
        ax.fill_between(xs, lo, [p[1] if p[3] is None else p[3] for p in pts], alpha=0.2)
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
    panels: OrderedDict[tuple[str, str], dict[str, dict[int, float]]] = OrderedDict()
    shard_label = "one GPU at batch / g (no communication)"
    train = [
        r
        for r in records
        if r.get("bench") == "train_step" and not failed(r) and not r.get("smoke")
    ]
    for r in train:  # single_shard: the bound of every mode at each GPU count
        ideal, g = num(r.get("ideal_speedup_vs_single")), num(r.get("shards"))
        if ideal and g:
            key = (str(r.get("model")), str(r.get("dtype")))
            panels.setdefault(key, {}).setdefault(shard_label, {1: 1.0})[int(g)] = ideal
    for r in train:
        if num(r.get("speedup_vs_single")) is None:
            continue
        modes = panels.setdefault((str(r.get("model")), str(r.get("dtype"))), {})
        if str(r.get("mode")) != "single":
            line = modes.setdefault(str(r.get("mode")), {1: 1.0})
            line[int(r.get("gpus") or 1)] = float(r["speedup_vs_single"])
    panels = OrderedDict((k, v) for k, v in panels.items() if v)
    if not panels:
        return None
    plt = pyplot()
    cols = min(3, len(panels))
    rows = (len(panels) + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.4 * rows), squeeze=False)
    top = max(g for modes in panels.values() for line in modes.values() for g in line)
    for ax, ((model, dtype), modes) in zip(axes.flat, panels.items(), strict=False):
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
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.5, 2.0))
    ax.axis("off")
    ax.text(0.5, 0.5, text, ha="center", va="center")
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


SMOKE_TEXT = (
    "**Smoke run**: tiny models on CPU device lists; the timings check that everything runs and "
    "mean nothing."
)
PLOTS = (
    ("Speedup over one GPU", plot_speedup, "speedup"),
    ("Replicate time vs module count", plot_replicate, "replicate"),
    ("Scaling with the GPU count", plot_scaling, "scaling"),
)


def render(paths: list[str], md_path: str, plot_prefix: str | None) -> str:
    machine, extra, records, warnings = common.load_results(paths)
    plots: list[tuple[str, str]] = []
    for title, plot, suffix in PLOTS if plot_prefix else ():
        path = f"{plot_prefix}-{suffix}.png"
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        try:
            out = plot(records, machine, path)
            if out is None:  # keep the file set of a run complete: a placeholder
                out = plot_placeholder(path, f"{title}: no records in this run")
                title += " (no records in this run)"
            plots.append((title, out))
        except Exception as e:  # noqa: BLE001 - the tables still get written
            warnings.append(f"plot {suffix} failed: {type(e).__name__}: {e}")
    lines = [f"# torchdp benchmarks{machine_name_text(machine)}", ""]
    if any(r.get("smoke") for r in records) or any(m.get("smoke") for m in extra):
        lines += [SMOKE_TEXT, ""]
    lines += [f"Source: {', '.join(f'`{p}`' for p in paths)}; {len(records)} records.", ""]
    lines += machine_section(machine, extra) + targets.section(records)
    sections = (train_section, threads_section, memory_section, replicate_section, cpp_section)
    for section in sections:
        lines += section(records)
    if plots:
        md_dir = Path(md_path).resolve().parent
        lines += ["## Plots", ""]
        for title, p in plots:
            lines += [f"![{title}]({os.path.relpath(Path(p).resolve(), md_dir)})", ""]
    run_failures = machine.get("failures")
    run_failures = run_failures if isinstance(run_failures, list) else []
    lines += problems_section(records, warnings, run_failures)
    text = "\n".join(lines).rstrip() + "\n"
    Path(md_path).parent.mkdir(parents=True, exist_ok=True)
    Path(md_path).write_text(text)
    return text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("results", nargs="+", help="results JSON files; the first is the main one")
    parser.add_argument("--md", default=None, help="Markdown file (default: RESULTS.md)")
    parser.add_argument("--plots", default=None, help="prefix of the PNG plots")
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
