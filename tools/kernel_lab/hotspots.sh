#!/usr/bin/env bash
# Where the fused verify's warps wait, instruction by instruction: Nsight Compute's
# stall samples per SASS instruction (SourceCounters) for one launch at each point
# B,T,SPLIT[,tree] given, exported as CSV under DIR (the source page, and the top
# instructions by samples in hot_B_T_SPLIT[_tree].txt). Run from the repository root
# with CuTe DSL and Nsight Compute installed:  bash tools/kernel_lab/hotspots.sh DIR 64,4,1 1,4,2
set -u
OUT=$1
shift
mkdir -p "$OUT"
for point in "$@"; do
  IFS=, read -r B T SPLIT TREE <<< "$point"
  name=hot_${B}_${T}_${SPLIT}${TREE:+_tree}
  JAX_PLATFORMS=cpu ncu --clock-control none --section SourceCounters \
      --section WarpStateStats --section SchedulerStats -k regex:kernel \
      --launch-skip 2 --launch-count 1 -f -o "$OUT/$name" \
      python tools/kernel_lab/ncu_target.py "$B" "$T" "$SPLIT" $TREE > "$OUT/$name.log" 2>&1
  ncu -i "$OUT/$name.ncu-rep" --page source --csv --print-source sass \
      > "$OUT/$name.csv" 2>> "$OUT/$name.log"
  ncu -i "$OUT/$name.ncu-rep" --page details --csv > "$OUT/${name}_details.csv" 2>&1
  python - "$OUT/$name.csv" > "$OUT/$name.txt" <<'PY'
import csv, io, sys
text = open(sys.argv[1]).read().split("\n", 1)[1]  # line 1 names the kernel
rows = list(csv.DictReader(io.StringIO(text)))
samples = lambda r: float(r["Warp Stall Sampling (All Samples)"] or 0)
reasons = [k for k in rows[0] if k.startswith("stall_") and "Not Issued" not in k]
total = sum(map(samples, rows))
def top(group, n=4):
    s = sum(map(samples, group)) or 1
    sums = sorted(((sum(float(r[k] or 0) for r in group), k[6:]) for k in reasons),
                  reverse=True)
    return " ".join(f"{k} {v / s:.0%}" for v, k in sums[:n])
print(f"{len(rows)} instructions, {total:.0f} samples; {top(rows, 8)}")
print("regions between barriers (share of samples, warp instructions per warp):")
warps = float(rows[0]["Instructions Executed"])  # the first instruction: once per warp
cuts = [0] + [i + 1 for i, r in enumerate(rows)
              if any(w in r["Source"] for w in ("BAR.SYNC", "SYNCS.", "DEPBAR", "UCGABAR"))]
for a, b in zip(cuts, cuts[1:] + [len(rows)]):
    group = rows[a:b]
    share = sum(map(samples, group)) / total
    if group and share >= 0.004:
        executed = sum(float(r["Instructions Executed"] or 0) for r in group) / warps
        print(f"  {a:5d}-{b - 1:5d} {share:6.1%} {executed:7.1f}  {top(group)}")
print("instructions by samples:")
for i, r in sorted(enumerate(rows), key=lambda x: -samples(x[1]))[:40]:
    print(f"  {samples(r) / total:6.1%} #{i:5d} {r['Source'].strip()[:70]}")
PY
  head -25 "$OUT/$name.txt"
done
