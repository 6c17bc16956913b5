#!/usr/bin/env bash
# Ours next to the peers (fairseq, HF Marian, OpenNMT-py, nn.Transformer, CTranslate2) in the
# peers' own harness (../shared/peers, see its RESULTS.md): training and memory in ONE process,
# interleaved round-robin, median of --reps; translation (W2) one process per variant in
# interleaved rounds (below). Our side: benchmarks/peers_adapter.py.
# Install the peers first (pip extra `peers` + the fairseq/OpenNMT-py steps in docs/performance.md).
#
#   bash benchmarks/bench_peers.sh            # everything (~25 min on the 2-core CPU)
#   bash benchmarks/bench_peers.sh train      # or: train-fp32 | train-each | beam | greedy | memory
#   OURS_TRAIN=ext:peers_adapter:make_train_torch_layouts,ext:peers_adapter:make_train \
#     bash benchmarks/bench_peers.sh train    # W1 before/after the row-major weight gradients
#   OURS_TRAIN=ext:peers_adapter:make_train_torch_ops,ext:peers_adapter:make_train \
#     bash benchmarks/bench_peers.sh train    # W1 before/after the fused kernels (round 27)
#   OURS_TRAIN=ext:peers_adapter:make_train_lanes_attention,ext:peers_adapter:make_train \
#     bash benchmarks/bench_peers.sh train    # W1 before/after the attention's dot products (r65)
set -euo pipefail
cd "$(dirname "$0")/.."
PEERS=${PEERS_DIR:-../shared/peers}
PY=${PY:-.venv/bin/python}
OUT=${OUT:-benchmarks/results/peers}
REPS=${REPS:-3}
export PYTHONPATH=$PWD/benchmarks${PYTHONPATH:+:$PYTHONPATH}
mkdir -p "$OUT"
OURS_TRAIN=${OURS_TRAIN:-ext:peers_adapter:make_train}
# Peers per workload (RESULTS.md measured hf:fp32/hf:bf16/ct2:int16 too; they are slower than
# ct2:int8, the target, and take minutes per round). Override to run them all.
BEAM_PEERS=${BEAM_PEERS:-ct2:float32,ct2:int8}
GREEDY_PEERS=${GREEDY_PEERS:-ct2:float32,ct2:int8,hf:bf16}
WHAT=${1:-all}
echo "# $(date -u +%FT%TZ) load average: $(cut -d' ' -f1-3 /proc/loadavg)"
$PY -c 'from bench_contention import cpu_line; print("#", cpu_line())'
# A CPU without native bf16 products (no avx512_bf16, no AMX: an AVX2 Zen 3) runs every
# implementation's bf16 through slow fallbacks (a base training step takes minutes, W2 beam 4 in
# bf16 115 s against fp32's 16): there the bf16 workloads (train, memory, our bf16 decoding) run in
# fp32 instead, and say so (docs/performance.md, "A CPU without bf16"). BF16=1 keeps bf16 anyway.
NATIVE_BF16=$($PY -c 'from transformer.cpuinfo import native_bf16; print(" ".join(native_bf16()))')
BF16_DTYPE=bf16
if [[ -z $NATIVE_BF16 && ${BF16:-0} != 1 ]]; then
  BF16_DTYPE=fp32
  echo "# no native bf16 on this CPU (no avx512_bf16 or amx_bf16): W1 and W3 in fp32, no bf16 decoding"
  OURS_INFER=${OURS_INFER:-ext:peers_adapter:Infer:fp32,ext:peers_adapter:Infer:int8}
fi
OURS_INFER=${OURS_INFER:-ext:peers_adapter:Infer:fp32,ext:peers_adapter:Infer:bf16,ext:peers_adapter:Infer:int8}

run() { [[ $WHAT == all || $WHAT == "$1" ]]; }

if run train && [[ $WHAT == train || $BF16_DTYPE == bf16 ]]; then  # `all`: train-fp32 runs next
  $PY $PEERS/bench_train.py --impl fairseq,hf,torch,onmt,$OURS_TRAIN --dtype $BF16_DTYPE \
    --warmup 1 --reps "$REPS" --json "$OUT/w1_train_$BF16_DTYPE.json"
fi
# W1 with each implementation in its own process, interleaved rounds (bench_w1_processes.py):
# in the harness's one process the peers slow one another by ~15-20% (docs/performance.md,
# "Round sixteen"); this is the reading without that. Not part of `all`: name it.
if [[ $WHAT == train-each ]]; then
  PEERS_DIR=$PEERS $PY benchmarks/bench_w1_processes.py --python "$PY" \
    --impl fairseq,hf,torch,onmt,$OURS_TRAIN --dtype $BF16_DTYPE --reps "${W1_EACH_REPS:-3}" \
    --rounds "${W1_ROUNDS:-2}" --json "$OUT/w1_train_${BF16_DTYPE}_each.json"
fi
if run train-fp32; then
  $PY $PEERS/bench_train.py --impl fairseq,hf,torch,onmt,$OURS_TRAIN --dtype fp32 \
    --warmup 1 --reps "$REPS" --json "$OUT/w1_train_fp32.json"
fi
# W2: by default each variant runs in its own process (bench_w2_processes.py, W2_ROUNDS
# interleaved rounds of REPS runs): in one process CTranslate2 binds torch's OpenMP runtime and
# its idle team makes libgomp throttle every thread's spin-wait, which slows whatever runs beside
# it (docs/performance.md, "Round eight"). W2_PROCESS=one runs the harness as it comes, every
# variant in one process, and measures token agreement against the first variant (ct2:float32,
# equal to hf:fp32, RESULTS.md).
w2() {  # beams json-name peers
  if [[ ${W2_PROCESS:-each} == one ]]; then
    $PY $PEERS/bench_infer.py --variants "$3,$OURS_INFER" --beams "$1" --reps "$REPS" \
      --json "$OUT/$2"
  else
    PEERS_DIR=$PEERS $PY benchmarks/bench_w2_processes.py --python "$PY" --variants "$3,$OURS_INFER" \
      --beams "$1" --reps "$REPS" --rounds "${W2_ROUNDS:-2}" --json "$OUT/$2"
  fi
}
if run beam; then
  w2 4 w2_infer_beam4.json "$BEAM_PEERS"
fi
if run greedy; then
  w2 1 w2_infer_greedy.json "$GREEDY_PEERS"
fi
if run memory; then
  $PY $PEERS/bench_memory.py --impl hf,torch,$OURS_TRAIN --dtype $BF16_DTYPE --sents 128 \
    --json "$OUT/w3_mem_4k_$BF16_DTYPE.json"
  $PY $PEERS/bench_memory.py --impl hf,torch,$OURS_TRAIN --dtype $BF16_DTYPE --sents 512 \
    --json "$OUT/w3_mem_16k_$BF16_DTYPE.json"
fi
echo "# $(date -u +%FT%TZ) load average: $(cut -d' ' -f1-3 /proc/loadavg)"
