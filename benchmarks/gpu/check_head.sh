#!/bin/bash
# One lent GPU, one call: the CUDA checks of HEAD, bench_gpu.py against fairseq and HF, the
# step's variants (step_variants.py: candidates for the GPU step, interleaved) and where a
# step's GPU time goes (profile_step.py). ~6-7 minutes on an H200 after the machine's start.
# Run on the GPU machine from the repo root, after carrying `.device` with (docs/performance.md, "GPU"):
#   .device/fsite      fairseq 0.12.2's `fairseq/` package, hydra-core 1.0.7, omegaconf 2.0.6,
#                      antlr4 4.8 (its src/antlr4), sacremoses 0.2.0 (unpacked)
#   .device/siteNNN    bitarray 3.12.3's cpNNN manylinux wheel, unpacked (NNN: 311, 312, 313)
#   .device/pt         pytest, pluggy, iniconfig, packaging wheels, unpacked (if the image lacks pytest)
#   .device/qs         a trained model.safetensors, test.en.txt, test.de.txt and the CPU's fp32
#                      beam-4 translation of test.en.txt (test_2016_flickr.de.hyp) with ALPHA
# usage: bash benchmarks/gpu/check_head.sh ALPHA 2>&1 | tee $OUT/check_head.log
#        ($OUT gets peers.log, variants.log, profile.log and translations.tgz: the device tool
#        brings back 8 files at most)
ALPHA=${1:-1.4}
V=$(python3 -c 'import sys; print(f"{sys.version_info[0]}{sys.version_info[1]}")')
export PYTHONPATH=$PWD/src:$PWD/.device/fsite:$PWD/.device/site$V:$PWD/.device/pt PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
python3 -c 'import sys, torch, transformers, sacrebleu; print(sys.version.split()[0], "torch", torch.__version__, "transformers", transformers.__version__, "sacrebleu", sacrebleu.__version__)'
echo "== the suite's CUDA tests (marked gpu)"
timeout 120 python3 -m pytest -q -p no:cacheprovider -p no:hydra_pytest -m gpu tests/unit 2>&1 | tail -3
echo "== search.row_argmax = argmax on CUDA"
python3 - <<'PY'
import torch
from transformer.search import row_argmax
g = torch.Generator(device="cuda").manual_seed(0)
bad = 0
for shape in [(1, 7), (64, 32000), (256, 32000), (3, 257), (5, 1)]:
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(shape, device="cuda", generator=g).to(dtype)
        x[0, -1] = x[0].max()  # a tie with an earlier maximum: argmax keeps the first
        if shape[1] > 3:
            x[-1, 2] = float("nan")  # NaN wins, the first NaN
            x[-1, 3] = float("nan")
        same = torch.equal(row_argmax(x), x.argmax(-1))
        bad += not same
        print(shape, dtype, "same" if same else "DIFFERENT")
print("row_argmax:", "all same" if bad == 0 else f"{bad} different")
PY
echo "== translate test_2016_flickr on CUDA (fp32 beam 4, bf16 beam 4, bf16 greedy)"
T=$(mktemp -d)
for spec in "fp32 4" "bf16 4" "bf16 1"; do
  set -- $spec
  /usr/bin/time -f "%e s" python3 -m transformer translate .device/qs/model.safetensors .device/qs/test.en.txt \
    --dtype $1 --beam $2 --alpha $ALPHA > $T/test.$1.b$2.hyp 2> $T/translate.$1.b$2.log
  tail -1 $T/translate.$1.b$2.log
  python3 - $T/test.$1.b$2.hyp "$1 beam $2" <<'PY'
import sys, sacrebleu
hyp = open(sys.argv[1]).read().splitlines()
ref = open(".device/qs/test.de.txt").read().splitlines()
cpu = open(".device/qs/test_2016_flickr.de.hyp").read().splitlines()
same = sum(a == b for a, b in zip(hyp, cpu, strict=True))
print(f"{sys.argv[2]}: {len(hyp)} lines, BLEU {sacrebleu.corpus_bleu(hyp, [ref]).score:.2f}, "
      f"{same} of {len(cpu)} lines as the CPU's fp32 beam 4")
PY
done
tar czf $OUT/translations.tgz -C $T . && rm -rf $T
echo "== bench_gpu.py: ours, fairseq, hf"
timeout 330 python3 -W ignore benchmarks/bench_gpu.py --peers fairseq,hf 2>&1 | tee $OUT/peers.log | grep -v "^ *$"
echo "== step_variants.py: head, per-tensor collect_grads, bias gradients as products, fused norms"
timeout 200 python3 -W ignore benchmarks/gpu/step_variants.py 2>&1 | tee $OUT/variants.log
echo "== profile_step.py (the whole table in profile.log)"
timeout 90 python3 -W ignore benchmarks/gpu/profile_step.py > $OUT/profile.log 2>&1
grep -E "^=====|Self CUDA time total" $OUT/profile.log
