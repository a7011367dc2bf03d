"""Runs the whole benchmark suite side by side in one run and writes its results.

    python benchmarks/run_all.py [--smoke] [--gpus 1,2] [--only train_step,memory,replicate,cpp]
                                 [--cpp-bin build/benchmarks/cpp/torchdp_bench_cpp]
                                 [--out-dir benchmarks/results] [--name STEM]

Each benchmark runs in a process of its own (GPU memory starts clean); their records and the
machine go to ``<out-dir>/<machine>.json``, which report.py renders into ``<machine>.md`` and the
plots, replacing the machine's previous run. CI runs ``--smoke`` (CPU) through tests/python.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import common

# Each benchmark's command, without --out, --smoke and --gpus.
BENCHES = {
    "train_step": [sys.executable, str(HERE / "bench_train_step.py")],
    "memory": [sys.executable, str(HERE / "bench_train_step.py"), "--memory"],
    "replicate": [sys.executable, str(HERE / "bench_replicate.py")],
    "cpp": [],  # --cpp-bin
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny CPU run of every benchmark")
    parser.add_argument("--gpus", default=None, help="GPU counts to compare, e.g. 1,2")
    parser.add_argument("--only", default=",".join(BENCHES), help="comma list of benchmarks")
    parser.add_argument("--cpp-bin", default=None, help="the torchdp_bench_cpp executable")
    parser.add_argument("--out-dir", default=str(HERE / "results"))
    parser.add_argument("--name", default=None, help="file stem (default <machine>)")
    args = parser.parse_args(argv)
    selected = common.parse_list(args.only, list(BENCHES), "benchmarks")
    env = dict(os.environ, TORCHDP_GIT_REV=common.git_revision())
    env["PYTHONPATH"] = os.pathsep.join([str(HERE.parent / "python"), env.get("PYTHONPATH", "")])

    machine = common.machine_info()
    records: list[dict] = []
    failures: list[str] = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in selected:
            out = Path(tmp) / f"{name}.json"
            cmd = [*BENCHES[name], "--out", str(out)] + ["--smoke"] * args.smoke
            if name == "cpp":
                if not args.cpp_bin or not Path(args.cpp_bin).exists():
                    failures.append(
                        f"cpp: no executable {args.cpp_bin!r} (TORCHDP_BUILD_BENCHMARKS)"
                    )
                    continue
                cmd.insert(0, args.cpp_bin)
            elif args.gpus and name != "memory":
                cmd += ["--gpus", args.gpus]
            common.progress("running " + " ".join(cmd))
            started = time.perf_counter()
            rc = subprocess.call(cmd, env=env)
            common.progress(f"finished in {time.perf_counter() - started:.1f} s, exit status {rc}")
            if rc != 0 or not out.exists():
                failures.append(f"{name}: exit status {rc}")
            if out.exists():
                data = common.load(out)
                records += data["records"]
                if name == "cpp":
                    machine["cpp"] = data["machine"]

    stem = (args.name or common.machine_name(machine)) + ("-smoke" if args.smoke else "")
    out_dir = Path(args.out_dir)
    result = common.write_json(
        out_dir / f"{stem}.json", {"machine": {**machine, "failures": failures}, "records": records}
    )
    report = [sys.executable, str(HERE / "report.py"), str(result)]
    rc = subprocess.call(
        [*report, "--md", str(out_dir / f"{stem}.md"), "--plots", str(out_dir / stem)], env=env
    )
    failures += [f"report: exit status {rc}"] if rc else []
    for failure in failures:
        common.progress("FAILED " + failure)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
