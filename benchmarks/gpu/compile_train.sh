#!/bin/bash
# `train.compile` on a GPU in a real run: the base preset on prepared Multi30k (token batches
# of every shape), eager then compiled, STEPS steps each; prints each run's target tokens/s from
# its metrics after the first LOG rows (the warm-up and the compiles) and in all.
# Carry: .device/m30k (a recipe run's OUT/data). usage: bash benchmarks/gpu/compile_train.sh [STEPS]
STEPS=${1:-300}
PRESET=${PRESET:-base}
MODES=${MODES:-false true}
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv,noheader
for c in $MODES; do
  rm -rf /tmp/ct_$c
  SECONDS=0
  timeout 170 ${PY:-python3} -m transformer train .device/m30k --preset $PRESET --out /tmp/ct_$c \
    --max-steps $STEPS train.dtype=bf16 train.compile=$c train.valid_every_steps=100000 \
    train.log_every_steps=25 train.save_every_steps=100000 > /tmp/ct_$c.log 2>&1
  echo "compile=$c rc=$? wall ${SECONDS} s"
  python3 - /tmp/ct_$c <<'PY'
import json, sys
rows = [json.loads(x) for x in open(sys.argv[1] + "/metrics.jsonl") if '"train"' in x]
late = rows[4:]
print(f"  steps {rows[-1]['step']}, tok/s after step {rows[3]['step']}: "
      f"{sum(r['tokens_per_s'] for r in late) / len(late):,.0f} (mean of {len(late)} windows); "
      f"first window {rows[0]['tokens_per_s']:,.0f}")
PY
done
