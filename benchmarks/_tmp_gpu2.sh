export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
TORCHDP_REQUIRE_CUDA=1 JOBS=16 make build > $OUT/build.log 2>&1 || { tail -50 $OUT/build.log; exit 1; }
PYTHONPATH=python python3 -m pytest -q tests/python -x 2>&1 | grep -v "^SKIPPED" | tail -4
PYTHONPATH=python python3 benchmarks/_tmp_prof.py 2>&1 | head -6
PYTHONPATH=python python3 benchmarks/_tmp_exp.py 2>&1 | tee $OUT/exp.log | grep -v "^ *$" | cut -c1-160 | tail -80
