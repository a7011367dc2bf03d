"""The benchmark suite's smoke mode: every script runs on the CPU with a few steps and writes a valid
results file, a Markdown report and the plots. This checks that the suite works, not how fast
anything is (timings are only meaningful from `make bench` on GPUs)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))

import common


def _script_env() -> dict[str, str]:
    """The environment of a benchmark script run in a child process: this checkout's package."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO / "python"), env.get("PYTHONPATH", "")])
    return env


def _run_script(
    script: str, *args: str, env: dict[str, str] | None = None, timeout: float = 300
) -> subprocess.CompletedProcess[str]:
    """benchmarks/<script> with `args` in a child process (output captured as text)."""
    return subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / script), *args],
        env=_script_env() if env is None else env,
        capture_output=True,
        check=False,
        text=True,
        timeout=timeout,
    )


def test_run_all_smoke_writes_valid_results(tmp_path):
    cpp = os.environ.get("TORCHDP_BENCH_CPP")
    if not cpp or not Path(cpp).exists():
        pytest.skip(
            "TORCHDP_BENCH_CPP does not name the built torchdp_bench_cpp (make test sets it)"
        )
    proc = _run_script(
        "run_all.py",
        "--smoke",
        "--cpp-bin",
        cpp,
        "--out-dir",
        str(tmp_path),
        "--name",
        "ci",
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    data = common.load(tmp_path / "ci-smoke.json")
    benches = {r["bench"] for r in data["records"]}
    assert {"train_step", "memory", "replicate", "replicate_curve", "cpp_train_step"} <= benches
    assert data["machine"]["torch"]
    assert data["machine"]["torchdp_git_revision"]
    assert data["machine"]["failures"] == []
    timed = [r for r in data["records"] if "error" not in r and r.get("step_ms_median")]
    assert timed and all(r["step_ms_median"] > 0 for r in timed)
    # single_shard: one replica's share of the batch on one device, and the bound it gives.
    shards = [r for r in timed if r["mode"] == "single_shard"]
    assert {r["bench"] for r in shards} == {"train_step", "cpp_train_step"}
    assert all(r["shards"] == 2 and r["ideal_speedup_vs_single"] > 0 for r in shards)
    full = {(r["model"], r["dtype"]): r for r in timed if r["mode"] == "single" and "batch" in r}
    python_shards = [r for r in shards if r["bench"] == "train_step"]
    assert all(r["batch"] == full[(r["model"], r["dtype"])]["batch"] // 2 for r in python_shards)
    report = (tmp_path / "ci-smoke.md").read_text()
    assert "torchdp" in report and "|" in report
    for suffix in ("speedup", "replicate"):
        png = tmp_path / f"ci-smoke-{suffix}.png"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    json.dumps(data)  # round-trips


def test_memory_run_with_shares(tmp_path):
    out = tmp_path / "shares.json"
    args = (
        "--memory",
        "--smoke",
        "--shares",
        "1,3",
        "--modes",
        "torch_dp,torchdp,torchdp_balanced",
    )
    proc = _run_script("bench_train_step.py", *args, "--out", str(out), timeout=200)
    assert proc.returncode == 0, proc.stderr[-2000:]
    records = {r["mode"]: r for r in common.load(out)["records"] if r["gpus"] == 0}
    assert records["torchdp"]["shares"] == [1.0, 3.0]
    assert records["torchdp_balanced"]["shares"] == [1.0, 3.0]
    assert "shares" not in records["torch_dp"]  # torch.nn.DataParallel, side by side
    assert all(r.get("step_ms_median") for r in records.values()), records
    bad = _run_script("bench_train_step.py", "--memory", "--smoke", "--shares", "1,2,3",
                      "--out", str(tmp_path / "bad.json"), timeout=120)  # fmt: skip
    assert bad.returncode != 0 and "give one share per GPU of the run" in bad.stderr


def test_results_validation_rejects_incomplete_records():
    with pytest.raises(ValueError, match="lacks"):
        common.validate_record({"bench": "train_step", "model": "mlp200"})
    common.validate_record(
        {
            "bench": "x",
            "model": "m",
            "mode": "torchdp",
            "gpus": 2,
            "dtype": "fp32",
            "speedup_vs_single": None,
            "peak_mem_gib": [],
            "step_ms_median": 1.0,
        }
    )


def test_profile_step_smoke_records_every_phase(tmp_path):
    out = tmp_path / "profile.json"
    proc = _run_script(
        "profiling.py",
        "step",
        "--smoke",
        "--models",
        "mlp200",
        "--steps",
        "2",
        "--out",
        str(out),
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    data = json.loads(out.read_text())
    (rec,) = data["records"]
    assert rec["model"] == "mlp200" and rec["gpus"] == 2 and rec["step_ms_median"] > 0
    phases = rec["phase_cpu_ms_per_step"]
    assert set(phases) >= {"DataParallel.replicate", "DataParallel.parallel_apply", "backward"}
    # torchdp's own ranges are profiled too. The smoke MLP has no hooks and only plain modules,
    # so its replicas skip the device check; a free-threaded Python keeps no replicas to park.
    assert phases.pop("torchdp.replicate.device_check") == 0
    if sysconfig.get_config_var("Py_GIL_DISABLED"):
        assert phases.pop("torchdp.replicate.park") == 0
    assert all(v > 0 for v in phases.values()), phases
    # The DataParallel call contains replicate .. gather.
    inner = ("replicate", "scatter", "parallel_apply", "gather")
    assert phases["forward"] >= sum(phases[f"DataParallel.{p}"] for p in inner)
    one = rec["single_device"]
    assert one["step_ms_median"] > 0
    assert set(one["phase_cpu_ms_per_step"]) == {"forward", "loss", "backward", "optimizer"}
    assert all(v > 0 for v in one["phase_cpu_ms_per_step"].values())
    table = out.with_suffix(".md").read_text()
    assert "| mlp200 | cpu, cpu |" in table and "parallel_apply" in table
    assert "one device: step ms" in table
    assert rec["gpu_kernel_ms_per_step"] == {}  # CPU devices: no device activity


def test_profile_step_rejects_bad_device_ids():
    for ids, expected in [("0,x", "comma-separated integers"), ("99,99", "--device-ids needs")]:
        proc = _run_script("profiling.py", "step", "--device-ids", ids, timeout=120)
        assert proc.returncode == 2, proc.stdout + proc.stderr
        assert expected in proc.stderr, proc.stderr
    proc = _run_script("profiling.py", "step", "--device-ids", "0,0", "--smoke", timeout=120)
    assert proc.returncode == 2 and "replaces --gpus and --smoke" in proc.stderr


def test_process_modes_time_every_mode(tmp_path):
    """DDP, torchdp's process_group option and DDP around torchdp, one process per CPU device."""
    out = tmp_path / "pg.json"
    modes = ["single", "ddp", "torchdp_process_group", "ddp_over_torchdp"]
    proc = _run_script(
        "bench_train_step.py",
        "--smoke",
        "--models",
        "mlp200",
        "--dtypes",
        "fp32",
        "--modes",
        ",".join(modes),
        "--steps",
        "3",
        "--out",
        str(out),
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    records = common.load(out)["records"]
    assert [r["mode"] for r in records] == modes
    for r in records:
        assert r["bench"] == "train_step" and r["model"] == "mlp200" and "error" not in r
        assert r["step_ms_count"] == 3 and r["step_ms_median"] > 0 and r["speedup_vs_single"] > 0
    assert "torchdp_process_group" in proc.stdout


def test_threads_bench_records_cpu_time_threads_and_the_gil(tmp_path):
    out = tmp_path / "threads.json"
    proc = _run_script("bench_threads.py", "--smoke", "--settings", "1", "--out", str(out))
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    records = common.load(out)["records"]
    assert [(r["batch"], r["mode"]) for r in records] == [
        (b, m) for b in (16, 512) for m in ("single", "torchdp", "torchdp_serial")
    ]
    for r in records:
        assert r["bench"] == "threads" and r["intra_op"] == "1" and r["intra_op_threads"] == 1
        assert r["step_ms_count"] == 3 and r["step_ms_median"] > 0 and r["cpu_ms_median"] > 0
        assert r["gil_enabled"] is not r["free_threaded"]  # a free-threaded Python keeps it off
    import report

    md = tmp_path / "threads.md"
    report.render([str(out)], str(md), None)
    assert "## CPU replicas: threads and the GIL" in md.read_text()
