#!/usr/bin/env bash
# A refactor proves it changed nothing (CONTRIBUTING.md): run this at the commit before and at
# the commit after, and compare the two outputs. It trains the quickstart preset on Multi30k
# deterministically (one thread, fixed seed, 200 steps, a checkpoint every 50 steps and none on
# the clock), prints the sha256 of every checkpoint's parameters, averages the last 3 and prints
# the sha256 of the beam-4 translations of test_2016_flickr.
#   scripts/check_no_behaviour_change.sh OUT_DIR [extra translate flags, e.g. --stop fairseq]
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:?usage: scripts/check_no_behaviour_change.sh OUT_DIR [translate flags]}
shift
M30K=${M30K:-../shared/data/multi30k}
T=.venv/bin/transformer
rm -rf "$OUT" && mkdir -p "$OUT"
$T prepare multi30k --src en --tgt de --from "$M30K" --out "$OUT/data" > "$OUT/prepare.log" 2>&1
$T train "$OUT/data" --preset quickstart --out "$OUT/run" train.deterministic=true train.seed=1 \
  train.dtype=bf16 train.save_every_steps=50 train.save_every_minutes=1e9 --max-steps 200 \
  > "$OUT/train.log" 2>&1
.venv/bin/python - "$OUT/run/checkpoints" <<'PY'
import hashlib, sys
from pathlib import Path
import torch
for path in sorted(Path(sys.argv[1]).glob("ckpt_*.pt"), key=lambda p: int(p.stem.split("_")[1])):
    model = torch.load(path, weights_only=True, map_location="cpu")["model"]
    h = hashlib.sha256()
    for key in sorted(model):
        h.update(key.encode()); h.update(model[key].float().numpy().tobytes())
    print(f"{path.name}  parameters sha256 {h.hexdigest()}")
PY
$T average "$OUT/run" --last 3 --out "$OUT/average.safetensors" > "$OUT/average.log" 2>&1
$T translate "$OUT/average.safetensors" --beam 4 --alpha 0.6 --dtype fp32 "$@" < "$M30K/test_2016_flickr.en" \
  > "$OUT/test.hyp" 2> "$OUT/translate.log"
echo "test_2016_flickr translations ($(wc -l < "$OUT/test.hyp") lines) sha256 $(sha256sum < "$OUT/test.hyp" | cut -c1-64)"
