#!/bin/bash
# CPU speed of the multi30k-full preset's 8,192-token step cut into K batches of 8,192 / K
# tokens, accumulated (docs/multi30k_converged.md, "A step in parts"): one process, the
# default threads, ROUNDS interleaved rounds of 50 steps each; prints steps/s and real target
# tokens/s over steps 10-50. Run alone, from the repo root, on a prepared Multi30k (a recipe
# run's OUT/data).   usage: bash benchmarks/train_parts_speed.sh DATA_DIR [ROUNDS]
set -euo pipefail
DATA=$1; ROUNDS=${2:-2}
PY=${PY:-.venv/bin/python}
lscpu | sed -n 's/^Model name: *//p'; grep -o 'avx512_bf16\|amx_bf16\|avx512f\|avx2' /proc/cpuinfo | sort -u | tr '\n' ' '; echo; uptime
tmp=$(mktemp -d)
for round in $(seq "$ROUNDS"); do
  for spec in 8192:1 4096:2 2731:3 2048:4; do
    IFS=: read -r tok acc <<< "$spec"
    d=$tmp/${tok}_${acc}_$round
    "$PY" -m transformer train "$DATA" --preset multi30k-full --out "$d" --max-steps 50 \
      train.max_tokens="$tok" train.accum_steps="$acc" train.valid_every_steps=100000 \
      train.save_every_steps=100000 train.log_every_steps=10 > "$d.log" 2>&1
    "$PY" - "$d" "$tok" "$acc" "$round" <<'PY'
import sys
from transformer.rundir import read_metrics
rows = [r for _, r in read_metrics(sys.argv[1], "train")]
dt = rows[-1]["time"] - rows[0]["time"]
steps, toks = rows[-1]["step"] - rows[0]["step"], rows[-1]["tokens"] - rows[0]["tokens"]
print(f"round {sys.argv[4]} {sys.argv[2]}x{sys.argv[3]}: {steps / dt:.3f} steps/s, "
      f"{toks / dt:,.0f} real target tok/s, {toks / steps:,.0f} tok/step")
PY
  done
done
uptime; rm -rf "$tmp"
