"""Where each chunk's (n, V) logits of the loss lie, in one W3 step of ours (round thirty-three).

One fp32 training step at ~4k target tokens (the harness's W3, 3,826 tokens: chunks of 1,912,
1,912 and 2 rows): prints the address of every (n, V) logits block the loss makes and the RSS
then, and the peak. Before c8fd650 each chunk made its own block, and in some processes the
second landed 245 MB above the first (the high mode of round thirty-two); since, the chunks
share one block. Run from the repository root, a fresh process each time:

    .venv/bin/python benchmarks/results/peers_zen3/round33/w3_logit_blocks.py
"""

import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[4]
sys.path[:0] = [str(ROOT.parent / "shared" / "peers"), str(ROOT / "benchmarks")]

from common import make_mt_batch, setup_threads  # noqa: E402  (the peers' harness, on sys.path above)
from train_adapters import PAPER_BASE, get_adapter  # noqa: E402

V = PAPER_BASE["vocab"]


def rss() -> int:
    """Resident set of this process, MiB."""
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * 4096 // 2**20


def hwm() -> int:
    """Peak resident set of this process, MiB."""
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) // 1024 for line in status if line.startswith("VmHWM"))


def report(tensor: torch.Tensor) -> None:
    if tensor.dim() == 2 and tensor.size(1) == V and tensor.size(0) > 1:
        print(f"  logits {tuple(tensor.shape)} at {tensor.data_ptr():#x}, rss {rss()} MiB")


def main() -> None:
    from transformer import loss

    mm, linear = torch.mm, loss.F.linear

    def watched_mm(*a, **k):  # the loss's own product since c8fd650
        out = mm(*a, **k)
        report(out)
        return out

    def watched_linear(*a, **k):  # its product before, and with the helper
        out = linear(*a, **k)
        report(out)
        return out

    setup_threads(2)
    cfg = dict(PAPER_BASE)
    adapter = get_adapter("ext:peers_adapter:make_train", cfg)
    prepared = adapter.prepare(make_mt_batch(128, 30, 30, 4, cfg["vocab"], seed=0))
    adapter.step(adapter.prepare(make_mt_batch(2, 30, 30, 4, cfg["vocab"], seed=1)), None)
    print(f"after the priming step: rss {rss()} MiB")
    loss.torch.mm = watched_mm  # loss.torch is torch: undone below
    loss.F.linear = watched_linear
    try:
        adapter.step(prepared, None)
    finally:
        loss.torch.mm, loss.F.linear = mm, linear
    print(f"peak {hwm()} MiB")


if __name__ == "__main__":
    main()
