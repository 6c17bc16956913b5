"""benchmarks/issue19_summary.py: issue 19's table and verdicts from issue19_table.sh's JSON."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "issue19_summary.py"
OURS_TRAIN = "ext:peers_adapter:make_train"
BATCH = {"sents": 128, "src_padded": 34, "tgt_padded": 34, "src_tokens": 3886, "tgt_tokens": 3826}


def _stats(xs: list[float]) -> dict:
    s = sorted(xs)
    return {"median": s[len(s) // 2], "min": s[0], "max": s[-1], "n": len(s), "all": xs}


def _write(out: Path, name: str, record: dict) -> None:
    (out / name).write_text(json.dumps(record), encoding="utf-8")


def _table(out: Path, amx: bool = False, bleu_change: float = 0.05, mem: float = 2258.0) -> Path:
    """A complete OUT as issue19_table.sh writes it (the fields the summary reads)."""
    out.mkdir(parents=True, exist_ok=True)
    _write(out, "machine.json", {"cpu": "Test CPU, 2 cores", "amx": amx, "torch": "2.13.0",
                                 "commit": "abc1234", "started": "2026-11-27T00:00:00Z",
                                 "load_average": 0.5})  # fmt: skip
    w0 = [{"shape": s, "dtype": "bf16", "gflops": _stats([r])} for s, r in
          (("a", 900.0), ("b", 940.0), ("c", 580.0), ("d", 910.0))]  # fmt: skip
    w0.append({"shape": "a", "dtype": "fp32", "gflops": _stats([200.0])})
    w0.append({"shape": "e", "dtype": "int8", "error": "unsupported"})
    _write(out, "w0.json", {"results": w0})
    _write(out, "w1_train_bf16.json", {"batch": BATCH, "results": [
        {"impl": "fairseq", "tok_per_s": _stats([700.0, 800.0, 760.0])},
        {"impl": "torch", "tok_per_s": _stats([900.0, 600.0, 650.0])},
        {"impl": OURS_TRAIN, "tok_per_s": _stats([1700.0, 1800.0, 1750.0])},
    ]})  # fmt: skip
    _write(out, "w1_train_bf16_each.json", {"batch": BATCH, "results": [
        {"impl": "fairseq", "tok_per_s": _stats([840.0, 850.0, 830.0, 845.0])},
        {"impl": "onmt", "tok_per_s": _stats([860.0, 800.0, 870.0, 850.0])},
        {"impl": OURS_TRAIN, "tok_per_s": _stats([1750.0, 1700.0, 1760.0, 1800.0])},
    ]})  # fmt: skip
    # bench_w1_share.py: three rounds, each W0's median and two steps, shares 55% / 62% / 70%
    rounds = [{"w0_gflops": {"a": w0, "b": w0}, "w0_median": w0, "step_s": [s, s],
               "step_gflops": 1.4e12 / s / 1e9, "share": 1.4e12 / s / 1e9 / w0}
              for w0, s in ((1000.0, 1.4e12 / 550e9), (900.0, 1.4e12 / 558e9),
                            (1100.0, 1.4e12 / 770e9))]  # fmt: skip
    _write(out, "w1_share.json", {
        "dtype": "bf16", "step_flops": 1.4e12, "rounds": rounds,
        "share": _stats([r["share"] for r in rounds]),
        "w0_median": _stats([r["w0_median"] for r in rounds]),
        "step_s": _stats([s for r in rounds for s in r["step_s"]]),
    })  # fmt: skip
    for name, scale in (("w2_infer_beam4.json", 1.0), ("w2_infer_greedy.json", 2.6)):
        _write(out, name, {"results": [
            {"variant": "ct2:int8", "tok_per_s": _stats([1000.0 * scale]),
             "round_medians": [1000.0 * scale, 1000.0 * scale]},
            {"variant": "ct2:float32", "tok_per_s": _stats([700.0 * scale])},
            {"variant": "ext:peers_adapter:Infer:int8", "tok_per_s": _stats([1600.0 * scale]),
             "round_medians": [1600.0 * scale, 1500.0 * scale]},
            {"variant": "ext:peers_adapter:Infer:bf16", "tok_per_s": _stats([1700.0 * scale])},
        ]})  # fmt: skip
    for size, tokens, peer in (("4k", 3826, 4372.0), ("16k", 15356, 12912.0)):
        _write(out, f"w3_mem_{size}_bf16.json", {"results": [
            {"impl": "hf", "peak_rss_mib": peer + 100, "tgt_tokens": tokens},
            {"impl": "torch", "peak_rss_mib": peer, "tgt_tokens": tokens},
            {"impl": OURS_TRAIN, "peak_rss_mib": mem * tokens / 3826, "tgt_tokens": tokens},
        ]})  # fmt: skip
    _write(out, "contention.json", {"workloads": {
        "train": {"unit": "tok/s", "pairs": [[8400, 6600], [8400, 6500], [8600, 6500]],
                  "alone": 8400, "beside": 6500, "kept": 0.782},
        "translate": {"unit": "words/s", "pairs": [[4500, 3000], [4700, 3100], [4600, 3200]],
                      "alone": 4600, "beside": 3100, "kept": 0.66},
    }})  # fmt: skip
    _write(out, "dtype_bleu.json", {
        "split": "test", "sentences": 1000, "alpha": 1.4, "auto": "int8", "auto_why": "VNNI",
        "runs": [{"dtype": d, "beam": b, "bleu": v, "tok_per_s": 1.0, "seconds": 1.0}
                 for d, b, v in (("fp32", 4, 37.34), ("int8", 4, 37.34 + bleu_change),
                                 ("bf16", 4, 37.45), ("fp32", 1, 36.45), ("int8", 1, 36.43),
                                 ("bf16", 1, 36.46))],
        "changes": [{"dtype": d, "base": "fp32", "beam": b, "lines_changed": 9, "bleu_change": c,
                     "low": c - 0.3, "high": c + 0.3}
                    for d, b, c in (("int8", 4, bleu_change), ("bf16", 4, 0.11),
                                    ("int8", 1, -0.02), ("bf16", 1, 0.01))],
    })  # fmt: skip
    return out


def _run(out: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), str(out)], capture_output=True,
                          text=True, timeout=120)  # fmt: skip


def _row(text: str, start: str) -> str:
    rows = [line for line in text.splitlines() if line.startswith(f"| {start}")]
    assert len(rows) == 1, (start, text)
    return rows[0]


def test_a_cpu_without_amx_gets_its_targets_and_auto_precision(tmp_path):
    done = _run(_table(tmp_path / "out"))
    assert done.returncode == 0, done.stderr
    text = done.stdout
    assert "Test CPU, 2 cores; no AMX" in text and "commit abc1234" in text
    # W1: the ratio of the medians (1,750 / fairseq's 760), and round by round against each
    # peer: fairseq 1700/700, 1800/800, 1750/760 -> median 2.30; torch's median is higher.
    w1 = _row(text, "W1 training, base bf16, the harness")
    assert "**1,750**" in w1 and "fairseq 760 (torch 650)" in w1
    assert "**2.30x** (round by round: 2.30x against fairseq): met" in w1 and ">= 2.0x" in w1
    # One process per implementation: its own row, the same target
    each = _row(text, "W1 training, base bf16, one process per implementation")
    assert "**1,760**" in each and "fairseq 845 (onmt 860)" not in each
    assert "onmt 860 (fairseq 845)" in each and "**2.05x**" in each and ": met" in each
    # round by round against onmt: 1750/860, 1700/800, 1760/870, 1800/850 -> median 2.08
    # (fairseq's: 2.08, 2.00, 2.12, 2.13 -> 2.10)
    assert "(round by round: 2.08x against onmt)" in each
    # The share of W0's bf16 median (905 over the four bf16 shapes, not fp32's), not a target
    mfu = _row(text, "W1 share of the bf16 matmul rate (W0")
    flops = 1.4078718e12
    assert f"**{flops / (3826 / 1750) / 1e9 / 905:.0%}** (W0 minutes before the step" in mfu
    assert "AMX target" not in mfu and "met" not in mfu
    # ... and with W0 in the same minutes (bench_w1_share.py): the median of the rounds' shares
    same = _row(text, "W1 share of the bf16 matmul rate, both in the same minutes (3 rounds")
    assert "then 2 of our steps" in same and "W0 median 1,000 (900-1,100)" in same
    assert "in 2.51 s = 558 GFLOP/s" in same  # the steps' median (1.4 TFLOP / 558 GFLOP/s)
    assert "**62%** (rounds 55%-70%) | (>= 65% is the AMX target)" in same
    # W2: the precision auto picks (int8), not ours' fastest (bf16)
    beam = _row(text, "W2 beam 4")
    assert "ours int8 (auto's)" in beam and "**1,600**" in beam
    assert "**1.60x** (rounds 1.60 / 1.50): met" in beam and ">= 1.0x CT2 int8" in beam
    assert "**1.60x**" in _row(text, "W2 greedy")
    assert "**0.52x**: met" in _row(text, "W3 peak RSS of a bf16 step, 3,826")
    assert "**78.2%** kept (78.6% / 77.4% / 75.6%): met" in _row(text, "train beside")
    assert "**66.0%** kept" in _row(text, "translate beside")
    assert "**not met**" in _row(text, "translate beside")
    bleu4 = _row(text, "BLEU test (1000 sentences), beam 4, α 1.4")
    assert "**int8 37.39 (+0.05, bootstrap -0.25..+0.35)**" in bleu4 and "auto = int8: met" in bleu4
    assert "Not in OUT" not in text


def test_an_amx_cpu_gets_the_higher_targets(tmp_path):
    text = _run(_table(tmp_path / "out", amx=True)).stdout
    assert "; **AMX**" in text
    w1 = _row(text, "W1 training, base bf16, the harness")
    assert "**not met**" in w1 and ">= 3.5x (AMX)" in w1
    old = _row(text, "W1 share of the bf16 matmul rate (W0")
    assert "**71%** (W0 minutes before the step" in old and "met" not in old
    assert "**62%** (rounds 55%-70%): **not met** | >= 65% (AMX)" in _row(
        text, "W1 share of the bf16 matmul rate, both"
    )
    assert ">= 1.5x CT2 int8 (AMX)" in _row(text, "W2 beam 4")


def test_bleu_outside_the_tenth_and_memory_at_the_edge_are_not_met(tmp_path):
    text = _run(_table(tmp_path / "out", bleu_change=0.19, mem=0.651 * 4372.0)).stdout
    assert "auto = int8: **not met**" in _row(text, "BLEU test (1000 sentences), beam 4")
    # 0.651 would print as 0.65 beside "not met": a third decimal says why
    assert "**0.651x**: **not met**" in _row(text, "W3 peak RSS of a bf16 step, 3,826")


def test_a_peer_the_harness_could_not_build_is_named_in_its_row_and_among_the_missing(tmp_path):
    """Round forty-eight's first table ran without fairseq's source tree: the harness wrote
    "failed" and the W1 row compared against the peers that ran. The row now says who did not."""
    out = _table(tmp_path / "out")
    for name in ("w1_train_bf16.json", "w2_infer_beam4.json", "w3_mem_4k_bf16.json"):
        record = json.loads((out / name).read_text(encoding="utf-8"))
        record["failed"] = {"fairseq": "ModuleNotFoundError: No module named 'fairseq'"}
        _write(out, name, record)
    done = _run(out)
    assert done.returncode == 0, done.stderr
    text = done.stdout
    w1 = _row(text, "W1 training, base bf16, the harness")
    assert w1.count("not run: fairseq") == 1 and "**2.30x**" in w1
    assert "not run" not in _row(text, "W1 training, base bf16, one process per implementation")
    assert "not run: fairseq" in _row(text, "W2 beam 4")
    assert "not run" not in _row(text, "W2 greedy")
    assert "not run: fairseq" in _row(text, "W3 peak RSS of a bf16 step, 3,826")
    missing = text.split("Not in OUT: ")[1]
    assert "W1, the harness's one process: fairseq did not run (ModuleNotFoundError" in missing
    assert "W2 beam 4: fairseq did not run" in missing and "W3 ~4k: fairseq did not run" in missing
    # a "failed" that is not a mapping is the file's error, one line
    _write(out, "w2_infer_greedy.json", {"results": [], "failed": ["fairseq"]})
    done = _run(out)
    assert done.returncode != 0 and "w2_infer_greedy.json" in done.stderr
    assert "Traceback" not in done.stderr


def test_without_the_share_in_the_same_minutes_the_tables_w0_decides(tmp_path):
    out = _table(tmp_path / "out", amx=True)
    (out / "w1_share.json").unlink()
    text = _run(out).stdout
    assert "**71%**: met | >= 65% (AMX)" in _row(text, "W1 share of the bf16 matmul rate (W0")
    assert "in the same minutes (" not in text
    assert "W1 share with W0 in the same minutes: no w1_share.json" in text


def test_missing_files_are_named_and_the_rest_is_summarized(tmp_path):
    out = _table(tmp_path / "out")
    for name in (
        "w0.json",
        "contention.json",
        "w2_infer_greedy.json",
        "machine.json",
        "w1_train_bf16_each.json",
    ):
        (out / name).unlink()
    done = _run(out)
    assert done.returncode == 0, done.stderr
    assert "CPU: unknown (no machine.json)" in done.stdout
    assert "W1 MFU: no bf16 rate in w0.json" in done.stdout
    assert "contention: no contention.json" in done.stdout
    assert "W2 greedy: no w2_infer_greedy.json" in done.stdout
    assert "W1 one process per implementation: no w1_train_bf16_each.json" in done.stdout
    assert "**2.30x**" in done.stdout and "W2 beam 4" in done.stdout


@pytest.mark.parametrize(
    ("name", "content", "message"),
    [("w1_train_bf16.json", "{not json", "w1_train_bf16.json: not readable JSON"),
     ("w1_train_bf16.json", json.dumps({"batch": BATCH, "results": [
         {"impl": "fairseq"}, {"impl": OURS_TRAIN, "tok_per_s": _stats([1.0])}]}),
      "w1_train_*.json, w0.json, w1_share.json: not as its writer writes it (KeyError: "
      "'tok_per_s')"),
     ("w1_share.json", json.dumps({"dtype": "fp32", "rounds": []}),
      "w1_share.json: dtype 'fp32', W1 ran in 'bf16'"),
     ("w1_share.json", json.dumps({"dtype": "bf16", "rounds": []}), "w1_share.json: no ['share']"),
     ("w1_train_bf16.json", json.dumps({"batch": BATCH, "results": []}),
      f"w1_train_bf16.json: no result for {OURS_TRAIN}"),
     ("contention.json", json.dumps({"cpu": "x"}), "contention.json: no ['workloads']"),
     ("dtype_bleu.json", json.dumps({"auto": "int8", "runs": [{"dtype": "fp32"}], "changes": []}),
      "dtype_bleu.json: not as its writer writes it (KeyError: 'beam')")],
)  # fmt: skip
def test_a_file_not_as_its_writer_writes_it_is_a_one_line_error(tmp_path, name, content, message):
    out = _table(tmp_path / "out")
    (out / name).write_text(content, encoding="utf-8")
    done = _run(out)
    assert done.returncode == 1 and done.stdout == ""
    assert done.stderr.startswith("issue19_summary.py: ") and message in done.stderr
    assert done.stderr.count("\n") == 1 and "Traceback" not in done.stderr


def test_a_bom_and_a_directory_in_place_of_a_file(tmp_path):
    out = _table(tmp_path / "out")
    path = out / "contention.json"
    path.write_bytes(b"\xef\xbb\xbf" + path.read_bytes())  # an editor's BOM: still read
    assert "**78.2%** kept" in _run(out).stdout
    path.unlink()
    path.mkdir()
    done = _run(out)
    assert done.returncode == 1 and "contention.json: not readable JSON (IsADirectoryError" in (
        done.stderr
    )


def test_not_a_directory(tmp_path):
    done = _run(tmp_path / "nowhere")
    assert done.returncode == 2 and "nowhere: not a directory" in done.stderr


def test_a_cpu_without_native_bf16_is_summarized_from_its_fp32_runs(tmp_path):
    # bench_peers.sh runs W1 and W3 in fp32 there (w1_train_fp32.json, w3_mem_*_fp32.json)
    out = _table(tmp_path / "out")
    for old in ("w1_train_bf16.json", "w1_train_bf16_each.json", "w3_mem_4k_bf16.json",
                "w3_mem_16k_bf16.json"):  # fmt: skip
        (out / old).rename(out / old.replace("bf16", "fp32"))
    share = json.loads((out / "w1_share.json").read_text(encoding="utf-8"))
    _write(out, "w1_share.json", {**share, "dtype": "fp32"})
    text = _run(out).stdout
    assert "**2.30x**" in _row(text, "W1 training, base fp32, the harness")
    assert "W1 training, base fp32, one process per implementation" in text
    # the share of W0's fp32 rate (200 GFLOP/s, its one fp32 shape), not of bf16's
    flops = 1.4078718e12
    share = f"{flops / (3826 / 1750) / 1e9 / 200:.0%}"
    assert share in _row(text, "W1 share of the fp32 matmul rate (W0")
    assert "**0.52x**: met" in _row(text, "W3 peak RSS of a fp32 step, 3,826")
    assert "Not in OUT" not in text
