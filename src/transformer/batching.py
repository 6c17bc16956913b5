"""§5.1 length-sorted, token-budgeted, resumable batch sampler.

§5.1: "Sentence pairs were batched together by approximate sequence length. Each training batch
contained a set of sentence pairs containing approximately 25000 source tokens and 25000 target
tokens." As in fairseq, pairs are sorted by (target length, source length) with a stable sort and
cut greedily into batches whose *padded* size, B * max length, stays within the budget on each
side. The batches are fixed; only their order is shuffled, by (seed, epoch).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

import numpy as np

logger = logging.getLogger(__name__)


def batch_by_tokens(
    src_lens: np.ndarray,
    tgt_lens: np.ndarray,
    max_tokens: int,
    max_sentences: int | None = None,
    longest_first: bool = False,
    oversize_alone: bool = False,
) -> list[np.ndarray]:
    """Group pairs of similar length into batches within a padded token budget per side.

    Args:
        src_lens, tgt_lens: (N,) sequence lengths (as padded: EOS / BOS included).
        max_tokens: budget per side, padding counted: B * max(src_lens[batch]) <= max_tokens
            and B * max(tgt_lens[batch]) <= max_tokens.
        max_sentences: optional cap on B.
        longest_first: cut the batches from the longest pair down (inference: the first batch
            shows at once whether the longest sentences fit in memory).
        oversize_alone: a pair longer than `max_tokens` is a batch of its own (inference)
            instead of an error (training).

    Returns:
        Batches of indices, in (target, source) length order; every index exactly once.

    Raises:
        ValueError: a single pair longer than `max_tokens` (unless oversize_alone).
    """
    src_lens = np.asarray(src_lens, dtype=np.int64)
    tgt_lens = np.asarray(tgt_lens, dtype=np.int64)
    if src_lens.shape != tgt_lens.shape:
        raise ValueError(f"src_lens {src_lens.shape} and tgt_lens {tgt_lens.shape} differ")
    too_long = np.flatnonzero(np.maximum(src_lens, tgt_lens) > max_tokens)
    if too_long.size and not oversize_alone:
        i = int(too_long[0])
        raise ValueError(
            f"pair {i} (src {src_lens[i]}, tgt {tgt_lens[i]} tokens) exceeds max_tokens="
            f"{max_tokens}; raise max_tokens or prepare with a smaller max_len"
        )
    cap = max_sentences or len(src_lens) or 1
    if longest_first:
        order = np.lexsort((-src_lens, -tgt_lens))  # stable; primary key tgt, then src
    else:
        order = np.lexsort((src_lens, tgt_lens))
    batches: list[np.ndarray] = []
    start, n, max_s, max_t = 0, 0, 0, 0
    for pos, (s, t) in enumerate(
        zip(src_lens[order].tolist(), tgt_lens[order].tolist(), strict=True)
    ):
        new_s, new_t = max(max_s, s), max(max_t, t)
        if n and ((n + 1) * new_s > max_tokens or (n + 1) * new_t > max_tokens or n + 1 > cap):
            batches.append(order[start:pos])
            start, n, new_s, new_t = pos, 0, s, t
        n, max_s, max_t = n + 1, new_s, new_t
    if n:
        batches.append(order[start:])
    return batches


class TokenBatchSampler:
    """Iterable over batches (lists of indices) of one epoch; resumable mid-epoch.

    Iterating yields the batches of the current epoch that this rank has not yet consumed; when
    the epoch is exhausted, `epoch` advances by one and the position returns to 0, so
    `for epoch in ...: for batch in sampler:` sees a fresh shuffle each epoch.

    Sharding: rank r takes batches r, r + W, r + 2W, ... of the epoch's order. With
    `shuffle=True` (training) the last `len % W` batches of each epoch are dropped so every rank
    takes the same number of steps (the dropped batches differ from epoch to epoch). With
    `shuffle=False` (validation / translation) nothing is dropped: batches come in length order,
    each pair exactly once across ranks, and the first `len % W` ranks get one batch more.

    Args:
        src_lens, tgt_lens: (N,) lengths including EOS (`ParallelSplit.src_lens`).
        max_tokens: per-side budget with padding (§5.1: ~25,000).
        seed: shuffle seed; batch order of epoch e is a function of (seed, e) only.
        rank, world_size: data-parallel shard.
        shuffle: shuffle batch order each epoch (training) or keep length order (evaluation).
        max_sentences: optional cap on sentences per batch.
    """

    def __init__(
        self,
        src_lens: np.ndarray,
        tgt_lens: np.ndarray,
        max_tokens: int,
        seed: int,
        rank: int = 0,
        world_size: int = 1,
        shuffle: bool = True,
        max_sentences: int | None = None,
    ) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not in [0, world_size={world_size})")
        self.batches = batch_by_tokens(src_lens, tgt_lens, max_tokens, max_sentences)
        self.max_tokens, self.seed = max_tokens, seed
        self.rank, self.world_size, self.shuffle = rank, world_size, shuffle
        self.epoch = 0
        self._position = 0

    def __len__(self) -> int:
        """Batches this rank takes per epoch."""
        n = len(self.batches)
        if self.shuffle:
            return n // self.world_size
        return len(range(self.rank, n, self.world_size))

    @property
    def epochs_done(self) -> float:
        """Epochs consumed so far, fractional (2.5 = half way through the third)."""
        return self.epoch + self._position / max(len(self), 1)

    def set_epoch(self, epoch: int) -> None:
        """Start epoch `epoch` from its first batch."""
        self.epoch, self._position = epoch, 0

    def _epoch_order(self) -> np.ndarray:
        n = len(self.batches)
        if not self.shuffle:
            return np.arange(self.rank, n, self.world_size)
        order = np.random.default_rng([self.seed, self.epoch]).permutation(n)
        usable = n - n % self.world_size
        return order[self.rank : usable : self.world_size]

    def __iter__(self) -> Iterator[list[int]]:
        order = self._epoch_order()
        while self._position < len(order):
            batch = self.batches[order[self._position]]
            self._position += 1  # a batch handed out counts as consumed (state_dict skips it)
            yield batch.tolist()
        self.set_epoch(self.epoch + 1)

    def state_dict(self) -> dict:
        """Epoch and position, plus what must match on resume."""
        return {
            "epoch": self.epoch,
            "position": self._position,
            "seed": self.seed,
            "max_tokens": self.max_tokens,
            "world_size": self.world_size,
            "n_batches": len(self.batches),
        }

    def load_state_dict(self, state: dict) -> None:
        """Resume: the next iteration yields exactly the remaining batches of that epoch."""
        current = self.state_dict()
        for key in ("seed", "max_tokens", "world_size", "n_batches"):
            if state[key] != current[key]:
                raise ValueError(
                    f"cannot resume batch sampler: {key} was {state[key]}, now {current[key]} "
                    "(data or batching settings changed)"
                )
        self.epoch, self._position = int(state["epoch"]), int(state["position"])
