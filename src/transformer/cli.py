"""The single entry point: `transformer SUBCOMMAND ...` (also `python -m transformer`).

Each subcommand parses its arguments and calls one library function; anything the CLI does,
Python code can do too. Only this module (and benchmarks/) prints.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys

from transformer.errors import UserError


def _cmd_presets(args: argparse.Namespace) -> int:
    from transformer.presets import describe_presets

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


# Each entry adds one subcommand. Subcommands live here in the order a user meets them.
_SUBCOMMANDS = [_add_presets]


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


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
    )
    try:
        return args.func(args)
    except UserError as e:
        print(f"transformer {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"transformer {args.command}: interrupted", file=sys.stderr)
        return 130
