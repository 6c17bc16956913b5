"""The length penalty α a quickstart chose on val, read from its quickstart.json: the number on
stdout, or one line on stderr naming the calling script, the file and the problem (exit 2).
`issue19_table.sh` and `gpu/prepare_device.sh` read it before any benchmark runs.

    python benchmarks/quickstart_alpha.py QS/quickstart.json issue19_table.sh
"""

from __future__ import annotations

import json
import sys


def main() -> None:
    path, caller = sys.argv[1], sys.argv[2]
    try:
        with open(path, encoding="utf-8") as f:
            print(float(json.load(f)["chosen_on_val"]["alpha"]))
    except (OSError, ValueError, KeyError, TypeError) as e:
        print(f"{caller}: {path}: no α chosen on val ({type(e).__name__}: {e})", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
