#!/bin/bash
# Is `--procs 3`'s lower dev curve (docs/multi30k_converged.md, run 13) the batches' doing? A
# step of run 13's three one-thread processes summed three batches of 8,192 / 3, each from its own
# length bucket; one process with `train.accum_steps=3` and the same per-batch tokens makes the
# same steps (the same batches, grouped the same way: batching.py shards batch r, r+W, ...). The
# `multi30k-full` preset on one lent GPU, several runs at once under MPS, one per
# NAME:TOKENS:ACCUM:SEED[:STEPS], STEPS steps each (the first argument unless the run names its
# own), dev perplexity every VALID (500) steps only (no BLEU, no early stopping).
# Carry: .device/m30k (a recipe run's OUT/data). Prints each run's dev perplexity curve.
# usage: [VALID=500] [LIMIT=500] bash benchmarks/gpu/batch_parts.sh STEPS NAME:TOKENS:ACCUM:SEED[:STEPS] ...
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1 OMP_NUM_THREADS=1
STEPS=$1; shift
source benchmarks/gpu/mps_start.sh
mkdir -p /tmp/bp
for spec in "$@"; do
  IFS=: read -r name tokens accum seed steps <<< "$spec"
  ( timeout ${LIMIT:-500} python3 -m transformer train .device/m30k --preset multi30k-full \
      --out /tmp/bp/$name --max-steps "${steps:-$STEPS}" train.max_tokens="$tokens" \
      train.accum_steps="$accum" train.seed="$seed" train.valid_every_steps=${VALID:-500} \
      train.valid_bleu=false train.patience=0 train.save_every_steps=100000 \
      train.log_every_steps=100 > /tmp/bp/$name.log 2>&1
    echo "$name rc=$?" ) &
done
sleep 60; nvidia-smi --query-gpu=utilization.gpu,memory.used --format=csv,noheader
wait
mkdir -p "$OUT/bp" && for d in /tmp/bp/*/; do cp "$d/metrics.jsonl" "$OUT/bp/$(basename "$d").jsonl"; done
cp /tmp/bp/*.log "$OUT/bp/" 2>/dev/null
python3 - "$@" <<'PY'
import sys
from transformer.errors import UserError
from transformer.rundir import read_metrics
for spec in sys.argv[1:]:
    name, tokens, accum, seed = spec.split(":")[:4]
    try:
        train = [r for _, r in read_metrics(f"/tmp/bp/{name}", "train")]
        valid = [r for _, r in read_metrics(f"/tmp/bp/{name}", "valid")]
    except UserError as e:
        print(name, "no metrics:", e)
        continue
    rate = sum(r["tokens_per_s"] for r in train[2:]) / max(len(train[2:]), 1)
    curve = " ".join(f"{r['step']}:{r['ppl']:.2f}" for r in valid)
    print(f"{name} {tokens}x{accum} seed {seed}: {train[-1]['step'] if train else 0} steps, "
          f"{rate:,.0f} tok/s; dev ppl {curve}")
PY
