#!/usr/bin/env python
"""Issue 19's table, with a verdict per target, from what `issue19_table.sh OUT` wrote.

    .venv/bin/python benchmarks/issue19_summary.py OUT      # markdown on stdout

Reads OUT's JSON files (the peers' harness: w0.json, w1_train_*.json, w2_infer_*.json,
w3_mem_*.json; ours: machine.json, w1_share.json, contention.json, dtype_bleu.json) and prints
the issue's table: each workload, ours against the fastest peer as the ratio of the medians
(the issue's "same-run ratios"), and the target for this machine's CPU (machine.json: an AMX
CPU has the higher ones). A file that is missing gives a row that says so; a file that is there
but not what its writer writes is an error naming it.

Targets (issue 19): training base at W1 >= 3.5x the fastest peer and >= 65% of the measured
matmul rate (W0's median over its shapes in the step's dtype; where OUT has w1_share.json,
bench_w1_share.py's reading with W0 and the step alternated in one process decides, since a
host's speed can move by a third between the table's W0 and its W1) on an AMX CPU, >= 2x
without AMX; translation (beam 4 and greedy, in the precision `--dtype auto` picks) >= 1.5x
CT2's int8 on AMX, >= 1.0x without; BLEU of that precision within 0.1 of fp32's on the test
set; peak memory <= 0.65x the best peer's; beside one busy process >= 70% of the alone
throughput.

Besides the ratio of the medians, W1 gives ours against each peer round by round (the same
round's steps, seconds apart): the lowest peer's median of those ratios, which a drift of the
host's speed during the run moves less.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

OURS_TRAIN = "ext:peers_adapter:make_train"
OURS_INFER = "ext:peers_adapter:Infer:"
CT2_INT8 = "ct2:int8"

# (AMX, without AMX)
W1_RATIO = (3.5, 2.0)
W1_MFU = 0.65  # AMX only
W2_RATIO = (1.5, 1.0)
W3_RATIO = 0.65
CONTENTION_KEPT = 0.70
BLEU_WITHIN = 0.1


class SummaryError(Exception):
    """An input file that exists but cannot be read as its writer writes it."""


def load(out: Path, name: str) -> dict | None:
    """OUT/name as JSON; None if absent."""
    path = out / name
    if not path.exists():
        return None
    try:
        return json.loads(path.read_text(encoding="utf-8-sig"))  # a BOM an editor added is fine
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise SummaryError(f"{path}: not readable JSON ({type(e).__name__}: {e})") from None


def _field(path: str, record: dict, *keys):
    """record[k0][k1]...; a missing key is a SummaryError naming the file and the key path."""
    value = record
    for k in keys:
        try:
            value = value[k]
        except (KeyError, IndexError, TypeError):
            where = "".join(f"[{k!r}]" for k in keys)
            raise SummaryError(f"{path}: no {where}") from None
    return value


def rates(results: dict[str, dict]) -> str:
    """ "name 1,234, name 567": each result's median tok/s."""
    return ", ".join(f"{k} {v['tok_per_s']['median']:,.0f}" for k, v in results.items())


def verdict(ok: bool | None) -> str:
    return "-" if ok is None else ("met" if ok else "**not met**")


def fmt_ratio(x: float, target: float | None = None) -> str:
    """x as "2.31x"; with a third decimal where two would print the target itself (0.651 is
    not <= 0.65: "0.651x", not "0.65x" beside "not met")."""
    if target is not None and round(x, 2) == target and x != target:
        return f"{x:.3f}x"
    return f"{x:.2f}x"


class Table:
    def __init__(self) -> None:
        self.rows: list[tuple[str, str, str, str, str]] = []
        self.missing: list[str] = []

    def add(self, workload: str, ours: str, peer: str, result: str, target: str) -> None:
        self.rows.append((workload, ours, peer, result, target))

    def markdown(self) -> str:
        lines = ["| workload | ours | fastest peer | result | target |", "|---|---:|---:|---:|---|"]
        lines += ["| " + " | ".join(r) + " |" for r in self.rows]
        return "\n".join(lines)


def not_run(name: str, data: dict, table: Table, what: str) -> str:
    """The implementations the harness could not build for `name` (its "failed": an import
    error, a peer not installed), each listed among the missing with its error; "" or
    "; not run: fairseq" for the row's peer column. Without this a row compares against the
    peers that did run, and a missing fast peer raises our ratio (round forty-eight's first
    table ran without fairseq's source tree)."""
    failed = data.get("failed") or {}
    if not isinstance(failed, dict):
        raise SummaryError(f"{name}: 'failed' is not a mapping of implementation to error")
    for impl, error in failed.items():
        table.missing.append(f"{what}: {impl} did not run ({str(error)[:120]})")
    return "; not run: " + ", ".join(failed) if failed else ""


def first_of(out: Path, pattern: str) -> tuple[str, str, dict] | None:
    """(dtype, file name, contents) of pattern.format(dtype) in OUT, bf16's if there, else
    fp32's (bench_peers.sh runs W1 and W3 in fp32 on a CPU without native bf16)."""
    for dtype in ("bf16", "fp32"):
        data = load(out, pattern.format(dtype))
        if data is not None:
            return dtype, pattern.format(dtype), data
    return None


def w0_rate(out: Path, dtype: str) -> tuple[float, list[float]] | None:
    """The median over W0's shapes of each shape's median GFLOP/s in dtype (`bf16`/`fp32`)."""
    w0 = load(out, "w0.json")
    if w0 is None:
        return None
    path = str(out / "w0.json")
    medians = [
        _field(path, r, "gflops", "median")
        for r in _field(path, w0, "results")
        if r.get("dtype") == dtype and "gflops" in r
    ]
    return (statistics.median(medians), medians) if medians else None


def w1(out: Path, amx: bool, table: Table) -> None:
    """W1 as the harness runs it (one process), its share of the matmul rate, and W1 with one
    process per implementation where OUT has it (`bench_w1_processes.py`)."""
    found = first_of(out, "w1_train_{}.json")
    if found is None:
        table.missing.append("W1: no w1_train_bf16.json or w1_train_fp32.json")
        return
    dtype, name, data = found
    ours = w1_row(out, name, data, dtype, ", the harness's one process", amx, table)
    each = f"w1_train_{dtype}_each.json"
    data_each = load(out, each)
    if data_each is None:
        table.missing.append(f"W1 one process per implementation: no {each}")
    else:
        w1_row(out, each, data_each, dtype, ", one process per implementation", amx, table)
    if ours is None:
        return
    w0 = w0_rate(out, dtype)
    if w0 is None:
        table.missing.append(f"W1 MFU: no {dtype} rate in w0.json")
        return
    batch = _field(str(out / name), data, "batch")
    flops = step_flops(batch)
    seconds = batch["tgt_tokens"] / ours["median"]
    achieved = flops / seconds / 1e9
    mfu = achieved / w0[0]
    shapes = " / ".join(f"{r:,.0f}" for r in w0[1])
    target = f">= {W1_MFU:.0%} (AMX)" if amx else "(>= 65% is the AMX target)"
    share = load(out, "w1_share.json")
    if share is not None:  # the verdict is the next row's
        said = " (W0 minutes before the step: the next row times both together)"
    else:
        table.missing.append("W1 share with W0 in the same minutes: no w1_share.json")
        said = f": {verdict(mfu >= W1_MFU)}" if amx else ""
    table.add(
        f"W1 share of the {dtype} matmul rate (W0: {shapes}, median {w0[0]:,.0f} GFLOP/s)",
        f"{flops / 1e12:.2f} TFLOP a step in {seconds:.2f} s = {achieved:,.0f} GFLOP/s",
        "",
        f"**{mfu:.0%}**{said}",
        "" if share is not None else target,
    )
    if share is not None:
        w1_share_row(out, share, dtype, amx, target, table)


def w1_share_row(out: Path, data: dict, dtype: str, amx: bool, target: str, table: Table):
    """The share of W0 from bench_w1_share.py: each round W0's shapes, then our W1 steps, in one
    process; the median over the rounds of step rate / that round's W0 median."""
    path = str(out / "w1_share.json")
    if _field(path, data, "dtype") != dtype:
        raise SummaryError(f"{path}: dtype {data['dtype']!r}, W1 ran in {dtype!r}")
    rounds = _field(path, data, "rounds")
    share, step = _field(path, data, "share"), _field(path, data, "step_s")
    w0 = _field(path, data, "w0_median")
    flops = _field(path, data, "step_flops")
    steps = len(_field(path, rounds[0], "step_s")) if rounds else 0
    table.add(
        f"W1 share of the {dtype} matmul rate, both in the same minutes ({len(rounds)} rounds "
        f"of W0's shapes, then {steps} of our steps, in one process)",
        f"{flops / 1e12:.2f} TFLOP a step in {step['median']:.2f} s = "
        f"{flops / step['median'] / 1e9:,.0f} GFLOP/s; W0 median {w0['median']:,.0f} "
        f"({w0['min']:,.0f}-{w0['max']:,.0f})",
        "",
        f"**{share['median']:.0%}** (rounds {share['min']:.0%}-{share['max']:.0%})"
        + (f": {verdict(share['median'] >= W1_MFU)}" if amx else ""),
        target,
    )  # fmt: skip


def w1_row(out: Path, name: str, data: dict, dtype: str, how: str, amx: bool, table: Table):
    """One W1 row: ours against the fastest peer (ratio of the medians) and, round by round,
    against each peer; returns our tok/s stats (None when no peer ran)."""
    path = str(out / name)
    results = {r["impl"]: r for r in _field(path, data, "results")}
    if OURS_TRAIN not in results:
        raise SummaryError(f"{path}: no result for {OURS_TRAIN}")
    peers = {k: v for k, v in results.items() if k != OURS_TRAIN}
    ours = _field(path, results[OURS_TRAIN], "tok_per_s")
    target = W1_RATIO[0 if amx else 1]
    absent = not_run(path, data, table, f"W1{how}")
    if not peers:
        table.add(f"W1 training, base {dtype}{how} (tok/s)", f"{ours['median']:,.0f}",
                  "no peer ran" + absent, "-", f">= {target}x")  # fmt: skip
        return None
    best = max(peers, key=lambda k: peers[k]["tok_per_s"]["median"])
    best_rate = peers[best]["tok_per_s"]["median"]
    ratio = ours["median"] / best_rate
    # Round by round: ours / each peer in the same round (the n-th step of each, seconds or,
    # one process each, a minute apart); each peer's median of those; the lowest.
    paired = {
        k: statistics.median(o / p for o, p in zip(ours["all"], v["tok_per_s"]["all"], strict=True))
        for k, v in peers.items()
    }
    worst = min(paired, key=paired.get)
    others = rates({k: v for k, v in peers.items() if k != best})
    table.add(
        f"W1 training, base {dtype}{how} (target tok/s, median of {ours['n']})",
        f"**{ours['median']:,.0f}** ({ours['min']:,.0f}-{ours['max']:,.0f})",
        f"{best} {best_rate:,.0f} ({others}){absent}",
        f"**{fmt_ratio(ratio, target)}** (round by round: {fmt_ratio(paired[worst])} against "
        f"{worst}): {verdict(ratio >= target)}",
        f">= {target}x" + (" (AMX)" if amx else " (no AMX)"),
    )
    return ours


def step_flops(batch: dict) -> float:
    """The analytic FLOPs of one W1 step (Transformer-base, V 32,000) on the batch's real tokens."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))
    from transformer.config import build_config  # noqa: PLC0415
    from transformer.experiments.flops import training_flops  # noqa: PLC0415

    cfg = build_config("base", None, ["model.max_len=1024"], vocab_size=32000).model
    sents = batch["sents"]
    return training_flops(cfg, batch["src_tokens"], batch["tgt_tokens"],
                          batch["src_tokens"] / sents, batch["tgt_tokens"] / sents)  # fmt: skip


def w2(out: Path, amx: bool, auto: str | None, table: Table) -> None:
    target = W2_RATIO[0 if amx else 1]
    for beam, name in ((4, "w2_infer_beam4.json"), (1, "w2_infer_greedy.json")):
        data = load(out, name)
        label = "beam 4" if beam == 4 else "greedy"
        if data is None:
            table.missing.append(f"W2 {label}: no {name}")
            continue
        path = str(out / name)
        results = {r["variant"]: r for r in _field(path, data, "results")}
        ours = {
            k.removeprefix(OURS_INFER): v for k, v in results.items() if k.startswith(OURS_INFER)
        }
        peers = {k: v for k, v in results.items() if not k.startswith(OURS_INFER)}
        absent = not_run(path, data, table, f"W2 {label}")
        if CT2_INT8 not in peers:
            table.missing.append(f"W2 {label}: no {CT2_INT8} in {name}")
            continue
        ref = _field(path, peers[CT2_INT8], "tok_per_s", "median")
        pick = auto if auto in ours else max(ours, key=lambda k: ours[k]["tok_per_s"]["median"])
        rate = _field(path, ours[pick], "tok_per_s", "median")
        rounds = ""
        if "round_medians" in ours[pick] and "round_medians" in peers[CT2_INT8]:
            pairs = zip(ours[pick]["round_medians"], peers[CT2_INT8]["round_medians"], strict=True)
            rounds = " (rounds " + " / ".join(f"{o / p:.2f}" for o, p in pairs) + ")"
        rest = rates({k: v for k, v in ours.items() if k != pick})
        others = rates({k: v for k, v in peers.items() if k != CT2_INT8})
        why = "auto's" if pick == auto else "the fastest of ours; auto's not measured"
        table.add(
            f"W2 {label} (tok/s): ours {pick} ({why})" + (f"; {rest}" if rest else ""),
            f"**{rate:,.0f}**",
            f"{CT2_INT8} {ref:,.0f}" + (f" ({others})" if others else "") + absent,
            f"**{fmt_ratio(rate / ref, target)}**{rounds}: {verdict(rate / ref >= target)}",
            f">= {target}x CT2 int8" + (" (AMX)" if amx else " (no AMX)"),
        )


def w3(out: Path, table: Table) -> None:
    for size in ("4k", "16k"):
        found = first_of(out, f"w3_mem_{size}_{{}}.json")
        if found is None:
            table.missing.append(f"W3 ~{size}: no w3_mem_{size}_bf16.json or _fp32.json")
            continue
        dtype, name, data = found
        path = str(out / name)
        results = {r["impl"]: r for r in _field(path, data, "results")}
        if OURS_TRAIN not in results:
            raise SummaryError(f"{path}: no result for {OURS_TRAIN}")
        ours = _field(path, results[OURS_TRAIN], "peak_rss_mib")
        peers = {k: v["peak_rss_mib"] for k, v in results.items() if k != OURS_TRAIN}
        absent = not_run(path, data, table, f"W3 ~{size}")
        if not peers:
            table.missing.append(f"W3 ~{size}: no peer in {name}")
            continue
        best = min(peers, key=peers.get)
        tokens = _field(path, results[OURS_TRAIN], "tgt_tokens")
        ratio = ours / peers[best]
        table.add(
            f"W3 peak RSS of a {dtype} step, {tokens:,} target tokens (MiB)",
            f"**{ours:,.0f}**",
            f"{best} {peers[best]:,.0f}{absent}",
            f"**{fmt_ratio(ratio, W3_RATIO)}**: {verdict(ratio <= W3_RATIO)}",
            f"<= {W3_RATIO}x",
        )


def contention(out: Path, table: Table) -> None:
    data = load(out, "contention.json")
    if data is None:
        table.missing.append("contention: no contention.json")
        return
    path = str(out / "contention.json")
    for name, work in _field(path, data, "workloads").items():
        kept = _field(path, work, "kept")
        pairs = _field(path, work, "pairs")
        each = " / ".join(f"{b / a:.1%}" for a, b in pairs)
        table.add(
            f"{name} beside one busy process ({work.get('unit', '')}, median of {len(pairs)})",
            f"{work['alone']:,.0f} alone, {work['beside']:,.0f} beside",
            "",
            f"**{kept:.1%}** kept ({each}): {verdict(kept >= CONTENTION_KEPT)}",
            f">= {CONTENTION_KEPT:.0%}",
        )


def bleu(out: Path, table: Table) -> str | None:
    """Adds the BLEU rows; returns the precision `--dtype auto` picked there (None: unknown)."""
    data = load(out, "dtype_bleu.json")
    if data is None:
        table.missing.append("BLEU: no dtype_bleu.json")
        return None
    path = str(out / "dtype_bleu.json")
    auto = _field(path, data, "auto")
    runs = {(r["dtype"], r["beam"]): r for r in _field(path, data, "runs")}
    changes = {(c["dtype"], c["beam"]): c for c in _field(path, data, "changes")}
    for beam in sorted({b for _, b in runs}, reverse=True):
        if ("fp32", beam) not in runs:
            continue
        label = "greedy" if beam == 1 else f"beam {beam}"
        cells = [f"fp32 {runs['fp32', beam]['bleu']:.2f}"]
        ok = None
        for dtype in sorted({d for d, b in runs if b == beam and d != "fp32"}):
            c = changes.get((dtype, beam))
            if c is None:
                continue
            mark = "**" if dtype == auto else ""
            cells.append(f"{mark}{dtype} {runs[dtype, beam]['bleu']:.2f} ({c['bleu_change']:+.2f}, "
                         f"bootstrap {c['low']:+.2f}..{c['high']:+.2f}){mark}")  # fmt: skip
            if dtype == auto:
                ok = abs(c["bleu_change"]) <= BLEU_WITHIN + 1e-9
        alpha = data.get("alpha")
        table.add(
            f"BLEU {data.get('split', '?')} ({data.get('sentences', '?')} sentences), {label}"
            + (f", α {alpha}" if alpha is not None else ""),
            "; ".join(cells),
            "",
            f"auto = {auto}: {verdict(ok)}" if ok is not None else f"auto = {auto}: not measured",
            f"within {BLEU_WITHIN} of fp32",
        )
    return auto


def guarded(out: Path, files: str, section):
    """section()'s result; a field of the wrong kind in its files is a SummaryError naming them."""
    try:
        return section()
    except (KeyError, TypeError, IndexError, ValueError, AttributeError, ArithmeticError) as e:
        raise SummaryError(f"{out}/{files}: not as its writer writes it "
                           f"({type(e).__name__}: {e})") from None  # fmt: skip


def summarize(out: Path) -> str:
    machine = load(out, "machine.json") or {}
    if not machine and (out / "machine.txt").exists():  # a table from before machine.json
        text = (out / "machine.txt").read_text(encoding="utf-8", errors="replace")
        cpu = next((line[2:] for line in text.splitlines()
                    if line.startswith("# ") and "cores" in line), None)  # fmt: skip
        if cpu:  # cpu_line names the AMX flags where the CPU has them
            machine = {"cpu": cpu, "amx": "amx_bf16" in cpu}
    amx = bool(machine.get("amx", False))
    # BLEU is read before W2 (W2 reports the precision auto picked) and printed last.
    table, bleu_table = Table(), Table()
    guarded(out, "w1_train_*.json, w0.json, w1_share.json", lambda: w1(out, amx, table))
    auto = guarded(out, "dtype_bleu.json", lambda: bleu(out, bleu_table))
    guarded(out, "w2_infer_*.json", lambda: w2(out, amx, auto, table))
    guarded(out, "w3_mem_*.json", lambda: w3(out, table))
    guarded(out, "contention.json", lambda: contention(out, table))
    table.rows += bleu_table.rows
    table.missing += bleu_table.missing
    head = [f"# Issue 19's table: {out}", ""]
    if machine:
        head.append(f"CPU: {machine.get('cpu', '?')}; " + ("**AMX**" if amx else "no AMX")
                    + f"; torch {machine.get('torch', '?')}; commit {machine.get('commit', '?')}; "
                    f"started {machine.get('started', '?')}, load average "
                    f"{machine.get('load_average', '?')}")  # fmt: skip
    else:
        head.append("CPU: unknown (no machine.json): the targets without AMX")
    body = ["", table.markdown()]
    if table.missing:
        body += ["", "Not in OUT: " + "; ".join(table.missing) + "."]
    return "\n".join(head + body) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out", type=Path, help="the directory issue19_table.sh wrote")
    args = ap.parse_args()
    if not args.out.is_dir():
        print(f"issue19_summary.py: {args.out}: not a directory", file=sys.stderr)
        return 2
    try:
        sys.stdout.write(summarize(args.out))
    except SummaryError as e:
        print(f"issue19_summary.py: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
