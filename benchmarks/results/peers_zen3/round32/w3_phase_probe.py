"""Where W3's peak RSS is made: one fp32 training step of ours at ~4k tokens (round thirty-two).

Prints VmRSS/VmHWM (MiB) after a priming step, at the end of the forward pass, before and
after ``opt.step``; with ``--malloc-info`` also glibc's heap count and the main arena's
system/free sizes before ``opt.step`` (``malloc_info(3)``). Run from the repository root:

    .venv/bin/python benchmarks/results/peers_zen3/round32/w3_phase_probe.py [--malloc-info]

Run it in a fresh process each time: the two modes of w3_runs.md show only across processes.
"""

import argparse
import ctypes
import re
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[4]
sys.path[:0] = [str(ROOT.parent / "shared" / "peers"), str(ROOT / "benchmarks")]

from common import make_mt_batch, setup_threads  # noqa: E402  (the peers' harness, on sys.path above)
from train_adapters import PAPER_BASE, get_adapter  # noqa: E402


def rss() -> str:
    """VmRSS and VmHWM of this process, in MiB."""
    fields = {}
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(("VmHWM", "VmRSS")):
                fields[line.split(":")[0]] = int(line.split()[1]) // 1024
    return f"rss {fields['VmRSS']} hwm {fields['VmHWM']}"


def malloc_info() -> str:
    """glibc's heap count and the last totals of malloc_info(3): where freed memory sits."""
    libc = ctypes.CDLL(None)
    libc.fopen.restype = ctypes.c_void_p
    with tempfile.NamedTemporaryFile(suffix=".xml") as out:
        stream = libc.fopen(out.name.encode(), b"w")
        libc.malloc_info(0, ctypes.c_void_p(stream))
        libc.fclose(ctypes.c_void_p(stream))
        xml = Path(out.name).read_text()
    heaps = len(re.findall("<heap nr", xml))
    totals = re.findall(r'<(?:total|system) type="(\w+)" (?:count="\d+" )?size="(\d+)"', xml)[-6:]
    return f"heaps {heaps} {totals}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--malloc-info", action="store_true", help="print malloc_info before opt.step"
    )
    args = parser.parse_args()

    setup_threads(2)
    cfg = dict(PAPER_BASE)
    adapter = get_adapter("ext:peers_adapter:make_train", cfg)
    prepared = adapter.prepare(make_mt_batch(128, 30, 30, 4, cfg["vocab"], seed=0))
    adapter.step(adapter.prepare(make_mt_batch(2, 30, 30, 4, cfg["vocab"], seed=1)), None)
    print("after priming step", rss())

    model, opt = adapter.runs["fp32"]
    model.register_forward_hook(lambda module, inputs, output: print("  end of forward", rss()))
    step = opt.step

    def probed_step(*a, **k):
        print("  before opt.step", rss())
        if args.malloc_info:
            print("   ", malloc_info())
        result = step(*a, **k)
        print("  after opt.step", rss())
        return result

    opt.step = probed_step
    adapter.step(prepared, None)
    print("end", rss())


if __name__ == "__main__":
    main()
