"""Runs the whole benchmark suite side by side in one run and writes its results.

    python benchmarks/run_all.py [--smoke] [--gpus 1,2] [--only train_step,memory,replicate,cpp]
                                 [--cpp-bin build/benchmarks/cpp/torchdp_bench_cpp]
                                 [--out-dir benchmarks/results]

Each benchmark runs in its own process (GPU memory starts clean for each); their records are merged
into ``<out-dir>/<machine>.json`` (``2xH200.json``) with the machine metadata, and
``report.py`` renders ``<machine>.md`` plus the ``-speedup.png``, ``-replicate.png`` and
``-scaling.png`` plots next to it. A new run of a machine replaces its files: benchmarks/results
holds the latest run per machine.
`make bench` runs this on all GPUs; CI runs ``--smoke`` (CPU, a few steps) through tests/python.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import common  # noqa: E402

PY_BENCHES = {
    "train_step": "bench_train_step.py",
    "memory": "bench_memory.py",
    "replicate": "bench_replicate.py",
}


def run(cmd: list[str], env: dict[str, str]) -> int:
    common.progress("running " + " ".join(str(c) for c in cmd))
    started = time.perf_counter()
    rc = subprocess.call(cmd, env=env)
    common.progress(f"finished in {time.perf_counter() - started:.1f} s with exit status {rc}")
    return rc


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny CPU run of every benchmark")
    parser.add_argument("--gpus", default=None, help="GPU counts to compare, e.g. 1,2")
    parser.add_argument(
        "--only",
        default=",".join([*PY_BENCHES, "cpp"]),
        help="comma-separated subset of train_step,memory,replicate,cpp",
    )
    parser.add_argument("--cpp-bin", default=None, help="the torchdp_bench_cpp executable")
    parser.add_argument("--out-dir", default=str(HERE / "results"))
    parser.add_argument("--name", default=None, help="file stem (default <machine>)")
    args = parser.parse_args(argv)

    selected = [s.strip() for s in args.only.split(",") if s.strip()]
    unknown = sorted(set(selected) - set(PY_BENCHES) - {"cpp"})
    if unknown:
        parser.error(f"unknown benchmarks {unknown}")
    env = dict(os.environ, **common.SAFE_ENV)
    env["TORCHDP_GIT_REV"] = common.git_revision()
    env["PYTHONPATH"] = os.pathsep.join(
        [str(HERE), str(HERE.parent / "python"), env.get("PYTHONPATH", "")]
    ).rstrip(os.pathsep)

    machine = common.machine_info()
    records: list[dict] = []
    failures: list[str] = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in selected:
            out = Path(tmp) / f"{name}.json"
            if name == "cpp":
                if not args.cpp_bin or not Path(args.cpp_bin).exists():
                    failures.append(
                        f"cpp: executable {args.cpp_bin!r} not found (build it with "
                        "-DTORCHDP_BUILD_BENCHMARKS=ON)"
                    )
                    continue
                cmd = [args.cpp_bin, "--out", str(out)] + (["--smoke"] if args.smoke else [])
            else:
                cmd = [sys.executable, str(HERE / PY_BENCHES[name]), "--out", str(out)]
                cmd += ["--smoke"] if args.smoke else []
                if args.gpus and name != "memory":
                    cmd += ["--gpus", args.gpus]
            rc = run(cmd, env)
            if rc != 0 or not out.exists():
                failures.append(f"{name}: exit status {rc}")
            if out.exists():
                data = common.load(out)
                records.extend(data["records"])
                if name == "cpp":
                    machine["cpp"] = data["machine"]

    stem = args.name or common.machine_name(machine)
    if args.smoke:
        stem += "-smoke"
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    machine["failures"] = failures
    result = out_dir / f"{stem}.json"
    result.write_text(json.dumps({"machine": machine, "records": records}, indent=1))
    common.progress(f"wrote {len(records)} records to {result}")
    rc = subprocess.call(
        [
            sys.executable,
            str(HERE / "report.py"),
            str(result),
            "--md",
            str(out_dir / f"{stem}.md"),
            "--plots",
            str(out_dir / stem),
        ],
        env=env,
    )
    if rc != 0:
        failures.append(f"report: exit status {rc}")
    for failure in failures:
        common.progress("FAILED " + failure)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
