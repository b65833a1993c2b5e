#!/bin/bash
# Device-machine run of the GPU tests and benchmarks (bench/RESULTS.md, "GPU (issue 5)").
# Here: .gpu/flashinfer-slim.tgz (../shared/GPU.md) and .whl/ (structlog wheel), both git-ignored;
# call the device tool with carry [".gpu", ".whl"] and the command `bash bench/gpu_run.sh`.
T0=$(date +%s)
mkdir -p /tmp/site && tar -xzf .gpu/flashinfer-slim.tgz -C /tmp/site &&
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD:$PYTHONPATH FLASHINFER_WORKSPACE_BASE=/tmp/fi PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
echo "=== tests"; timeout 150 python3 -m pytest -q -p no:cacheprovider -rP tests/gpu tests/unit/test_paged_kv.py tests/unit/test_graph_lifetime.py > $OUT/tests.log 2>&1; echo rc=$?
grep -E "^\[|passed|failed|^E  " $OUT/tests.log | grep -v Assertion | tail -30
echo "t=$(( $(date +%s) - T0 ))"
echo "=== forward"; timeout 100 python3 -m bench.gpu_forward --iters 40 --out $OUT/gpu_forward.json > $OUT/gpu_forward.log 2>&1; echo rc=$?
grep -v Assertion $OUT/gpu_forward.log | grep -v "INFO\|^\s\|^ours" | tail -13
echo "t=$(( $(date +%s) - T0 ))"
echo "=== batch"; timeout 110 python3 -m bench.gpu_batch --rounds 10 --out $OUT/gpu_batch.json > $OUT/gpu_batch.log 2>&1; echo rc=$?
grep -v Assertion $OUT/gpu_batch.log | grep -v '\[info\|INFO' | tail -9
echo "t=$(( $(date +%s) - T0 ))"
R=$(( 400 - $(date +%s) + T0 )); echo "=== rounds (${R}s)"; timeout $R python3 -m bench.gpu_rounds --drafts none eagle --rounds 12 --out $OUT/gpu_rounds.json > $OUT/gpu_rounds.log 2>&1; echo rc=$?
grep -v Assertion $OUT/gpu_rounds.log | grep -v '\[info\|INFO' | tail -8
