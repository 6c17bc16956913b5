#!/usr/bin/env bash
# Ours next to the peers (fairseq, HF Marian, OpenNMT-py, nn.Transformer, CTranslate2), each
# workload in ONE process of the peers' own harness (../shared/peers, see its RESULTS.md),
# interleaved round-robin, median of --reps. Our side: benchmarks/peers_adapter.py.
# Install the peers first (pip extra `peers` + the fairseq/OpenNMT-py steps in docs/performance.md).
#
#   bash benchmarks/bench_peers.sh            # everything (~25 min on the 2-core CPU)
#   bash benchmarks/bench_peers.sh train      # or: train-fp32 | beam | greedy | memory
set -euo pipefail
cd "$(dirname "$0")/.."
PEERS=${PEERS_DIR:-../shared/peers}
PY=${PY:-.venv/bin/python}
OUT=${OUT:-benchmarks/results/peers}
REPS=${REPS:-3}
export PYTHONPATH=$PWD/benchmarks${PYTHONPATH:+:$PYTHONPATH}
mkdir -p "$OUT"
OURS_TRAIN=ext:peers_adapter:make_train
OURS_INFER=${OURS_INFER:-ext:peers_adapter:Infer:fp32,ext:peers_adapter:Infer:bf16,ext:peers_adapter:Infer:int8}
# Peers per workload (RESULTS.md measured hf:fp32/hf:bf16/ct2:int16 too; they are slower than
# ct2:int8, the target, and take minutes per round). Override to run them all.
BEAM_PEERS=${BEAM_PEERS:-ct2:float32,ct2:int8}
GREEDY_PEERS=${GREEDY_PEERS:-ct2:float32,ct2:int8,hf:bf16}
WHAT=${1:-all}
echo "# $(date -u +%FT%TZ) load average: $(cut -d' ' -f1-3 /proc/loadavg)"
$PY -c 'from bench_contention import cpu_line; print("#", cpu_line())'

run() { [[ $WHAT == all || $WHAT == "$1" ]]; }

if run train; then
  $PY $PEERS/bench_train.py --impl fairseq,hf,torch,onmt,$OURS_TRAIN --dtype bf16 \
    --warmup 1 --reps "$REPS" --json "$OUT/w1_train_bf16.json"
fi
if run train-fp32; then
  $PY $PEERS/bench_train.py --impl fairseq,hf,torch,onmt,$OURS_TRAIN --dtype fp32 \
    --warmup 1 --reps "$REPS" --json "$OUT/w1_train_fp32.json"
fi
# Token agreement is measured against the first variant: ct2:float32 (equal to hf:fp32, RESULTS.md).
if run beam; then
  $PY $PEERS/bench_infer.py --variants $BEAM_PEERS,$OURS_INFER --beams 4 \
    --reps "$REPS" --json "$OUT/w2_infer_beam4.json"
fi
if run greedy; then
  $PY $PEERS/bench_infer.py --variants $GREEDY_PEERS,$OURS_INFER --beams 1 \
    --reps "$REPS" --json "$OUT/w2_infer_greedy.json"
fi
if run memory; then
  $PY $PEERS/bench_memory.py --impl hf,torch,$OURS_TRAIN --dtype bf16 --sents 128 \
    --json "$OUT/w3_mem_4k_bf16.json"
  $PY $PEERS/bench_memory.py --impl hf,torch,$OURS_TRAIN --dtype bf16 --sents 512 \
    --json "$OUT/w3_mem_16k_bf16.json"
fi
echo "# $(date -u +%FT%TZ) load average: $(cut -d' ' -f1-3 /proc/loadavg)"
