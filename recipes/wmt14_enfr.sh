#!/usr/bin/env bash
# WMT14 English-French from raw text to both of the paper's BLEU numbers (§5.1, §6.1; Table 2:
# base 38.1, big 41.8), as the paper's tensor2tensor setup did:
#   - training data: the raw statmt.org releases Europarl v7, Common Crawl, UN, News Commentary
#     v9 and Giga-FrEn (36M pairs), each archive checked against its checksum (corpora.py);
#   - one joint sentencepiece unigram model of 32,000 word-pieces; dev newstest2013;
#   - test: the full newstest2014, 3,003 lines, read from test-full.tgz's SGML;
#   - train, average the last 5 checkpoints written 10 minutes apart (20 for big), evaluate:
#     sacreBLEU on detokenized output + the paper's tokenized BLEU (no compound split).
# Needs internet, ~25 GB of disk, and GPUs (big: 3.5 days on 8 P100 in §5.2). sentencepiece
# trains on a 1M-sentence sample (prepare --spm-sample).
#
#   bash recipes/wmt14_enfr.sh [DATA_DIR] [RUN_DIR]
#
# Optional environment: as recipes/wmt14_ende.sh (PRESET, LAST, TRAIN_ARGS, VOCAB (32000),
# THREADS (8), MIRROR, CHECKSUMS, BEAM, ALPHA). The paper's big En-Fr model used P_drop = 0.1:
# TRAIN_ARGS="model.p_drop=0.1".
set -euo pipefail
DATA=${1:-data/wmt14_en_fr}
PRESET=${PRESET:-base}
RUN=${2:-runs/wmt14_en_fr_$PRESET}
LAST=${LAST:-$([ "$PRESET" = big ] && echo 20 || echo 5)}

transformer prepare wmt14 --src en --tgt fr --out "$DATA" --download-dir "$DATA.downloads" \
  --vocab-size "${VOCAB:-32000}" --spm-type unigram --threads "${THREADS:-8}" \
  ${MIRROR:+--mirror "$MIRROR"} ${CHECKSUMS:+--checksums "$CHECKSUMS"}
# shellcheck disable=SC2086  # TRAIN_ARGS is a list of arguments
transformer train "$DATA" --preset "$PRESET" --out "$RUN" ${TRAIN_ARGS:-}
transformer average "$RUN" --last "$LAST"   # writes RUN/model.safetensors
transformer evaluate "$RUN/model.safetensors" --data "$DATA" --split test \
  ${BEAM:+--beam "$BEAM"} ${ALPHA:+--alpha "$ALPHA"} \
  --output "$RUN/newstest2014.hyp.fr" --json > "$RUN/newstest2014.json"
cat "$RUN/newstest2014.json"
