#!/usr/bin/env bash
# WMT14 English-French, the paper's §5.1 setup: 36M pairs, 32,000 word-piece vocabulary
# (sentencepiece unigram), dev newstest2013, test newstest2014. Needs internet and ~25 GB.
#
#   bash recipes/wmt14_enfr.sh [OUT_DIR]
#
# Downloads the statmt.org archives (Europarl v7, CommonCrawl, UN, News Commentary v9,
# Giga-FrEn, dev, test-full) with resume, concatenates the training corpora in that order
# (as fairseq's prepare-wmt14en2fr.sh does), extracts newstest2014 from its .sgm files, then
# prepares. sentencepiece is trained on a 1M-sentence sample; raise --spm-sample if you like.
set -euo pipefail
OUT=${1:-data/wmt14_en_fr}
transformer prepare wmt14 --src en --tgt fr --out "$OUT" \
  --download-dir "$OUT.downloads" --vocab-size 32000 --spm-type unigram --threads 8
