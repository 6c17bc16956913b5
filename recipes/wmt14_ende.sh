#!/usr/bin/env bash
# WMT14 English-German from raw text to both of the paper's BLEU numbers (§5.1, §6.1; Table 2:
# base 27.3, big 28.4), as the paper's tensor2tensor setup did:
#   - training data: the raw statmt.org releases Europarl v7, Common Crawl and News Commentary
#     v9 (4.5M pairs), each archive checked against its checksum (corpora.py);
#   - one joint sentencepiece BPE of 37,000 on the raw text; dev newstest2013 (dev.tgz);
#   - test: the full newstest2014, 3,003 lines, read from test-full.tgz's SGML;
#   - train, average the last 5 checkpoints written 10 minutes apart (20 for big), evaluate:
#     sacreBLEU on detokenized output + the paper's tokenized, compound-split BLEU.
# Needs internet, ~2 GB of disk for the data, and a GPU for training (12 h on 8 P100 in §5.2).
#
#   bash recipes/wmt14_ende.sh [DATA_DIR] [RUN_DIR]
#
# Optional environment: PRESET (base; big), LAST (5; 20 for big), TRAIN_ARGS (more `transformer
# train` arguments: --device cuda, key=value overrides), VOCAB (37000), THREADS (sentencepiece),
# MIRROR (a base URL serving statmt.org's paths), CHECKSUMS (a file of "<sha256|md5>  <name>"
# lines for a mirror that repacked its archives), BEAM / ALPHA (the model's: 4 / 0.6).
# Re-running resumes partial downloads, verifies finished ones, reuses a finished preparation.
set -euo pipefail
DATA=${1:-data/wmt14_en_de}
PRESET=${PRESET:-base}
RUN=${2:-runs/wmt14_en_de_$PRESET}
LAST=${LAST:-$([ "$PRESET" = big ] && echo 20 || echo 5)}

transformer prepare wmt14 --src en --tgt de --out "$DATA" --download-dir "$DATA.downloads" \
  --vocab-size "${VOCAB:-37000}" --spm-type bpe ${THREADS:+--threads "$THREADS"} \
  ${MIRROR:+--mirror "$MIRROR"} ${CHECKSUMS:+--checksums "$CHECKSUMS"}
# shellcheck disable=SC2086  # TRAIN_ARGS is a list of arguments
transformer train "$DATA" --preset "$PRESET" --out "$RUN" ${TRAIN_ARGS:-}
transformer average "$RUN" --last "$LAST"   # writes RUN/model.safetensors
transformer evaluate "$RUN/model.safetensors" --data "$DATA" --split test \
  ${BEAM:+--beam "$BEAM"} ${ALPHA:+--alpha "$ALPHA"} \
  --output "$RUN/newstest2014.hyp.de" --json > "$RUN/newstest2014.json"
cat "$RUN/newstest2014.json"
