"""The single entry point: `transformer SUBCOMMAND ...` (also `python -m transformer`).

Each subcommand parses its arguments and calls one library function; anything the CLI does,
Python code can do too. Only this module (and benchmarks/) prints.
"""

from __future__ import annotations

import argparse
import errno
import gc
import json
import logging
import os
import sys
from pathlib import Path

from transformer.allocator import huge_pages_exec
from transformer.errors import JobError, UserError, out_of_memory, what_to_lower


def _add_no_verify(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--no-verify", dest="verify", action="store_false",
        help="skip the model file's checksum of its tensors (faster load, no damage check)",
    )  # fmt: skip


def thread_count(value: str) -> int | str:
    """argparse type of a `--threads` value: a count of 1 to cpuinfo.MAX_THREADS, or "auto"."""
    if value == "auto":
        return value
    try:
        count = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"a number or auto, not {value!r}") from None
    from transformer.cpuinfo import count_problem

    problem = count_problem(count)
    if problem is not None:  # said before a model or corpus is loaded, not after
        raise argparse.ArgumentTypeError(problem)
    return count


def window_lines(value: str) -> int:
    """argparse type of `--window`: a count of lines, 1 to config.MAX_WINDOW_LINES."""
    from transformer.config import MAX_WINDOW_LINES

    try:
        count = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"a number of lines, not {value!r}") from None
    if not 1 <= count <= MAX_WINDOW_LINES:
        raise argparse.ArgumentTypeError(f"1 to {MAX_WINDOW_LINES:,} lines, not {count}")
    return count


def _add_procs(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--procs", type=int, metavar="N",
        help="train.procs: train with N data-parallel processes on this CPU, one thread each "
        "(unless --threads): the same steps, without threads that wait for each other in "
        "every op; the processes share out a step's train.accum_steps batches where N divides "
        "it, else each batch is split (train.max_tokens / N tokens) (default: the preset's or "
        "the run's own)",
    )  # fmt: skip


def _procs_override(args: argparse.Namespace) -> list[str]:
    """`--procs N` as the override it stands for (none: the preset's or the run's own)."""
    return [] if args.procs is None else [f"train.procs={args.procs}"]


def _add_threads(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--threads", type=thread_count, default="auto", metavar="N|auto",
        help="CPU threads (default auto: OMP_NUM_THREADS if set, else tuned to the machine's "
        "load as it runs, on the cores this process may use: its CPU affinity and CPU quota; "
        "on 2+ such cores decoding jobs of 4+ batches then run several batches at once, up to "
        "one per core and one more, one thread each)",
    )  # fmt: skip


def _cmd_presets(args: argparse.Namespace) -> int:
    from transformer.experiments.table3 import describe_presets

    rows = describe_presets(args.vocab_size)
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    cols = ["name", "parameters", "n_layers", "d_model", "d_ff", "n_heads", "d_k", "d_v", "p_drop"]
    print("  ".join(f"{c:>10}" for c in cols))
    for row in rows:
        print("  ".join(f"{row[c]!s:>10}" for c in cols))
    return 0


def _add_presets(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("presets", help="list the model presets (Table 3 rows, big, parsing, CPU)")
    p.add_argument("--vocab-size", type=int, default=37000, help="joint vocabulary size V")
    p.add_argument("--json", action="store_true", help="print a JSON list")
    p.set_defaults(func=_cmd_presets)


def _cmd_flops(args: argparse.Namespace) -> int:
    from transformer.experiments.flops import paper_report, run_report

    if args.paper:
        report = paper_report(args.preset)
    elif args.run_dir is None:
        raise UserError("flops: give a RUN_DIR, or --paper for the paper's own inputs")
    else:
        report = run_report(
            args.run_dir, args.device_tflops, args.devices, args.src_len, args.tgt_len
        )
    print("\n".join(report.lines()))
    return 0


def _cmd_quickstart(args: argparse.Namespace) -> int:
    from transformer.experiments.quickstart import quickstart

    overrides = [*args.overrides, *_procs_override(args)]
    r = quickstart(args.out, args.src, args.tgt, smoke=args.smoke, train_minutes=args.minutes,
                   overrides=overrides)  # fmt: skip
    rep = r.report
    print()
    print(
        f"Multi30k {args.src}→{args.tgt}, test_2016_flickr ({rep['sentences']} sentences), "
        f"beam 4, α {rep['search']['length_penalty']} (chosen on val), "
        f"{rep['train_steps']} training steps"
    )
    print(f"  sacreBLEU {rep['bleu']:.2f}   {rep['bleu_signature']}")
    print(f"  chrF      {rep['chrf']:.2f}   {rep['chrf_signature']}")
    paper = "  tokenized BLEU, compounds split (the paper's metric):"
    if "paper_bleu" in rep:
        print(f"{paper} {rep['paper_bleu']:.2f}")
    elif "paper_bleu_missing" in rep:
        print(f"{paper} {rep['paper_bleu_missing']}")
    total = sum(r.stage_seconds.values())
    stages = ", ".join(f"{k} {v:.0f} s" for k, v in r.stage_seconds.items())
    print(f"  wall time {total / 60:.1f} min ({stages})")
    print(f"  model:        {r.model}")
    print(f"  translations: {r.translations}")
    if args.smoke and not r.loss_fell:
        print("smoke run: the training loss did not fall", file=sys.stderr)
        return 1
    return 0


def _add_quickstart(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "quickstart", help="Multi30k end to end: prepare, train, average, translate, BLEU"
    )
    p.__class__ = _IntermixedParser
    p.add_argument(
        "overrides", nargs="*", metavar="key=value",
        help="changes to the quickstart preset, e.g. train.seed=2 (recorded in RUN/config.yaml)",
    )  # fmt: skip
    p.add_argument("--out", type=Path, default=Path("runs/quickstart"), help="output directory")
    p.add_argument("--src", default="en", help="source language: en, de, fr or cs")
    p.add_argument("--tgt", default="de", help="target language: en, de, fr or cs")
    p.add_argument("--smoke", action="store_true", help="tiny model, a few steps (tests)")
    p.add_argument("--minutes", type=float, help="training budget in minutes (default 17)")
    _add_procs(p)
    p.set_defaults(func=_cmd_quickstart)


def _cmd_recipe(args: argparse.Namespace) -> int:
    from transformer.experiments.recipe import run_recipe

    name, *overrides = args.name_and_overrides  # run_recipe checks the name
    r = run_recipe(
        name, args.out, args.minutes, args.data_from, resume=args.resume,
        overrides=overrides, lowercase=args.lowercase, procs=args.procs,
        alpha_rule=args.alpha_rule,
    )  # fmt: skip
    train, test = r["train"], r["scores"]["test_2016_flickr"]
    print(
        f"{name}: {r['minutes']:.1f} min, {train['steps']} steps, "
        f"{train['epochs'] or 0:.1f} epochs; val BLEU {r['scores']['val']['bleu']:.2f}"
    )
    steps = r["averaged_checkpoints"]
    chosen = r["chosen_on_val"]
    rule = f", rule {chosen['alpha_rule']}; highest val at α {chosen['alpha_best']}"
    print(f"  chosen on val: checkpoints {steps[0]}-{steps[-1]} ({len(steps)}) averaged, "
          f"α {r['alpha']}{rule}")  # fmt: skip
    if r.get("lowercase"):
        print("  test_2016_flickr: trained and scored on lowercased text (--lowercase): "
              "no cased BLEU")  # fmt: skip
    else:
        print(f"  test_2016_flickr: BLEU {test['bleu']:.2f} ({test['bleu_signature']})")
    print(f"  lowercased: BLEU {test['bleu_lc']:.2f} ({test['bleu_lc_signature']})")
    if "tok_bleu_lc" in test:
        print(f"  tokenized, lowercased: BLEU {test['tok_bleu_lc']:.2f} "
              f"({test['tok_bleu_lc_signature']})")  # fmt: skip
    print(f"  report: {args.out / 'recipe.json'}")
    return 0


def _add_recipe(sub: argparse._SubParsersAction) -> None:
    from transformer.experiments.recipe import ALPHA_RULE, BUDGET_MINUTES, RECIPES
    from transformer.experiments.valchoice import ALPHA_RULES

    p = sub.add_parser(
        "recipe", help="a published result end to end: Multi30k trained to convergence"
    )
    p.add_argument(
        "name_and_overrides", nargs="+", metavar="NAME [key=value ...]",
        help=f"the recipe ({', '.join(RECIPES)}), then section.key=value changes",
    )  # fmt: skip
    p.add_argument("--out", type=Path, default=Path("runs/multi30k-full"), help="output directory")
    p.add_argument("--minutes", type=float, default=BUDGET_MINUTES, help="the whole job's budget")
    p.add_argument("--data-from", type=Path, help="Multi30k's raw files (default: found on disk)")
    p.add_argument("--resume", action="store_true", help="continue an interrupted run in OUT")
    p.add_argument(
        "--lowercase", action="store_true",
        help="train and score on lowercased text, as the Multi30k literature does (its BLEU "
        "is on lowercased, tokenized text); reports no cased BLEU",
    )  # fmt: skip
    p.add_argument(
        "--alpha-rule", choices=ALPHA_RULES, default=ALPHA_RULE,
        help="how the length penalty is chosen on val: the smallest α within one standard "
        "error (paired bootstrap) of the best (one-se), or the highest val BLEU (best) "
        f"(default: {ALPHA_RULE})",
    )  # fmt: skip
    _add_procs(p)
    p.set_defaults(func=_cmd_recipe)


PTB = "ptb"  # §6.3: `prepare ptb` builds the parsing corpus (parsing.corpus)


def _cmd_prepare(args: argparse.Namespace) -> int:
    from transformer.data import DataError

    if args.name == PTB:
        from transformer.parsing.corpus import prepare_parsing

        prepare_parsing(
            args.out, args.from_dir, vocab_size=args.vocab_size, leaves=args.leaves,
            force=args.force,
        )  # fmt: skip
        return 0
    from transformer.prepare import prepare_corpus, read_symbols

    if args.src is None or args.tgt is None:
        raise DataError("prepare", f"{args.name}: --src and --tgt are required")
    symbols = read_symbols(args.user_symbols) if args.user_symbols else ()
    prepare_corpus(
        args.name, args.src, args.tgt, args.out, from_dir=args.from_dir,
        vocab_size=args.vocab_size, spm_type=args.spm_type, max_len=args.max_len,
        max_ratio=args.max_ratio, train_files=args.train, valid_files=args.valid,
        test_files=args.test, force=args.force, download_dir=args.download_dir,
        spm_sample=args.spm_sample, user_symbols=symbols,
        num_threads=None if args.threads == "auto" else args.threads,
        mirror=args.mirror, checksums=args.checksums, lowercase=args.lowercase,
    )  # fmt: skip
    return 0


def _add_prepare(sub: argparse._SubParsersAction) -> None:
    from transformer import corpora, prepare
    from transformer.parsing.trees import LEAF_MODES

    p = sub.add_parser("prepare", help="§5.1 corpus -> joint subwords + binarized splits")
    names = [*corpora.REGISTRY, prepare.CUSTOM, PTB]
    p.add_argument("name", choices=names, help="corpus name (ptb: §6.3 parsing)")
    p.add_argument("--src", help="source language code, e.g. en (ptb: en)")
    p.add_argument("--tgt", help="target language code, e.g. de (ptb: tree)")
    p.add_argument("--out", required=True, type=Path, help="prepared-data directory")
    p.add_argument("--from", dest="from_dir", type=Path, help="use files in DIR, no download")
    for split in ("train", "valid", "test"):
        p.add_argument(
            f"--{split}", nargs=2, type=Path, metavar=("SRC", "TGT"), help=f"custom: {split} files"
        )
    p.add_argument("--vocab-size", type=int, help="joint subword vocabulary (default per corpus)")
    p.add_argument("--spm-type", choices=["bpe", "unigram"], help="default per corpus")
    p.add_argument(
        "--max-len", type=int, default=prepare.DEFAULT_MAX_LEN, help="train: max subwords incl. EOS"
    )
    p.add_argument(
        "--max-ratio", type=float, default=prepare.DEFAULT_MAX_RATIO, help="train: max length ratio"
    )
    p.add_argument(
        "--spm-sample", type=int, default=prepare.DEFAULT_SPM_SAMPLE,
        help="sentences for spm training",
    )  # fmt: skip
    p.add_argument(
        "--threads", type=thread_count, default="auto", metavar="N|auto",
        help="sentencepiece threads (default auto: the cores, at most 4)",
    )  # fmt: skip
    p.add_argument(
        "--user-symbols", type=Path, help="file of tokens (one a line) kept whole in the vocabulary"
    )
    p.add_argument(
        "--leaves", choices=LEAF_MODES, default="xx",
        help="ptb: what the linearized trees write for each word: XX (the paper's [37]), the "
        "POS tag, or the word itself (docs/parsing.md)",
    )  # fmt: skip
    p.add_argument("--download-dir", type=Path, help="default: OUT.downloads")
    p.add_argument(
        "--mirror", help="download from this base URL instead of each file's host (same paths)"
    )
    p.add_argument(
        "--checksums", type=Path,
        help="file of '<sha256 or md5>  <name>' lines replacing the built-in download checksums",
    )  # fmt: skip
    p.add_argument(
        "--lowercase", action="store_true",
        help="lowercase every split (the lowercasing step of the Multi30k literature's text); "
        "models trained on it lowercase their input and write lowercased text",
    )  # fmt: skip
    p.add_argument("--force", action="store_true", help="rebuild OUT even if it exists")
    p.set_defaults(func=_cmd_prepare)


def _add_flops(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("flops", help="Table 2: a run's training cost, estimated and counted")
    p.add_argument("run_dir", nargs="?", type=Path, help="training run directory")
    p.add_argument("--paper", action="store_true", help="the paper's own inputs (§5.1, §5.2)")
    p.add_argument("--preset", default="base", choices=["base", "big"], help="with --paper")
    p.add_argument(
        "--device-tflops", type=float, help="sustained TFLOPS per device (default: measured)"
    )
    p.add_argument("--devices", type=int, default=1, help="number of devices the run used")
    p.add_argument("--src-len", type=float, help="mean source length (attention terms)")
    p.add_argument("--tgt-len", type=float, help="mean target length (attention terms)")
    p.set_defaults(func=_cmd_flops)


def _cmd_attention(args: argparse.Namespace) -> int:
    from transformer.experiments.attention import KINDS, plot_attention

    kinds = KINDS if args.kind == "all" else (args.kind,)
    paths = plot_attention(
        args.model, args.text, args.out, args.layer, args.head, kinds, args.word, args.target,
        verify=args.verify,
    )  # fmt: skip
    print("\n".join(str(p) for p in paths))
    return 0


def _add_attention(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("attention", help="Figures 3-5: PNG pictures of attention weights")
    p.add_argument("model", type=Path, help="a model file")
    p.add_argument("--text", required=True, help="the source sentence")
    p.add_argument("--target", help="the target sentence (default: the greedy translation)")
    p.add_argument("--layer", type=int, help="0-based layer (default: last but one, as the paper)")
    p.add_argument("--head", type=int, help="one head for the Figure 4 picture (default: all)")
    p.add_argument("--word", help="Figure 3 query word: a subword or 0-based position")
    p.add_argument("--kind", choices=["encoder", "decoder", "cross", "all"], default="all")
    p.add_argument("--out", type=Path, default=Path("attention"), help="output directory")
    _add_no_verify(p)
    p.set_defaults(func=_cmd_attention)


def _cmd_sweep(args: argparse.Namespace) -> int:
    from transformer.experiments.table3 import ROWS, run_table3

    rows = [r.strip() for r in args.rows.split(",")] if args.rows else list(ROWS)
    if args.converge:
        return _sweep_converged(args, rows)
    given = [f for f, v in (("--resume", args.resume), ("--seeds", args.seeds),
             ("--patience", args.patience), ("--valid-every", args.valid_every),
             ("--max-epochs", args.max_epochs), ("--threads", args.threads != "auto"),
             ("--jobs", args.jobs))
             if v not in (None, False)]  # fmt: skip
    if given:
        raise UserError(f"sweep: {', '.join(given)} only with --converge")
    if args.budget_steps is None and args.budget_minutes is None:
        raise UserError("sweep: give --budget-steps or --budget-minutes (or --converge)")
    results = run_table3(
        args.data, args.out, rows, args.scale or "small", args.budget_steps, args.budget_minutes,
        args.set, args.beam, args.alpha, args.valid_limit,
    )  # fmt: skip
    print((args.out / "table3.md").read_text(encoding="utf-8"))
    print(f"{len(results)} rows; CSV: {args.out / 'table3.csv'}")
    return 0


def _sweep_converged(args: argparse.Namespace, rows: list[str]) -> int:
    from transformer.experiments.table3_converge import ConvergeSettings, run_converged

    if args.budget_steps is not None or args.budget_minutes is not None:
        raise UserError("sweep: --converge trains to convergence; drop --budget-steps/-minutes")
    defaults = ConvergeSettings(data="", scale="")
    settings = ConvergeSettings(
        data=str(args.data.resolve()), scale=args.scale or "mini", overrides=tuple(args.set),
        patience=defaults.patience if args.patience is None else args.patience,
        valid_every=args.valid_every,
        max_epochs=defaults.max_epochs if args.max_epochs is None else args.max_epochs,
        seeds=defaults.seeds if args.seeds is None else args.seeds,
        beam_size=args.beam, length_penalty=args.alpha, valid_limit=args.valid_limit,
    )  # fmt: skip
    jobs = 1 if args.jobs is None else args.jobs
    results = run_converged(args.data, args.out, settings, rows, args.resume, args.threads, jobs)
    print((args.out / "table3.md").read_text(encoding="utf-8"))
    print(f"{len(results)} trainings; CSV (one line per seed): {args.out / 'table3.csv'}")
    return 0


def _add_sweep(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("sweep", help="§6.2 Table 3: train and measure the model variations")
    p.add_argument("experiment", choices=["table3"], help="the sweep to run")
    p.add_argument("--data", type=Path, required=True, help="a prepared-data directory")
    p.add_argument("--out", type=Path, default=Path("runs/table3"), help="sweep directory")
    p.add_argument("--rows", help="comma-separated Table 3 rows (default: all, base to big)")
    p.add_argument(
        "--scale",
        help="base, small (cpu-small), mini (cpu-mini) or a preset name (default: small; "
        "mini with --converge)",
    )  # fmt: skip
    budget = p.add_mutually_exclusive_group()
    budget.add_argument("--budget-steps", type=int, help="training steps per row")
    budget.add_argument("--budget-minutes", type=float, help="training minutes per row")
    p.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE",
        help="override on the base, e.g. train.max_tokens=2000 (repeatable)",
    )  # fmt: skip
    p.add_argument("--beam", type=int, default=4, help="dev BLEU beam size (§6.1: 4)")
    p.add_argument("--alpha", type=float, default=0.6, help="length penalty α (§6.1: 0.6)")
    p.add_argument("--valid-limit", type=int, help="dev BLEU on the first N sentences only")
    conv = p.add_argument_group("convergence mode (docs/table3.md)")
    conv.add_argument(
        "--converge", action="store_true",
        help="train each row until dev perplexity stops improving (or --max-epochs), with seeds",
    )  # fmt: skip
    conv.add_argument("--patience", type=int, help="validations without a better dev PPL (3)")
    conv.add_argument("--valid-every", type=int, help="steps between validations (half an epoch)")
    conv.add_argument("--max-epochs", type=float, help="epoch cap per training (10)")
    conv.add_argument(
        "--seeds", type=int,
        help="seeds for base and for rows within 2 std of it (3)",
    )  # fmt: skip
    conv.add_argument(
        "--resume", action="store_true",
        help="continue the sweep in --out (same settings): finished seeds are kept",
    )  # fmt: skip
    conv.add_argument(
        "--jobs", type=int, metavar="N",
        help="trainings at once, each in its own process (1; a GPU takes ~12 small ones); "
        "with N > 1 each training gets one CPU thread unless --threads says otherwise",
    )  # fmt: skip
    _add_threads(conv)
    p.set_defaults(func=_cmd_sweep)


def _cmd_train(args: argparse.Namespace) -> int:
    if args.procs is not None and args.procs > 1:  # its imports of torch beside this process's
        from transformer import rankserver

        rankserver.start("transformer.train")
    from transformer.config import build_config
    from transformer.train import train

    positional = [a for a in args.args if "=" not in a]
    overrides = [a for a in args.args if "=" in a]
    if len(positional) > 1:
        raise UserError(f"train: expected one DATA_DIR, got {positional}")
    data_dir = Path(positional[0]) if positional else None
    for flag, key in ((args.max_steps, "train.max_steps"), (args.max_minutes, "train.max_minutes")):
        if flag is not None:
            overrides.append(f"{key}={flag}")
    overrides += _procs_override(args)
    if args.resume is not None:
        train(data_dir, args.resume, resume=True, overrides=overrides, device=args.device,
              threads=args.threads)  # fmt: skip
        return 0
    if args.out is None or data_dir is None:
        raise UserError("train: give DATA_DIR and --out RUN_DIR (or --resume RUN_DIR)")
    config = build_config(args.preset, args.config)
    train(data_dir, args.out, config, overrides=overrides, device=args.device, threads=args.threads)
    return 0


class _IntermixedParser(argparse.ArgumentParser):
    """Lets `key=value` overrides follow options (`train DATA --out R k=v`): argparse alone
    fills a positional only once, so positionals after options would be unrecognized."""

    _inner = False

    def parse_known_args(self, args=None, namespace=None):
        if self._inner:
            return super().parse_known_args(args, namespace)
        self._inner = True
        try:
            return self.parse_known_intermixed_args(args, namespace)
        finally:
            self._inner = False


def _add_train(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("train", help="§5 training on a prepared-data directory (or --resume)")
    p.__class__ = _IntermixedParser
    p.add_argument("args", nargs="*", metavar="DATA_DIR | key=value", help="data and overrides")
    p.add_argument("--preset", help="a model preset (see `transformer presets`)")
    p.add_argument("--config", type=Path, help="a YAML config (configs/*.yaml)")
    p.add_argument("--out", type=Path, help="the run directory to create")
    p.add_argument("--resume", type=Path, metavar="RUN_DIR", help="continue this run exactly")
    p.add_argument("--max-steps", type=int, help="stop after this many optimizer steps")
    p.add_argument("--max-minutes", type=float, help="stop after this many minutes")
    p.add_argument("--device", help="cpu, cuda, cuda:1 ... (default: cuda if available)")
    _add_threads(p)
    _add_procs(p)
    p.set_defaults(func=_cmd_train)


def _cmd_average(args: argparse.Namespace) -> int:
    from transformer.rundir import average_run

    print(average_run(args.run_dir, args.last, args.out, args.upper_bound))
    return 0


def _add_average(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("average", help="§6.1: average a run's last N checkpoints into a model")
    p.add_argument("run_dir", type=Path, help="training run directory")
    p.add_argument("--last", type=int, default=5, help="checkpoints to average (§6.1: 5 / 20)")
    p.add_argument("--out", type=Path, help="model file (default RUN_DIR/model.safetensors)")
    p.add_argument(
        "--upper-bound", type=int, metavar="STEP",
        help="average the last N checkpoints of at most this step (e.g. the best on dev)",
    )  # fmt: skip
    p.set_defaults(func=_cmd_average)


def _cmd_translate(args: argparse.Namespace) -> int:
    from transformer.data import open_binary
    from transformer.translate import Translator, translate_stream

    translator = Translator.from_path(
        args.model, dtype=args.dtype, verify=args.verify, threads=args.threads
    )
    translator.decode = translator.options(
        args.beam, args.alpha, max_tokens=args.max_tokens, stop=args.stop
    )
    if args.input == "-":
        translate_stream(translator, sys.stdin.buffer, "<stdin>", sys.stdout, args.window)
    else:
        with open_binary(args.input) as f:  # a missing file or a directory: one DataError
            translate_stream(translator, f, args.input, sys.stdout, args.window)
    return 0


def _add_translate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("translate", help="§6.1 beam search: translate lines (stdin or a file)")
    p.add_argument("model", help="a model file, or a run directory (its averaged/latest model)")
    p.add_argument("input", nargs="?", default="-", help="a UTF-8 text file (default: stdin)")
    p.add_argument("--beam", type=int, help="beam size (default: the model's, §6.1: 4; 1 = greedy)")
    p.add_argument("--alpha", type=float, help="length penalty α (default: the model's, 0.6)")
    _add_dtype(p)
    from transformer.config import WINDOW_LINES

    p.add_argument("--max-tokens", type=int, help="source tokens per batch (padding counted)")
    p.add_argument(
        "--window", type=window_lines, default=WINDOW_LINES, metavar="LINES",
        help=f"lines read, batched and translated together, then written (default "
        f"{WINDOW_LINES:,}): memory is one window's; from a pipe or terminal a window also "
        "ends where the input pauses",
    )  # fmt: skip
    _add_stop(p)
    _add_threads(p)
    _add_no_verify(p)
    p.set_defaults(func=_cmd_translate)


def _add_dtype(p: argparse.ArgumentParser, default: str = "auto") -> None:
    from transformer.config import INFERENCE_DTYPES

    p.add_argument(
        "--dtype",
        choices=INFERENCE_DTYPES,
        default=default,
        help=f"precision (default: {default}); auto = bf16 with CUDA or a CPU with AMX, "
        "int8 on a CPU with VNNI and no AMX, or with neither when the model file has GPTQ "
        "int8 weights (`transformer quantize`), else fp32 (the choice is logged)",
    )


def _add_stop(p: argparse.ArgumentParser) -> None:
    from transformer.config import STOP_RULES

    p.add_argument(
        "--stop",
        choices=STOP_RULES,
        help="when beam search ends a sentence: t2t = §6.1, when no live hypothesis can beat the "
        "best finished one; fairseq = once K have finished (default: the model's, t2t)",
    )


def _cmd_evaluate(args: argparse.Namespace) -> int:
    from transformer.evaluate import evaluate

    report = evaluate(
        args.model, args.data, args.split, args.beam, args.alpha, args.dtype, args.output,
        args.limit, args.stop, verify=args.verify, threads=args.threads,
    )  # fmt: skip
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    print(f"{report['split']}: {report['sentences']} sentences in {report['seconds']:.1f} s")
    print("search: " + ", ".join(f"{k} {v}" for k, v in report["search"].items())
          + f", dtype {report['dtype']}")  # fmt: skip
    print(f"sacreBLEU {report['bleu']:.2f}  {report['bleu_signature']}")
    print(f"  {report['bleu_details']}")
    print(f"chrF {report['chrf']:.2f}  {report['chrf_signature']}")
    print(f"sacreBLEU, lowercased {report['bleu_lc']:.2f}  {report['bleu_lc_signature']}")
    if "tok_bleu_lc" in report:  # the Multi30k literature's form
        print(f"tokenized BLEU, lowercased {report['tok_bleu_lc']:.2f}  "
              f"{report['tok_bleu_lc_signature']}")  # fmt: skip
    if "paper_bleu" in report:
        print(f"tokenized BLEU, compounds split (paper) {report['paper_bleu']:.2f}  "
              f"{report['paper_bleu_signature']}")  # fmt: skip
    elif "paper_bleu_missing" in report:
        print(f"tokenized BLEU, compounds split (paper): {report['paper_bleu_missing']}")
    return 0


def _add_evaluate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("evaluate", help="translate a prepared split; sacreBLEU, chrF (paper BLEU)")
    p.add_argument("model", help="a model file, or a run directory (its averaged/latest model)")
    p.add_argument("--data", required=True, help="a prepared-data directory")
    p.add_argument("--split", default="test", help="split name (default: test)")
    p.add_argument("--beam", type=int, help="beam size (default: the model's, §6.1: 4)")
    p.add_argument("--alpha", type=float, help="length penalty α (default: the model's, 0.6)")
    _add_dtype(p)
    p.add_argument("--output", help="write the translations to this file")
    p.add_argument("--limit", type=int, help="only the first N sentences")
    _add_stop(p)
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    _add_threads(p)
    _add_no_verify(p)
    p.set_defaults(func=_cmd_evaluate)


def _cmd_score(args: argparse.Namespace) -> int:
    from transformer.bleu import score_files

    report = score_files(args.hyp, args.ref, args.lang)
    if args.json:
        print(json.dumps(report.as_dict(), indent=2))
        return 0
    paper = "tokenized BLEU, compounds split" if args.lang == "de" else "tokenized BLEU"
    print(f"{report.lines} lines")
    print(f"sacreBLEU {report.sacrebleu.score:.2f}  {report.sacrebleu.signature}")
    print(f"  {report.sacrebleu}")
    print(f"chrF {report.chrf.score:.2f}  {report.chrf.signature}")
    print(f"{paper} (paper) {report.paper.score:.2f}  {report.paper.signature}")
    print(f"  {report.paper}")
    return 0


def _add_score(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "score", help="score a detokenized output file: sacreBLEU, chrF, the paper's BLEU"
    )
    p.add_argument("hyp", help="detokenized system output, one line per reference line")
    p.add_argument("ref", help="the raw (untokenized) references")
    p.add_argument(
        "--lang",
        required=True,
        choices=["de", "fr"],
        help="target language: de = En-De metric (compounds split), fr = En-Fr metric",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=_cmd_score)


def _cmd_serve(args: argparse.Namespace) -> int:
    from transformer.serving.server import ServeLimits, serve

    given = {
        "max_request_bytes": args.max_request_bytes,
        "max_sentences": args.max_sentences,
        "max_sentence_tokens": args.max_sentence_tokens,
        "batch_wait_ms": args.batch_wait_ms,
        "max_batch_sentences": args.max_batch_sentences,
        "max_attention_weights": args.max_attention_weights,
        "max_connections": args.max_connections,
        "idle_timeout_s": args.idle_timeout,
        "header_timeout_s": args.header_timeout,
        "body_timeout_s": args.body_timeout,
    }
    limits = ServeLimits(**{k: v for k, v in given.items() if v is not None})
    print(f"serving {args.model} on http://{args.host}:{args.port}/ (Ctrl-C stops)")
    serve(args.model, args.host, args.port, limits, args.dtype, args.threads, verify=args.verify)
    return 0


def _add_serve(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="HTTP translation server: JSON API + attention web page")
    p.add_argument("model", help="a model file, or a run directory (its averaged/latest model)")
    p.add_argument("--host", default="127.0.0.1", help="interface (default: loopback only)")
    p.add_argument("--port", type=int, default=8000)
    _add_dtype(p)
    _add_threads(p)
    p.add_argument("--max-request-bytes", type=int, help="JSON body limit (default 262144)")
    p.add_argument("--max-sentences", type=int, help="sentences per request (default 64)")
    p.add_argument("--max-sentence-tokens", type=int, help="subwords per sentence (default 250)")
    p.add_argument("--batch-wait-ms", type=float, help="batching window (default 5 ms)")
    p.add_argument("--max-batch-sentences", type=int, help="sentences per batch (default 64)")
    p.add_argument(
        "--max-attention-weights", type=int,
        help='attention weights in one "attention": true answer (default 2000000)',
    )  # fmt: skip
    p.add_argument(
        "--max-connections", type=int,
        help="open connections; beyond them only /health is answered (default 256)",
    )  # fmt: skip
    p.add_argument(
        "--idle-timeout", type=float, metavar="S",
        help="close a connection that sends nothing between requests (default 5 s)",
    )  # fmt: skip
    p.add_argument(
        "--header-timeout", type=float, metavar="S",
        help="a request head must arrive within this from its first byte (default 10 s)",
    )  # fmt: skip
    p.add_argument(
        "--body-timeout", type=float, metavar="S",
        help="a request body must arrive within this from its head, else 408 (default 30 s)",
    )  # fmt: skip
    _add_no_verify(p)
    p.set_defaults(func=_cmd_serve)


def _cmd_quantize(args: argparse.Namespace) -> int:
    from transformer.gptq import quantize_model_file

    print(quantize_model_file(args.model, args.data, args.out, args.split, args.sentences,
                              threads=args.threads))  # fmt: skip
    return 0


def _add_quantize(sub: argparse._SubParsersAction) -> None:
    from transformer.config import CALIBRATION_SENTENCES

    p = sub.add_parser(
        "quantize", help="int8 weights rounded by GPTQ on real sentences, into the model file"
    )
    p.add_argument("model", type=Path, help="a model file or run directory")
    p.add_argument("data", type=Path, help="prepared data of the model (its tokenizer)")
    p.add_argument("--split", default="train", help="the pairs to calibrate on (default train)")
    p.add_argument(
        "--sentences", type=int, default=CALIBRATION_SENTENCES,
        help=f"the first N pairs of the split (default {CALIBRATION_SENTENCES})",
    )  # fmt: skip
    p.add_argument("--out", type=Path, help="model file (default: the model file, rewritten)")
    _add_threads(p)
    p.set_defaults(func=_cmd_quantize)


def _cmd_export(args: argparse.Namespace) -> int:
    from transformer.serving.export import export_ctranslate2

    print(export_ctranslate2(args.model, args.out, args.quantization, args.force, args.verify))
    return 0


def _add_export(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("export", help="write a model for a fast inference engine (CTranslate2)")
    p.add_argument("model", type=Path, help="a model file")
    p.add_argument("out", type=Path, help="output directory")
    p.add_argument("--to", choices=["ctranslate2"], required=True, help="target engine")
    p.add_argument("--quantization", help="int8, int8_float32, int16, float16, bfloat16, float32")
    p.add_argument("--force", action="store_true", help="replace an existing output directory")
    _add_no_verify(p)
    p.set_defaults(func=_cmd_export)


def _cmd_kernels(args: argparse.Namespace) -> int:
    from transformer import kernels, translate

    why = kernels.unavailable()
    if why is not None:  # nothing to keep: torch's ops run here
        raise UserError(f"the compiled kernels cannot be had here: {why}")
    target = kernels.build_ahead(args.into)
    for line in kernels.describe():
        print(line)
    print(f"int8 decoding's products: {translate.int8_product_said()}")
    found = "" if args.into is None else f" with TRANSFORMER_KERNELS={target.parent}"
    print(f"kept in {target}: a process without a C compiler loads it from there{found}")
    return 0


def _add_kernels(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "kernels",
        help="build the compiled CPU kernels now and keep them in the package's folder, for a "
        "copy of this environment without a C compiler (a container image's second stage)",
    )  # fmt: skip
    p.add_argument(
        "--into", type=Path, metavar="DIR",
        help="keep the library here instead (a process finds it with TRANSFORMER_KERNELS=DIR)",
    )  # fmt: skip
    p.set_defaults(func=_cmd_kernels)


def _cmd_parse(args: argparse.Namespace) -> int:
    from transformer.data import read_lines, write_output
    from transformer.parsing.parse import evaluate_parser, parse_file

    if args.eval is not None:
        r = evaluate_parser(
            args.model, args.eval, args.split, beam=args.beam, alpha=args.alpha,
            limit=args.limit, dtype=args.dtype, output=args.output, constrain=args.constrain,
            verify=args.verify, threads=args.threads,
        )  # fmt: skip
        short = r["len<=40"]
        print(f"{r['split']}: {r['sentences']} sentences in {r['seconds']:.1f} s "
              f"(beam {r['beam']}, alpha {r['alpha']})")  # fmt: skip
        for name, s in (("all", r), ("len<=40", short)):
            print(f"EVALB {name}: P {s['precision']:.2f}  R {s['recall']:.2f}  F1 {s['f1']:.2f}  "
                  f"exact {s['exact_match']:.2f}  valid {s['valid_sentences']}  "
                  f"errors {s['error_sentences']}")  # fmt: skip
        return 0

    def lines(path: str) -> list[str]:
        if path == "-":
            return list(read_lines(sys.stdin.buffer, "<stdin>"))
        return list(read_lines(path))  # a missing file or a directory: one DataError

    name = "<stdin>" if args.input == "-" else args.input
    pos = lines(args.pos) if args.pos else None
    trees = parse_file(
        args.model, lines(args.input), name, pos, args.beam, args.alpha, args.dtype,
        args.constrain, verify=args.verify, threads=args.threads,
    )  # fmt: skip
    text = "".join(t + "\n" for t in trees)
    if args.output:
        write_output(args.output, text)
    else:
        sys.stdout.write(text)
    return 0


def _add_parse(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("parse", help="§6.3 constituency parsing: sentences -> bracketed trees")
    p.add_argument("model", help="a parsing model file, or its run directory")
    p.add_argument("input", nargs="?", default="-", help="one tokenized sentence a line (stdin)")
    p.add_argument("--pos", help="POS tags, one line per sentence, for the trees (default XX)")
    p.add_argument("--beam", type=int, default=21, help="beam size (§6.3: 21)")
    p.add_argument("--alpha", type=float, default=0.3, help="length penalty α (§6.3: 0.3)")
    _add_dtype(p, default="fp32")
    _add_threads(p)
    p.add_argument("--output", help="write the trees to this file (default stdout)")
    p.add_argument(
        "--eval", metavar="GOLD", help="parse GOLD's sentences (a tree file or `prepare ptb` dir) "
        "with its POS tags and print EVALB (COLLINS.prm) P/R/F1"
    )  # fmt: skip
    p.add_argument("--split", default="test", help="with --eval DIR: train, valid or test")
    p.add_argument("--limit", type=int, help="with --eval: only the first N trees")
    p.add_argument(
        "--constrain", action=argparse.BooleanOptionalAction, default=False,
        help="search only well-formed trees over the sentence's words (models trained with "
        "`prepare ptb --leaves words`; off by default)",
    )  # fmt: skip
    _add_no_verify(p)
    p.set_defaults(func=_cmd_parse)


# Each entry adds one subcommand. Subcommands live here in the order a user meets them.
_SUBCOMMANDS = [
    _add_quickstart,
    _add_recipe,
    _add_prepare,
    _add_presets,
    _add_flops,
    _add_attention,
    _add_sweep,
    _add_train,
    _add_average,
    _add_quantize,
    _add_translate,
    _add_evaluate,
    _add_score,
    _add_parse,
    _add_serve,
    _add_export,
    _add_kernels,
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="transformer",
        description='The Transformer of "Attention Is All You Need" (Vaswani et al., 2017).',
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add in _SUBCOMMANDS:
        add(sub)
    return parser


# The commands that run themselves again with glibc's heap in 2 MB pages (allocator.py).
HUGE_PAGE_COMMANDS = frozenset({"train"})


def _command(argv: list[str]) -> str | None:
    """The subcommand named in argv: its first word that is not an option (the program's own
    options take no value)."""
    return next((word for word in argv if not word.startswith("-")), None)


def main(argv: list[str] | None = None) -> int:
    if argv is None and _command(sys.argv[1:]) in HUGE_PAGE_COMMANDS:
        again = huge_pages_exec()
        if again is not None:  # before the imports: glibc reads the tunable as a process starts
            try:
                for stream in (sys.stdout, sys.stderr):
                    if stream is not None:  # None: started without it (`>&-`)
                        stream.flush()
                os.execve(*again)
            except OSError as e:  # not run again (an interpreter gone meanwhile): as it is
                print(f"transformer: 4 KiB pages ({e})", file=sys.stderr)
    if argv is None:
        _standard_fds_held()
    try:  # building the parser imports no torch: `--help` in ~0.4 s, not ~2.5 (round sixty-one)
        args = build_parser().parse_args(argv)
    except KeyboardInterrupt:
        print("transformer: interrupted", file=sys.stderr)
        return 130
    if argv is None:  # the program (`transformer ...`, `python -m transformer`), not a caller's
        # Python's cycle collector walks every tracked object of the heap at each full
        # collection, and the imports alone made ~170,000 (torch's modules, classes and
        # functions, which live as long as the process): set them aside so that it walks only
        # what the command makes (prepare multi30k: 0.31 -> 0.16 s; benchmarks/bench_gc.py).
        gc.freeze()
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
    )
    stdout, sys.stdout = sys.stdout, _Stdout(sys.stdout)
    try:
        status = args.func(args)
        sys.stdout.flush()  # a full or closed stdout fails here, inside the handlers below
        return status
    except UserError as e:
        return _fail(args.command, str(e))
    except JobError as e:  # stopped by the machine (memory, a signal): no traceback to read
        return _fail(args.command, str(e))
    except (MemoryError, RuntimeError) as e:  # an allocation that failed, anywhere else
        what = out_of_memory(e)
        if what is None:
            raise
        return _fail(args.command, f"{what}: {_needs_less(args, what)}")
    except OSError as e:  # disk full, permission denied, stdout closed (`| head -c0`) or full
        if e.filename == STDOUT and stdout is not None:  # nothing more can be written there
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, stdout.fileno())
            os.close(devnull)
        where = "" if e.filename is None else f"{e.filename}: "
        return _fail(args.command, f"{where}{e.strerror or e}")
    except KeyboardInterrupt:
        print(f"transformer {args.command}: interrupted", file=sys.stderr)
        return 130
    finally:
        sys.stdout = stdout


STDOUT = "<stdout>"


def _standard_fds_held() -> None:
    """Hold each of fds 0-2 that the program started without (`<&-`, `>&-`, `2>&-`) on
    /dev/null: else the first file a command opens takes that number, and a library's write to
    stdout or stderr lands in it (a checkpoint, a model file). Python has set the stream to None:
    reading a closed stdin and writing a closed stdout still fail, in one line as a closed
    pipe does (_ClosedStdin, _Stdout); what goes to a closed stderr is dropped."""
    for fd in (0, 1, 2):
        try:
            os.fstat(fd)
        except OSError:
            null = os.open(os.devnull, os.O_RDWR)  # the lowest free number: fd itself
            if null != fd:
                os.dup2(null, fd)
                os.close(null)
    if sys.stdin is None:
        sys.stdin = _ClosedStdin()
    if sys.stderr is None:
        sys.stderr = open(2, "w", encoding="utf-8", errors="backslashreplace", closefd=False)  # noqa: SIM115


def _bad_fd(name: str) -> OSError:
    return OSError(errno.EBADF, os.strerror(errno.EBADF), name)


class _ClosedStdin:
    """sys.stdin of a program started without one: reading it fails, naming <stdin>."""

    def __getattr__(self, name: str):
        raise _bad_fd("<stdin>")


class _Stdout:
    """sys.stdout whose write errors (EPIPE, ENOSPC) name it, as the file of the error."""

    def __init__(self, stream) -> None:
        self._stream = stream

    def write(self, text: str) -> int:
        if self._stream is None:  # the program started without a stdout (`>&-`)
            raise _bad_fd(STDOUT)
        try:
            return self._stream.write(text)
        except OSError as e:
            e.filename = STDOUT
            raise

    def flush(self) -> None:
        if self._stream is None:  # nothing was written
            return
        try:
            self._stream.flush()
        except OSError as e:
            e.filename = STDOUT
            raise

    def __getattr__(self, name: str):
        return getattr(self._stream, name)


def _needs_less(args: argparse.Namespace, what: str) -> str:
    """What to lower after `what` (errors.out_of_memory's words), in the command's own flags."""
    flags = [flag for flag, dest in (("--max-tokens", "max_tokens"), ("--beam", "beam"))
             if hasattr(args, dest)]  # fmt: skip
    return what_to_lower(what, f"a smaller {' or '.join(flags)} needs" if flags
                         else "smaller batches need")  # fmt: skip


def _fail(command: str, message: str) -> int:
    print(f"transformer {command}: error: {message}", file=sys.stderr)
    return 2
