"""§5.1 token-budgeted batching: invariants, determinism, resume, sharding."""

from __future__ import annotations

import numpy as np
import pytest

from transformer.batching import TokenBatchSampler, batch_by_tokens


def _lengths(n: int = 2000, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    src = rng.integers(2, 80, n)
    tgt = np.clip(src + rng.integers(-10, 10, n), 2, 90)
    return src, tgt


def test_hand_worked_example():
    # Sorted by (tgt, src): indices 3 (1,1), 0 (2,2), 2 (3,2), 1 (2,4), 4 (5,5).
    # Budget 8: [3, 0, 2] would need 3 * max_src 3 = 9 > 8, so [3, 0] | [2, 1] (2*4=8) | [4].
    src = np.array([2, 2, 3, 1, 5])
    tgt = np.array([2, 4, 2, 1, 5])
    batches = batch_by_tokens(src, tgt, max_tokens=8)
    assert [b.tolist() for b in batches] == [[3, 0], [2, 1], [4]]


def test_sort_is_stable_for_equal_lengths():
    src = np.array([3, 3, 3, 3])
    batches = batch_by_tokens(src, src.copy(), max_tokens=6)
    assert [b.tolist() for b in batches] == [[0, 1], [2, 3]]


@pytest.mark.parametrize("max_tokens", [100, 1000, 4096])
def test_every_pair_once_and_budget_respected_with_padding(max_tokens):
    src, tgt = _lengths()
    sampler = TokenBatchSampler(src, tgt, max_tokens=max_tokens, seed=1)
    seen = []
    for batch in sampler:
        assert len(batch) * src[batch].max() <= max_tokens
        assert len(batch) * tgt[batch].max() <= max_tokens
        seen.extend(batch)
    assert sorted(seen) == list(range(len(src)))


def test_batches_are_full_not_trivially_small():
    src, tgt = _lengths()
    batches = batch_by_tokens(src, tgt, max_tokens=4096)
    # greedy: adding the next pair (in sorted order) to any batch but the last would overflow
    order = np.concatenate(batches)
    starts = np.cumsum([len(b) for b in batches])[:-1]
    for batch, nxt in zip(batches[:-1], order[starts], strict=True):
        grown = [*batch, nxt]
        assert len(grown) * max(src[grown].max(), tgt[grown].max()) > 4096


def test_max_sentences_caps_batch_size():
    src, tgt = _lengths()
    batches = batch_by_tokens(src, tgt, max_tokens=100_000, max_sentences=7)
    assert max(len(b) for b in batches) == 7
    assert sum(len(b) for b in batches) == len(src)


def test_single_pair_over_budget_is_an_error():
    with pytest.raises(ValueError, match="pair 1 .* exceeds max_tokens=10"):
        batch_by_tokens(np.array([3, 11]), np.array([3, 4]), max_tokens=10)


def test_same_seed_same_batches_and_epochs_differ():
    src, tgt = _lengths()
    a = list(TokenBatchSampler(src, tgt, 1000, seed=7))
    b = list(TokenBatchSampler(src, tgt, 1000, seed=7))
    c = list(TokenBatchSampler(src, tgt, 1000, seed=8))
    assert a == b
    assert a != c
    s = TokenBatchSampler(src, tgt, 1000, seed=7)
    first, second = list(s), list(s)  # iteration advances the epoch
    assert s.epoch == 2
    assert first == a and second != first
    assert sorted(map(tuple, first)) == sorted(map(tuple, second))  # same batches, new order


def test_set_epoch_reproduces_an_epoch():
    src, tgt = _lengths()
    s = TokenBatchSampler(src, tgt, 1000, seed=3)
    s.set_epoch(5)
    e5 = list(s)
    s.set_epoch(5)
    assert list(s) == e5


def test_resume_mid_epoch_yields_exactly_the_remaining_batches():
    src, tgt = _lengths()
    full = TokenBatchSampler(src, tgt, 1000, seed=3)
    full.set_epoch(2)
    expected = list(full)

    run = TokenBatchSampler(src, tgt, 1000, seed=3)
    run.set_epoch(2)
    it = iter(run)
    consumed = [next(it) for _ in range(10)]
    state = run.state_dict()
    assert state["epoch"] == 2 and state["position"] == 10

    resumed = TokenBatchSampler(src, tgt, 1000, seed=3)
    resumed.load_state_dict(state)
    assert consumed + list(resumed) == expected
    assert resumed.epoch == 3 and resumed.state_dict()["position"] == 0


def test_resume_with_other_settings_is_refused():
    src, tgt = _lengths()
    state = TokenBatchSampler(src, tgt, 1000, seed=3).state_dict()
    with pytest.raises(ValueError, match="seed was 3, now 4"):
        TokenBatchSampler(src, tgt, 1000, seed=4).load_state_dict(state)
    with pytest.raises(ValueError, match="max_tokens"):
        TokenBatchSampler(src, tgt, 2000, seed=3).load_state_dict(state)


@pytest.mark.parametrize("world_size", [2, 3, 8])
def test_shards_are_disjoint_equal_and_drop_only_the_remainder(world_size):
    src, tgt = _lengths()
    shards = [
        list(TokenBatchSampler(src, tgt, 1000, seed=1, rank=r, world_size=world_size))
        for r in range(world_size)
    ]
    n_batches = len(batch_by_tokens(src, tgt, 1000))
    assert {len(s) for s in shards} == {n_batches // world_size}
    assert len(TokenBatchSampler(src, tgt, 1000, 1, 0, world_size)) == n_batches // world_size
    flat = [i for shard in shards for batch in shard for i in batch]
    assert len(flat) == len(set(flat))
    single = list(TokenBatchSampler(src, tgt, 1000, seed=1))
    dropped = single[n_batches - n_batches % world_size :]
    assert len(flat) + sum(len(b) for b in dropped) == len(src)


def test_eval_mode_is_length_ordered_and_complete_across_ranks():
    src, tgt = _lengths()
    whole = list(TokenBatchSampler(src, tgt, 1000, seed=0, shuffle=False))
    assert whole == [b.tolist() for b in batch_by_tokens(src, tgt, 1000)]
    assert whole == list(TokenBatchSampler(src, tgt, 1000, seed=99, shuffle=False))
    shards = [list(TokenBatchSampler(src, tgt, 1000, 0, r, 3, shuffle=False)) for r in range(3)]
    assert sorted(i for s in shards for b in s for i in b) == list(range(len(src)))


def test_bad_rank_is_an_error():
    with pytest.raises(ValueError, match="rank 2"):
        TokenBatchSampler(np.array([2]), np.array([2]), 10, seed=0, rank=2, world_size=2)


def test_longest_first_with_oversize_alone_as_inference_batches():
    # Translator.batches: longest first (stable), padded budget, an oversize source alone.
    lens = np.array([3, 9, 3, 12, 5, 9, 1])
    batches = [b.tolist() for b in batch_by_tokens(lens, lens, 10, longest_first=True,
                                                    oversize_alone=True)]  # fmt: skip
    assert batches == [[3], [1], [5], [4, 0], [2, 6]]
    assert sorted(i for b in batches for i in b) == list(range(7))
    with pytest.raises(ValueError, match="exceeds max_tokens=10"):
        batch_by_tokens(lens, lens, 10, longest_first=True)
