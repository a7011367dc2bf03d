"""benchmarks/targets.py: the two-GPU targets judged from a results file (synthetic runs and
records for each verdict)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))

import common
import report
import targets


def verdict_of(verdicts, needle):
    hits = [v for v in verdicts if needle in v.figure]
    assert len(hits) == 1, (needle, [v.figure for v in verdicts])
    return hits[0]


def train(model, mode, gpus, ms, dtype="fp32", **extra):
    return {
        "bench": "train_step",
        "model": model,
        "mode": mode,
        "gpus": gpus,
        "dtype": dtype,
        "step_ms_median": ms,
        **extra,
    }


def replicate(model, mode, ms, bench="replicate", modules=None, **extra):
    r = {"bench": bench, "model": model, "mode": mode, "gpus": 2, "dtype": "fp32"}
    r["replicate_ms_median"] = ms
    if modules is not None:
        r["modules"] = modules
    return {**r, **extra}


def full_record(record: dict) -> dict:
    """`record` with the fields every results file's record carries (common.validate_record)."""
    return {"speedup_vs_single": None, "peak_mem_gib": [], **record}


def two_gpu_run() -> list[dict]:
    """The records of a synthetic two-GPU run with a record for every target: three met (module
    count, peak memory, gradients), the others not."""
    records = []
    for model, one, ours, ddp in (
        ("resnet50", 100.0, 57.0, 55.0),  # 1.75x, DDP 1.82x
        ("transformer", 100.0, 60.0, 56.0),
        ("mlp200", 30.0, 43.5, None),  # 0.69x
    ):
        records.append(train(model, "single", 1, one))
        records.append(
            train(model, "torchdp", 2, ours, grads_match_torch_dp=True, grads_max_abs_diff=0.0)
        )
        if ddp is not None:
            records.append(train(model, "ddp", 2, ddp))
    records += [
        replicate("transformer", "torch_replicate", 8.74),
        replicate("transformer", "torchdp_replicate", 2.0, bound_vs_torch=4.83),  # 4.37x
        replicate("resnet50", "torch_replicate", 12.0),
        replicate("resnet50", "torchdp_replicate", 1.0),
    ]
    for m in (11, 101, 1001):
        records.append(replicate(f"seq{m}", "torch_replicate", 0.05 * m, "replicate_curve", m))
        records.append(
            replicate(f"seq{m}", "torchdp_replicate", 0.1 + 0.01 * m, "replicate_curve", m)
        )
    records += [
        cpp("cpp_mlp200", "single", 1, 30.0),
        cpp("cpp_mlp200", "libtorch_dp", 2, 328.0),
        cpp("cpp_mlp200", "torchdp", 2, 50.0),  # 6.56x
        # The flat net of older runs (no description): not the reference's conv net.
        cpp("cpp_convnet", "single", 1, 40.0, model_desc=""),
        cpp("cpp_convnet", "libtorch_dp", 2, 30.0, model_desc=""),
        cpp("cpp_convnet", "torchdp", 2, 22.0, model_desc=""),
    ]
    for mode, peaks in (("torchdp_balanced", [10.3, 10.0]), ("torch_dp", [25.7, 10.0])):
        records.append(
            {
                "bench": "memory",
                "model": "lm50k",
                "mode": mode,
                "gpus": 2,
                "dtype": "fp32",
                "step_ms_median": 10.0,
                "peak_mem_gib": peaks,
            }
        )
    return [full_record(r) for r in records]


def write_run(path: Path, records: list[dict], **machine) -> Path:
    machine = {"gpus": ["H200", "H200"], **machine}
    path.write_text(json.dumps({"machine": machine, "records": records}))
    return path


def test_a_two_gpu_results_file_is_judged(tmp_path):
    run = write_run(tmp_path / "r.json", two_gpu_run())
    _, _, records, warnings = common.load_results([str(run)])
    assert not warnings
    vs = targets.judge(records)
    assert len(vs) == len(targets.TARGETS)
    resnet = verdict_of(vs, "ResNet-50")
    assert resnet.verdict == targets.NOT_MET
    assert "torchdp 1.75x" in resnet.measured and "DDP 1.82x" in resnet.measured
    assert verdict_of(vs, "TransformerEncoder").verdict == targets.NOT_MET
    assert "torchdp 0.69x" in verdict_of(vs, "MLP").measured
    rep = verdict_of(vs, "torchdp.replicate")
    assert rep.verdict == targets.NOT_MET and "transformer 4.37x" in rep.measured
    assert "bounds it at 4.83x" in rep.measured
    assert verdict_of(vs, "module count").verdict == targets.MET
    cpp_v = verdict_of(vs, "LibTorch data_parallel")
    assert cpp_v.verdict == targets.NOT_MET and "cpp_mlp200 6.56x" in cpp_v.measured
    conv = verdict_of(vs, "conv net")
    assert conv.verdict == targets.NOT_MEASURED and "flat net" in conv.measured
    mem = verdict_of(vs, "peak memory")
    assert mem.verdict == targets.MET and "balanced 1.03" in mem.measured
    assert "nn.DataParallel 2.57" in mem.measured
    grads = verdict_of(vs, "gradients")
    assert grads.verdict == targets.MET and "3 of 3 match" in grads.measured


def test_report_has_the_targets_section_only_with_two_gpu_records(tmp_path):
    run = write_run(tmp_path / "r.json", two_gpu_run())
    text = report.render([str(run)], str(tmp_path / "r.md"), None)
    assert "## Targets (two GPUs)" in text
    assert "3 of 9 met" in text
    smoke = {
        "machine": {"smoke": True},
        "records": [train("mlp", "single", 0, 3.0), train("mlp", "torchdp", 0, 4.0)],
    }
    path = tmp_path / "smoke.json"
    path.write_text(json.dumps(smoke))
    assert "## Targets" not in report.render([str(path)], str(tmp_path / "s.md"), None)
    assert targets.main([str(path)]) == 1
    # Two replicas on one GPU (a one-GPU run of the C++ suite): no two-GPU targets to judge.
    shared = {
        "machine": {"gpus": ["NVIDIA H200"]},
        "records": [
            train("mlp", "single", 1, 3.0, devices="cuda:0"),
            train("mlp", "torchdp", 2, 4.0, devices="cuda:0,cuda:0"),
        ],
    }
    path = tmp_path / "shared.json"
    path.write_text(json.dumps(shared))
    assert "## Targets" not in report.render([str(path)], str(tmp_path / "o.md"), None)
    assert targets.main([str(path)]) == 1


def test_training_targets_default_option_and_missing():
    records = [
        train("resnet50", "single", 1, 100.0),
        train("resnet50", "torchdp", 2, 52.0),  # 1.92x
        train("resnet50", "ddp", 2, 53.0),  # 1.89x
        train("transformer", "single", 1, 100.0),
        train("transformer", "torchdp", 2, 54.0),  # 1.85x, but DDP is faster
        train("transformer", "ddp", 2, 53.0),
        train("mlp200", "single", 1, 30.0),
        train("mlp200", "torchdp", 2, 45.0),
        train("mlp200", "torchdp_graphs", 2, 20.0),
        train("mlp200", "single_graphs", 1, 10.0),
    ]
    records.append(
        train("resnet50", "single_shard", 1, 51.0, shards=2, ideal_speedup_vs_single=1.96)
    )
    vs = targets.judge(records)
    assert verdict_of(vs, "ResNet-50").verdict == targets.MET
    assert "bound 1.96x (one GPU at half the batch)" in verdict_of(vs, "ResNet-50").measured
    assert "bound" not in verdict_of(vs, "TransformerEncoder").measured
    assert verdict_of(vs, "TransformerEncoder").verdict == targets.NOT_MET
    mlp = verdict_of(vs, "MLP")
    # The graphed replicas are judged against the graphed one-GPU step, not the eager one.
    assert mlp.verdict == targets.NOT_MET
    assert "cuda_graphs=True 1.50x (vs one GPU eager)" in mlp.measured
    assert "cuda_graphs=True vs one GPU graphed 0.50x" in mlp.measured
    records[8]["step_ms_median"] = 8.0  # torchdp_graphs: 1.25x the graphed one GPU
    assert verdict_of(targets.judge(records), "MLP").verdict == "met with cuda_graphs=True"
    # Nothing recorded for the C++ benchmark, replicate or memory: not measured, not met.
    for needle in ("LibTorch", "conv net", "torchdp.replicate", "module count", "peak memory"):
        assert verdict_of(vs, needle).verdict == targets.NOT_MEASURED


def test_failed_records_and_missing_ddp_are_not_measured():
    records = [
        train("resnet50", "single", 1, 100.0),
        train("resnet50", "torchdp", 2, 50.0),
        train("transformer", "single", 1, 100.0),
        train("transformer", "torchdp", 2, 50.0, error="CUDA out of memory"),
        train("transformer", "ddp", 2, 60.0),
    ]
    vs = targets.judge(records)
    resnet = verdict_of(vs, "ResNet-50")
    assert resnet.verdict == targets.NOT_MEASURED and "no DDP record" in resnet.measured
    assert verdict_of(vs, "TransformerEncoder").verdict == targets.NOT_MEASURED


def test_speedup_is_computed_from_the_medians_when_the_record_lacks_it():
    records = [train("mlp200", "single", 1, 30.0), train("mlp200", "torchdp", 2, 25.0)]
    assert verdict_of(targets.judge(records), "MLP").verdict == targets.MET
    # The record's own figure wins over the medians.
    records[1]["speedup_vs_single"] = 0.9
    assert verdict_of(targets.judge(records), "MLP").verdict == targets.NOT_MET


def test_replicate_target_with_the_broadcast_bound():
    records = [
        replicate("a", "torch_replicate", 10.0),
        replicate("a", "torchdp_replicate", 1.0),
        replicate("b", "torch_replicate", 6.0),
        replicate("b", "torchdp_replicate", 1.5, bound_vs_torch=4.8),
    ]
    v = verdict_of(targets.judge(records), "torchdp.replicate")
    assert v.verdict == targets.NOT_MET and "a 10.00x" in v.measured and "b 4.00x" in v.measured
    assert "broadcast alone bounds it at 4.80x" in v.measured
    records[3]["replicate_ms_median"] = 1.0
    assert verdict_of(targets.judge(records), "torchdp.replicate").verdict == targets.MET


@pytest.mark.parametrize(
    "torchdp_ms, verdict",
    [
        (lambda m: 0.1 + 0.01 * m, targets.MET),  # linear, the smaller slope
        (lambda m: 0.1 + 0.08 * m, targets.NOT_MET),  # linear, but steeper than torch's
        (lambda m: 1e-5 * m * m, targets.NOT_MET),  # quadratic
        (lambda m: 0.002 * m**1.3, targets.NOT_MET),  # mildly superlinear: R² alone passes it
    ],
)
def test_replicate_curve_target(torchdp_ms, verdict):
    records = []
    for m in (11, 31, 101, 301, 1001, 2001):
        records.append(replicate(f"seq{m}", "torch_replicate", 0.05 * m, "replicate_curve", m))
        records.append(
            replicate(f"seq{m}", "torchdp_replicate", torchdp_ms(m), "replicate_curve", m)
        )
    assert verdict_of(targets.judge(records), "module count").verdict == verdict


def test_linear_fit():
    slope, intercept, r2 = targets.linear_fit([(1, 3.0), (2, 5.0), (4, 9.0)])
    assert slope == pytest.approx(2.0) and intercept == pytest.approx(1.0)
    assert r2 == pytest.approx(1.0)
    _, _, r2 = targets.linear_fit([(1, 1.0), (2, 3.0), (3, 1.0), (4, 3.0)])
    assert r2 < 0.5


VGG_DESC = "Conv2d(3x3)+BatchNorm2d+ReLU blocks, plan 64 M 128 M 256 256 M (M: MaxPool2d(2))"


def cpp(model: str, mode: str, gpus: int, ms: float, **extra) -> dict:
    """A C++ training-step record (cpp_convnet with the VGG-plan description the bench writes)."""
    if model == "cpp_convnet":
        extra.setdefault("model_desc", VGG_DESC)
    return {
        "bench": "cpp_train_step",
        "model": model,
        "mode": mode,
        "gpus": gpus,
        "dtype": "fp32",
        "step_ms_median": ms,
        **extra,
    }


def test_cpp_targets():
    records = [
        cpp("cpp_mlp200", "single", 1, 30.0),
        cpp("cpp_mlp200", "libtorch_dp", 2, 300.0),
        cpp("cpp_mlp200", "torchdp", 2, 40.0),  # 7.5x
        cpp("cpp_mlp200", "torchdp_graphs", 2, 12.0),  # 25x
        cpp("cpp_convnet", "single", 1, 40.0),
        cpp("cpp_convnet", "libtorch_dp", 2, 30.0),
        cpp("cpp_convnet", "torchdp", 2, 22.0),  # 1.36x vs LibTorch, 1.82x vs one GPU
    ]
    vs = targets.judge(records)
    v = verdict_of(vs, "LibTorch")
    assert v.verdict == targets.NOT_MET
    assert "cpp_mlp200 7.50x (cuda_graphs 25.00x)" in v.measured
    assert verdict_of(vs, "conv net").verdict == targets.MET
    records.append(
        cpp("cpp_convnet", "single_shard", 1, 21.0, shards=2, ideal_speedup_vs_single=1.9)
    )
    assert "bound 1.90x" in verdict_of(targets.judge(records), "conv net").measured
    records[-2]["step_ms_median"] = 2.5  # 12x vs LibTorch
    assert verdict_of(targets.judge(records), "LibTorch").verdict == "met with cuda_graphs"


def test_cpp_target_judges_the_reference_models_only() -> None:
    records = [
        cpp("cpp_mlp200", "single", 1, 30.0),
        cpp("cpp_mlp200", "libtorch_dp", 2, 300.0),
        cpp("cpp_mlp200", "torchdp", 2, 25.0),  # 12x
        cpp("cpp_convnet_flat", "single", 1, 40.0),
        cpp("cpp_convnet_flat", "libtorch_dp", 2, 30.0),
        cpp("cpp_convnet_flat", "torchdp", 2, 22.0),  # 1.36x: shown, not judged
    ]
    v = verdict_of(targets.judge(records), "LibTorch")
    # The reference conv net is missing: not measured, never met through the other models.
    assert v.verdict == targets.NOT_MEASURED
    assert "cpp_convnet not measured" in v.measured
    assert "cpp_convnet_flat 1.36x (not judged" in v.measured
    records += [
        cpp("cpp_convnet", "single", 1, 12.0),
        cpp("cpp_convnet", "libtorch_dp", 2, 130.0),
        cpp("cpp_convnet", "torchdp", 2, 7.0),  # 18.6x
    ]
    v = verdict_of(targets.judge(records), "LibTorch")
    assert v.verdict == targets.MET, v
    assert "cpp_convnet 18.57x" in v.measured
    records[2]["step_ms_median"] = 40.0  # the MLP at 7.5x fails it
    assert verdict_of(targets.judge(records), "LibTorch").verdict == targets.NOT_MET


def test_cpp_convnet_records_of_the_flat_net_are_not_judged() -> None:
    """Before 2026-12-02 cpp_convnet named the flat net (no description, no pooling)."""
    records = [
        cpp("cpp_convnet", "single", 1, 40.0, model_desc=""),
        cpp("cpp_convnet", "libtorch_dp", 2, 30.0, model_desc=""),
        cpp("cpp_convnet", "torchdp", 2, 22.0, model_desc=""),
    ]
    vs = targets.judge(records)
    assert verdict_of(vs, "conv net").verdict == targets.NOT_MEASURED
    assert verdict_of(vs, "LibTorch").verdict == targets.NOT_MEASURED


def test_gradient_target_needs_every_model_checked():
    checked = [
        train(m, "torchdp", 2, 50.0, grads_match_torch_dp=True, grads_max_abs_diff=0.0)
        for m in ("resnet50", "transformer", "mlp200")
    ]
    assert verdict_of(targets.judge(checked), "gradients").verdict == targets.MET
    v = verdict_of(targets.judge(checked[:2]), "gradients")
    assert v.verdict == targets.NOT_MEASURED and "not checked: mlp200" in v.measured
    raised = [*checked[:2], train("mlp200", "torchdp", 2, 50.0, grads_match_torch_dp=None)]
    v = verdict_of(targets.judge(raised), "gradients")
    assert v.verdict == targets.NOT_MET and "mlp200/torchdp (the check raised)" in v.measured


def test_replicate_target_without_a_torchdp_record_is_not_measured():
    records = [
        replicate("a", "torch_replicate", 10.0),
        replicate("a", "torchdp_replicate", 1.0),
        replicate("b", "torch_replicate", 6.0),
    ]
    v = verdict_of(targets.judge(records), "torchdp.replicate")
    assert v.verdict == targets.NOT_MEASURED and "no torchdp_replicate record: b" in v.measured


def test_replicas_sharing_a_gpu_are_not_judged() -> None:
    records = [
        cpp("cpp_convnet", "single", 1, 12.0, devices="cuda:0"),
        cpp("cpp_convnet", "torchdp", 2, 14.0, devices="cuda:0,cuda:0"),
    ]
    assert verdict_of(targets.judge(records), "conv net").verdict == targets.NOT_MEASURED
    records[1]["devices"] = "cuda:0,cuda:1"
    assert verdict_of(targets.judge(records), "conv net").verdict == targets.NOT_MET
