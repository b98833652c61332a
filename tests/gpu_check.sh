#!/usr/bin/env bash
# The GPU test suite (tests/test_gpu.py) in shards over the CPU cores (its references run
# on the CPU), on a Hopper GPU with the package installed ("pip install .[cuda]"):
#   bash tests/gpu_check.sh [SECONDS_PER_SHARD] [LOG_DIR]
# The shards' logs and every comparison's worst errors (errors.jsonl) go to LOG_DIR.
set -u
limit=${1:-300}
logs=${2:-$(mktemp -d)}
mkdir -p "$logs"
python=${PYTHON:-python3}
export XLA_PYTHON_CLIENT_PREALLOCATE=false KDA_GPU_LOG=$logs/errors.jsonl PYTHONUNBUFFERED=1
work=$(mktemp -d)
$python -m pytest tests/test_gpu.py --collect-only -q -p no:cacheprovider | grep :: > "$work/ids"
split -n r/15 "$work/ids" "$work/shard_"
for f in "$work"/shard_*; do
  timeout "$limit" $python -m pytest -q -p no:cacheprovider $(cat "$f") > "$f.log" 2>&1 &
done
wait
cat "$work"/shard_*.log > "$logs/pytest.log"
grep -h "^FAILED\|^E  " "$work"/shard_*.log | cut -c1-240 | head -20
grep -h -E "passed|failed|error" "$work"/shard_*.log | grep -v "^E " | sort | uniq -c
echo "logs: $logs"
