set -x
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
nvidia-smi -L
TORCHDP_REQUIRE_CUDA=1 JOBS=16 make build > $OUT/build.log 2>&1 || { tail -50 $OUT/build.log; exit 1; }
(cd build && ctest -j8 2>&1 | tail -15) | tee $OUT/ctest.log
PYTHONPATH=python python3 -m pytest -q tests/python -x 2>&1 | grep -v "^SKIPPED" | tail -15 | tee $OUT/pytest.log
PYTHONPATH=python python3 benchmarks/_tmp_rep1.py 2>&1 | tee $OUT/rep1.log
