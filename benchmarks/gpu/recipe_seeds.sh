#!/bin/bash
# Several `transformer recipe multi30k-full` runs at once on one lent GPU (docs/multi30k_converged.md,
# "On a GPU: the spread of one run"). Run on the GPU machine from the repo root, after carrying:
#   .device/multi30k   Multi30k's raw files (cp -r ../shared/data/multi30k .device/)
#   .device/m30kdata   the same data prepared once here (a recipe run's OUT/data)
#   .device/site       sacremoses (pip download --no-deps sacremoses==0.2.0; unzip the wheel)
# usage: bash benchmarks/gpu/recipe_seeds.sh MINUTES NAME:"key=value ..." ...
# Each run trains at most MINUTES - 5 minutes; $OUT/res.tgz gets every run's recipe.json,
# log and metrics, and a line per run is printed. A run the 555-s limit stops before its choices
# on val keeps its checkpoints in /tmp/r/NAME: benchmarks/gpu/score_run.py scores them.
export PYTHONPATH=$PWD/src:$PWD/.device/site PYTHONUNBUFFERED=1 OMP_NUM_THREADS=1
MIN=$1; shift
source benchmarks/gpu/mps_start.sh
python3 -c 'import sacrebleu; print("sacrebleu", sacrebleu.__version__)'
mkdir -p /tmp/r
for spec in "$@"; do
  name=${spec%%:*}; ovr=${spec#*:}
  mkdir -p /tmp/r/$name && cp -r .device/m30kdata /tmp/r/$name/data
  # shellcheck disable=SC2086  # $ovr is a list of overrides
  ( timeout 555 python3 -m transformer recipe multi30k-full $ovr --out /tmp/r/$name \
      --minutes $MIN --data-from .device/multi30k > /tmp/r/$name/log.txt 2>&1
    echo "$name rc=$?" ) &
done
sleep 20; nvidia-smi --query-gpu=utilization.gpu,memory.used --format=csv,noheader
wait
cd /tmp/r && tar czf $OUT/res.tgz */recipe.json */log.txt */run/*.jsonl */run/config* 2>/dev/null
for d in */; do python3 - "$d" <<'PY'
import json, sys
d = sys.argv[1]
try:
    r = json.load(open(d + "recipe.json"))
except OSError as e:
    raise SystemExit(f"{d} no report: {e}")
s, t = r["scores"], r["train"]
val, test = s["val"], s["test_2016_flickr"]
print(d, "steps", t["steps"], "epochs %.1f" % t["epochs"], "alpha", r["alpha"],
      "window", r["averaged_checkpoints"][0], len(r["averaged_checkpoints"]),
      "val %.2f/%.2f" % (val["bleu"], val["bleu_lc"]),
      "test %.2f/%.2f tok-lc %.2f" % (test["bleu"], test["bleu_lc"], test["tok_bleu_lc"]))
PY
done
