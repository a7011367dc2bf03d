"""Peak memory per GPU for a language model with a large output (50k-token vocabulary).

Model ``lm50k``: ``nn.Embedding(50000, 1024)``, a 4-layer ``nn.TransformerEncoder`` (d=1024,
nhead=16, dim_feedforward=4096, batch_first=True) and a ``nn.Linear(1024, 50000)`` head; batch
32 x 512 tokens, cross-entropy over the vocabulary; a training step with SGD. Modes:

* ``single``: one GPU;
* ``torch_dp`` / ``torchdp``: ``torch.nn.DataParallel`` / ``torchdp.DataParallel`` used as usual:
  the logits are gathered on GPU 0 and the loss is computed there;
* ``torchdp_balanced``: torchdp's balanced option: ``torchdp.DataParallel(model,
  gather_output=False)`` returns each replica's logits on its own GPU and
  ``torchdp.DataParallelCriterion(lm_loss)`` computes the loss there; only the per-replica scalars
  travel, so GPU 0 never holds the full logits;
* ``torch_dp_balanced``: the closest ``torch.nn.DataParallel`` pattern (it has no such option): the
  loss is computed inside each replica (model + criterion in one module whose forward(tokens,
  targets) returns the replica's mean loss), the scalars are gathered, then ``.mean()``;
* ``ddp``: DistributedDataParallel, one process per GPU (NCCL), ``batch / gpus`` samples each.

Every mode starts from the same weights and inputs. Per mode: ``step_ms_median`` (warm-up 2,
5 steps), ``peak_mem_gib`` per GPU and ``mem_ratio_gpu0_gpu1`` for multi-GPU modes.

    python benchmarks/bench_memory.py --out results/memory.json          # 2 H200: ~1 min
    python benchmarks/bench_memory.py --out /tmp/mem.json --smoke        # CPU, seconds
"""

from __future__ import annotations

import argparse
import copy
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

_HERE = Path(__file__).resolve().parent
if str(_HERE) not in sys.path:
    sys.path.insert(0, str(_HERE))

import common
import torch
import torch.nn.functional as F
from bench_train_step import (
    autocast_context,
    ddp_time_steps,
    error_text,
    free_memory,
    mode_devices,
    parse_list,
    record_ddp_jobs,
    time_left,
    wrap_data_parallel,
)
from torch import nn

import torchdp

SEED = 1234
INPUT_SEED = 4321
LR = 1e-3
MODEL = "lm50k"
DTYPES = ("fp32", "bf16")
MODES = ("single", "torch_dp", "torchdp", "torchdp_balanced", "torch_dp_balanced", "ddp")
DEFAULT_MODES = MODES

# vocab, d_model, layers, nhead, dim_feedforward, batch, tokens
FULL = {"vocab": 50000, "d": 1024, "layers": 4, "nhead": 16, "ff": 4096, "batch": 32, "seq": 512}
SMOKE = {"vocab": 1000, "d": 32, "layers": 1, "nhead": 4, "ff": 64, "batch": 4, "seq": 16}

BALANCED_NOTE = "loss computed inside each replica"
TORCHDP_BALANCED_NOTE = "gather_output=False + DataParallelCriterion: loss on each replica's GPU"
_GATHER_SCALARS = ".*Was asked to gather along dimension 0, but all input tensors were scalars.*"


class LanguageModel(nn.Module):
    def __init__(self, vocab: int, d: int, layers: int, nhead: int, ff: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        layer = nn.TransformerEncoderLayer(
            d_model=d, nhead=nhead, dim_feedforward=ff, batch_first=True
        )
        self.encoder = nn.TransformerEncoder(layer, num_layers=layers, enable_nested_tensor=False)
        self.head = nn.Linear(d, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(self.embed(tokens)))


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


class LossInReplica(nn.Module):
    """Model + criterion: forward(tokens, targets) returns this replica's mean loss (0-dim)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return lm_loss(self.model(tokens), targets)


def config(smoke: bool) -> dict[str, int]:
    return SMOKE if smoke else FULL


def model_desc(smoke: bool) -> str:
    c = config(smoke)
    return (
        f"Embedding({c['vocab']},{c['d']}) + TransformerEncoder {c['layers']}L d{c['d']} "
        f"h{c['nhead']} ff{c['ff']} + Linear({c['d']},{c['vocab']}), cross-entropy"
    )


def build_model(smoke: bool) -> nn.Module:
    c = config(smoke)
    torch.manual_seed(SEED)
    return LanguageModel(c["vocab"], c["d"], c["layers"], c["nhead"], c["ff"])


def make_inputs(smoke: bool) -> tuple[torch.Tensor, torch.Tensor]:
    c = config(smoke)
    g = torch.Generator().manual_seed(INPUT_SEED)
    tokens = torch.randint(0, c["vocab"], (c["batch"], c["seq"]), generator=g)
    targets = torch.randint(0, c["vocab"], (c["batch"], c["seq"]), generator=g)
    return tokens, targets


def make_step(
    forward_loss: Callable[[], torch.Tensor],
    opt: torch.optim.Optimizer,
    dtype: str,
    device_type: str,
) -> Callable[[], None]:
    def step() -> None:
        opt.zero_grad(set_to_none=True)
        with autocast_context(dtype, device_type):
            loss = forward_loss()
        loss.backward()
        opt.step()

    return step


def lm_ddp_job(job: dict[str, Any], rank: int, world: int, device: torch.device) -> dict:
    """One DDP configuration, run in each worker process."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    smoke, dtype = job["smoke"], job["dtype"]
    model = build_model(smoke).to(device)
    ddp = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    tokens, targets = make_inputs(smoke)
    per_rank = tokens.shape[0] // world
    sl = slice(rank * per_rank, (rank + 1) * per_rank)
    tokens, targets = tokens[sl].to(device), targets[sl].to(device)
    step = make_step(lambda: lm_loss(ddp(tokens), targets), opt, dtype, device.type)
    common.reset_peak_memory([device])
    times = ddp_time_steps(step, device, job["warmup"], job["steps"])
    peak = common.peak_memory_gib([device])
    return {"times": times, "peak_gib": peak[0] if peak else None, "batch_per_rank": per_rank}


def run_local_mode(
    mode: str,
    dtype: str,
    master: nn.Module,
    tokens: torch.Tensor,
    targets: torch.Tensor,
    smoke: bool,
    gpus: int,
    warmup: int,
    steps: int,
) -> dict[str, Any]:
    dev0 = tokens.device
    model = copy.deepcopy(master).to(dev0)
    notes = []
    balanced = mode.endswith("_balanced")
    if mode == "single":
        wrapped: nn.Module = model
        devices = [dev0]
    elif mode == "torchdp_balanced":
        wrapped = (
            torchdp.DataParallel(model, devices=mode_devices(True, gpus), gather_output=False)
            if smoke
            else torchdp.DataParallel(model, device_ids=list(range(gpus)), gather_output=False)
        )
        devices = mode_devices(smoke, gpus)
    else:
        impl = mode.removesuffix("_balanced")
        inner = LossInReplica(model) if balanced else model
        wrapped, note = wrap_data_parallel(impl, inner, smoke, gpus)
        if note:
            notes.append(note)
        devices = mode_devices(smoke, gpus) if wrapped.device_ids else [dev0]
    if mode == "torchdp_balanced":
        notes.insert(0, TORCHDP_BALANCED_NOTE)
        criterion = torchdp.DataParallelCriterion(lm_loss)

        def forward_loss() -> torch.Tensor:
            return criterion(wrapped(tokens), targets)  # logits stay on their GPUs
    elif balanced:
        notes.insert(0, BALANCED_NOTE)

        def forward_loss() -> torch.Tensor:
            per_replica = wrapped(tokens, targets)  # one scalar per replica
            return per_replica.mean()
    else:

        def forward_loss() -> torch.Tensor:
            return lm_loss(wrapped(tokens), targets)  # logits gathered on GPU 0

    opt = torch.optim.SGD(model.parameters(), lr=LR)
    step = make_step(forward_loss, opt, dtype, dev0.type)
    free_memory()
    common.reset_peak_memory(devices)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_GATHER_SCALARS)
        times = common.time_steps(step, devices, warmup, steps)
    used = sorted(set(devices), key=lambda d: (d.type, d.index or 0))
    fields: dict[str, Any] = {
        **common.summarize(times),
        "replicas": len(devices),
        "peak_mem_gib": common.peak_memory_gib(used),
    }
    if notes:
        fields["note"] = "; ".join(notes)
    return fields


def mem_ratio(peaks: Sequence[float]) -> float | None:
    if len(peaks) >= 2 and peaks[1]:
        return round(peaks[0] / peaks[1], 3)
    return None


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    common.add_common_args(parser)
    parser.add_argument("--dtypes", default="fp32", help="comma list of fp32,bf16 (default fp32)")
    parser.add_argument("--modes", default=None, help=f"comma list of {','.join(MODES)}")
    common.add_timing_args(parser, warmup=(2, 1), steps=(5, 1), budget=(120.0, 55.0))
    args = parser.parse_args(argv)

    dtypes = parse_list(args.dtypes, DTYPES, "dtypes")
    modes = parse_list(args.modes, MODES, "modes") if args.modes else list(DEFAULT_MODES)
    run = common.start_run(args, warmup=(2, 1), steps=(5, 1), budget=(120.0, 55.0))
    smoke, warmup, steps, budget = run.smoke, run.warmup, run.steps, run.budget
    deadline, multi, dev0 = run.deadline, run.multi, run.dev0
    c = config(smoke)
    desc = model_desc(smoke)

    results = common.Results(bench="memory")
    common.progress(
        f"memory: modes={modes} dtypes={dtypes} gpus={multi or [1]} warmup={warmup} "
        f"steps={steps} smoke={smoke} budget={budget:.0f}s"
    )
    singles: dict[str, float] = {}

    def base(dtype: str, mode: str, g: int) -> dict[str, Any]:
        return {
            "model": MODEL,
            "mode": mode,
            "gpus": 0 if smoke else g,
            "dtype": dtype,
            "batch": c["batch"],
            "seq_len": c["seq"],
            "vocab": c["vocab"],
            "input_shape": [c["batch"], c["seq"]],
            "model_desc": desc,
            "device_type": dev0.type,
            "replicas": g,
            "warmup": warmup,
            "steps": steps,
            "speedup_vs_single": None,
            "mem_ratio_gpu0_gpu1": None,
        }

    def add(rec: dict[str, Any]) -> None:
        med = rec.get("step_ms_median")
        single = singles.get(rec["dtype"])
        if med and single:
            rec["speedup_vs_single"] = single / med
        rec.setdefault("peak_mem_gib", [])
        if rec["mode"] != "single":
            rec["mem_ratio_gpu0_gpu1"] = mem_ratio(rec["peak_mem_gib"])
        results.add(**rec)
        label = f"{MODEL} {rec['dtype']} {rec['mode']} x{rec['replicas']}"
        if rec.get("error"):
            common.progress(f"{label}: ERROR {rec['error'][:300]}")
        else:
            sp = rec["speedup_vs_single"]
            common.progress(
                f"{label}: median {med:.1f} ms, speedup "
                f"{'-' if sp is None else f'{sp:.2f}x'}, peak GiB "
                f"{rec['peak_mem_gib']}, gpu0/gpu1 {rec['mem_ratio_gpu0_gpu1']}"
            )

    def failed(rec: dict[str, Any], message: str) -> None:
        rec.update(step_ms_median=None, peak_mem_gib=[], error=message)
        add(rec)

    local_modes = [m for m in modes if m != "ddp"]
    if local_modes:
        master = tokens = targets = None
        try:
            master = build_model(smoke)
            tc, gc_ = make_inputs(smoke)
            tokens, targets = tc.to(dev0), gc_.to(dev0)
            setup_error = None
        except Exception as exc:  # noqa: BLE001
            setup_error = f"setup: {error_text(exc)}"
        for dtype in dtypes:
            for mode in local_modes:
                for g in [1] if mode == "single" else multi:
                    rec = base(dtype, mode, g)
                    if mode == "torchdp_balanced":
                        rec["note"] = TORCHDP_BALANCED_NOTE
                    elif mode.endswith("_balanced"):
                        rec["note"] = BALANCED_NOTE
                    if setup_error:
                        failed(rec, setup_error)
                        continue
                    if time_left(deadline) <= 0:
                        failed(rec, "skipped: time budget exhausted")
                        continue
                    try:
                        rec.update(
                            run_local_mode(
                                mode, dtype, master, tokens, targets, smoke, g, warmup, steps
                            )
                        )
                        if mode == "single":
                            singles[dtype] = rec["step_ms_median"]
                        add(rec)
                    except Exception as exc:  # noqa: BLE001 - recorded, the run goes on
                        failed(rec, error_text(exc))
                    free_memory()
        del master, tokens, targets
        free_memory()

    if "ddp" in modes:
        backend = "gloo" if smoke else "nccl"
        for g in multi:
            jobs = [
                {
                    "dtype": d,
                    "smoke": smoke,
                    "warmup": warmup,
                    "steps": steps,
                    "label": f"{MODEL} {d}",
                }
                for d in dtypes
            ]
            record_ddp_jobs(
                lm_ddp_job,
                jobs,
                g,
                backend,
                deadline,
                smoke,
                lambda job: base(job["dtype"], "ddp", g),
                failed,
                add,
            )

    results.write(args.out)
    common.progress(f"memory finished in {time.monotonic() - run.started:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
