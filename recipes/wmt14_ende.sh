#!/usr/bin/env bash
# WMT14 English-German, the paper's §5.1 setup: ~4.5M pairs, joint BPE of 37,000,
# dev newstest2013, test newstest2014. Needs internet and ~2 GB of disk.
#
#   bash recipes/wmt14_ende.sh [OUT_DIR]
#
# Downloads the Stanford NLP release of WMT14 En-De (Luong et al. 2015; Moses-tokenized, with
# ##AT##-##AT## hyphen splitting) with resume, then prepares it. Re-running resumes partial
# downloads and reuses a finished preparation.
set -euo pipefail
OUT=${1:-data/wmt14_en_de}
transformer prepare wmt14 --src en --tgt de --out "$OUT" \
  --download-dir "$OUT.downloads" --vocab-size 37000 --spm-type bpe
