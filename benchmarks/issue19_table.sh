#!/usr/bin/env bash
# Issue 19's "must show" on this machine in one command (docs/performance.md, "Round four"):
# the CPU and its load, W0 (matmul rates), W1 / W2 beam 4 / W2 greedy / W3 against the peers
# (bench_peers.sh), contention (train and translate, alone and beside a busy process, median of
# rounds), a training step's pieces and one process's bound, and each precision's BLEU against
# fp32 with a trained quickstart model. Run it alone on the machine (`uptime` first): ~13 min
# on a 2-core Zen 5.
#
#   QS=QUICKSTART_OUT PY=PEERS_PYTHON bash benchmarks/issue19_table.sh OUT
#
# QS: a `transformer quickstart --out QS` directory (its data/, model.safetensors and
# quickstart.json, whose α chosen on val is the one the BLEU table decodes with). PY: the
# Python that has the peers installed (docs/performance.md, "Reproducing"); REPS (default 5);
# W2_ROUNDS (default 2: W2's interleaved rounds, each variant in its own process): on a host
# whose speed moves within minutes (docs/performance.md, "Round nineteen") W2_ROUNDS=6 reads
# the W2 rows steadier, for ~20 more minutes on a 2-core Zen 4; W1_ROUNDS (default 2) the same
# for W1 with a process per implementation (~3 minutes a round there; round seventy's table read
# 1.78x over two rounds, then 2.08x and 1.90x over four; round seventy-one's 1.99x over four,
# then 2.11x over four more: the peers' own speed moves too; round seventy-two's 1.86x over six,
# and pooled over rounds sixty-five to seventy-two 1.93x, results/peers_zen4/round72);
# SHARE_ROUNDS (default 8) the rounds of bench_w1_share.py (~9 s each on the AMX Xeon).
# Ends with the issue's table and a verdict per target (benchmarks/issue19_summary.py, from the
# JSON files in OUT), also written to OUT/summary.md.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:?usage: QS=QUICKSTART_OUT PY=PEERS_PYTHON bash benchmarks/issue19_table.sh OUT}
QS=${QS:?QS: a quickstart output directory (data/, model.safetensors, quickstart.json)}
PY=${PY:-.venv/bin/python}
OURS=.venv/bin/python
REPS=${REPS:-5}
for f in "$QS/data/manifest.json" "$QS/model.safetensors" "$QS/quickstart.json"; do
  [[ -f $f ]] || { echo "issue19_table.sh: $f not found (QS=$QS)" >&2; exit 2; }
done
mkdir -p "$OUT"
ALPHA=$($OURS benchmarks/quickstart_alpha.py "$QS/quickstart.json" issue19_table.sh)
# Every peer the rows compare against, imported before the ~25 minutes start: one that is not
# installed (fairseq's source tree, OpenNMT-py: docs/performance.md, "Reproducing") drops out of
# its rows, and a row without the fastest peer reads high (round forty-eight's first run had no
# fairseq). PEERS_MISSING_OK=1 runs anyway; the summary names who did not run.
if ! ABSENT=$($PY - 2>/dev/null <<'PY'
import importlib, logging, sys
sys.path.insert(0, "../shared/peers")
logging.disable(logging.WARNING)
absent = []
for name, load in (("fairseq", lambda: importlib.import_module("train_adapters").import_fairseq()),
                   ("onmt", lambda: importlib.import_module("onmt.encoders.transformer")),
                   ("hf", lambda: importlib.import_module("transformers")),
                   ("ct2", lambda: importlib.import_module("ctranslate2"))):
    try:
        load()
    except Exception as e:  # noqa: BLE001 -- any failure to import is the peer's absence
        absent.append(f"{name} ({type(e).__name__}: {e})")
print("; ".join(absent))
PY
); then
  echo "issue19_table.sh: $PY cannot run the peers' harness (PY: the peers' Python)" >&2; exit 2
fi
if [[ -n $ABSENT && ${PEERS_MISSING_OK:-0} != 1 ]]; then
  echo "issue19_table.sh: peers not importable with $PY: $ABSENT (PEERS_MISSING_OK=1 runs without them)" >&2
  exit 2
fi
DTYPES=fp32,int8
if [[ -n $($OURS -c 'from transformer.cpuinfo import native_bf16; print(*native_bf16())') ]]; then
  DTYPES=fp32,int8,bf16  # bf16 decoding only where the CPU multiplies bf16 natively
fi
note() { echo "# $(date -u +%FT%TZ) load average: $(cut -d' ' -f1-3 /proc/loadavg) | $*"; }
{
  note "machine"
  $OURS -c 'from transformer.cpuinfo import cpu_line; print("#", cpu_line())'
  lscpu | grep -E 'Model name|^CPU\(s\)|Flags' | cut -c1-200
} | tee "$OUT/machine.txt"
COMMIT=$(git rev-parse --short HEAD 2>/dev/null || echo '?')
# "(modified)": the code measured is not the commit's (docs and results do not count)
[[ -z $(git status --porcelain --untracked-files=no -- src benchmarks pyproject.toml 2>/dev/null) ]] \
  || COMMIT="$COMMIT (modified)"
$OURS - "$OUT/machine.json" "$COMMIT" <<'PY'
import json, os, sys, time
import torch
from transformer.cpuinfo import cpu_flags, cpu_line
record = {"cpu": cpu_line(), "amx": "amx_bf16" in cpu_flags(), "torch": torch.__version__,
          "commit": sys.argv[2], "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
          "load_average": round(os.getloadavg()[0], 2)}
with open(sys.argv[1], "w", encoding="utf-8") as f:
    json.dump(record, f, indent=1)
PY
note "W0" | tee "$OUT/w0.log"
# bf16's products only where the CPU multiplies bf16 natively: without it (a Zen 3) their
# fallback runs at ~1 GFLOP/s and W0 took 23 minutes, for a rate nothing here uses (fp32 there)
W0_DTYPES=fp32
[[ $DTYPES == *bf16* ]] && W0_DTYPES=fp32,bf16
$PY ../shared/peers/bench_matmul.py --threads 2 --dtypes "$W0_DTYPES" --json "$OUT/w0.json" 2>&1 \
  | tee -a "$OUT/w0.log"
# W1's share of W0 with both in the same minutes (bench_w1_share.py): on a guest whose speed
# moves within the half hour the W0 above and the harness's W1 step below can be minutes and a
# third of the host's speed apart (docs/performance.md, "Round fifty-four")
W1_DTYPE=fp32
[[ $DTYPES == *bf16* ]] && W1_DTYPE=bf16
note "W1 share: W0's products and our W1 steps alternated in one process" | tee "$OUT/w1_share.log"
PYTHONPATH=$PWD/benchmarks${PYTHONPATH:+:$PYTHONPATH} $PY benchmarks/bench_w1_share.py \
  --dtype "$W1_DTYPE" --rounds "${SHARE_ROUNDS:-8}" --json "$OUT/w1_share.json" 2>&1 \
  | tee -a "$OUT/w1_share.log"
for w in train train-each beam greedy memory; do
  note "$w" | tee "$OUT/$w.log"
  OUT=$OUT PY=$PY REPS=$REPS GREEDY_PEERS=${GREEDY_PEERS:-ct2:float32,ct2:int8} \
    bash benchmarks/bench_peers.sh "$w" 2>&1 | grep -v -i warn | tee -a "$OUT/$w.log"
done
note "contention" | tee "$OUT/contention.log"
$OURS benchmarks/bench_contention.py --data "$QS/data" --model "$QS/model.safetensors" \
  --lines 1014 --repeat 5 --rounds 3 --json "$OUT/contention.json" 2>&1 | tee -a "$OUT/contention.log"
note "step phases" | tee "$OUT/step_phases.log"
$OURS benchmarks/bench_step_phases.py --data "$QS/data" 2>&1 | tee -a "$OUT/step_phases.log"
note "BLEU of each precision, alpha $ALPHA" | tee "$OUT/dtype_bleu.log"
$OURS benchmarks/bench_decode.py --model "$QS/model.safetensors" --data "$QS/data" \
  --dtypes "$DTYPES" --beams 4,1 --reps 1 --alpha "$ALPHA" --json "$OUT/dtype_bleu.json" 2>&1 \
  | tee -a "$OUT/dtype_bleu.log"
note "done" | tee -a "$OUT/machine.txt"
$OURS benchmarks/issue19_summary.py "$OUT" | tee "$OUT/summary.md"
