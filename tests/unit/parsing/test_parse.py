"""§6.3 parsing with a tiny random model: a tree per sentence with exactly its words, the §6.3
decoding options, EVALB scoring, and CLI errors."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from transformer.cli import main
from transformer.config import DecodeConfig, ModelConfig, RunConfig
from transformer.errors import UserError
from transformer.model import Transformer
from transformer.modelfile import save_model
from transformer.parsing.parse import (
    MAX_OPEN_RUN,
    TreeConstraint,
    _needs_repair,
    evaluate_parser,
    leaf_mode,
    parse_decode_config,
    parse_file,
    parse_sentences,
)
from transformer.parsing.trees import linearize, parse_trees, write_trees
from transformer.search import beam_steps, greedy_steps
from transformer.tokenizer import BOS_ID, EOS_ID, PAD_ID, Tokenizer

GOLD = parse_trees(
    """
    (TOP (S (NP (DT The) (NN dog)) (VP (VBZ runs)) (. .)))
    (TOP (S (NP (NNP John)) (VP (VBZ has) (NP (DT a) (JJ red) (NN ball))) (. .)))
    (TOP (NP (NN Hello)))
    (TOP (S (NP (DT A) (NN cat)) (VP (VBD sat) (PP (IN on) (NP (DT the) (NN mat)))) (. .)))
    """
)
WORDS = "the a dog cat John has red ball runs sat on mat Hello .".split()


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def model_file(tmp_path_factory) -> Path:
    """A tiny random model (d_model 16, 2 layers) with a joint vocabulary of words and tree
    symbols, as `prepare ptb` makes it."""
    tmp = tmp_path_factory.mktemp("parse")
    rng = random.Random(0)
    lines = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 9))) for _ in range(300)]
    lines += [" ".join(linearize(t)) for t in GOLD] * 30
    (tmp / "text.txt").write_text("\n".join(lines) + "\n", encoding="utf-8")
    symbols = sorted({tok for t in GOLD for tok in linearize(t)})
    tok = Tokenizer.train([tmp / "text.txt"], tmp / "spm", 320, num_threads=1, user_symbols=symbols)
    cfg = RunConfig(
        model=ModelConfig(vocab_size=tok.vocab_size, n_layers=2, d_model=16, d_ff=32, n_heads=2,
                          d_k=8, d_v=8, p_drop=0.0, max_len=512),
        decode=DecodeConfig(),
    )  # fmt: skip
    torch.manual_seed(0)
    model = Transformer(cfg.model).eval()
    proto = (tmp / "spm.model").read_bytes()
    return save_model(tmp / "model.safetensors", model, cfg, proto, "en", "tree")


def test_decode_options_are_section_6_3():
    # §6.3: "beam size of 21 and α = 0.3", "maximum output length to input length + 300"
    cfg = parse_decode_config()
    assert (cfg.beam_size, cfg.length_penalty, cfg.max_len_a, cfg.max_len_b) == (21, 0.3, 1.0, 300)
    assert cfg.n_best == 1


def test_every_sentence_gets_a_tree_with_exactly_its_words(model_file):
    sentences = [t.leaves() for t in GOLD]
    trees = parse_sentences(model_file, sentences, beam=3)
    assert len(trees) == len(sentences)
    for tree, words in zip(trees, sentences, strict=True):
        assert tree.label == "TOP" and tree.leaves() == words
        assert set(tree.pos()) == {"XX"}  # no tags given: the model's normalized tag


def test_pos_tags_are_used_for_the_output_trees(model_file):
    trees = parse_sentences(model_file, [t.leaves() for t in GOLD], [t.pos() for t in GOLD], 3)
    assert [t.pos() for t in trees] == [t.pos() for t in GOLD]


def test_default_beam_21_decoding(model_file):
    """The §6.3 defaults run end to end (random weights: output is mostly repaired)."""
    trees = parse_sentences(model_file, [GOLD[0].leaves(), GOLD[2].leaves()])
    assert [t.leaves() for t in trees] == [GOLD[0].leaves(), GOLD[2].leaves()]


def test_evaluate_parser_scores_against_gold_trees(model_file, tmp_path):
    write_trees(GOLD, tmp_path / "gold.trees")
    r = evaluate_parser(model_file, tmp_path / "gold.trees", beam=3, output=tmp_path / "pred")
    assert r["sentences"] == 4 and r["valid_sentences"] == 4 and r["error_sentences"] == 0
    assert 0.0 <= r["f1"] <= 100.0 and r["gold_brackets"] == 13  # 3 + 4 + 1 + 5, TOP not counted
    pred = parse_trees((tmp_path / "pred").read_text(encoding="utf-8"))
    assert [t.leaves() for t in pred] == [t.leaves() for t in GOLD]
    assert [t.pos() for t in pred] == [t.pos() for t in GOLD]  # gold tags, for EVALB


def test_perfect_output_scores_100(model_file, tmp_path, monkeypatch):
    """With the model's output replaced by the gold linearization, EVALB gives 100."""
    from transformer.translate import Translation, Translator

    gold_lines = {" ".join(t.leaves()): " ".join(linearize(t)) for t in GOLD}

    def oracle(self, lines, *args, **kwargs):
        return [[Translation(gold_lines[line], [], 0.0)] for line in lines]

    monkeypatch.setattr(Translator, "translate", oracle)
    write_trees(GOLD, tmp_path / "gold.trees")
    r = evaluate_parser(model_file, tmp_path / "gold.trees", beam=3)
    assert (r["precision"], r["recall"], r["f1"]) == (100.0, 100.0, 100.0)


@pytest.mark.parametrize(
    ("tokens", "n_words", "repair"),
    [
        ("(S (NP XX )NP (VP XX )VP )S", 2, False),
        ("(S (NP XX )NP (VP XX )VP", 2, True),  # unclosed
        ("(S (NP XX )VP )S", 1, True),  # mismatched label
        ("(S XX XX XX )S", 2, True),  # too many leaves
        ("(S XX )S )S", 1, True),  # extra closing bracket
        ("", 1, True),  # nothing
    ],
)
def test_needs_repair(tokens, n_words, repair):
    assert _needs_repair(tokens.split(), ["w"] * n_words, "xx") is repair


@pytest.mark.parametrize(
    ("tokens", "repair"),
    [
        ("(S (NP John )NP (VP runs )VP )S", False),
        ("(S (NP John )NP (VP walks )VP )S", True),  # a different word, same count
        ("(S (NP John )NP (VP runs runs )VP )S", True),  # a repeated word
    ],
)
def test_needs_repair_with_words_as_leaves(tokens, repair):
    assert _needs_repair(tokens.split(), ["John", "runs"], "words") is repair


def test_leaf_mode_comes_from_the_target_language():
    assert [leaf_mode(lang) for lang in ("tree", "tree_pos", "tree_words")] == [
        "xx",
        "pos",
        "words",
    ]
    with pytest.raises(UserError, match="not a parsing model: its target language is 'de'"):
        leaf_mode("de")


def test_bad_input_is_a_user_error_naming_the_line(model_file):
    with pytest.raises(UserError, match=r"in.txt:2: empty line"):
        parse_file(model_file, ["The dog runs .", "  ", "Hello"], "in.txt", beam=3)
    with pytest.raises(UserError, match=r"--pos line 1: 2 tags for 3 words"):
        parse_file(model_file, ["The dog runs"], "in.txt", ["DT NN"], beam=3)
    with pytest.raises(UserError, match=r"--pos: 2 lines for 1 sentences"):
        parse_file(model_file, ["The dog runs"], "in.txt", ["DT NN VBZ", "DT"], beam=3)
    with pytest.raises(UserError, match=r"sentence 1: empty"):
        parse_sentences(model_file, [[]], beam=3)


def test_cli_parse_writes_one_tree_per_line(model_file, tmp_path, capsys):
    (tmp_path / "in.txt").write_text("The dog runs .\nHello\n", encoding="utf-8")
    (tmp_path / "pos.txt").write_text("DT NN VBZ .\nNN\n", encoding="utf-8")
    argv = ["parse", str(model_file), str(tmp_path / "in.txt"), "--beam", "3", "--threads", "1"]
    assert main([*argv, "--pos", str(tmp_path / "pos.txt")]) == 0
    out = capsys.readouterr().out.splitlines()
    trees = parse_trees("\n".join(out))
    assert len(out) == 2 and [t.leaves() for t in trees] == [["The", "dog", "runs", "."], ["Hello"]]
    assert trees[0].pos() == ["DT", "NN", "VBZ", "."]


def test_cli_parse_eval_prints_evalb(model_file, tmp_path, capsys):
    write_trees(GOLD, tmp_path / "gold.trees")
    assert (
        main(["parse", str(model_file), "--eval", str(tmp_path / "gold.trees"), "--beam", "3"]) == 0
    )
    assert capsys.readouterr().out.count("EVALB") == 2


def test_cli_errors_exit_2(model_file, tmp_path, capsys):
    (tmp_path / "in.txt").write_text("The dog\n\n", encoding="utf-8")
    assert main(["parse", str(model_file), str(tmp_path / "in.txt")]) == 2
    assert "in.txt:2: empty line" in capsys.readouterr().err
    assert main(["parse", str(model_file), str(tmp_path / "missing.txt")]) == 2
    assert "missing.txt: file not found" in capsys.readouterr().err
    assert main(["parse", str(model_file), "--eval", str(tmp_path)]) == 2  # no test.trees
    assert "test.trees: no such tree file" in capsys.readouterr().err
    (tmp_path / "bad.trees").write_text("(TOP (S (NP x)\n", encoding="utf-8")
    assert main(["parse", str(model_file), "--eval", str(tmp_path / "bad.trees")]) == 2
    assert "bad.trees" in capsys.readouterr().err


def test_cli_damaged_model_no_verify_and_an_unwritable_output(model_file, tmp_path, capsys):
    (tmp_path / "in.txt").write_text("The dog barks .\n", encoding="utf-8")
    damaged = tmp_path / "damaged.safetensors"
    data = bytearray(model_file.read_bytes())
    data[-2] ^= 0x01  # one bit of the last tensor
    damaged.write_bytes(bytes(data))
    argv = ["parse", str(damaged), str(tmp_path / "in.txt"), "--beam", "1"]
    assert main(argv) == 2
    assert "damaged.safetensors: the tensor data does not match" in capsys.readouterr().err
    assert main([*argv, "--no-verify"]) == 0
    assert capsys.readouterr().out.startswith("(TOP")
    assert main([*argv, "--no-verify", "--output", "/dev/full"]) == 2
    assert capsys.readouterr().err.endswith("/dev/full: cannot write: No space left on device\n")


# A vocabulary as `prepare ptb --leaves words` makes it: specials, bracket symbols with their
# word mark, word pieces (word-initial with the mark, continuations without).
PIECES = ["<pad>", "<s>", "</s>", "<unk>", "▁(S", "▁)S", "▁(NP", "▁)NP", "▁(VP", "▁)VP",
          "▁(ADJP", "▁The", "▁dog", "▁bar", "ks", "▁lo", "ud", "▁.", "▁(X"]  # fmt: skip
ID = {p: i for i, p in enumerate(PIECES)}


class RandomStepper:
    """Stateless random log-probs: the constraint alone must make every output a tree."""

    def __init__(self, seed: int):
        self.generator = torch.Generator().manual_seed(seed)

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        logits = torch.randn(tokens.size(0), len(PIECES), generator=self.generator) * 3
        return logits.log_softmax(-1)

    def reorder(self, index: torch.Tensor, same_sentences: bool = False) -> None:
        pass


def _source(words: str) -> list[int]:
    return [ID[p] for p in words.split()] + [EOS_ID]


def _constrained(sources: list[list[int]], seed: int):
    width = max(len(s) for s in sources)
    src = torch.tensor([s + [PAD_ID] * (width - len(s)) for s in sources])
    return TreeConstraint(PIECES)(RandomStepper(seed), src, src != PAD_ID)


def _check_tree(output: list[int], source: list[int]) -> None:
    """Balanced brackets with matching labels, one outer constituent, the source's pieces
    copied in order, no constituent without a word."""
    pieces = [PIECES[i] for i in output]
    stack, words, outer = [], [], 0
    for p in pieces:
        bare = p.lstrip("▁")
        if bare.startswith("(") and len(bare) > 1:
            outer += not stack
            stack.append((bare[1:], len(words)))
        elif bare.startswith(")") and len(bare) > 1:
            label, start = stack.pop()
            assert label == bare[1:] and len(words) > start, pieces
        else:
            assert stack, pieces  # every word inside a constituent
            words.append(ID[p])
    assert not stack and outer == 1 and words == source[:-1], pieces


@pytest.mark.parametrize("seed", range(20))
def test_tree_constraint_makes_every_beam_and_greedy_output_a_tree_over_the_words(seed):
    sources = [
        _source("▁The ▁dog ▁bar ks ▁lo ud ▁."),
        _source("▁dog"),
        _source("▁bar ks ▁The"),
    ]
    max_lens = torch.tensor([len(s) + 300 for s in sources])
    found = beam_steps(_constrained(sources, seed), max_lens, beam_size=4, alpha=0.3, n_best=4)
    for source, hyps in zip(sources, found, strict=True):
        assert len(hyps) == 4
        for hyp in hyps:
            _check_tree(hyp.tokens, source)
    greedy = greedy_steps(_constrained(sources, seed), max_lens)
    for source, tokens in zip(sources, greedy, strict=True):
        _check_tree(tokens, source)


def test_tree_constraint_bars_long_runs_of_opening_brackets():
    stepper = _constrained([_source("▁dog")], 0)
    opens = torch.tensor([ID["▁(S"], ID["▁(NP"], ID["▁(VP"]])
    unclosable = torch.tensor([ID["▁(ADJP"], ID["▁(X"]])  # no closing piece in the vocabulary
    last = torch.tensor([BOS_ID])
    for run in range(MAX_OPEN_RUN):
        allowed = stepper.step(last).isfinite()[0]
        assert bool(allowed[opens].all()) and not bool(allowed[unclosable].any())
        assert bool(allowed[ID["▁dog"]]) == (run > 0)  # a word only inside a constituent
        assert not bool(allowed[ID["▁)NP"]])  # nothing to close: no word yet
        last = torch.tensor([ID["▁(NP"]])
    allowed = stepper.step(last).isfinite()[0]
    assert allowed.nonzero().squeeze(1).tolist() == [ID["▁dog"]]  # only the word now


def test_tree_constraint_ends_at_the_maximum_length_even_mid_tree():
    sources = [_source("▁The ▁dog ▁bar ks ▁lo ud ▁.")]
    hyps = beam_steps(_constrained(sources, 1), torch.tensor([4]), 3, 0.3)[0]
    assert len(hyps[0].tokens) <= 3  # cut by the maximum length (EOS included), not stuck
    assert len(greedy_steps(_constrained(sources, 1), torch.tensor([4]))[0]) <= 3


def test_constrained_search_needs_a_model_that_writes_words(model_file):
    with pytest.raises(UserError, match="needs a model whose trees write the words"):
        parse_sentences(model_file, [["The", "dog"]], beam=1, constrain=True)
