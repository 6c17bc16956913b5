from __future__ import annotations

import itertools
import math

import pytest
import torch

from transformer import search
from transformer.config import ModelConfig
from transformer.model import Transformer
from transformer.search import (
    NEG_INF,
    STOP_RULES,
    ModelStepper,
    _row_top,
    _top_candidates,
    beam_search,
    beam_steps,
    greedy_search,
    greedy_steps,
    length_penalty,
    max_output_lengths,
    row_argmax,
)
from transformer.tokenizer import BOS_ID, EOS_ID, PAD_ID

pytestmark = pytest.mark.usefixtures("one_thread")


def tiny_model(vocab: int = 20, max_len: int = 64, scale: float = 1.0) -> Transformer:
    cfg = ModelConfig(
        vocab_size=vocab, n_layers=2, d_model=16, d_ff=32, n_heads=2, d_k=8, d_v=8,
        p_drop=0.0, max_len=max_len,
    )  # fmt: skip
    model = Transformer(cfg).eval()
    with torch.no_grad():  # a larger logit spread makes the searches disagree more often
        model.src_embed.weight.mul_(scale)
    return model


def random_batch(B: int, vocab: int, lengths: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, S) sources ending in EOS, right-padded, and their masks."""
    S = max(lengths)
    src = torch.full((B, S), PAD_ID, dtype=torch.long)
    for i, n in enumerate(lengths):
        src[i, : n - 1] = torch.randint(4, vocab, (n - 1,))
        src[i, n - 1] = EOS_ID
    return src, src != PAD_ID


# ------------------------------------------------------------------------------ pure functions


def test_length_penalty_matches_gnmt_formula():
    # §6.1: lp(Y) = ((5 + |Y|) / 6)^α, worked by hand: ((5 + 1) / 6)^0.6 = 1; ((5 + 7) / 6)^0.6
    # = 2^0.6 = 1.515716...; α = 0 disables it.
    assert length_penalty(1, 0.6) == 1.0
    assert length_penalty(7, 0.6) == pytest.approx(1.5157165665103982)
    assert length_penalty(30, 0.0) == 1.0


def test_max_output_lengths_is_a_times_source_plus_b_capped():
    lens = max_output_lengths(torch.tensor([3, 10, 400]), 1.0, 50, limit=256)
    assert lens.tolist() == [53, 60, 256]
    assert max_output_lengths(torch.tensor([10]), 2.0, 300, limit=1024).tolist() == [320]


# ------------------------------------------------------------------------ incremental decoding


def test_cached_decoding_equals_full_decoding():
    model = tiny_model()
    src, src_mask = random_batch(3, 20, [5, 7, 3])
    tgt = torch.cat([torch.full((3, 1), BOS_ID), torch.randint(4, 20, (3, 8))], dim=1)
    with torch.no_grad():
        memory = model.encode(src, src_mask)
        full = model.decode(tgt, memory, src_mask).log_softmax(-1)  # (B, T, V)
        cache = model.new_cache()
        steps = [model.decode(tgt[:, t : t + 1], memory, src_mask, cache) for t in range(9)]
    cached = torch.cat(steps, dim=1).log_softmax(-1)
    torch.testing.assert_close(cached, full, atol=1e-5, rtol=1e-5)


def test_reordered_cache_equals_full_decoding_of_reordered_prefixes():
    model = tiny_model()
    src, src_mask = random_batch(2, 20, [6, 4])
    tgt = torch.cat([torch.full((2, 1), BOS_ID), torch.randint(4, 20, (2, 6))], dim=1)
    index = torch.tensor([1, 0, 1])
    stepper = ModelStepper(model, src, src_mask)
    with torch.no_grad():
        for t in range(3):
            stepper.step(tgt[:, t])
        stepper.reorder(index)
        got = torch.stack([stepper.step(tgt[index, t]) for t in range(3, 7)], dim=1)
        memory = model.encode(src[index], src_mask[index])
        want = model.decode(tgt[index], memory, src_mask[index]).log_softmax(-1)[:, 3:]
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------------------- model searches


def test_beam_size_1_equals_greedy():
    model = tiny_model(scale=4.0)
    src, src_mask = random_batch(5, 20, [6, 9, 4, 7, 2])
    greedy = greedy_search(model, src, src_mask, max_len_a=1.0, max_len_b=5)
    # fairseq's stop (K = 1 finished) is greedy exactly; under §6.1's "t2t" rule a beam of 1
    # may go on past greedy's EOS when a longer output could still score better (α > 0).
    beams = beam_search(model, src, src_mask, beam_size=1, length_penalty=0.6, max_len_b=5,
                        stop="fairseq")  # fmt: skip
    assert [h[0].tokens for h in beams] == greedy
    assert any(len(g) > 0 for g in greedy)


def test_greedy_on_logits_equals_greedy_on_log_probs():
    # greedy_search skips the log-softmax (same argmax); the previous path normalized first.
    model = tiny_model(scale=4.0)
    src, src_mask = random_batch(5, 20, [6, 9, 4, 7, 2])
    max_lens = max_output_lengths(src_mask.sum(1), 1.0, 8, model.cfg.max_len)
    with torch.inference_mode():
        on_logits = greedy_steps(ModelStepper(model, src, src_mask, log_probs=False), max_lens)
        on_lprobs = greedy_steps(ModelStepper(model, src, src_mask), max_lens)
        logits = ModelStepper(model, src, src_mask, log_probs=False).step(torch.full((5,), BOS_ID))
    assert on_logits == on_lprobs and any(len(g) > 0 for g in on_logits)
    assert not torch.allclose(logits.logsumexp(-1), torch.zeros(5))  # really unnormalized


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_steps_scores_are_the_fp32_log_softmax_of_its_logits(dtype):
    # Beam search ranks log-probabilities: fp32 rows normalized from the step's logits, bf16's
    # widened first, with the bits of torch's log-softmax of the fp32 logits, in inference and
    # with a gradient wanted.
    model = tiny_model(scale=4.0).to(dtype)
    src, src_mask = random_batch(5, 20, [6, 9, 4, 7, 2])
    bos = torch.full((5,), BOS_ID)
    for context in (torch.inference_mode, torch.enable_grad):
        with context():
            logits = ModelStepper(model, src, src_mask, log_probs=False).step(bos)
            lprobs = ModelStepper(model, src, src_mask).step(bos)
        assert logits.dtype == dtype and lprobs.dtype == torch.float32
        assert torch.equal(lprobs.detach(), torch.log_softmax(logits.detach().float(), -1))
        assert torch.allclose(lprobs.detach().exp().sum(-1), torch.ones(5))


def test_outputs_respect_max_length_and_never_emit_specials():
    model = tiny_model(scale=4.0)
    src, src_mask = random_batch(4, 20, [3, 5, 2, 6])
    max_lens = max_output_lengths(src_mask.sum(1), 1.0, 2, model.cfg.max_len)
    for hyps in beam_search(model, src, src_mask, beam_size=3, max_len_b=2, n_best=3):
        assert len(hyps) == 3
        assert [h.score for h in hyps] == sorted((h.score for h in hyps), reverse=True)
    results = beam_search(model, src, src_mask, beam_size=3, max_len_b=2)
    for i, hyps in enumerate(results):
        assert len(hyps[0].tokens) + 1 <= int(max_lens[i])  # + EOS
        assert not {PAD_ID, BOS_ID, EOS_ID} & set(hyps[0].tokens)
    for i, tokens in enumerate(greedy_search(model, src, src_mask, max_len_b=2)):
        assert len(tokens) + 1 <= int(max_lens[i])
        assert not {PAD_ID, BOS_ID, EOS_ID} & set(tokens)


def test_batched_beam_search_equals_one_sentence_at_a_time():
    model = tiny_model(scale=4.0)
    src, src_mask = random_batch(4, 20, [5, 8, 3, 6])
    batched = beam_search(model, src, src_mask, beam_size=4, max_len_b=6, n_best=2)
    for i in range(4):
        n = int(src_mask[i].sum())
        alone = beam_search(model, src[i : i + 1, :n], src_mask[i : i + 1, :n], 4, max_len_b=6,
                            n_best=2)  # fmt: skip
        assert [h.tokens for h in alone[0]] == [h.tokens for h in batched[i]]
        for a, b in zip(alone[0], batched[i], strict=True):
            assert a.score == pytest.approx(b.score, abs=1e-5)


def test_exhaustive_beam_finds_the_exact_best_under_the_length_penalty():
    # V = 6: PAD, BOS, EOS, UNK and two words; outputs may use UNK and the two words.
    # With max length 4 (EOS included) and at least one token (EOS is barred at the first
    # step) there are 3 + 9 + 27 = 39 outputs, and a beam of
    # 64 holds every live prefix, so search must return the exact top of the enumeration.
    model = tiny_model(vocab=6, scale=3.0)
    src, src_mask = random_batch(1, 6, [4])
    alpha, max_len = 0.6, 4
    with torch.no_grad():
        memory = model.encode(src, src_mask)
    scored = []
    for n in range(1, max_len):
        for body in itertools.product([3, 4, 5], repeat=n):
            tgt_in = torch.tensor([[BOS_ID, *body]])
            with torch.no_grad():
                lprobs = model.decode(tgt_in, memory, src_mask).log_softmax(-1)[0]
            log_prob = sum(float(lprobs[t, y]) for t, y in enumerate([*body, EOS_ID]))
            scored.append((log_prob / length_penalty(n + 1, alpha), list(body)))
    scored.sort(key=lambda x: -x[0])
    hyps = beam_search(model, src, src_mask, 64, alpha, max_len_a=0.0, max_len_b=max_len,
                       n_best=5)[0]  # fmt: skip
    assert [h.tokens for h in hyps] == [body for _, body in scored[:5]]
    for h, (score, _) in zip(hyps, scored, strict=False):
        assert h.score == pytest.approx(score, abs=1e-5)
    assert {len(body) for _, body in scored[:5]} != {1}  # not trivially "one token, then stop"


# -------------------------------------------------------------------------- scripted decoder

A, B_ = 4, 5  # two words of a 6-id vocabulary (PAD, BOS, EOS, UNK, a, b)

# Per-step probabilities written by hand: prefix -> {token: p}; every other token has p = 0.
SCRIPT = {
    (): {A: 0.55, B_: 0.35, EOS_ID: 0.10},
    (A,): {A: 0.60, B_: 0.30, EOS_ID: 0.10},
    (B_,): {A: 0.05, B_: 0.05, EOS_ID: 0.90},
    (A, A): {A: 0.07, B_: 0.03, EOS_ID: 0.90},
    (A, B_): {A: 0.12, B_: 0.08, EOS_ID: 0.80},
}


class ScriptedStepper:
    """A `Stepper` that reads its next-token probabilities from SCRIPT by prefix."""

    def __init__(self, script: dict, rows: int = 1, vocab: int = 6):
        self.script, self.vocab = script, vocab
        self.prefixes: list[tuple[int, ...]] = [()] * rows
        self.started, self.calls = False, 0

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.started:
            self.prefixes = [p + (t,) for p, t in zip(self.prefixes, tokens.tolist(), strict=True)]
        self.started = True
        probs = torch.zeros(len(self.prefixes), self.vocab, dtype=torch.float64)
        for r, prefix in enumerate(self.prefixes):
            for token, p in self.script.get(prefix, {EOS_ID: 1.0}).items():
                probs[r, token] = p
        return probs.log().float()

    def reorder(self, index: torch.Tensor, same_sentences: bool = False) -> None:
        self.prefixes = [self.prefixes[i] for i in index.tolist()]


def test_scripted_beam_gives_exact_hypotheses_and_scores():
    # Beam 2, by hand. Step 1 keeps a (.55), b (.35). Step 2: a a .33, b EOS .315, a b .165,
    # a EOS .055: "b EOS" ranks within the top 2 and is finished; a a, a b stay live. Step 3:
    # a a EOS .297 and a b EOS .132 rank top 2 and finish; 3 finished >= beam, so search stops.
    lp = {n: ((5 + n) / 6) for n in (2, 3)}  # α = 1: lp = (5 + |Y|) / 6, |Y| with the EOS
    want_logp = {(B_,): math.log(0.35 * 0.90), (A, A): math.log(0.55 * 0.60 * 0.90),
                 (A, B_): math.log(0.55 * 0.30 * 0.80)}  # fmt: skip
    for alpha, order in [(0.0, [(B_,), (A, A), (A, B_)]), (1.0, [(A, A), (B_,), (A, B_)])]:
        stepper = ScriptedStepper(SCRIPT)
        hyps = beam_steps(stepper, torch.tensor([10]), beam_size=2, alpha=alpha, n_best=2)[0]
        assert [tuple(h.tokens) for h in hyps] == order[:2]
        for h in hyps:
            penalty = lp[len(h.tokens) + 1] ** alpha
            assert h.log_prob == pytest.approx(want_logp[tuple(h.tokens)], abs=1e-6)
            assert h.score == pytest.approx(want_logp[tuple(h.tokens)] / penalty, abs=1e-6)
        assert stepper.calls == 3
    # Worked through by hand for α = 1: a a scores log(.297) / (8/6) = -0.910517; b scores
    # log(.315) / (7/6) = -0.990157: the length penalty makes the longer output win.
    hyps = beam_steps(ScriptedStepper(SCRIPT), torch.tensor([10]), 2, 1.0, n_best=2)[0]
    assert [h.score for h in hyps] == pytest.approx([-0.910517, -0.990157], abs=1e-6)


def test_scripted_early_termination_when_no_live_beam_can_win():
    # α = 0: after step 2, "b EOS" (.36) is finished and the best live beam a a has .25 < .36;
    # its log-prob can only fall, so search stops without a third step.
    script = {
        (): {A: 0.50, B_: 0.40, EOS_ID: 0.10},
        (A,): {A: 0.50, B_: 0.30, EOS_ID: 0.20},
        (B_,): {A: 0.05, B_: 0.05, EOS_ID: 0.90},
    }
    stepper = ScriptedStepper(script)
    hyps = beam_steps(stepper, torch.tensor([10]), beam_size=2, alpha=0.0)[0]
    assert [h.tokens for h in hyps] == [[B_]]
    assert hyps[0].log_prob == pytest.approx(math.log(0.36), abs=1e-6)
    assert stepper.calls == 2
    # With α = 1 the bound log(.25) / lp(10) beats log(.36) / lp(2), so search goes on.
    stepper = ScriptedStepper(script)
    beam_steps(stepper, torch.tensor([10]), beam_size=2, alpha=1.0)
    assert stepper.calls > 2


# Both EOS candidates of step 2 rank in the top 2, so K = 2 hypotheses finish at once; the
# live "a a" (.27) is then one step from a better length-penalized score (worked by hand below).
OVERTAKE = {
    (): {A: 0.60, B_: 0.40},
    (A,): {EOS_ID: 0.50, A: 0.45, B_: 0.05},
    (B_,): {EOS_ID: 0.70, A: 0.30},
    (A, A): {EOS_ID: 0.99, A: 0.01},
}


def test_scripted_t2t_stop_lets_a_longer_live_hypothesis_overtake_the_finished_ones():
    # Step 2: a EOS .30 and b EOS .28 finish (top 2); a a .27, b a .12 stay live.
    # fairseq stops (2 = K finished): best "a", log(.30) / (7/6) = -1.031977 (α = 1).
    # t2t: the bound log(.27) / lp(10) = -0.523733 > -1.031977, so search goes on. Step 3:
    # a a EOS = .6 * .45 * .99 = .2673 scores log(.2673) / (8/6) = -0.989538 and wins; the
    # live a a a (.0027) bounds at log(.0027) / lp(10) = -2.365801 < -0.989538: stop.
    fairseq, t2t = ScriptedStepper(OVERTAKE), ScriptedStepper(OVERTAKE)
    f = beam_steps(fairseq, torch.tensor([10]), 2, 1.0, n_best=2, stop="fairseq")[0]
    assert [h.tokens for h in f] == [[A], [B_]] and fairseq.calls == 2
    assert f[0].score == pytest.approx(math.log(0.30) / (7 / 6), abs=1e-6)
    assert f[0].score == pytest.approx(-1.031977, abs=1e-6)
    h = beam_steps(t2t, torch.tensor([10]), 2, 1.0, n_best=2)[0]  # the default rule
    assert [x.tokens for x in h] == [[A, A], [A]] and t2t.calls == 3
    assert h[0].log_prob == pytest.approx(math.log(0.6 * 0.45 * 0.99), abs=1e-6)
    assert h[0].score == pytest.approx(-0.989538, abs=1e-6)
    # α = 0: no live beam can beat log(.30) after step 2, so both rules stop there with "a".
    for stop in STOP_RULES:
        stepper = ScriptedStepper(OVERTAKE)
        hyps = beam_steps(stepper, torch.tensor([10]), 2, 0.0, stop=stop)[0]
        assert [x.tokens for x in hyps] == [[A]] and stepper.calls == 2


def test_scripted_t2t_finishes_eos_candidates_ranked_below_k():
    # α = 0, beam 2, max length 3. Step 2 candidates: a a .399, a b .301, b EOS .201, b a .099:
    # "b EOS" ranks 3rd. tensor2tensor's grow_finished keeps it (all 2K candidates); fairseq
    # drops it. At step 3 only EOS is allowed: a a EOS .1596, a b EOS .1505.
    script = {
        (): {A: 0.70, B_: 0.30},
        (A,): {A: 0.57, B_: 0.43},
        (B_,): {EOS_ID: 0.67, A: 0.33},
        (A, A): {EOS_ID: 0.40, A: 0.60},
        (A, B_): {EOS_ID: 0.50, A: 0.50},
    }
    t2t = beam_steps(ScriptedStepper(script), torch.tensor([3]), 2, 0.0, n_best=2)[0]
    assert [h.tokens for h in t2t] == [[B_], [A, A]]
    assert t2t[0].log_prob == pytest.approx(math.log(0.3 * 0.67), abs=1e-6)
    fairseq = beam_steps(ScriptedStepper(script), torch.tensor([3]), 2, 0.0, 2, stop="fairseq")
    assert [h.tokens for h in fairseq[0]] == [[A, A], [A, B_]]
    assert fairseq[0][0].log_prob == pytest.approx(math.log(0.7 * 0.57 * 0.4), abs=1e-6)
    with pytest.raises(ValueError, match="stop must be one of"):
        beam_steps(ScriptedStepper(script), torch.tensor([3]), 2, 0.0, stop="first")


def test_scripted_max_length_forces_eos():
    script = {(): {A: 0.9, EOS_ID: 0.1}, (A,): {A: 0.9, EOS_ID: 0.1}, (A, A): {A: 0.9, EOS_ID: 0.1}}
    hyps = beam_steps(ScriptedStepper(script), torch.tensor([3]), beam_size=2, alpha=0.0)[0]
    # At length 3 only EOS is allowed: "a a EOS" gets .9 * .9 * .1 (the forced EOS keeps its
    # own probability); "a EOS" scores .9 * .1 and wins.
    assert [h.tokens for h in hyps] == [[A]]
    full = beam_steps(ScriptedStepper(script), torch.tensor([3]), 2, 0.0, n_best=2)[0]
    assert [h.tokens for h in full] == [[A], [A, A]]
    assert full[1].log_prob == pytest.approx(math.log(0.9 * 0.9 * 0.1), abs=1e-6)


def test_eos_is_barred_at_the_first_step_unless_forced():
    # The empty output is the most probable one (.8), but never a translation of a sentence.
    script = {(): {EOS_ID: 0.8, A: 0.15, B_: 0.05}, (A,): {EOS_ID: 1.0}, (B_,): {EOS_ID: 1.0}}
    hyps = beam_steps(ScriptedStepper(script), torch.tensor([5]), 2, 0.6, n_best=2)[0]
    assert [h.tokens for h in hyps] == [[A], [B_]]
    assert greedy_steps(ScriptedStepper(script), torch.tensor([5])) == [[A]]
    # A maximum length of 1 (EOS included) leaves only the empty output.
    assert [
        h.tokens for h in beam_steps(ScriptedStepper(script), torch.tensor([1]), 2, 0.6)[0]
    ] == [[]]
    assert greedy_steps(ScriptedStepper(script), torch.tensor([1])) == [[]]


def test_scripted_greedy_follows_the_argmax():
    tokens = greedy_steps(ScriptedStepper(SCRIPT, rows=2), torch.tensor([10, 2]))
    # Row 0: a (.55), a (.60), EOS (.90). Row 1 has max length 2: a, then forced EOS.
    assert tokens == [[A, A], [A]]


class EndlessStepper:
    """A `Stepper` whose every row would go on with token 4: rows end only at their maximum
    length. Records the rows of each step, the tokens it was given and its reorders."""

    def __init__(self, rows: int, vocab: int = 6):
        self.ids = list(range(rows))  # the original row of each current row
        self.vocab, self.rows_per_step, self.fed, self.reorders = vocab, [], [], 0

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        self.rows_per_step.append(len(self.ids))
        self.fed.append(dict(zip(self.ids, tokens.tolist(), strict=True)))
        logits = torch.zeros(len(self.ids), self.vocab)
        logits[:, 4] = 1.0
        return logits

    def reorder(self, index: torch.Tensor, same_sentences: bool = False) -> None:
        self.ids = [self.ids[i] for i in index.tolist()]
        self.reorders += 1


def test_greedy_drops_ended_rows_once_a_quarter_of_them_have_ended():
    stepper = EndlessStepper(8)
    out = greedy_steps(stepper, torch.arange(1, 9))  # row i ends at step i + 1
    assert out == [[4] * i for i in range(8)]
    # one row ends a step: dropped when 2 of 8, then 2 of 6, 1 of 4, 1 of 3, ... have ended
    assert stepper.rows_per_step == [8, 8, 6, 6, 4, 3, 2, 1]
    assert stepper.reorders == 6
    assert stepper.fed[1][0] == EOS_ID and stepper.fed[1][1] == 4  # an ended row: EOS
    assert stepper.fed[3][2] == EOS_ID and stepper.fed[3][3] == 4


def test_greedy_with_ended_rows_kept_translates_as_with_rows_dropped_at_once(monkeypatch):
    model = tiny_model(scale=4.0)
    src, src_mask = random_batch(6, 20, [7, 3, 5, 6, 2, 4])
    max_lens = torch.tensor([9, 3, 6, 12, 2, 7])
    with torch.no_grad():
        kept = greedy_steps(ModelStepper(model, src, src_mask), max_lens)
        monkeypatch.setattr(search, "DROP_ENDED", 0.0)  # every ended row dropped at once
        dropped = greedy_steps(ModelStepper(model, src, src_mask), max_lens)
    assert kept == dropped
    assert len({len(t) for t in kept}) > 2  # the rows did end at different steps


def test_reorder_within_sentences_keeps_cross_attention_and_equals_full_decoding():
    model = tiny_model()
    src, src_mask = random_batch(2, 20, [6, 4])
    tgt = torch.cat([torch.full((4, 1), BOS_ID), torch.randint(4, 20, (4, 5))], dim=1)
    stepper = ModelStepper(model, src, src_mask)
    with torch.no_grad():
        stepper.step(tgt[[0, 2], 0])
        stepper.reorder(torch.tensor([0, 0, 1, 1]))  # expand: 2 beams per sentence
        stepper.step(tgt[:, 1])
        cross = stepper.cache.layers[0].cross_k
        swap = torch.tensor([1, 0, 3, 2])  # beams swap within each sentence
        stepper.reorder(swap, same_sentences=True)
        assert stepper.cache.layers[0].cross_k is cross  # not copied
        got = torch.stack([stepper.step(tgt[swap, t]) for t in range(2, 6)], dim=1)
        rows = torch.tensor([0, 0, 1, 1])[swap]  # the sentence of each new row
        memory = model.encode(src[rows], src_mask[rows])
        want = model.decode(tgt[swap], memory, src_mask[rows]).log_softmax(-1)[:, 2:]
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def _top_candidates_over_all_pairs(scores, lprobs, beam_size):
    """The reference: rank every (beam, token) pair of a sentence (k * V of them)."""
    Ba, k = scores.shape
    V = lprobs.size(-1)
    total = (scores[:, :, None] + lprobs.view(Ba, k, V)).view(Ba, k * V)
    cand_scores, flat = total.topk(min(2 * beam_size, k * V), dim=1)
    return cand_scores, flat // V, flat % V


@pytest.mark.parametrize("V", [5, 1000, 1024, 1039, 32000])
def test_row_top_finds_each_rows_largest_values(V):
    g = torch.Generator().manual_seed(V)
    x = torch.randn(37, V, generator=g)
    x[3] = NEG_INF  # a row with no finite value
    x[4, 7:] = NEG_INF  # fewer finite values than n
    x[5, : V // 2] = 9.0  # ties at the top
    x[6, -1] = 50.0  # the largest value in the tail beyond the last full block
    for n in (1, 3, 8):
        n = min(n, V)
        ids = _row_top(x, n)
        assert ids.shape == (37, n)
        assert all(len(set(row)) == n for row in ids.tolist())  # no column twice
        got = x.gather(1, ids).sort(dim=1, descending=True).values
        assert torch.equal(got, x.topk(n, dim=1).values)


@pytest.mark.parametrize("bf16_read", [True, False])
@pytest.mark.parametrize("V", [5, 511, 512, 1000, 1024, 32000])
def test_row_argmax_gives_argmaxs_indices(V, bf16_read, monkeypatch):
    # bf16 rows read as they are (a CPU with native bf16) or through an fp32 copy (without)
    monkeypatch.setattr(search, "_BF16_MAX", bf16_read)
    g = torch.Generator().manual_seed(V)
    x = torch.randn(41, V, generator=g)
    x[3] = NEG_INF  # no finite value: the first column, as argmax says
    x[4, : V // 2] = 9.0  # ties: the first of them
    x[5, [V // 3, V - 1]] = 50.0  # a tie between a block and the tail: the block's
    x[6, -1] = 60.0  # the largest value in the tail beyond the last full block
    x[7] = 0.0  # all equal
    x[8, [V // 2, V - 1]] = float("nan")  # NaN is the largest, the first of them
    x[9, -1] = float("nan")  # NaN in the tail alone
    x[10, [1, V // 2]] = torch.tensor([-0.0, 0.0]) + 70  # equal maxima, the first one
    assert torch.equal(row_argmax(x), x.argmax(dim=1))
    assert torch.equal(row_argmax(x.bfloat16()), x.bfloat16().argmax(dim=1))
    assert torch.equal(row_argmax(x.t().contiguous().t()), x.argmax(dim=1))  # strided rows
    assert torch.equal(row_argmax(x[:0]), x[:0].argmax(dim=1))  # no rows left


# Each row's best tokens by the compiled kernel (`kernels.row_top`), where it runs here, and by
# torch's ops (`_row_top`): the searches must not depend on which.
ROW_TOP_WAYS = [False] + ([True] if search.row_top_kernel() else [])


@pytest.mark.parametrize("kernel", ROW_TOP_WAYS)
def test_top_candidates_equal_ranking_every_pair(kernel, monkeypatch):
    monkeypatch.setattr(search, "row_top_kernel", lambda: kernel)
    g = torch.Generator().manual_seed(0)
    for k, V in ((1, 32000), (4, 32000), (4, 3000), (3, 7)):
        scores = torch.randn(6, k, generator=g) * 3
        scores[1, 1:] = NEG_INF  # empty beam slots
        lprobs = torch.log_softmax(torch.randn(6 * k, V, generator=g) * 4, dim=-1)
        lprobs[:, PAD_ID : BOS_ID + 1] = NEG_INF
        got = _top_candidates(scores, lprobs, beam_size=4)
        want = _top_candidates_over_all_pairs(scores, lprobs, beam_size=4)
        assert torch.equal(got[0], want[0])  # the same scores, best first
        for c in (got, want):  # pairs scored -inf (empty slots, barred tokens) tie: any will do
            c[1][c[0] == NEG_INF], c[2][c[0] == NEG_INF] = -1, -1
        assert torch.equal(got[1], want[1]) and torch.equal(got[2], want[2])  # no other ties


@pytest.mark.parametrize("kernel", ROW_TOP_WAYS)
def test_beam_search_with_a_large_vocabulary_equals_ranking_every_pair(kernel, monkeypatch):
    monkeypatch.setattr(search, "row_top_kernel", lambda: kernel)
    torch.manual_seed(0)
    model = tiny_model(vocab=3000, scale=30.0)
    src, src_mask = random_batch(3, 3000, [5, 9, 7])
    got = beam_search(model, src, src_mask, beam_size=4, n_best=4)
    monkeypatch.setattr(search, "_top_candidates", _top_candidates_over_all_pairs)
    want = beam_search(model, src, src_mask, beam_size=4, n_best=4)
    assert [[h.tokens for h in s] for s in got] == [[h.tokens for h in s] for s in want]
    for s, t in zip(got, want, strict=True):
        assert [h.score for h in s] == pytest.approx([h.score for h in t], abs=0, rel=0)


@pytest.mark.skipif(not search.row_top_kernel(), reason="no compiled row_top on this CPU")
def test_rows_best_takes_the_kernel_only_where_it_can_and_agrees_with_torchs_ops(monkeypatch):
    """The same candidates both ways on rows without ties; rows the kernel cannot read (bf16, a
    strided view, a beam too wide) and a row_top that differs from topk go through torch's ops."""
    from transformer import kernels

    g = torch.Generator().manual_seed(1)
    lprobs = torch.log_softmax(torch.randn(12, 8000, generator=g) * 4, dim=-1)
    lprobs[:, PAD_ID : BOS_ID + 1] = NEG_INF
    ids, values = search._rows_best(lprobs, 4)
    ref = _row_top(lprobs, 8)
    assert torch.equal(ids, ref.gather(1, lprobs.gather(1, ref).argsort(1, descending=True)))
    assert torch.equal(values, lprobs.gather(1, ids))
    called = []
    monkeypatch.setattr(kernels, "row_top", lambda *a: called.append(a) or None)
    for rows, beam in ((lprobs.bfloat16(), 4), (lprobs[:, ::2], 4), (lprobs, 40)):
        got_ids, got_values = search._rows_best(rows, beam)
        want = rows.topk(got_ids.size(1)).values
        assert torch.equal(got_values.sort(1).values, want.sort(1).values)
    assert not called
    # the check a process makes once: a kernel that ranks wrongly is not used

    def wrong(x, n):
        return x.topk(n).indices.flip(1), x.topk(n).values

    monkeypatch.setattr(kernels, "row_top", wrong)
    assert search.row_top_kernel.__wrapped__() is False


class RecordingTuner:
    """A thread tuner that records the work of each unit it was given."""

    def __init__(self) -> None:
        self.units: list[int] = []
        self.open = False
        self.settled = 0

    def settle(self) -> None:
        assert not self.open  # between units: before the encoder
        self.settled += 1

    def start(self) -> None:
        self.open = True

    def stop(self, work: float) -> None:
        assert self.open
        self.units.append(int(work))
        self.open = False


def test_stepper_times_units_of_several_steps_after_the_first():
    # One decoder step's time varies too much to compare thread counts on, and the first step
    # (cross keys/values, B rows) is unlike the rest: the tuner gets TUNER_STEPS-step units.
    model = tiny_model()
    src, src_mask = random_batch(3, 20, [5, 7, 4])
    tuner = RecordingTuner()
    stepper = ModelStepper(model, src, src_mask, tuner=tuner)
    assert tuner.settled == 1  # the encoder ran on the tuner's count, outside any unit
    tokens = torch.full((3,), BOS_ID)
    with torch.inference_mode():
        for n in range(1 + 2 * search.TUNER_STEPS + 3):
            if n == 1 + 2 * search.TUNER_STEPS:  # the first step, then two whole units
                assert tuner.units == [3 * search.TUNER_STEPS] * 2 and not tuner.open
            stepper.step(tokens)
            tokens = torch.randint(4, 20, (3,))
    assert len(tuner.units) == 2 and tuner.open  # a partial unit stays open (dropped)
    # A search without a tuner is unchanged by one: the same scores step by step.
    plain = ModelStepper(model, src, src_mask)
    timed = ModelStepper(model, src, src_mask, tuner=RecordingTuner())
    with torch.inference_mode():
        for tok in (torch.full((3,), BOS_ID), torch.tensor([5, 6, 7])):
            assert torch.equal(plain.step(tok), timed.step(tok))


def _blocks_model(dtype: str) -> Transformer:
    torch.manual_seed(1)
    cfg = ModelConfig(vocab_size=300, n_layers=2, d_model=32, d_ff=64, n_heads=2, d_k=16, d_v=16,
                      p_drop=0.0)  # fmt: skip
    model = Transformer(cfg).eval()
    with torch.no_grad():  # a larger logit spread: searches that differ would show it
        model.src_embed.weight.mul_(20.0)
    if dtype == "bf16":
        return model.to(torch.bfloat16)
    from transformer.translate import packed_projection, quantize_int8

    # As `Translator` decodes: fp32 with its projection packed for oneDNN, whose rows are the
    # same bits in any batch (MKL's F.linear rounds a row by the batch's size: blocks of rows
    # would change the last bits of an unpacked fp32 model's scores, as batches do)
    return quantize_int8(model) if dtype == "int8" else packed_projection(model)


@pytest.mark.parametrize("dtype", ["fp32", "bf16", "int8"])
def test_a_steps_scores_in_blocks_of_rows_give_the_same_search(dtype, monkeypatch):
    # Scores above STEP_BLOCK_BYTES are made and searched a block of rows at a time (a 64 MiB
    # block is a fresh mmap every step in a decoding thread): the same hypotheses and scores,
    # bit for bit, and no projection of more rows than a block.
    model = _blocks_model(dtype)
    src, src_mask = random_batch(6, 300, [9, 4, 12, 7, 10, 5])

    def searches():
        return (beam_search(model, src, src_mask, beam_size=4, n_best=4),
                greedy_search(model, src, src_mask))  # fmt: skip

    whole = searches()
    projected = []
    project = model.project
    monkeypatch.setattr(model, "project", lambda h: projected.append(len(h)) or project(h))
    monkeypatch.setattr(search, "STEP_BLOCK_BYTES", 5 * 4 * 300)  # 5 rows; beam 4 has 24
    blocked = searches()
    assert max(projected) == 5 and len(projected) > 2 * 20  # every step in blocks
    for got, want in zip(blocked[0], whole[0], strict=True):
        assert [(h.tokens, h.score, h.log_prob) for h in got] == [
            (h.tokens, h.score, h.log_prob) for h in want
        ]
    assert blocked[1] == whole[1]


def test_a_stepper_in_blocks_times_the_same_units(monkeypatch):
    monkeypatch.setattr(search, "STEP_BLOCK_BYTES", 2 * 4 * 300)  # 2 rows a block
    model = _blocks_model("int8")
    src, src_mask = random_batch(3, 300, [5, 7, 4])
    plain, blocked = RecordingTuner(), RecordingTuner()
    steppers = (ModelStepper(model, src, src_mask, tuner=plain),
                ModelStepper(model, src, src_mask, tuner=blocked))  # fmt: skip
    tokens = torch.full((3,), BOS_ID)
    with torch.inference_mode():
        for _ in range(1 + search.TUNER_STEPS + 2):
            whole = steppers[0].step(tokens)
            parts = list(steppers[1].step_blocks(tokens))
            assert [len(p) for p in parts] == [2, 1]
            assert torch.equal(torch.cat(parts), whole)
            tokens = torch.randint(4, 300, (3,))
    assert plain.units == blocked.units == [3 * search.TUNER_STEPS]
    assert steppers[0].steps == steppers[1].steps == 1 + search.TUNER_STEPS + 2


# ------------------------------------------------------------------- several α in one search


class PrefixStepper:
    """A stepper whose next-token log-probs depend only on (sentence, prefix), seeded by them:
    the same for a sentence whatever else is in the batch, so searches can be compared exactly.
    """

    def __init__(self, B: int, V: int = 9, spread: float = 2.5) -> None:
        self.rows = [(s, ()) for s in range(B)]  # (sentence, generated tokens) per live row
        self.V, self.spread = V, spread

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        self.rows = [(s, p if t == BOS_ID else (*p, t))
                     for (s, p), t in zip(self.rows, tokens.tolist(), strict=True)]  # fmt: skip
        out = []
        for s, p in self.rows:
            g = torch.Generator().manual_seed(hash((s, p)) % 2**31)
            out.append(torch.log_softmax(torch.randn(self.V, generator=g) * self.spread, -1))
        return torch.stack(out)

    def reorder(self, index: torch.Tensor, same_sentences: bool = False) -> None:
        self.rows = [self.rows[i] for i in index.tolist()]


@pytest.mark.parametrize("stop", STOP_RULES)
@pytest.mark.parametrize("n_best", [1, 3])
def test_beam_steps_alphas_equal_one_search_per_alpha(stop, n_best):
    # One search for several α gives, for each α, exactly what a search with that α alone
    # gives: the same hypotheses, scores and log-probs, bit for bit, in the same order.
    B, alphas = 16, (0.0, 0.6, 1.0, 1.6, 3.0)
    max_lens = torch.tensor([3, 5, 8, 12] * 4)
    together = search.beam_steps_alphas(PrefixStepper(B), max_lens, 4, alphas, n_best, stop)
    assert len(together) == len(alphas)
    for alpha, got in zip(alphas, together, strict=True):
        want = beam_steps(PrefixStepper(B), max_lens, 4, alpha, n_best, stop)
        assert got == want
        assert all(len(hyps) == n_best for hyps in got)
    # not vacuous: α changes some outputs, and ends the search for some sentences sooner
    assert together[0] != together[-1]
    assert together[0] != together[2] or together[2] != together[-1]


def test_beam_steps_alphas_keeps_only_what_each_alpha_finished_in_its_own_search():
    # Beam 2, by hand. Step 1: a .7, b .3. Step 2: "a EOS" .385 and "b EOS" .3 finish, "a b"
    # .315 stays live. Under α 0 no live beam can beat .385 (lp = 1): that search ends with
    # "a". Under α 2 the bound is log .315 / lp(6) = -0.344 > log .385 / lp(2) = -0.701: it
    # goes on, and "a b EOS" (log .315 / lp(3) = -0.650) wins there; α 0 keeps "a".
    script = {(): {A: 0.7, B_: 0.3}, (A,): {EOS_ID: 0.55, B_: 0.45}}
    zero, two = search.beam_steps_alphas(ScriptedStepper(script), torch.tensor([6]), 2,
                                         (0.0, 2.0), n_best=1)  # fmt: skip
    assert zero == beam_steps(ScriptedStepper(script), torch.tensor([6]), 2, 0.0)
    assert two == beam_steps(ScriptedStepper(script), torch.tensor([6]), 2, 2.0)
    assert zero[0][0].tokens == [A] and two[0][0].tokens == [A, B_]
    assert zero[0][0].score == pytest.approx(math.log(0.385), abs=1e-6)
    assert two[0][0].score == pytest.approx(math.log(0.315) / (8 / 6) ** 2, abs=1e-6)


def test_beam_search_alphas_with_a_model_equals_one_search_per_alpha():
    torch.manual_seed(0)
    model = tiny_model(vocab=40, scale=8.0)
    src, src_mask = random_batch(6, 40, [5, 9, 7, 3, 8, 6])
    alphas = (0.2, 1.0, 2.0)
    together = search.beam_search_alphas(model, src, src_mask, alphas, beam_size=3, n_best=2,
                                         max_len_b=10)  # fmt: skip
    for alpha, got in zip(alphas, together, strict=True):
        want = beam_search(model, src, src_mask, 3, alpha, max_len_b=10, n_best=2)
        assert [[h.tokens for h in s] for s in got] == [[h.tokens for h in s] for s in want]
        for s, t in zip(got, want, strict=True):
            assert [h.score for h in s] == pytest.approx([h.score for h in t], abs=1e-6)
    with pytest.raises(ValueError, match="at least one"):
        search.beam_search_alphas(model, src, src_mask, (), beam_size=3)
