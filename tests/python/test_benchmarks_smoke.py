"""The benchmark suite's smoke mode: every script runs on the CPU with a few steps and writes a valid
results file, a Markdown report and the plots. This checks that the suite works, not how fast
anything is (timings are only meaningful from `make bench` on GPUs)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))

import common  # noqa: E402


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
    # torchdp's own ranges are profiled (CPU time), not wall-clocked. The smoke MLP has no hooks
    # and only plain modules, so its replicas skip the device check.
    ranges = {p for p in phases if p.startswith("torchdp.replicate.")}
    assert phases.pop("torchdp.replicate.device_check") == 0
    assert all(v > 0 for v in phases.values()), phases
    assert rec["top_ops_self_cpu_ms_per_step"]
    wall = rec["phase_wall_ms_per_step"]
    assert set(wall) == {"forward", *phases} - ranges
    assert all(v > 0 for v in wall.values()), wall
    # The DataParallel call contains replicate .. gather.
    inner = sum(
        wall[p]
        for p in (
            "DataParallel.replicate",
            "DataParallel.scatter",
            "DataParallel.parallel_apply",
            "DataParallel.gather",
        )
    )
    assert wall["forward"] >= inner
    one = rec["single_device"]
    assert one["step_ms_median"] > 0
    assert set(one["phase_wall_ms_per_step"]) == {"forward", "loss", "backward", "optimizer"}
    assert all(v > 0 for v in one["phase_wall_ms_per_step"].values())
    table = out.with_suffix(".md").read_text()
    assert "| mlp200 | cpu, cpu |" in table and "parallel_apply" in table
    assert "one device: step ms" in table
    assert rec["gpu_idle"] == {}  # CPU devices: no device activity


def test_profile_step_gpu_idle_finds_the_gaps_and_their_phases():
    import profiling

    ms = 1e3  # the profiler's intervals are in microseconds
    # Device 0 works 0-10 and 14-20 ms; device 1 starts late (3) and stops early (18), with a gap
    # 5-6. Phases: "forward" 0-12 with "replicate" inside it 2-4, "backward" 12-20.
    busy = {
        0: [(0 * ms, 6 * ms), (4 * ms, 10 * ms), (14 * ms, 20 * ms)],
        1: [(3 * ms, 5 * ms), (6 * ms, 18 * ms)],
    }
    phases = [
        ("forward", 0, 12 * ms),
        ("replicate", 2 * ms, 4 * ms),
        ("backward", 12 * ms, 20 * ms),
    ]
    idle = profiling.gpu_idle(busy, phases, steps=2)
    assert set(idle) == {"cuda:0", "cuda:1"}
    assert idle["cuda:0"] == {"idle_ms_per_step": 2.0, "largest_gaps": [[4.0, "forward"]]}
    # Device 1: 3 ms before it starts, 1 ms at 5, 2 ms at the end: 6 ms over 2 steps.
    assert idle["cuda:1"]["idle_ms_per_step"] == 3.0
    assert idle["cuda:1"]["largest_gaps"] == [[3.0, "forward"], [2.0, "backward"], [1.0, "forward"]]
    assert len(profiling.gpu_idle(busy, phases, steps=1, top=1)["cuda:1"]["largest_gaps"]) == 1
    # The innermost phase names a gap: one beginning at 2.5 ms falls in replicate; one outside
    # every phase is said to be between phases.
    inner = profiling.gpu_idle(
        {0: [(0, 2.5 * ms), (3 * ms, 20 * ms), (21 * ms, 22 * ms)]}, phases, 1
    )
    assert inner["cuda:0"]["largest_gaps"] == [[1.0, "between phases"], [0.5, "replicate"]]
    assert profiling.gpu_idle({}, phases, steps=1) == {}


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
