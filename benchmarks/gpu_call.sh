#!/usr/bin/env bash
# One call on a GPU machine (the device tool's `run`): build, the GPU tests and the benchmark suite,
# each step with its own log under $OUT/x, skipped when the time left cannot hold it, and everything
# packed into $OUT/<name>.tar.gz at the end, next to $OUT/summary.txt (the tool brings back only a
# few files).
#
#   bash benchmarks/gpu_call.sh <name> [step ...]
#
# Steps, in the order given (default: priority bench kept pg test; more than one call holds: with
# two GPUs run `priority bench kept`, then `test pg`):
#   priority  the extension, then the graph, bucket and ordering tests
#   bench     make bench (all modes side by side) and the profiled steps with traces
#   kept      training steps with kept replicas and with new ones at every step (cache_replicas):
#             bench_train_step.py --modes single,torchdp,torchdp_new_replicas, into results/
#   pg        benchmarks/bench_process_group.py, one process per GPU over NCCL: DDP, torchdp's
#             process_group option and DDP around torchdp, into results/ (two GPUs or more)
#   test      make test (TORCHDP_REQUIRE_CUDA=1 with two GPUs or more)
# Environment: OUT (required), BUDGET_S (seconds for the whole call, default 560),
# TORCHDP_GIT_REV (pass it: the device tool's copy of the tree may carry an older .git, so the
# default, git rev-parse --short HEAD, can name the wrong revision).
set -u -o pipefail
name=${1:?usage: gpu_call.sh <name> [priority|bench|kept|pg|test ...]}
shift
steps=("$@")
[ ${#steps[@]} -eq 0 ] && steps=(priority bench kept pg test)
: "${OUT:?OUT must name the folder whose files come back}"

# Never NVLink multicast on shared multi-GPU hosts (also for the processes the steps start).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1
if [ -z "${TORCHDP_GIT_REV:-}" ]; then
  TORCHDP_GIT_REV=$(git rev-parse --short HEAD 2>/dev/null || echo unknown)
  echo "warning: TORCHDP_GIT_REV not set; using git's $TORCHDP_GIT_REV, which may lag the tree" >&2
fi
export TORCHDP_GIT_REV
gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
jobs=$(nproc)
require=()
[ "$gpus" -ge 2 ] && require=(TORCHDP_REQUIRE_CUDA=1)
deadline=$((SECONDS + ${BUDGET_S:-560}))
logs=$OUT/x
mkdir -p "$logs"
summary=$logs/summary.txt
echo "gpu_call $name: $gpus GPUs, rev $TORCHDP_GIT_REV, steps ${steps[*]}" | tee "$summary"

# run <log> <seconds it needs at least> <command...>: skipped when less time is left; stopped at
# the deadline otherwise.
run() {
  local log=$1 need=$2
  shift 2
  local left=$((deadline - SECONDS))
  if [ "$left" -lt "$need" ]; then
    echo "skipped $log: needs ${need}s, ${left}s left" | tee -a "$summary"
    return 0
  fi
  local start=$SECONDS
  echo "[$((SECONDS))s] $log (${left}s left)"
  timeout --signal=INT --kill-after=20 "$left" env ${require[@]+"${require[@]}"} "$@" >"$logs/$log.log" 2>&1
  local rc=$?
  echo "$log: rc=$rc in $((SECONDS - start))s" | tee -a "$summary"
  grep -E "tests passed|passed|failed|FAILED|Error|error:" "$logs/$log.log" | tail -n 6 |
    sed 's/^/    /' >>"$summary"
  return 0
}

for step in "${steps[@]}"; do
  case $step in
    priority)
      run build 120 make python JOBS="$jobs"
      run priority-tests 60 env PYTHONPATH=python python -m pytest -q -rs \
        tests/python/test_cuda_graphs.py tests/python/test_grad_buckets.py tests/python/test_gpu.py \
        tests/python/test_kept_replicas.py \
        -k "graph or bucket or ordered or kept"
      ;;
    bench)
      run bench 240 make bench JOBS="$jobs" \
        BENCH_ARGS="--out-dir $logs/results --name $name" \
        PROFILE_ARGS="--out $logs/results/$name-profile.json --trace $logs/results/traces"
      # The targets judged on this run's two-GPU records, into the summary that comes back.
      if [ -f "$logs/results/$name.json" ]; then
        python benchmarks/targets.py "$logs/results/$name.json" >>"$summary" 2>&1 || true
      fi
      ;;
    kept)
      mkdir -p "$logs/results"
      run kept 120 env PYTHONPATH=python python benchmarks/bench_train_step.py \
        --modes single,torchdp,torchdp_new_replicas --dtypes fp32 \
        --out "$logs/results/$name-kept-replicas.json"
      ;;
    pg)
      if [ "$gpus" -ge 2 ]; then
        mkdir -p "$logs/results"
        run bench-process-group 120 env PYTHONPATH=python python benchmarks/bench_process_group.py \
          --out "$logs/results/$name-process-group.json"
      else
        echo "pg: needs two GPUs or more (one process per GPU), skipped" | tee -a "$summary"
      fi
      ;;
    test)
      run make-test 240 make test JOBS="$jobs"
      ;;
    *)
      echo "unknown step '$step' (priority, bench, kept, pg, test)" |
        tee -a "$summary"
      ;;
  esac
done

cp "$summary" "$OUT/summary.txt"
tar -czf "$OUT/$name.tar.gz" -C "$logs" . && rm -rf "$logs"
cat "$OUT/summary.txt"
