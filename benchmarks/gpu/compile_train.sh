#!/bin/bash
# `train.compile` on a GPU in a real run: the base preset on prepared Multi30k (token batches
# of every shape; batches are cut once, so the first epoch shows every shape the run will see),
# eager then compiled, STEPS steps each; prints each run's target tokens/s from its metrics after
# the first 4 log windows (the warm-up and the compiles) and in all, its wall time to each
# validation, its dev perplexity every VALID steps (default: none) and, compiled, how many times
# dynamo recompiled (TORCH_LOGS=recompiles). Each run stops after LIMIT seconds (default 170).
# Carry: .device/m30k (a recipe run's OUT/data).
# usage: [VALID=250] [LIMIT=170] [PRESET=base] [MODES="false true"] bash benchmarks/gpu/compile_train.sh [STEPS]
STEPS=${1:-300}
PRESET=${PRESET:-base}
MODES=${MODES:-false true}
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv,noheader
python3 -c 'import torch; print("torch", torch.__version__)'
for c in $MODES; do
  rm -rf /tmp/ct_$c
  SECONDS=0
  TORCH_LOGS=recompiles timeout ${LIMIT:-170} ${PY:-python3} -m transformer train .device/m30k \
    --preset $PRESET --out /tmp/ct_$c --max-steps $STEPS train.dtype=bf16 train.compile=$c \
    train.valid_every_steps=${VALID:-100000} train.valid_bleu=false train.patience=0 \
    train.log_every_steps=25 train.save_every_steps=100000 > /tmp/ct_$c.log 2>&1
  echo "compile=$c rc=$? wall ${SECONDS} s; recompiles logged: $(grep -c 'Recompiling' /tmp/ct_$c.log)"
  if [ -n "$OUT" ]; then cp /tmp/ct_$c.log "$OUT/"; cp /tmp/ct_$c/metrics.jsonl "$OUT/ct_$c.jsonl"; fi
  python3 - /tmp/ct_$c <<'PY'
import sys
from transformer.rundir import read_metrics
rows = [r for _, r in read_metrics(sys.argv[1], "train")]
late = rows[4:]
print(f"  steps {rows[-1]['step']}, tok/s after step {rows[3]['step']}: "
      f"{sum(r['tokens_per_s'] for r in late) / len(late):,.0f} (mean of {len(late)} windows); "
      f"first window {rows[0]['tokens_per_s']:,.0f}")
valid = [r for _, r in read_metrics(sys.argv[1], "valid")]
if valid:
    t0 = rows[0]["time"]  # the end of the first log window
    print(f"  dev ppl (step:ppl@seconds after step {rows[0]['step']}) "
          + " ".join(f"{r['step']}:{r['ppl']:.2f}@{r['time'] - t0:.0f}" for r in valid))
PY
done
