#!/usr/bin/env bash
# The GPU test suite on the device machine, sharded over its CPU cores (the references
# run on the CPU there), logs under $OUT. Run from the repository root after
# installing CuTe DSL (see tests/GPU_RESULTS.md):  bash tests/gpu_check.sh [SECONDS]
set -u
limit=${1:-300}
python -m pip install -q --no-deps --no-build-isolation --no-index -e . >/dev/null 2>&1
export XLA_PYTHON_CLIENT_PREALLOCATE=false KDA_GPU_LOG=$OUT/errors.jsonl PYTHONUNBUFFERED=1
work=$(mktemp -d)  # fresh: a warm machine keeps /tmp between calls
python -m pytest tests/test_gpu.py --collect-only -q -p no:cacheprovider | grep :: > "$work/ids"
split -n r/15 "$work/ids" "$work/shard_"
for f in "$work"/shard_*; do
  timeout "$limit" python -m pytest -q -p no:cacheprovider $(cat "$f") > "$f.log" 2>&1 &
done
wait
cat "$work"/shard_*.log > "$OUT/pytest.log"
grep -h "^FAILED\|^E  " "$work"/shard_*.log | cut -c1-240 | head -20
grep -h -E "passed|failed|error" "$work"/shard_*.log | grep -v "^E " | sort | uniq -c
