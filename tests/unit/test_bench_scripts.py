"""benchmarks/bench_step_phases.py, bench_grad_helper.py, bench_wakeup.py, bench_streams.py,
bench_split_rows.py, bench_weighted_rows.py, bench_read_trees.py, bench_gc.py,
bench_translate_stream.py, bench_int8_rows.py, bench_step_attention.py, bench_adam_step.py,
bench_beam_history.py, bench_row_top.py, bench_int8_product.py, bench_bf16_keys.py,
issue19_table.sh, bench_cpu_limits.sh, bench_no_compiler.py, bench_side_by_side.py and
gpu/prepare_device.sh:
bad input is one clear line (the script, the problem), exit status 2, before any timing starts.
bench_before_after.py: its --kernels swaps each side's compiled library in."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from preloaded import run_script
from transformer import cpuinfo

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture
def src(tmp_path):
    """Source lines for the benchmarks' `--what real` runs: 20 short English sentences."""
    path = tmp_path / "src.txt"
    path.write_text("A man rides a bike.\nTwo dogs play in the snow.\n" * 10, encoding="utf-8")
    return path


def _run(script: str, *args: str) -> subprocess.CompletedProcess:
    return run_script(BENCH / script, *args)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--threads", "0"], "--threads, --batches and --rounds must be at least 1"),
        (["--threads", "1,two"], "--threads: comma-separated thread counts, got '1,two'"),
        (["--batches", "0"], "--threads, --batches and --rounds must be at least 1"),
        (["--warmup", "-1"], "--warmup at least 0"),
    ],
)
def test_step_phases_rejects_bad_counts(tmp_path, args, message):
    out = _run("bench_step_phases.py", "--data", str(tmp_path), *args)
    assert out.returncode == 2
    assert message in out.stderr and "Traceback" not in out.stderr


def test_step_phases_names_a_missing_corpus(tmp_path):
    out = _run("bench_step_phases.py", "--data", str(tmp_path / "none"))
    assert out.returncode == 2
    assert f"{tmp_path / 'none' / 'manifest.json'}: not found" in out.stderr
    assert "Traceback" not in out.stderr


@pytest.mark.parametrize(
    ("script", "args", "message"),
    [
        ("bench_grad_helper.py", ["--modes", "one,three"], "--modes: some of one, two, helper"),
        ("bench_grad_helper.py", ["--rounds", "0"], "--batches and --rounds at least 1"),
        ("bench_grad_helper.py", ["--where", "moon"], "invalid choice: 'moon'"),
        ("bench_wakeup.py", ["--seconds", "0"], "--seconds must be positive"),
        ("bench_wakeup.py", ["--rounds", "0"], "--rounds at least 1"),
        ("bench_split_rows.py", ["--modes", "one,split:1.5"], "'split:1.5' is not one, two or"),
        ("bench_split_rows.py", ["--modes", "split:x"], "'split:x' is not one, two or"),
        ("bench_split_rows.py", ["--rows", "0"], "--rows, --d-model, --d-ff and --rounds must"),
        ("bench_weighted_rows.py", ["--what", "x"], "--what: products and/or w2, got 'x'"),
        ("bench_weighted_rows.py", ["--dtypes", "fp16"], "--dtypes: some of fp32, bf16, int8"),
        ("bench_weighted_rows.py", ["--beams", "1,a"], "--beams: comma-separated beam sizes"),
        ("bench_weighted_rows.py", ["--rounds", "0"], "--rounds, --out-len and --threads must"),
        ("bench_read_trees.py", ["--reps", "0"], "--reps: at least 1, not 0"),
        ("bench_read_trees.py", ["--data", "/nonexistent"], "/nonexistent/ptb_sample/combined"),
        ("bench_gc.py", ["--runs", "0", "--", "presets"], "--runs: at least 1, not 0"),
        ("bench_gc.py", [], "give the transformer command after --"),
        ("bench_gc.py", ["--runs", "1", "--", "presets", "--nope"], "`transformer presets --nope`"),
    ],
)
def test_helper_benchmarks_reject_bad_arguments(tmp_path, script, args, message):
    out = _run(script, *(["--data", str(tmp_path)] if script == "bench_grad_helper.py" else []),
               *args)  # fmt: skip
    assert out.returncode == 2
    assert message in out.stderr and "Traceback" not in out.stderr


@pytest.mark.parametrize(
    ("script", "args"),
    [("bench_contention.py", ["--data", "d", "--model", "m"]),
     ("bench_decode.py", ["--model", "m", "--data", "d"])],
)  # fmt: skip
def test_benchmarks_refuse_a_json_path_in_no_directory_before_running(tmp_path, script, args):
    # issue19_table.sh's runs take minutes: a --json they cannot write fails at the start.
    target = tmp_path / "none" / "out.json"
    out = _run(script, *args, "--json", str(target))
    assert out.returncode == 2, out.stderr
    assert f"--json: no directory {target.parent}" in out.stderr and "Traceback" not in out.stderr


def test_grad_helper_names_a_missing_corpus(tmp_path):
    out = _run("bench_grad_helper.py", "--data", str(tmp_path / "none"))
    assert out.returncode == 2
    assert f"{tmp_path / 'none' / 'manifest.json'}: not found" in out.stderr
    assert "Traceback" not in out.stderr


def _table(qs: Path | None, out: Path | None) -> subprocess.CompletedProcess:
    env = {"PATH": "/usr/bin:/bin"} | ({"QS": str(qs)} if qs else {})
    return subprocess.run(["bash", str(BENCH / "issue19_table.sh"), *([str(out)] if out else [])],
                          capture_output=True, text=True, env=env, timeout=60)  # fmt: skip


def test_issue19_table_names_what_is_missing(tmp_path):
    usage = _table(tmp_path, None)
    assert usage.returncode != 0 and "usage: QS=QUICKSTART_OUT" in usage.stderr

    missing = _table(tmp_path, tmp_path / "out")
    assert missing.returncode == 2
    assert f"{tmp_path}/data/manifest.json not found" in missing.stderr

    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "manifest.json").write_text("{}")
    (tmp_path / "model.safetensors").write_bytes(b"")
    (tmp_path / "quickstart.json").write_text(json.dumps({"bleu": 1.0}))  # no α chosen on val
    no_alpha = _table(tmp_path, tmp_path / "out")
    assert no_alpha.returncode != 0
    assert "quickstart.json: no α chosen on val (KeyError" in no_alpha.stderr
    assert not (tmp_path / "out" / "w0.log").exists()  # stopped before any benchmark ran

    # A peer the harness cannot import stops it before the benchmarks, naming the peer
    (tmp_path / "quickstart.json").write_text(json.dumps({"chosen_on_val": {"alpha": 1.2}}))
    no_peers = subprocess.run(
        ["bash", str(BENCH / "issue19_table.sh"), str(tmp_path / "out")], capture_output=True,
        text=True, timeout=120, env={"PATH": "/usr/bin:/bin", "QS": str(tmp_path),
                                     "PEERS_FAIRSEQ_SRC": str(tmp_path / "no-fairseq")},
    )  # fmt: skip
    assert no_peers.returncode == 2, no_peers.stderr
    said = "issue19_table.sh: peers not importable with .venv/bin/python: fairseq ("
    assert said in no_peers.stderr
    assert "PEERS_MISSING_OK=1" in no_peers.stderr and "Traceback" not in no_peers.stderr
    assert not (tmp_path / "out" / "w0.log").exists()


def test_prepare_device_names_what_is_missing_before_touching_dot_device(tmp_path):
    def prepare(*args):
        return subprocess.run(["bash", str(BENCH / "gpu" / "prepare_device.sh"), *args],
                              capture_output=True, text=True, timeout=60)  # fmt: skip

    device = BENCH.parent / ".device"
    before = sorted(p.name for p in device.iterdir()) if device.is_dir() else None
    usage = prepare()
    assert usage.returncode != 0 and "usage: bash benchmarks/gpu/prepare_device.sh" in usage.stderr
    missing = prepare(str(tmp_path))
    assert missing.returncode == 2
    assert missing.stderr.strip() == f"prepare_device.sh: {tmp_path}/model.safetensors not found"
    (tmp_path / "model.safetensors").write_bytes(b"")
    (tmp_path / "quickstart.json").write_text(json.dumps({"bleu": 1.0}))  # no α chosen on val
    no_alpha = prepare(str(tmp_path))
    assert no_alpha.returncode == 2
    assert "quickstart.json: no α chosen on val (KeyError" in no_alpha.stderr
    after = sorted(p.name for p in device.iterdir()) if device.is_dir() else None
    assert after == before  # nothing removed or made before the inputs were checked


# A stand-in for the peers' W2 harness: each variant's tokens/s is fixed by its name (the
# number after the last colon, times the run's index), so the merge can be checked exactly;
# a variant named "crash" exits 1 with a message, as a broken install would.
FAKE_INFER = r"""
import argparse, json, sys
ap = argparse.ArgumentParser()
for a in ("--variants", "--beams", "--reps", "--warmup", "--threads", "--json"):
    ap.add_argument(a)
args = ap.parse_args()
if args.variants == "crash":
    sys.exit("ModuleNotFoundError: No module named 'ctranslate2'")
base = float(args.variants.rsplit(":", 1)[1])
res = []
for beam in map(int, args.beams.split(",")):
    tps = [base * beam * (i + 1) for i in range(int(args.reps))]
    res.append({"variant": args.variants, "beam": beam, "note": "fake", "seconds": [1.0] * len(tps),
                "tok_per_s": {"median": sorted(tps)[len(tps) // 2], "all": tps}})
print("variant beam tok/s med")
json.dump({"env": {"cpu": "fake"}, "args": vars(args), "cfg": {}, "src": {}, "failed": {},
           "peak_rss_mib": 1.0, "results": res}, open(args.json, "w"))
"""


def _w2(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    (tmp_path / "peers").mkdir(exist_ok=True)
    (tmp_path / "peers" / "bench_infer.py").write_text(FAKE_INFER)
    return run_script(BENCH / "bench_w2_processes.py", "--peers", str(tmp_path / "peers"), *args)


def test_w2_processes_interleaves_and_pools_the_rounds(tmp_path):
    out_json = tmp_path / "w2.json"
    done = _w2(
        tmp_path,
        "--variants",
        "ct2:int8:100,ours:150",
        "--ratio-to",
        "ct2:int8:100",
        "--beams",
        "4,1",
        "--reps",
        "3",
        "--rounds",
        "3",
        "--json",
        str(out_json),
    )
    assert done.returncode == 0, done.stderr
    # one process per variant and round, the order reversed every other round (A B, B A, A B)
    assert "round 2/3: ours:150 (its own process)" in done.stdout
    merged = json.loads(out_json.read_text())
    assert [(p["round"], p["variant"]) for p in merged["processes"]] == [
        (1, "ct2:int8:100"),
        (1, "ours:150"),
        (2, "ours:150"),
        (2, "ct2:int8:100"),
        (3, "ct2:int8:100"),
        (3, "ours:150"),
    ]
    rows = {(r["variant"], r["beam"]): r for r in merged["results"]}
    assert [(r["variant"], r["beam"]) for r in merged["results"]] == [
        ("ct2:int8:100", 4),
        ("ours:150", 4),
        ("ct2:int8:100", 1),
        ("ours:150", 1),
    ]
    ours = rows[("ours:150", 4)]
    assert ours["tok_per_s"]["n"] == 9 and ours["tok_per_s"]["all"] == [600.0, 1200.0, 1800.0] * 3
    assert ours["tok_per_s"]["median"] == 1200.0 and ours["round_medians"] == [1200.0] * 3
    assert ours["vs_ct2:int8:100"] == 1.5 and rows[("ct2:int8:100", 1)]["vs_ct2:int8:100"] == 1.0
    assert "1.50x" in done.stdout


def test_w2_processes_names_a_failed_run_and_bad_arguments(tmp_path):
    crash = _w2(tmp_path, "--variants", "ct2:int8:100,crash", "--rounds", "1")
    assert crash.returncode == 2 and "Traceback" not in crash.stderr
    assert crash.stderr.strip() == (
        "bench_w2_processes.py: crash: the harness exited with 1: "
        "ModuleNotFoundError: No module named 'ctranslate2'"
    )
    for args, message in [
        (["--variants", "a:1,a:1"], "--variants: distinct comma-separated variants, got 'a:1,a:1'"),
        (
            ["--variants", "a:1", "--rounds", "0"],
            "--reps, --rounds and --threads must be at least 1",
        ),
    ]:
        bad = _w2(tmp_path, *args)
        assert bad.returncode == 2 and message in bad.stderr, bad.stderr
    none = run_script(
        BENCH / "bench_w2_processes.py", "--variants", "a:1", "--peers", str(tmp_path / "nowhere")
    )
    assert none.returncode == 2
    assert f"{tmp_path / 'nowhere' / 'bench_infer.py'}: not found" in none.stderr


def test_omp_teams_rejects_bad_arguments(tmp_path):
    def run(*args: str) -> subprocess.CompletedProcess:
        return run_script(BENCH / "bench_omp_teams.py", *args, timeout=60)

    few = run("--reps", "5")
    assert few.returncode == 2 and "--reps must be at least 10" in few.stderr
    nodir = run("--ct2-dir", str(tmp_path))
    assert nodir.returncode == 2 and "Traceback" not in nodir.stderr
    assert f"{tmp_path}: no model.bin (a CTranslate2 model directory)" in nodir.stderr


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--clients", "0"], "--clients and --beam must be at least 1, --seconds above 0"),
        (["--seconds", "-1"], "--clients and --beam must be at least 1, --seconds above 0"),
        (["--beam", "0"], "--clients and --beam must be at least 1, --seconds above 0"),
        (["--threads", "two"], "argument --threads: a number or auto, not 'two'"),
        (["--threads", "0"], "argument --threads: at least 1 (or auto), not 0"),
    ],
)
def test_serve_load_refuses_bad_counts_before_starting_a_server(args, message):
    out = run_script(
        BENCH / "bench_serve_load.py", "--url", "http://127.0.0.1:9", *args, timeout=60
    )
    assert out.returncode == 2 and message in out.stderr and "Traceback" not in out.stderr


@pytest.mark.parametrize("streams", ["3,x", "0", "3q", ""])
def test_streams_rejects_a_bad_count_before_loading_the_model(tmp_path, streams):
    model, src = tmp_path / "model.safetensors", tmp_path / "src.txt"
    model.write_bytes(b"not read")
    src.write_text("A man.\n")
    out = _run("bench_streams.py", "--model", str(model), "--src", str(src), "--streams", streams)
    assert out.returncode == 2
    assert "--streams:" in out.stderr and "is not a count" in out.stderr
    assert "Traceback" not in out.stderr


# A stand-in for the peers' W1 harness: an implementation's tokens/s is the number after its
# last colon times the step's index; "crash" exits 1, "nobuild" reports a failed build.
FAKE_TRAIN = r"""
import argparse, json, sys
ap = argparse.ArgumentParser()
for a in ("--impl", "--dtype", "--reps", "--warmup", "--threads", "--json"):
    ap.add_argument(a)
args = ap.parse_args()
if args.impl == "crash":
    sys.exit("ImportError: fairseq")
failed = {args.impl: "RuntimeError: no"} if args.impl == "nobuild" else {}
res = []
if not failed:
    tps = [float(args.impl.rsplit(":", 1)[1]) * (i + 1) for i in range(int(args.reps))]
    res.append({"impl": args.impl, "dtype": args.dtype, "params": 1, "notes": "fake",
                "losses": [1.0] * len(tps),
                "tok_per_s": {"median": sorted(tps)[len(tps) // 2], "all": tps}})
    for i, t in enumerate(tps):
        print(f"# rep {i} {args.impl}/{args.dtype}: {t:.0f} tok/s")
json.dump({"env": {"cpu": "fake"}, "args": vars(args), "batch": {"tgt_tokens": 10},
           "cfg": {}, "failed": failed, "peak_rss_mib_process": 1.0, "results": res},
          open(args.json, "w"))
"""


def _w1(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    (tmp_path / "peers").mkdir(exist_ok=True)
    (tmp_path / "peers" / "bench_train.py").write_text(FAKE_TRAIN)
    return run_script(BENCH / "bench_w1_processes.py", "--peers", str(tmp_path / "peers"), *args)


def test_w1_processes_interleaves_and_writes_the_harness_format(tmp_path):
    out_json = tmp_path / "w1.json"
    done = _w1(tmp_path, "--impl", "peer:100,ours:210", "--reps", "3", "--rounds", "3",
               "--json", str(out_json))  # fmt: skip
    assert done.returncode == 0, done.stderr
    order = [line.split(": ", 1)[1] for line in done.stdout.splitlines()
             if line.startswith("# round")]  # fmt: skip
    assert order == ["peer:100 (its own process)", "ours:210 (its own process)",
                     "ours:210 (its own process)", "peer:100 (its own process)",
                     "peer:100 (its own process)", "ours:210 (its own process)"]  # fmt: skip
    assert "  | # rep 2 ours:210/bf16: 630 tok/s" in done.stdout
    merged = json.loads(out_json.read_text())
    assert merged["mode"] == "one process per implementation, 3 interleaved rounds"
    assert merged["batch"] == {"tgt_tokens": 10} and merged["args"]["rounds"] == 3
    # the harness's own format (issue19_summary.py reads it as it reads bench_train.py's)
    ours = merged["results"][1]
    assert [r["impl"] for r in merged["results"]] == ["peer:100", "ours:210"]
    assert ours["tok_per_s"]["all"] == [210.0, 420.0, 630.0] * 3
    assert ours["tok_per_s"]["median"] == 420.0 and ours["round_medians"] == [420.0] * 3
    assert ours["dtype"] == "bf16" and len(ours["losses"]) == 9
    assert "2.10" not in done.stdout and "0.48" in done.stdout  # vs best: 200 / 420


def test_w1_processes_names_a_failed_run_and_bad_arguments(tmp_path):
    crash = _w1(tmp_path, "--impl", "peer:1,crash", "--rounds", "1")
    assert crash.returncode == 2 and "Traceback" not in crash.stderr
    assert crash.stderr.strip() == (
        "bench_w1_processes.py: crash: the harness exited with 1: ImportError: fairseq"
    )
    nobuild = _w1(tmp_path, "--impl", "nobuild", "--rounds", "1")
    assert nobuild.returncode == 2
    assert "nobuild: the harness could not build it: {'nobuild': 'RuntimeError: no'}" in (
        nobuild.stderr
    )
    for args, message in [
        (["--impl", "a:1,a:1"], "--impl: distinct comma-separated implementations, got 'a:1,a:1'"),
        (["--impl", "a:1", "--reps", "0"], "--reps, --rounds and --threads must be at least 1"),
        (["--impl", "a:1", "--json", str(tmp_path / "no" / "x.json")], "--json: no directory"),
        (["--impl", "a:1", "--peers", str(tmp_path / "none")], "bench_train.py: not found"),
    ]:
        bad = _w1(tmp_path, *args)
        assert bad.returncode == 2 and message in bad.stderr, bad.stderr


# Stand-ins for the peers' modules bench_w1_share.py uses: a W0 product sleeps 5 ms whatever
# its shape (the larger M x K x N, the higher its rate), a step of "fake:S" sleeps S ms.
FAKE_SHARE = {
    "common.py": r"""
def setup_threads(n):
    pass
def env_info():
    return {"cpu": "fake"}
def make_mt_batch(sents, src_len, tgt_len, jitter, vocab, seed=0):
    return {"shape": {"sents": sents, "src_padded": src_len, "tgt_padded": tgt_len,
                      "src_tokens": sents * src_len, "tgt_tokens": sents * tgt_len}}
""",
    "bench_matmul.py": r"""
import time
def make_case(dtype, m, k, n):
    return lambda: time.sleep(0.005)
""",
    "train_adapters.py": r"""
import time
PAPER_BASE = dict(vocab=32000)
class Fake:
    notes = "fake"
    def __init__(self, ms):
        self.ms, self.steps = ms, 0
    def prepare(self, batch):
        return batch
    def step(self, prepared, amp):
        self.steps += 1
        time.sleep(self.ms / 1000)
def get_adapter(name, cfg):
    if name == "broken":
        raise RuntimeError("no model")
    return Fake(float(name.split(":")[1]))
""",
}


def _share(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    peers = tmp_path / "peers"
    peers.mkdir(exist_ok=True)
    for name, text in FAKE_SHARE.items():
        (peers / name).write_text(text)
    return _run("bench_w1_share.py", "--peers", str(peers), *args)


def test_w1_share_alternates_w0_and_steps_and_divides_within_each_round(tmp_path):
    out_json = tmp_path / "share.json"
    done = _share(tmp_path, "--impl", "fake:40", "--rounds", "3", "--steps", "2", "--warmup",
                  "1", "--min-time", "0.02", "--shapes", "4x8x8,6x8x8,20x8x8", "--sents", "4",
                  "--src-len", "5", "--tgt-len", "6", "--json", str(out_json))  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert [line[:9] for line in done.stdout.splitlines() if line.startswith("# round")] == [
        "# round 0", "# round 1", "# round 2"]  # fmt: skip
    data = json.loads(out_json.read_text())
    assert data["batch"]["tgt_tokens"] == 24 and data["impl"] == "fake:40"
    assert data["dtype"] == "bf16" and len(data["rounds"]) == 3
    # the analytic FLOPs of a base step on the batch's real tokens (issue19_summary.step_flops)
    sys.path.insert(0, str(BENCH))
    from issue19_summary import step_flops  # noqa: PLC0415

    assert data["step_flops"] == step_flops(data["batch"])
    for r in data["rounds"]:
        assert list(r["w0_gflops"]) == ["4x8x8", "6x8x8", "20x8x8"] and len(r["step_s"]) == 2
        # each call sleeps 5 ms: the rates go as M x K x N, and the median is the middle one
        assert r["w0_median"] == r["w0_gflops"]["6x8x8"]
        assert all(0.04 <= s < 0.5 for s in r["step_s"])
        step = sorted(r["step_s"])
        assert r["share"] == pytest.approx(
            data["step_flops"] / ((step[0] + step[1]) / 2) / 1e9 / r["w0_median"]
        )
    shares = sorted(r["share"] for r in data["rounds"])
    assert data["share"]["median"] == shares[1] and data["share"]["all"] == [
        r["share"] for r in data["rounds"]]  # fmt: skip
    assert f"median {shares[1]:.1%}" in done.stdout


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--rounds", "0"], "--rounds, --steps and --threads must be at least 1"),
        (["--warmup", "-1"], "--warmup at least 0"),
        (["--min-time", "0"], "--min-time: seconds above 0, got 0.0"),
        (["--shapes", "4x8"], "--shapes: comma-separated MxKxN of positive integers, got '4x8'"),
        (["--shapes", "4x8x0"], "got '4x8x0'"),
        (["--json", "/nonexistent/dir/x.json"], "--json: no directory /nonexistent/dir"),
    ],
)
def test_w1_share_refuses_bad_arguments_in_one_line(tmp_path, args, message):
    bad = _share(tmp_path, "--impl", "fake:1", *args)
    assert bad.returncode == 2 and message in bad.stderr and "Traceback" not in bad.stderr


def test_w1_share_names_an_implementation_it_cannot_build(tmp_path):
    done = _share(tmp_path, "--impl", "broken")
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert done.stderr.strip() == "bench_w1_share.py: broken: not built: RuntimeError: no model"


def test_w1_share_needs_the_peers_modules(tmp_path):
    (tmp_path / "empty").mkdir()
    done = _run("bench_w1_share.py", "--peers", str(tmp_path / "empty"))
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert done.stderr.strip() == (
        f"bench_w1_share.py: {tmp_path / 'empty' / 'common.py'}: not found (--peers or PEERS_DIR)"
    )


def _texts(tmp_path: Path) -> tuple[Path, Path]:
    """A one-line input and one with no words: the translate benchmarks' bad arguments."""
    text, empty = tmp_path / "in.txt", tmp_path / "empty.txt"
    text.write_text("A dog.\n", encoding="utf-8")
    empty.write_text("\n \n", encoding="utf-8")
    return text, empty


def _names_each(script: str, cases) -> None:
    """Each (args, message): exit status 2, the message, no traceback."""
    for args, message in cases:
        out = _run(script, *args)
        assert out.returncode == 2, args
        assert message in out.stderr and "Traceback" not in out.stderr, out.stderr


def test_translate_stream_bench_names_bad_arguments_and_a_failed_run(tmp_path):
    text, empty = _texts(tmp_path)
    _names_each(
        "bench_translate_stream.py",
        [
            (["m", str(text), "--runs", "0"], "--runs: at least 1, not 0"),
            (["m", str(tmp_path / "none.txt")], "none.txt: not a file"),
            (["m", str(empty)], "empty.txt: no words to translate"),
            (["m", str(text), "--before", str(tmp_path)], "holds no transformer package"),
            ([str(tmp_path / "none.safetensors"), str(text)], "failed (2)"),
        ],
    )


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--pairs", "0"], "--pairs and --out-len must be at least 1"),
        (["--threads", "auto"], "--threads: a count of at least 1 (or auto with --what real)"),
        (["--threads", "two"], "--threads: a count of at least 1"),
        (["--what", "real"], "--what real needs --model and --src"),
        (["--what", "real", "--model", "none.safetensors", "--src", "x"], "--model: no such file"),
    ],
)
def test_int8_rows_bench_names_bad_arguments(args, message):
    out = _run("bench_int8_rows.py", *args)
    assert out.returncode == 2
    assert message in out.stderr and "Traceback" not in out.stderr


def test_int8_rows_bench_times_each_layer_both_ways():
    from transformer import kernels

    out = _run("bench_int8_rows.py", "--what", "layers", "--pairs", "1", "--threads", "1")
    if not kernels.rows_supported():  # neither AVX-512 nor AVX2: torch's ops are all there is
        assert out.returncode == 1 and "the row kernels do not run here" in out.stderr
        return
    assert out.returncode == 0, out.stderr
    rows = [line for line in out.stdout.splitlines() if line.startswith("layer (")]
    assert len(rows) == 9 and all("torch's ops" in r and "faster in" in r for r in rows)
    assert cpuinfo.cpu_line() in out.stdout.splitlines()[0]  # the CPU and ISA beside the figures


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--pairs", "0"], "--pairs and --out-len must be at least 1"),
        (["--threads", "two"], "--threads: a count of at least 1"),
        (["--dtype", "fp16"], "invalid choice: 'fp16'"),
        (["--what", "real"], "--what real needs --model and --src"),
    ],
)
def test_step_attention_bench_names_bad_arguments(args, message):
    out = _run("bench_step_attention.py", *args)
    assert out.returncode == 2
    assert message in out.stderr and "Traceback" not in out.stderr


def test_int8_rows_bench_has_no_dtype_option():
    """The row kernels are int8's: --dtype is bench_step_attention.py's alone."""
    out = _run("bench_int8_rows.py", "--dtype", "fp32")
    assert out.returncode == 2 and "unrecognized arguments: --dtype fp32" in out.stderr
    assert "Traceback" not in out.stderr


def test_step_attention_bench_times_each_shape_both_ways():
    from transformer import model

    out = _run("bench_step_attention.py", "--what", "layers", "--pairs", "1", "--threads", "1")
    if not model.step_attention_kernel():  # no AVX-512: torch's ops are all there is
        assert out.returncode == 1 and "the kernel does not run here" in out.stderr
        return
    assert out.returncode == 0, out.stderr
    rows = [line for line in out.stdout.splitlines() if " self, " in line or " cross, " in line]
    assert len(rows) == 8 and all("torch's ops" in r and "faster in" in r for r in rows)
    assert cpuinfo.cpu_line() in out.stdout.splitlines()[0]  # the CPU and ISA beside the figures


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--pairs", "0"], "--pairs and --threads must be at least 1"),
        (["--threads", "-1"], "--pairs and --threads must be at least 1"),
        (["--what", "w2"], "invalid choice: 'w2'"),
    ],
)
def test_adam_step_bench_names_bad_arguments(args, message):
    out = _run("bench_adam_step.py", *args)
    assert out.returncode == 2
    assert message in out.stderr and "Traceback" not in out.stderr


def test_adam_step_bench_times_a_quickstart_step_both_ways():
    from transformer import optim

    out = _run("bench_adam_step.py", "--what", "quickstart", "--pairs", "1", "--threads", "1")
    if not optim.one_pass_adam():  # no AVX-512: torch's passes are all there is
        assert out.returncode == 1 and "does not run here" in out.stderr
        return
    assert out.returncode == 0, out.stderr
    assert cpuinfo.cpu_line() in out.stdout.splitlines()[0]  # the CPU and ISA beside the figures
    (row,) = [line for line in out.stdout.splitlines() if line.startswith("quickstart step")]
    assert "torch's ops" in row and "faster in" in row


@pytest.mark.parametrize(
    ("args", "message", "status"),
    [
        (["--pairs", "0"], "--pairs and --out-len must be at least 1", 2),
        (["--what", "real"], "--what real needs --model and --src", 2),
        (["--what", "layers", "--dtype", "bf16"], "--what w2 or real", 1),
        (["--what", "w2", "--dtype", "int8"], "--dtype bf16", 1),
    ],
)
def test_beam_history_bench_names_bad_arguments(args, message, status):
    out = _run("bench_beam_history.py", *args)
    assert out.returncode == status
    assert message in out.stderr and "Traceback" not in out.stderr


def test_beam_history_bench_times_a_real_models_searches_both_ways(tiny_model_file, src):
    from transformer import model

    out = _run("bench_beam_history.py", "--what", "real", "--model", str(tiny_model_file),
               "--src", str(src), "--pairs", "1", "--threads", "1", "--dtype", "bf16")  # fmt: skip
    if not model.bf16_beam_history():  # no compiled step attention: the copies are all there is
        assert out.returncode == 1 and "bf16 takes the copies here" in out.stderr
        return
    assert out.returncode == 0, out.stderr
    rows = [line for line in out.stdout.splitlines() if "bf16 beam" in line]
    assert len(rows) == 2 and all("copies" in r and "back-pointers" in r for r in rows)
    assert cpuinfo.cpu_line() in out.stdout.splitlines()[0]  # the CPU and ISA beside the figures


@pytest.mark.parametrize(
    ("script", "args"),
    [(script, args) for script in ("bench_row_top.py", "bench_int8_product.py",
                                   "bench_bf16_keys.py")
     for args in (["--pairs", "0"], ["--what", "real"], ["--threads", "x"],
                  ["--what", "real", "--model", "nowhere", "--src", "x"])],
)  # fmt: skip
def test_row_top_int8_product_and_bf16_keys_benches_name_bad_arguments(script, args):
    out = _run(script, *args)
    assert out.returncode == 2
    assert f"{script}: error: --" in out.stderr and "Traceback" not in out.stderr


@pytest.mark.parametrize(
    ("script", "switch", "marker", "n_layers", "labels", "dtype"),
    [("bench_row_top.py", ("search", "row_top_kernel"), "best 8", 4, ("torch's ops", "kernel"),
      "fp32"),
     ("bench_bf16_keys.py", ("model", "step_attention_kernel"), " keys ", 1,
      ("fp32 K^T", "bf16 rows"), "bf16")],
)  # fmt: skip
def test_row_top_and_bf16_keys_benches_time_the_layers_and_a_real_models_searches_both_ways(
    script, switch, marker, n_layers, labels, dtype, tiny_model_file, src
):
    import importlib

    available = getattr(importlib.import_module(f"transformer.{switch[0]}"), switch[1])
    out = _run(script, "--what", "layers", "--pairs", "1", "--threads", "1")
    if not available():  # no AVX-512 or AVX2: torch's ops are all there is
        assert out.returncode == 1 and "does not run here" in out.stderr
        return
    assert out.returncode == 0, out.stderr
    assert " cores, " in out.stdout.splitlines()[0]  # the CPU and its ISA beside the figures
    rows = [line for line in out.stdout.splitlines() if marker in line]
    assert len(rows) == n_layers and all(labels[0] in r and labels[1] in r for r in rows)
    dtype_args = ["--dtype", dtype] if script == "bench_row_top.py" else []
    out = _run(script, "--what", "real", "--model", str(tiny_model_file), "--src", str(src),
               "--pairs", "1", "--threads", "1", *dtype_args)  # fmt: skip
    assert out.returncode == 0, out.stderr
    rows = [line for line in out.stdout.splitlines() if f"{dtype} beam" in line]
    assert len(rows) == 2 and all("faster in" in r for r in rows)


def test_int8_product_bench_times_a_real_models_searches_both_ways(tiny_model_file, src):
    from transformer import translate

    out = _run("bench_int8_product.py", "--what", "real", "--model", str(tiny_model_file),
               "--src", str(src), "--pairs", "1", "--threads", "1")  # fmt: skip
    if not translate.int8_onednn():  # no VNNI: fbgemm's product is all there is
        assert out.returncode == 1 and "does not run here" in out.stderr
        return
    assert out.returncode == 0, out.stderr
    rows = [line for line in out.stdout.splitlines() if "int8 beam" in line]
    assert len(rows) == 2 and all("fbgemm" in r and "oneDNN" in r for r in rows)
    assert " cores, " in out.stdout.splitlines()[0]  # the CPU and its ISA beside the figures


def test_int8_product_bench_times_fbgemms_7_bit_weights_against_the_avx2_product(
    tiny_model_file, src
):
    """A Zen 3's two int8 products (fbgemm's with 7-bit weights, the library's exact AVX2 one
    with 8-bit), timed the same way on any CPU with AVX2; bad choices named in one line."""
    out = _run("bench_int8_product.py", "--what", "real", "--model", str(tiny_model_file),
               "--src", str(src), "--pairs", "1", "--threads", "1", "--products", "fbgemm,avx2",
               "--fbgemm-bits=7")  # fmt: skip
    assert out.returncode == 0, out.stderr
    rows = [line for line in out.stdout.splitlines() if "int8 beam" in line]
    assert len(rows) == 2 and all("fbgemm" in r and "AVX2 exact" in r for r in rows)
    assert "fbgemm's weights 7-bit" in out.stdout.splitlines()[0]
    for bad, said in ((["--products", "avx2"], "--products: two of"),
                      (["--products", "avx2,avx2"], "--products: two of"),
                      (["--fbgemm-bits", "9"], "--fbgemm-bits: 7 or 8"),
                      (["--products"], "--products: expected one argument")):  # fmt: skip
        out = _run("bench_int8_product.py", *bad)
        assert out.returncode == 2 and said in out.stderr and "Traceback" not in out.stderr


def _limits(*args: str, **env: str) -> subprocess.CompletedProcess:
    import os

    return subprocess.run(["bash", str(BENCH / "bench_cpu_limits.sh"), *args],
                          capture_output=True, text=True, timeout=300,
                          env={**os.environ, **env})  # fmt: skip


def test_cpu_limits_bench_names_bad_arguments_before_running(tmp_path, src):
    tree = Path(__file__).resolve().parents[2] / "src"
    cases = [
        ((), {}, "usage: bench_cpu_limits.sh OLD_SRC MODEL INPUT (got 0 arguments)"),
        ((str(tmp_path), str(src), str(src)), {}, "not a tree's src"),
        ((str(tree), str(tmp_path / "no.safetensors"), str(src)), {}, "no such model file"),
        ((str(tree), str(src), str(tmp_path / "none.txt")), {}, "none.txt: no such input file"),
        ((str(tree), str(src), str(src)), {"RUNS": "0"}, "RUNS=0: a count of at least 1"),
        ((str(tree), str(src), str(src)), {"QUOTAS": "1.0 -2"}, "QUOTAS: -2 is not a positive"),
        ((str(tree), str(src), str(src)), {"QUOTAS": "0"}, "QUOTAS: 0 is not a positive"),
    ]
    for args, env, message in cases:
        done = _limits(*args, **env)
        assert done.returncode == 2 and done.stdout == ""
        assert done.stderr.startswith("bench_cpu_limits.sh: ") and message in done.stderr
        assert done.stderr.count("\n") == 1


def test_cpu_limits_bench_runs_both_trees_on_one_cpu_and_unlimited(tiny_model_file, src):
    import os

    # No quota runs (they need root and a cgroup hierarchy): taskset's and the unlimited ones.
    tree = Path(__file__).resolve().parents[2] / "src"
    done = _limits(str(tree), str(tiny_model_file), str(src), RUNS="1", QUOTAS="none",
                   PY=sys.executable)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    out = done.stdout
    assert "== no quota runs (QUOTAS=none)" in out and "== taskset -c 0" in out
    assert out.count("outputs identical") == 2
    one_cpu = out.split("== no limit")[0]  # the CPU line says so where the machine has more
    assert ("(1 usable)" in one_cpu) == ((os.cpu_count() or 1) > 1)


def test_no_compiler_bench_names_bad_arguments(tmp_path):
    text, empty = _texts(tmp_path)
    _names_each(
        "bench_no_compiler.py",
        [
            (["m", str(text), "--runs", "0"], "--runs: at least 1, not 0"),
            (["m", str(tmp_path / "none.txt")], "none.txt: not a file"),
            (["m", str(empty)], "empty.txt: no words to translate"),
            ([str(tmp_path / "none.safetensors"), str(text)], "failed (2)"),
        ],
    )


def test_no_compiler_bench_runs_the_three_ways(tiny_model_file, src):
    from transformer import kernels

    if list(kernels.PREBUILT.glob(f"kernels-{kernels._source_key()}-*.so")):
        out = _run("bench_no_compiler.py", str(tiny_model_file), str(src), "--runs", "1")
        assert out.returncode == 2 and "a library built ahead; move it away" in out.stderr
        return
    out = _run("bench_no_compiler.py", str(tiny_model_file), str(src), "--runs", "1")
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.splitlines()
    assert " cores, " in lines[0]  # the CPU and its ISA beside the figures
    summary = [line for line in lines if "of the compiler's" in line]
    assert [line.split(":")[0] for line in summary] == ["compiler", "no compiler", "built ahead"]
    assert summary[0].endswith("0 lines differ from the kernels' (medians)")
    assert summary[2].endswith("0 lines differ from the kernels' (medians)")


def test_side_by_side_bench_names_bad_arguments(tmp_path):
    text, empty = _texts(tmp_path)
    _names_each(
        "bench_side_by_side.py",
        [
            (["m", str(text), "--jobs", "1"], "--jobs at least 2 and --rounds at least 1"),
            (["m", str(text), "--rounds", "0"], "--jobs at least 2 and --rounds at least 1"),
            (["m", str(tmp_path / "none.txt")], "none.txt: not a file"),
            (["m", str(empty)], "empty.txt: no words to translate"),
            (["m", str(text), "--before", str(tmp_path)], "holds no transformer package"),
            (["m", str(text), "--", "--threads", "2"], "--threads: the script sets it"),
            ([str(tmp_path / "none.safetensors"), str(text)], "failed [2, 2]"),
        ],
    )


def test_side_by_side_bench_runs_each_way(tiny_model_file, src):
    tree = Path(__file__).resolve().parents[2] / "src"
    out = _run("bench_side_by_side.py", str(tiny_model_file), str(src), "--rounds", "1",
               "--before", str(tree))  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.splitlines()
    assert " cores, " in lines[0] and "2 jobs of" in lines[0]
    summary = [line.split(":")[0] for line in lines if "of --threads 1's rate" in line]
    assert summary == ["before", "after", "threads 1", "one job"]


def test_train_side_by_side_bench_names_bad_arguments(tmp_path):
    (tmp_path / "manifest.json").write_text("{}")  # a corpus `transformer train` refuses
    _names_each(
        "bench_train_side_by_side.py",
        [
            ([str(tmp_path), "--jobs", "1"], "--jobs at least 2 and --rounds at least 1"),
            ([str(tmp_path), "--rounds", "0"], "--jobs at least 2 and --rounds at least 1"),
            ([str(tmp_path / "none")], "none: not a prepared corpus (no manifest.json)"),
            ([str(tmp_path), "--before", str(tmp_path)], "holds no transformer package"),
            ([str(tmp_path), "--", "--threads", "2"], "--threads and --out: the script sets"),
            ([str(tmp_path), "--rounds", "1"], "failed [2, 2]: "),
        ],
    )


def test_train_side_by_side_bench_reads_the_rate_past_the_first_window(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))
    import bench_train_side_by_side as bench

    def metrics(*windows):  # (tokens at the window's end, its tokens/s)
        lines = [json.dumps({"kind": "train", "tokens": t, "tokens_per_s": r}) for t, r in windows]
        (tmp_path / "metrics.jsonl").write_text("\n".join([*lines, '{"kind": "valid"}']) + "\n")

    metrics((100, 10.0), (400, 100.0), (1000, 300.0))  # the first window's slow rate not counted
    assert bench.steady_rate(tmp_path) == pytest.approx(600 / 2.0)
    metrics((100, 10.0), (400, 100.0))
    with pytest.raises(bench.RunFailed, match="fewer than 3 metric windows"):
        bench.steady_rate(tmp_path)


def test_train_side_by_side_bench_runs_each_way(tmp_path):
    from fixtures import SHARED_DATA, prepare_slice

    data = prepare_slice(tmp_path / "data", SHARED_DATA / "multi30k")
    out = _run("bench_train_side_by_side.py", str(data), "--rounds", "1",
               "--", "--preset", "tiny", "--max-steps", "25", "train.max_tokens=400")  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.splitlines()
    assert " cores, " in lines[0] and "2 runs of `transformer train" in lines[0]
    summary = [line.split(":")[0] for line in lines if "of --threads 1's pace" in line]
    assert summary == ["after", "threads 1"]
    assert "(100.0% of --threads 1's)" in lines[-1]


def test_before_after_runs_each_sides_compiled_library(monkeypatch) -> None:
    """bench_before_after.py --kernels: `switched` puts each side's compiled library in
    `transformer.kernels` before its calls, and `module_at` gives a revision's kernels.py the
    path it reads its folders from."""
    monkeypatch.syspath_prepend(str(BENCH))
    import bench_before_after as ba
    from transformer import kernels

    old = ba.module_at("HEAD", "src/transformer/kernels.py", "before_kernels_test")
    monkeypatch.delitem(sys.modules, "before_kernels_test")
    assert old.PREBUILT == kernels.PREBUILT and "adam_sumsq" in old._SOURCE
    monkeypatch.setattr(kernels, "_LIB", kernels._LIB)  # restored after the test
    monkeypatch.setattr(kernels, "_NOGIL", kernels._NOGIL)
    libraries = {"before": ("old", "old, no GIL"), "after": ("new", "new, no GIL")}
    monkeypatch.setattr(ba, "LIBRARIES", libraries)
    ba.switched("before")
    assert (kernels._LIB, kernels._NOGIL) == libraries["before"]
    ba.switched("after")
    assert (kernels._LIB, kernels._NOGIL) == libraries["after"]


def test_before_after_names_a_revision_git_does_not_know() -> None:
    done = _run(
        "bench_before_after.py", "--rev", "no-such-revision", "--kernels", "--what", "train"
    )
    assert done.returncode == 1 and "Traceback" not in done.stderr
    assert done.stderr.startswith("bench_before_after.py: --rev no-such-revision: fatal:")
    assert len(done.stderr.strip().splitlines()) == 1
