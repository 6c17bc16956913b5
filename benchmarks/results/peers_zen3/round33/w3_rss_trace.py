"""RSS through one W3 step of ours (fp32, ~4k tokens), labelled with what ran (round thirty-three).

A thread samples VmRSS every 2 ms; the label is the module whose forward was entered last, "F
loss" after the model's forward (the loss, whose gradient is made in its own forward), or the
autograd node that backward reached last. Prints each label whose span raised the running peak
by 4 MiB or more, then the peak. Run from the repository root, a fresh process each time:

    .venv/bin/python benchmarks/results/peers_zen3/round33/w3_rss_trace.py
"""

import sys
import threading
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[4]
sys.path[:0] = [str(ROOT.parent / "shared" / "peers"), str(ROOT / "benchmarks")]

from common import make_mt_batch, setup_threads  # noqa: E402  (the peers' harness, on sys.path above)
from train_adapters import PAPER_BASE, get_adapter  # noqa: E402


def rss() -> int:
    """Resident set of this process, MiB."""
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * 4096 // 2**20


def label_backward(label: list[str]) -> None:
    """Make every backward label each autograd node of its graph as it starts."""
    backward = torch.Tensor.backward

    def labelled(self, *a, **k):
        seen, stack = set(), [self.grad_fn]
        while stack:
            node = stack.pop()
            if node is None or node in seen:
                continue
            seen.add(node)
            name = f"B{len(seen):04d} {node.name()}"
            node.register_prehook(lambda grads, name=name: label.__setitem__(0, name))
            stack.extend(f for f, _ in node.next_functions)
        return backward(self, *a, **k)

    torch.Tensor.backward = labelled


def main() -> None:
    setup_threads(2)
    cfg = dict(PAPER_BASE)
    adapter = get_adapter("ext:peers_adapter:make_train", cfg)
    prepared = adapter.prepare(make_mt_batch(128, 30, 30, 4, cfg["vocab"], seed=0))
    adapter.step(adapter.prepare(make_mt_batch(2, 30, 30, 4, cfg["vocab"], seed=1)), None)
    model, _ = adapter.runs["fp32"]
    label = ["start"]
    for name, module in model.named_modules():
        if name.count(".") <= 2:
            module.register_forward_pre_hook(
                lambda mod, inputs, name=name: label.__setitem__(0, "F " + name)
            )
    model.register_forward_hook(lambda *a: label.__setitem__(0, "F loss"))
    label_backward(label)

    events: list[tuple[int, str]] = []
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            events.append((rss(), label[0]))
            time.sleep(0.002)

    sampler = threading.Thread(target=sample)
    sampler.start()
    adapter.step(prepared, None)
    done.set()
    sampler.join()

    spans: list[list] = []  # [label, rss at its start, its highest rss]
    for value, name in events:
        if not spans or spans[-1][0] != name:
            spans.append([name, value, value])
        spans[-1][2] = max(spans[-1][2], value)
    peak = 0
    for name, first, highest in spans:
        if highest - peak >= 4:
            print(f"{name:40s} {first:6d} {highest:6d}")
        peak = max(peak, highest)
    print("peak", max(value for value, _ in events))


if __name__ == "__main__":
    main()
