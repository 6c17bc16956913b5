#!/usr/bin/env bash
# Everything a lent GPU's one call needs (check_head.sh), made here, before any device time is
# spent: the git-ignored folder .device that the call carries (~50 MB of the 64 MiB a call takes).
#   .device/fsite    fairseq 0.12.2's package with hydra-core 1.0.7, omegaconf 2.0.6 and antlr4 4.8,
#                    unpacked, with the two edits Python 3.12 needs (docs/performance.md, "GPU")
#   .device/site312  bitarray 3.12.3 for CPython 3.12 (the GPU image's Python), unpacked
#   .device/qs       QS's model without its int8 weights (CUDA decodes fp32 / bf16), Multi30k's
#                    test_2016_flickr, this CPU's fp32 beam-4 translation of it with the α QS chose
#                    on val (check_head.sh compares CUDA's line by line), and that α
# usage: bash benchmarks/gpu/prepare_device.sh QUICKSTART_OUT
# then, on the device: A=$(cat .device/qs/alpha); bash benchmarks/gpu/check_head.sh $A 2>&1 | tee $OUT/check_head.log
set -euo pipefail
cd "$(dirname "$0")/../.."
QS=${1:?usage: bash benchmarks/gpu/prepare_device.sh QUICKSTART_OUT}
M30K=${M30K:-../shared/data/multi30k}
PY=.venv/bin/python
fail() { echo "prepare_device.sh: $*" >&2; exit 2; }
[[ -x $PY ]] || fail "$PY not found: install first (the README's first lines)"
for f in "$QS/model.safetensors" "$QS/quickstart.json" "$M30K/test_2016_flickr.en"; do
  [[ -f $f ]] || fail "$f not found"
done
ALPHA=$($PY benchmarks/quickstart_alpha.py "$QS/quickstart.json" prepare_device.sh) || exit 2
DL=$(mktemp -d)
trap 'rm -rf "$DL"' EXIT
rm -rf .device/fsite .device/site312 .device/qs
mkdir -p .device/fsite .device/site312 .device/qs
$PY -m pip download -q --no-deps fairseq==0.12.2 hydra-core==1.0.7 omegaconf==2.0.6 \
  antlr4-python3-runtime==4.8 -d "$DL" > "$DL/pip.log" 2>&1 \
  || fail "pip download of fairseq 0.12.2 and its dependencies failed: $(grep -m1 ERROR "$DL/pip.log")"
$PY -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 -d "$DL" bitarray==3.12.3 \
  > "$DL/pip.log" 2>&1 || fail "pip download of bitarray 3.12.3 failed: $(grep -m1 ERROR "$DL/pip.log")"
tar xzf "$DL"/fairseq-0.12.2.tar.gz -C "$DL" && tar xzf "$DL"/antlr4-python3-runtime-4.8.tar.gz -C "$DL"
cp -r "$DL"/fairseq-0.12.2/fairseq "$DL"/antlr4-python3-runtime-4.8/src/antlr4 .device/fsite
(cd .device/fsite && unzip -q "$DL"/hydra_core-1.0.7-*.whl && unzip -q "$DL"/omegaconf-2.0.6-*.whl)
(cd .device/site312 && unzip -q "$DL"/bitarray-3.12.3-*.whl)
# typing.io is gone in 3.13; find_module / load_module in 3.12 (hydra's plugin scanner)
sed -i 's/from typing\.io import/from typing import/' .device/fsite/antlr4/{Lexer,Parser}.py \
  .device/fsite/hydra/grammar/gen/Override{Lexer,Parser}.py
$PY - .device/fsite/hydra/core/plugins.py <<'PY'
import sys
path = sys.argv[1]
text = open(path, encoding="utf-8").read()
text = text.replace("                    m = importer.find_module(modname)\n", "")
text = text.replace("m.load_module(modname)", "importlib.import_module(modname)")
assert "\nimport importlib\n" in text and "find_module" not in text, path  # imported there already
open(path, "w", encoding="utf-8").write(text)
PY

echo "$ALPHA" > .device/qs/alpha
cp "$M30K/test_2016_flickr.en" .device/qs/test.en.txt
cp "$M30K/test_2016_flickr.de" .device/qs/test.de.txt
PYTHONPATH=src $PY - "$QS/model.safetensors" .device/qs/model.safetensors <<'PY'
import sys
from pathlib import Path
from transformer.modelfile import load_model, save_model
m = load_model(Path(sys.argv[1]))
save_model(Path(sys.argv[2]), m.model, m.config, m.spm_proto, m.src_lang, m.tgt_lang)
PY
.venv/bin/transformer translate .device/qs/model.safetensors .device/qs/test.en.txt --dtype fp32 \
  --beam 4 --alpha "$ALPHA" > .device/qs/test_2016_flickr.de.hyp 2> "$DL/translate.log" \
  || fail "the CPU's reference translation failed: $(tail -1 "$DL/translate.log")"
echo "prepare_device.sh: .device ready ($(du -sm .device | cut -f1) MB; α $ALPHA); on the device:"
echo '  A=$(cat .device/qs/alpha); bash benchmarks/gpu/check_head.sh $A 2>&1 | tee $OUT/check_head.log'
