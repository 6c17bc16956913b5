"""Table 2: analytic FLOPs counted by hand and by torch's FlopCounterMode; the paper's estimate."""

from __future__ import annotations

import json

import pytest
import torch
import yaml
from torch.utils.flop_counter import FlopCounterMode

from transformer.config import ModelConfig, RunConfig, to_dict
from transformer.errors import UserError
from transformer.experiments.flops import (
    PAPER_TABLE2_FLOPS,
    forward_flops_per_src_token,
    forward_flops_per_tgt_token,
    paper_estimate,
    paper_report,
    run_report,
    training_flops,
)
from transformer.model import Transformer

# N=1, D=4, d_ff=8, h=2, d_k=3, d_v=5, V=10: small enough to count on paper.
TINY = ModelConfig(vocab_size=10, n_layers=1, d_model=4, d_ff=8, n_heads=2, d_k=3, d_v=5)


def test_hand_counted_tiny_config() -> None:
    # Hand count, S=6, T=7 (2 FLOPs per multiply-add):
    #   W^Q 2*4*(2*3)=48, W^K+W^V 2*4*(2*(3+5))=128, W^O 2*(2*5)*4=80, FFN 2*2*4*8=128,
    #   attention products per query 2*2*(3+5)*keys = 32*keys.
    #   source token: encoder 48+128+80+32*6+128 = 576, plus cross-attention K,V 128 -> 704.
    #   target token: self 48+128+80+32*7 = 480, cross 48+80+32*6 = 320, FFN 128,
    #   output 2*4*10 = 80 -> 1008.
    assert forward_flops_per_src_token(TINY, 6) == 704
    assert forward_flops_per_tgt_token(TINY, 6, 7) == 1008
    assert training_flops(TINY, 60, 70, 6, 7) == 3 * (60 * 704 + 70 * 1008)


@pytest.mark.parametrize("backward", [False, True])
def test_count_equals_torch_flop_counter(backward: bool) -> None:
    cfg = ModelConfig(vocab_size=11, n_layers=2, d_model=8, d_ff=12, n_heads=2, d_k=3, d_v=5)
    model = Transformer(cfg)
    src, tgt = torch.randint(4, 11, (1, 6)), torch.randint(4, 11, (1, 7))
    with FlopCounterMode(display=False) as counter:
        logits = model.project(model(src, torch.ones(1, 6, dtype=torch.bool), tgt))
        if backward:
            logits.sum().backward()
    expected = training_flops(cfg, 6, 7, 6, 7)  # one sentence: tokens = lengths
    assert counter.get_total_flops() == (expected if backward else expected / 3)


def test_paper_arithmetic() -> None:
    # Table 2 footnote 5 and §5.2: 12 h x 8 P100 x 9.5 TFLOPS; 3.5 days x 8 x 9.5 TFLOPS.
    assert paper_estimate(12, 8, 9.5) == pytest.approx(12 * 3600 * 8 * 9.5e12)
    assert paper_estimate(12, 8, 9.5) == pytest.approx(3.2832e18)
    assert paper_estimate(3.5 * 24, 8, 9.5) == pytest.approx(2.29824e19)
    for preset, printed in PAPER_TABLE2_FLOPS.items():
        report = paper_report(preset)
        assert f"{report.estimated_flops:.1e}" == f"{printed:.1e}"  # rounds to the printed value
        assert 0.0 < report.mfu < 1.0  # the count must fit under the estimate


def test_run_report_reads_run_dir(tmp_path) -> None:
    cfg = RunConfig(model=TINY)
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(to_dict(cfg)))
    # The trainer's format: cumulative target tokens, window throughput; valid lines ignored.
    records = [
        {"kind": "train", "step": 2, "tokens": 40, "tokens_per_s": 10.0},
        {"kind": "valid", "step": 2, "loss": 3.0},
        {"kind": "train", "step": 5, "tokens": 140, "tokens_per_s": 2.0},
    ]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    report = run_report(tmp_path, device_tflops=1.0, src_len=6, tgt_len=7)
    assert report.steps == 5
    # Source tokens = target tokens x 6/7; time = 40/10 + 100/2 = 54 s.
    assert report.analytic_flops == pytest.approx(training_flops(TINY, 120, 140, 6, 7))
    assert report.estimated_flops == pytest.approx(54.0 * 1e12)


def test_run_report_errors_name_the_file(tmp_path) -> None:
    with pytest.raises(UserError, match="config.yaml"):
        run_report(tmp_path, device_tflops=1.0)
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(to_dict(RunConfig(model=TINY))))
    (tmp_path / "metrics.jsonl").write_text('{"kind": "valid", "step": 1}\nnot json\n')
    with pytest.raises(UserError, match="metrics.jsonl:2"):
        run_report(tmp_path, device_tflops=1.0)


def test_the_analytic_counts_do_not_import_torch():
    # benchmarks/issue19_summary.py counts a W1 step's FLOPs with training_flops: ~0.1 s, not
    # the ~2.5 s of torch's import (rundir's), which only run_report needs.
    import subprocess
    import sys

    code = (
        "import sys\n"
        "from transformer.config import build_config\n"
        "from transformer.experiments.flops import training_flops\n"
        "cfg = build_config('base', None, [], vocab_size=32000).model\n"
        "assert training_flops(cfg, 100, 100, 20.0, 20.0) > 0\n"
        "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True, timeout=120)  # fmt: skip
    assert done.stdout.strip() == "[]"
