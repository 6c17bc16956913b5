"""§6.1 search: greedy decoding and batched beam search with the GNMT length penalty.

Search talks to the model through a small step interface (`Stepper`): `step(tokens)` feeds the
last token of every live row and returns next-token log-probabilities, `reorder(index)` keeps
and reorders rows. `ModelStepper` implements it with the model's incremental-decoding cache
(encoder once per sentence, cross-attention keys/values once, one new position per step); tests
plug in a scripted stepper whose per-step probabilities are written by hand. See
docs/decoding.md for the search rules and the early-termination criterion.

Shapes: B sentences, K beam size, R live rows (B * K, fewer once sentences finish), V vocab.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from transformer import kernels
from transformer.allocator import keep_large_blocks
from transformer.cache import DecoderCache
from transformer.config import STOP_RULES
from transformer.cpuinfo import native_bf16
from transformer.model import Transformer
from transformer.threads import ThreadTuner
from transformer.tokenizer import BOS_ID, EOS_ID, PAD_ID

logger = logging.getLogger(__name__)
NEG_INF = float("-inf")


def length_penalty(length: int, alpha: float) -> float:
    """§6.1 (GNMT): lp(Y) = ((5 + |Y|) / 6)^α; a hypothesis scores log P(Y|X) / lp(Y).

    |Y| counts the generated tokens including the final EOS (as tensor2tensor and fairseq do).
    """
    return ((5.0 + length) / 6.0) ** alpha


def max_output_lengths(
    src_lengths: torch.Tensor, max_len_a: float, max_len_b: int, limit: int
) -> torch.Tensor:
    """§6.1: maximum output length (EOS included) = a * source length + b, capped at `limit`.

    Args:
        src_lengths: (B,) real source tokens per sentence (including the source EOS).
        limit: the most target positions the model can encode (its max_len).

    Returns:
        (B,) int64 lengths, at least 1.
    """
    lengths = torch.floor(src_lengths.double() * max_len_a).long() + max_len_b
    return lengths.clamp(min=1, max=limit)


@dataclass
class Hypothesis:
    """A finished translation: ids without BOS/EOS, its length-penalized score and log P(Y|X)."""

    tokens: list[int]
    score: float
    log_prob: float


class Stepper(Protocol):
    """What search needs from a decoder: one step of next-token log-probs, and row selection."""

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens: (R,) the last token of each row -> log-probs (R, V) of the next token. A row
        that has ended may be stepped again with EOS (`greedy_steps` keeps such rows a while);
        its scores are then ignored."""
        ...

    def reorder(self, index: torch.Tensor, same_sentences: bool = False) -> None:
        """Keep rows `index` (R',) of the state, in that order (duplicates allowed).

        same_sentences: row i is replaced by a row of the same sentence (beams are reordered
        but no sentence is added or dropped), so per-sentence state can stay as it is.
        """
        ...


# Decoder steps per unit of work timed by the thread tuner (`ModelStepper.step`).
TUNER_STEPS = 8

# A step's scores (rows, V) in fp32 larger than this are made and searched in blocks of rows
# (`ModelStepper.step_blocks`). glibc serves a block above 64 MiB in a thread other than the
# main one (a decoding stream of `translate`, `serve`'s decoder) with a fresh mmap, faulted in
# page by page at every step (allocator.py): beam 4 over a WMT-size batch, (592, 37,000) fp32
# scores, 84 MiB, ran 27-34% slower in such a thread (docs/performance.md, "Round twenty-two").
# 8 MiB against 32 (round twenty-three, `translate` with its streams, the same output): 800
# newstest2014 lines with V = 37,000 the same time (93.8 against 92.7 s, five alternated pairs)
# at 0.56 GB less peak memory (5.38 against 5.94 GB: a decoding stream's arena keeps its heaps,
# allocator.py, and smaller blocks fill them better); Multi30k's test set 2% faster.
STEP_BLOCK_BYTES = 8 << 20

# Wraps a decoder's stepper given the batch's (src, src_mask): a constraint on what may be
# emitted next (e.g. `parse.TreeConstraint`), applied by masking the stepper's scores.
Constrain = Callable[["Stepper", torch.Tensor, torch.Tensor], "Stepper"]


class ModelStepper:
    """`Stepper` over a Transformer: encodes once, then decodes one cached position per step.

    The first step runs on B rows (every beam starts from the same BOS); beam search's first
    `reorder` expands each sentence's cache, cross-attention keys/values included, to K rows.
    """

    def __init__(
        self,
        model: Transformer,
        src: torch.Tensor,
        src_mask: torch.Tensor,
        log_probs: bool = True,
        tuner: ThreadTuner | None = None,
    ):
        """log_probs=False: `step` returns the raw logits (R, V) instead, which have the same
        argmax: greedy search needs no log-softmax over V per row and step. tuner: chooses the
        CPU threads step by step (threads.py; a decoder step is the unit of work)."""
        keep_large_blocks()  # per-step tensors of tens of MiB: reuse their pages (allocator.py)
        self.model, self.log_probs, self.tuner = model, log_probs, tuner
        self.src_mask = src_mask  # (R, S)
        if tuner is not None:  # the encoder on the chosen count (one while others crowd)
            tuner.settle()
        self.memory = model.encode(src, src_mask)  # (B, S, D); read only by the first step
        self.cache: DecoderCache = model.new_cache()
        self.steps = 0  # decoder steps so far
        self._unit_steps = self._unit_rows = 0  # the tuner's current unit of work
        self._tune = False  # whether the step under way is timed by the tuner

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        hidden = self._hidden(tokens)
        out = self._scores(hidden)
        self._step_done(len(tokens))
        return out

    def block_rows(self) -> int:
        """Rows per block of `step_blocks`: as many as STEP_BLOCK_BYTES of fp32 scores hold."""
        return max(1, STEP_BLOCK_BYTES // (4 * self.model.cfg.target_vocab_size))

    def step_blocks(self, tokens: torch.Tensor) -> Iterator[torch.Tensor]:
        """`step`'s result as blocks of `block_rows()` consecutive rows (the last one shorter),
        in order: no step tensor of the size of all rows' scores is made. Each row's scores
        are the same values as `step`'s (the projection's and the softmax's rows do not depend
        on the rows beside them: docs/decoding.md, "A sentence's translation does not depend
        on its batch"). A block is read before the next one is made."""
        hidden = self._hidden(tokens)
        rows = self.block_rows()
        for start in range(0, hidden.size(0), rows):
            yield self._scores(hidden[start : start + rows])
        self._step_done(len(tokens))

    def _hidden(self, tokens: torch.Tensor) -> torch.Tensor:
        """The decoder's output at the new position of each row, (R, D); the cache extended."""
        # From the second step on, cross-attention reads its keys/values from the cache, so
        # `memory` (still B rows) is not touched and needs no reordering.
        # The tuner's unit of work is TUNER_STEPS decoder steps (one step's time varies too much
        # from step to step for a probe to compare thread counts on it), from the second step
        # on: the first also computes the encoder-decoder keys and values, and under beam
        # search has B rows against the others' K*B. A unit still open when the search ends
        # is dropped (the next search's first unit restarts its clock).
        self._tune = self.tuner is not None and self.steps > 0
        if self._tune and self._unit_steps == 0:
            self.tuner.start()
        hidden = self.model.decode_hidden(tokens[:, None], self.memory, self.src_mask, self.cache)
        return hidden[:, -1]  # (R, D): only the new position

    def _step_done(self, rows: int) -> None:
        if self._tune:
            self._unit_steps, self._unit_rows = self._unit_steps + 1, self._unit_rows + rows
            if self._unit_steps == TUNER_STEPS:
                self.tuner.stop(self._unit_rows)
                self._unit_steps = self._unit_rows = 0
        self.steps += 1

    def _scores(self, hidden: torch.Tensor) -> torch.Tensor:
        """Log-probs (or logits, log_probs=False) (R, V) of the decoder outputs hidden (R, D)."""
        logits = self.model.project(hidden)
        if not self.log_probs:
            return logits
        # The fp32 log-softmax written over fp32 logits (fp32, int8; the same kernel and
        # values; the lines just read are written, no fresh 31 MiB block): 9.3 -> 7.2 ms at
        # (256, 32,000) on Zen 3. bf16 logits are widened to an fp32 copy first, which
        # `log_softmax(dtype=torch.float32)` makes too (torch 2.13) before writing a second
        # (R, V) block: over the copy instead, the same bits, 0.67 -> 0.56 ms at (65, 32,000)
        # (docs/performance.md, "Round forty-two").
        if logits.requires_grad:  # out= is not differentiable (decoding outside no_grad)
            return torch.log_softmax(logits, dim=-1, dtype=torch.float32)
        if logits.dtype != torch.float32:
            logits = logits.float()
        return torch.ops.aten._log_softmax.out(logits, -1, False, out=logits)

    def reorder(self, index: torch.Tensor, same_sentences: bool = False) -> None:
        if not same_sentences:
            self.src_mask = self.src_mask.index_select(0, index)
        # Beams of one sentence share their cross-attention keys/values: no copy needed.
        self.cache = self.cache.reorder(index, cross=not same_sentences)


def _mask_specials(lprobs: torch.Tensor, force_eos: torch.Tensor | None, t: int) -> torch.Tensor:
    """Never emit PAD or BOS; rows with `force_eos` (R,) may emit only EOS (max length).

    force_eos None: no row is at its maximum length (saves the check per step).
    EOS is also barred at the first step t = 1 (unless forced): an empty translation of a
    non-empty sentence is never right, yet an under-trained model can rank it first (~0.5% of
    Multi30k sentences, each then scoring zero). fairseq's `min_len=1` does the same; empty
    sources never reach the search (`translate` passes them through).
    """
    assert PAD_ID + 1 == BOS_ID  # one slice bars both
    lprobs[:, PAD_ID : BOS_ID + 1] = NEG_INF
    if t == 1:
        if force_eos is None:
            lprobs[:, EOS_ID] = NEG_INF
        else:
            lprobs[:, EOS_ID] = torch.where(force_eos, lprobs[:, EOS_ID], NEG_INF)
    if force_eos is not None and bool(force_eos.any()):
        # A search constraint may have barred EOS (`Constrain`); at the maximum length the
        # output ends all the same, at no cost.
        eos = lprobs[:, EOS_ID].clone().nan_to_num(neginf=0.0)
        lprobs[force_eos] = NEG_INF
        lprobs[:, EOS_ID] = torch.where(force_eos, eos, lprobs[:, EOS_ID])
    return lprobs


@torch.inference_mode()
def greedy_search(
    model: Transformer,
    src: torch.Tensor,
    src_mask: torch.Tensor,
    max_len_a: float = 1.0,
    max_len_b: int = 50,
    constrain: Constrain | None = None,
    tuner: ThreadTuner | None = None,
) -> list[list[int]]:
    """Greedy decoding: the most probable token at each step, until EOS or the maximum length.

    Args:
        src: (B, S) source ids ending in EOS, right-padded; src_mask: (B, S) True at real tokens.
        max_len_a, max_len_b: maximum output length = a * source length + b (EOS included).
        constrain: wraps the stepper to bar tokens (`Constrain`); None: every token allowed.
        tuner: chooses the CPU thread count decoder step by step (threads.py), or None.

    Returns:
        B token lists, without BOS and EOS.
    """
    stepper: Stepper = ModelStepper(model, src, src_mask, log_probs=False, tuner=tuner)
    if constrain is not None:
        stepper = constrain(stepper, src, src_mask)
    max_lens = max_output_lengths(src_mask.sum(1), max_len_a, max_len_b, model.cfg.max_len)
    return greedy_steps(stepper, max_lens)


# Greedy search keeps a row whose sentence has ended in the batch (stepped with EOS, its
# output ignored) until this share of the rows has ended, then drops them in one `reorder`:
# each drop copies every other row's cache prefix (10.8% of a real greedy search when rows were
# dropped at every step that ended one), against the steps of the ended rows. Of 0.1, 0.25 and
# 0.5, 0.25 was the fastest (docs/performance.md).
DROP_ENDED = 0.25


def greedy_steps(stepper: Stepper, max_lens: torch.Tensor) -> list[list[int]]:
    """Greedy search over any `Stepper`; rows that have ended are dropped from the state once
    DROP_ENDED of them have (meanwhile they are stepped with EOS and their scores ignored).

    Args:
        max_lens: (B,) maximum output length per sentence, EOS included.
    """
    B, device = max_lens.size(0), max_lens.device  # the search runs where the model does
    out: list[list[int]] = [[] for _ in range(B)]
    alive = torch.arange(B, device=device)  # sentence of each row in the batch
    last = torch.full((B,), BOS_ID, dtype=torch.long, device=device)
    shortest = int(max_lens.min()) if B else 0  # before this step no row is forced to end
    ended = None  # (R,) rows whose sentence has ended, still in the batch (None: none)
    t = 0
    while alive.numel() > 0:
        t += 1
        force_eos = max_lens[alive] <= t if t >= shortest else None
        if _in_blocks(stepper, last.numel()):
            last = torch.cat([row_argmax(b) for b in _masked_blocks(stepper, last, force_eos, t)])
        else:
            last = row_argmax(_mask_specials(stepper.step(last), force_eos, t))  # (R,)
        if ended is not None:
            last = last.masked_fill(ended, EOS_ID)  # an ended row stays ended
        for row, token in zip(alive.tolist(), last.tolist(), strict=True):
            if token != EOS_ID:
                out[row].append(token)
        ended = last == EOS_ID
        n_ended = int(ended.sum())
        if n_ended == 0:
            ended = None
        elif n_ended >= DROP_ENDED * ended.numel():
            keep = (~ended).nonzero().squeeze(1)
            stepper.reorder(keep)
            alive, last, ended = alive[keep], last[keep], None
    return out


def _max_reads_bf16() -> bool:
    """Whether `row_argmax` takes bf16 rows as they are: on a CPU with native bf16 (AVX512-BF16
    or AMX), where its blocks' max reads half the bytes of an fp32 copy and needs no copy (the
    same indices: bf16 -> fp32 is exact). At (64, 32,000) on an AMX Xeon 0.57 ms against 0.64
    alone, and the copy a greedy step's projection output fed it took 0.96 ms in a W2 search
    (docs/performance.md, "Round twenty-four")."""
    global _BF16_MAX
    if _BF16_MAX is None:
        _BF16_MAX = bool(native_bf16())
    return _BF16_MAX


_BF16_MAX: bool | None = None
# Columns per block of `row_argmax`.
_ARGMAX_BLOCK = 256


def row_argmax(x: torch.Tensor) -> torch.Tensor:
    """`x.argmax(dim=1)` of x (R, V): the same indices (the first of equal maxima, NaN counted
    as the largest), found faster on the CPU.

    ATen's argmax does not vectorize there: 2.3 ms at (64, 32,000) on 2 threads (AMD Zen 3),
    4% of a greedy int8 decoder step. Its max over contiguous blocks does: the row's first
    maximum lies in the first block whose maximum is the row's, so one vectorized pass over V
    and an argmax over that block's columns give it (0.26 ms). The last V mod _ARGMAX_BLOCK
    columns are compared after the blocks, and win only when strictly larger.
    """
    R, V = x.shape
    nb = V // _ARGMAX_BLOCK
    if x.device.type != "cpu" or nb < 2 or x.stride(1) != 1:
        return x.argmax(dim=1)
    if x.dtype != torch.float32 and not (x.dtype == torch.bfloat16 and _max_reads_bf16()):
        x = x.float()  # bf16's max: ~4x fp32's time on AVX2 (Zen 3), the copy costs less
    head = x[:, : nb * _ARGMAX_BLOCK].view(R, nb, _ARGMAX_BLOCK)
    maxima = head.amax(2)  # (R, nb)
    block = maxima.argmax(1)  # (R,) the first block holding each row's maximum
    rows = torch.arange(R, device=x.device)
    index = block * _ARGMAX_BLOCK + head[rows, block].argmax(1)
    if V > nb * _ARGMAX_BLOCK:
        tail, tail_index = x[:, nb * _ARGMAX_BLOCK :].max(1)
        best = maxima[rows, block]
        later = (tail > best) | (tail.isnan() & ~best.isnan())
        index = torch.where(later, tail_index + nb * _ARGMAX_BLOCK, index)
    return index


@torch.inference_mode()
def beam_search(
    model: Transformer,
    src: torch.Tensor,
    src_mask: torch.Tensor,
    beam_size: int = 4,
    length_penalty: float = 0.6,
    max_len_a: float = 1.0,
    max_len_b: int = 50,
    n_best: int = 1,
    constrain: Constrain | None = None,
    stop: str = "t2t",
    tuner: ThreadTuner | None = None,
) -> list[list[Hypothesis]]:
    """§6.1 batched beam search (beam 4, α 0.6, max length = source length + 50).

    Args:
        src: (B, S) source ids ending in EOS, right-padded; src_mask: (B, S) True at real tokens.
        beam_size: K hypotheses kept per sentence (§6.3 parsing uses 21).
        length_penalty: α of lp(Y) = ((5 + |Y|) / 6)^α (§6.3 uses 0.3).
        max_len_a, max_len_b: maximum output length = a * source length + b (EOS included).
        n_best: hypotheses returned per sentence, best first.
        constrain: wraps the stepper to bar tokens (`Constrain`); None: every token allowed.
        stop: when a sentence's search ends, one of `STOP_RULES` (default §6.1's "t2t").
        tuner: chooses the CPU thread count decoder step by step (threads.py), or None.

    Returns:
        For each sentence, its `n_best` finished hypotheses sorted by score.
    """
    return beam_search_alphas(
        model, src, src_mask, (length_penalty,), beam_size, max_len_a, max_len_b, n_best,
        constrain, stop, tuner,
    )[0]  # fmt: skip


@torch.inference_mode()
def beam_search_alphas(
    model: Transformer,
    src: torch.Tensor,
    src_mask: torch.Tensor,
    alphas: Sequence[float],
    beam_size: int = 4,
    max_len_a: float = 1.0,
    max_len_b: int = 50,
    n_best: int = 1,
    constrain: Constrain | None = None,
    stop: str = "t2t",
    tuner: ThreadTuner | None = None,
) -> list[list[list[Hypothesis]]]:
    """`beam_search` for several length penalties in one search (`beam_steps_alphas`): for
    each α in order, what `beam_search` with that α returns. Arguments as `beam_search`'s."""
    if not 1 <= n_best <= beam_size:
        raise ValueError(f"n_best must be in [1, beam_size={beam_size}], got {n_best}")
    stepper: Stepper = ModelStepper(model, src, src_mask, tuner=tuner)
    if constrain is not None:
        stepper = constrain(stepper, src, src_mask)
    max_lens = max_output_lengths(src_mask.sum(1), max_len_a, max_len_b, model.cfg.max_len)
    return beam_steps_alphas(stepper, max_lens, beam_size, alphas, n_best, stop)


@dataclass
class _Finished:
    """A finished hypothesis during the search, with its score under each α searched for."""

    tokens: list[int]
    log_prob: float
    scores: tuple[float, ...]  # log_prob / lp(|Y|, α) for each α, in order


@dataclass
class _BeamState:
    """Live beams of the active sentences; row r of the stepper is (sentence r // k, beam r % k)."""

    sentences: torch.Tensor  # (Ba,) original index of each active sentence
    scores: torch.Tensor  # (Ba, k) cumulative log-probs, -inf for empty beam slots
    tokens: torch.Tensor  # (Ba * k, t) generated ids so far
    finished: list[list[_Finished]]  # per original sentence, in the order found
    # closed[i][s]: how many of sentence s's finished hypotheses α number i keeps, set when
    # the search for that α ends (None while it runs). Under both stop rules a hypothesis
    # finished later cannot enter that α's n-best (the t2t bound is sound, and the fairseq
    # count ends every α at once); keeping the count makes "the same as a search with α alone"
    # hold by construction, whatever the stop rule.
    closed: list[list[int | None]]


def beam_steps(
    stepper: Stepper,
    max_lens: torch.Tensor,
    beam_size: int,
    alpha: float,
    n_best: int = 1,
    stop: str = "t2t",
) -> list[list[Hypothesis]]:
    """Beam search over any `Stepper`, starting from one BOS row per sentence.

    Each step: expand every live beam by every token, take the top 2K candidates per sentence
    (`_top_candidates`), finalize those ending in EOS (`_finalize`: all 2K under "t2t", as
    tensor2tensor's grow_finished; the top K under "fairseq"), keep the best K others as the
    new beams, then drop sentences that are done (`_is_done`, by the `stop` rule) and reorder
    the stepper's state in one `reorder` call.
    """
    return beam_steps_alphas(stepper, max_lens, beam_size, (alpha,), n_best, stop)[0]


def beam_steps_alphas(
    stepper: Stepper,
    max_lens: torch.Tensor,
    beam_size: int,
    alphas: Sequence[float],
    n_best: int = 1,
    stop: str = "t2t",
) -> list[list[list[Hypothesis]]]:
    """`beam_steps` for several α at once: for each α in order, exactly what `beam_steps` with
    that α alone returns, for about the price of one search (α chosen on val, `valchoice.py`).

    Not in the paper. Under both stop rules the live beams do not depend on α: they are the
    best K non-EOS candidates by log-probability, and which EOS candidates are finalized
    depends on their rank by log-probability too. α enters only the finished hypotheses'
    scores and the stop test. So one search serves every α: each finished hypothesis is scored
    under each α; the search for α ends, sentence by sentence, where `beam_steps` with α alone
    would end it (α then keeps the hypotheses finished so far, and no later one); a sentence
    leaves the batch once every α has ended.
    """
    if stop not in STOP_RULES:
        raise ValueError(f"stop must be one of {STOP_RULES}, got {stop!r}")
    alphas = tuple(alphas)
    if not alphas:
        raise ValueError("alphas: give at least one length penalty")
    B, device = max_lens.size(0), max_lens.device  # the search runs where the model does
    state = _BeamState(
        sentences=torch.arange(B, device=device),
        scores=torch.zeros(B, 1, device=device),
        tokens=torch.empty(B, 0, dtype=torch.long, device=device),
        finished=[[] for _ in range(B)],
        closed=[[None] * B for _ in alphas],
    )
    last = torch.full((B,), BOS_ID, dtype=torch.long, device=device)
    shortest = int(max_lens.min()) if B else 0  # before this step no row is forced to end
    max_lens_list = max_lens.tolist()
    t = 0
    while state.sentences.numel() > 0:
        t += 1
        k = state.scores.size(1)
        force_eos = None
        if t >= shortest:
            force_eos = (max_lens[state.sentences] <= t).repeat_interleave(k)
        if _in_blocks(stepper, last.numel()):
            blocks = _masked_blocks(stepper, last, force_eos, t)
            cand_scores, cand_beams, cand_tokens = _top_candidates_of_blocks(
                state.scores, blocks, beam_size
            )
        else:
            lprobs = _mask_specials(stepper.step(last), force_eos, t)  # (Ba * k, V)
            cand_scores, cand_beams, cand_tokens = _top_candidates(state.scores, lprobs, beam_size)
        ranks = cand_scores.size(1) if stop == "t2t" else beam_size
        _finalize(state, cand_scores, cand_beams, cand_tokens, ranks, t, alphas)
        scores, beams, tokens = _select_live(cand_scores, cand_beams, cand_tokens, beam_size)
        parents = beams + torch.arange(beams.size(0), device=device)[:, None] * k  # (Ba, K) rows
        done = _is_done(state, scores, max_lens_list, t, beam_size, alphas, n_best, stop)
        keep = (~done).nonzero().squeeze(1)
        rows = parents[keep].reshape(-1)  # one reorder: beam parents of the kept sentences
        if rows.numel() > 0:
            stepper.reorder(rows, same_sentences=k == beam_size and keep.numel() == len(done))
        state.tokens = torch.cat(
            [state.tokens.index_select(0, rows), tokens[keep].reshape(-1, 1)], 1
        )
        state.scores, state.sentences = scores[keep], state.sentences[keep]
        last = tokens[keep].reshape(-1)
    results = []
    for i, closed in enumerate(state.closed):
        per_sentence = []
        for hyps, n in zip(state.finished, closed, strict=True):
            kept = [Hypothesis(h.tokens, h.scores[i], h.log_prob) for h in hyps[:n]]
            per_sentence.append(sorted(kept, key=lambda h: -h.score)[:n_best])
        results.append(per_sentence)
    return results


def _top_candidates(
    scores: torch.Tensor, lprobs: torch.Tensor, beam_size: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Top 2K extensions per sentence over all (beam, token) pairs.

    Args:
        scores: (Ba, k) cumulative log-probs of the live beams; lprobs: (Ba * k, V).

    Returns:
        Candidate cumulative log-probs, parent beams and tokens, each (Ba, C), best first.
    """
    return _best_pairs(scores, *_rows_best(lprobs, beam_size), beam_size)


def _rows_best(lprobs: torch.Tensor, beam_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's best min(2K, V) tokens (R, n), in no set order, and their log-probs (R, n).
    A sentence's best 2K (beam, token) pairs are among each beam's own best 2K tokens: rank
    k * 2K pairs, not k * V. In one pass over each row where `kernels.row_top` runs."""
    n = min(2 * beam_size, lprobs.size(-1))
    if row_top_kernel() and not lprobs.requires_grad and not kernels.row_top_problem(lprobs, n):
        return kernels.row_top(lprobs, n)
    ids = _row_top(lprobs, n)
    return ids, lprobs.gather(1, ids)


@functools.cache
def row_top_kernel() -> bool:
    """Whether beam search takes each row's best tokens by `kernels.row_top` (AVX-512 F or
    AVX2, where the library builds, `TRANSFORMER_FUSED_KERNELS` not 0): only once it has found
    topk's values on rows of every kind (ties, -inf, a NaN, fewer finite values than asked for,
    widths off its vectors); `_row_top`'s torch ops otherwise. At V = 8,000 (the quickstart's
    vocabulary) and 262 rows 0.7 ms -> 0.06 ms a step, at V = 32,000 and 256 rows 1.4 -> 0.4
    ms (docs/performance.md, "Round forty-one"). Decoding streams may ask at once: each gets
    the same answer."""
    if kernels.row_top_problem(torch.zeros(1, 1), 1):
        return False
    g = torch.Generator().manual_seed(0)
    for R, V, n in ((9, 5, 5), (9, 37, 8), (9, 300, 3), (70, 1039, 8)):
        x = torch.randn(R, V, generator=g).round(decimals=1)  # ties
        x[1], x[2, 4:] = NEG_INF, NEG_INF  # no finite value; fewer than n
        x[3, V // 2], x[4, -1] = float("nan"), 50.0  # a NaN; the best in the tail
        ids, values = kernels.row_top(x, n)
        want = x.nan_to_num(nan=NEG_INF).topk(n, dim=1).values
        read = x.gather(1, ids)
        same = bool(((read == values) | (read.isnan() & values.isnan())).all())
        distinct = all(len(set(row)) == n for row in ids.tolist())
        if not (same and distinct and torch.equal(values.nan_to_num(nan=NEG_INF), want)):
            logger.info("search: torch's topk for the candidates (the compiled kernel differs)")
            return False
    return True


def _top_candidates_of_blocks(
    scores: torch.Tensor, blocks: Iterator[torch.Tensor], beam_size: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`_top_candidates` of the log-probs given as blocks of consecutive rows, in order
    (`_masked_blocks`): the same candidates, each block's rows reduced to their best 2K
    tokens before the next block is made."""
    ids, values = zip(*(_rows_best(block, beam_size) for block in blocks), strict=True)
    return _best_pairs(scores, torch.cat(ids), torch.cat(values), beam_size)


def _best_pairs(
    scores: torch.Tensor, ids: torch.Tensor, values: torch.Tensor, beam_size: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The top 2K (beam, token) pairs per sentence among each beam's n tokens ids (Ba * k, n)
    with log-probs values (Ba * k, n); as `_top_candidates` returns them."""
    Ba, k = scores.shape
    n = ids.size(1)
    total = scores[:, :, None] + values.view(Ba, k, n)
    cand_scores, flat = total.view(Ba, k * n).topk(min(2 * beam_size, k * n), dim=1)  # (Ba, C)
    return cand_scores, flat // n, ids.view(Ba, k * n).gather(1, flat)


def _in_blocks(stepper: Stepper, rows: int) -> bool:
    """Whether a step of `rows` rows makes its scores in blocks of rows
    (`ModelStepper.step_blocks`; other steppers, such as a search constraint's, never)."""
    block_rows = getattr(stepper, "block_rows", None)
    return block_rows is not None and block_rows() < rows


def _masked_blocks(
    stepper: Stepper, last: torch.Tensor, force_eos: torch.Tensor | None, t: int
) -> Iterator[torch.Tensor]:
    """`_mask_specials(stepper.step(last), force_eos, t)` as blocks of consecutive rows."""
    start = 0
    for block in stepper.step_blocks(last):
        end = start + block.size(0)
        yield _mask_specials(block, None if force_eos is None else force_eos[start:end], t)
        start = end


# Columns per block of `_row_top`; rows shorter than _BLOCK * _MIN_BLOCKS use a plain topk.
_BLOCK, _MIN_BLOCKS = 16, 64


def _row_top(x: torch.Tensor, n: int) -> torch.Tensor:
    """Column indices (R, n) of the n largest values of each row of x (R, V), in no set order.

    `topk` over V = 32,000 is a partial sort of every row; a max over blocks is one vectorized
    pass. The n largest values lie in the n blocks with the largest maxima (each of them is at
    most its block's maximum, and a block that holds one has a maximum among the n largest), so
    only those n blocks are ranked. Block j holds the columns j, j + nb, j + 2nb, ... (a strided
    reduction, which vectorizes along the row); the last V mod _BLOCK columns are always kept.
    Ties may pick other columns of equal value than `topk` would.
    """
    R, V = x.shape
    nb = V // _BLOCK
    if nb < _MIN_BLOCKS:
        return x.topk(n, dim=1).indices
    maxima = x[:, : nb * _BLOCK].view(R, _BLOCK, nb).amax(1)  # (R, nb)
    blocks = maxima.topk(n, dim=1).indices  # (R, n)
    starts = torch.arange(0, nb * _BLOCK, nb, device=x.device)  # (_BLOCK,) offsets in a block
    cols = (blocks[:, None, :] + starts[None, :, None]).view(R, -1)  # (R, _BLOCK * n)
    if V > nb * _BLOCK:
        tail = torch.arange(nb * _BLOCK, V, device=x.device).expand(R, -1)
        cols = torch.cat([cols, tail], dim=1)
    best = x.gather(1, cols).topk(n, dim=1).indices
    return cols.gather(1, best)


def _finalize(
    state: _BeamState,
    cand_scores: torch.Tensor,
    cand_beams: torch.Tensor,
    cand_tokens: torch.Tensor,
    ranks: int,
    t: int,
    alphas: tuple[float, ...],
) -> None:
    """Move EOS candidates that rank within the top `ranks` into the finished lists, scored
    under each α.

    Tensors are read back with one `tolist` each, not element by element (an op per element).
    """
    top = cand_tokens[:, :ranks] == EOS_ID
    ends = (top & (cand_scores[:, :ranks] > NEG_INF)).nonzero().tolist()
    if not ends:
        return
    k = state.scores.size(1)
    # §6.1: lp(Y) = ((5 + |Y|) / 6)^α, |Y| = t with the EOS
    lps = [length_penalty(t, alpha) for alpha in alphas]
    scores, beams = cand_scores.tolist(), cand_beams.tolist()
    sentences = state.sentences.tolist()
    rows = [b * k + beams[b][c] for b, c in ends]
    prefixes = state.tokens[rows].tolist()  # (len(ends), t - 1)
    for (b, c), prefix in zip(ends, prefixes, strict=True):
        log_prob = scores[b][c]
        hyp = _Finished(prefix, log_prob, tuple(log_prob / lp for lp in lps))
        state.finished[sentences[b]].append(hyp)


def _select_live(
    cand_scores: torch.Tensor, cand_beams: torch.Tensor, cand_tokens: torch.Tensor, beam_size: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The best K candidates that do not end in EOS become the next beams, each (Ba, K).

    Slots without a finite candidate (tiny vocabularies, forced EOS) get score -inf.
    """
    C = cand_scores.size(1)
    usable = (cand_tokens != EOS_ID) & (cand_scores > NEG_INF)
    rank = torch.arange(C, device=cand_scores.device).expand_as(cand_scores) + C * (~usable).long()
    order = rank.argsort(dim=1)
    if C < beam_size:  # pad with repeats of the last (unusable or worst) candidate
        order = torch.cat([order, order[:, -1:].expand(-1, beam_size - C)], dim=1)
    order = order[:, :beam_size]
    scores = cand_scores.gather(1, order)
    scores = scores.masked_fill(~usable.gather(1, order), NEG_INF)
    if C < beam_size:
        scores[:, C:] = NEG_INF
    return scores, cand_beams.gather(1, order), cand_tokens.gather(1, order)


def _is_done(
    state: _BeamState,
    scores: torch.Tensor,
    max_lens: list[int],
    t: int,
    beam_size: int,
    alphas: tuple[float, ...],
    n_best: int,
    stop: str,
) -> torch.Tensor:
    """(Ba,) bool: a sentence is done when its search has ended for every α (`state.closed`).

    The search for α ends when no live beam is left (maximum length), or when no live beam can
    still beat its n_best-th finished score under α (§6.1 early termination, rule "t2t"), or,
    under rule "fairseq" only, as soon as it has K finished hypotheses.

    The bound: log-probs only fall as a hypothesis grows, so a live beam with log-prob s can
    score at most s / lp(L) at best over the lengths L still open to it.
    """
    done = [False] * scores.size(0)
    best_live = scores.max(dim=1).values.tolist()
    for b, sentence in enumerate(state.sentences.tolist()):
        hyps = state.finished[sentence]
        open_alphas = [i for i, closed in enumerate(state.closed) if closed[sentence] is None]
        if best_live[b] == NEG_INF or (stop == "fairseq" and len(hyps) >= beam_size):
            ended = open_alphas
        elif len(hyps) >= n_best:
            max_len = max_lens[sentence]
            ended = []
            for i in open_alphas:
                alpha = alphas[i]
                lp_best = max(length_penalty(t + 1, alpha), length_penalty(max_len, alpha))
                nth = sorted((h.scores[i] for h in hyps), reverse=True)[n_best - 1]
                if best_live[b] / lp_best <= nth:
                    ended.append(i)
        else:
            ended = []
        for i in ended:
            state.closed[i][sentence] = len(hyps)
        done[b] = len(ended) == len(open_alphas)
    return torch.tensor(done, dtype=torch.bool, device=scores.device)


__all__ = [
    "STOP_RULES",
    "Hypothesis",
    "ModelStepper",
    "Stepper",
    "beam_search",
    "beam_search_alphas",
    "beam_steps",
    "beam_steps_alphas",
    "greedy_search",
    "greedy_steps",
    "length_penalty",
    "max_output_lengths",
]
