#!/usr/bin/env bash
# Where the fused verify's warps wait, instruction by instruction: Nsight Compute's
# stall samples per SASS instruction (SourceCounters) for one launch at each point
# B,T,SPLIT given, exported as CSV under $OUT (the source page, and the top
# instructions by samples in hot_B_T_SPLIT.txt). Run from the repository root after
# installing CuTe DSL:  bash tests/gpu_hotspots.sh 64,4,1 1,4,2
set -u
cd tests
for point in "$@"; do
  IFS=, read -r B T SPLIT <<< "$point"
  name=hot_${B}_${T}_${SPLIT}
  JAX_PLATFORMS=cpu ncu --clock-control none --section SourceCounters \
      --section WarpStateStats --section SchedulerStats -k regex:kernel \
      --launch-skip 2 --launch-count 1 -f -o "$OUT/$name" \
      python gpu_profile.py "$B" "$T" "$SPLIT" > "$OUT/$name.log" 2>&1
  ncu -i "$OUT/$name.ncu-rep" --page source --csv --print-source sass \
      > "$OUT/$name.csv" 2>> "$OUT/$name.log"
  ncu -i "$OUT/$name.ncu-rep" --page details --csv > "$OUT/${name}_details.csv" 2>&1
  python - "$OUT/$name.csv" > "$OUT/$name.txt" <<'PY'
import csv, sys
rows = list(csv.DictReader(open(sys.argv[1])))
if not rows:
    sys.exit("no rows")
key = next(k for k in rows[0] if "Sampling (All" in k)
total = sum(float(r[key] or 0) for r in rows)
print(f"{len(rows)} instructions, {total:.0f} samples; columns: {list(rows[0])}")
for r in sorted(rows, key=lambda r: -float(r[key] or 0))[:60]:
    print(f"{float(r[key] or 0) / total:6.1%}  {r.get('Address', '')}  {r.get('Source', '')}")
PY
  head -25 "$OUT/$name.txt"
done
