"""§6.3 English constituency parsing with a trained Transformer: sentences in, trees out.

The model translates words into linearized trees (`trees.linearize`, POS tags written `XX`, or
the words themselves for a model trained on `prepare ptb --leaves words`: the model file's
target language, "tree" or "tree_words", says which).
Decoding follows §6.3: beam size 21, α = 0.3, maximum output length = input length + 300
(input length in source subwords, EOS included, as in every other decoding here). Each output is
then turned back into a tree with exactly the sentence's words (`trees.delinearize`, which
repairs unbalanced or ill-formed output).

POS tags: the model predicts `XX`. EVALB (COLLINS.prm) deletes punctuation by each tree's own
tags, so for scoring the predicted trees take the input's tags: `evaluate_parser` uses the gold
trees' tags, and `parse_sentences` uses `pos` when given, else every tag is `XX`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from transformer.config import DecodeConfig
from transformer.errors import UserError
from transformer.evalb import evaluate_parses
from transformer.trees import (
    NORMALIZED_POS,
    Tree,
    TreeFormatError,
    read_trees,
    trees_from_predictions,
)

logger = logging.getLogger(__name__)

# §6.3: "we increased the maximum output length to input length + 300 ... beam size of 21 and
# α = 0.3"
PARSE_BEAM = 21
PARSE_ALPHA = 0.3
PARSE_MAX_LEN_A = 1.0
PARSE_MAX_LEN_B = 300
# Source tokens per decoding batch: beam 21 makes each batch 21x wider than in translation.
PARSE_MAX_TOKENS = 600


def parse_decode_config(
    beam: int = PARSE_BEAM, alpha: float = PARSE_ALPHA, max_tokens: int = PARSE_MAX_TOKENS
) -> DecodeConfig:
    """The §6.3 decoding options (beam 21, α 0.3, max length = input + 300)."""
    return DecodeConfig(
        beam_size=beam,
        length_penalty=alpha,
        max_len_a=PARSE_MAX_LEN_A,
        max_len_b=PARSE_MAX_LEN_B,
        n_best=1,
        max_tokens=max_tokens,
    )


def parse_sentences(
    model_path: str | Path,
    sentences: Sequence[Sequence[str]],
    pos: Sequence[Sequence[str]] | None = None,
    beam: int = PARSE_BEAM,
    alpha: float = PARSE_ALPHA,
    *,
    max_tokens: int = PARSE_MAX_TOKENS,
    dtype: str = "fp32",
    device: str = "cpu",
) -> list[Tree]:
    """Parse tokenized sentences into trees (§6.3).

    Args:
        model_path: a model file, or a run directory (`translate.resolve_model`).
        sentences: the words of each sentence, tokenized as in the treebank (`-LRB-`, `n't`).
        pos: POS tags per sentence for the output trees (e.g. from a tagger or gold trees);
            None writes `XX` (then EVALB cannot remove punctuation from the predicted trees).
        beam, alpha: beam size and length penalty α (§6.3: 21 and 0.3).
        max_tokens: source tokens per decoding batch (padding counted).
        dtype: "fp32", "bf16" or "int8" (`translate.Translator`).
        device: where to decode.

    Returns:
        One tree per sentence, root `TOP`, whose leaves are exactly the sentence's words.

    Raises:
        UserError: an empty sentence, or `pos` that does not match the sentences.
    """
    from transformer.translate import Translator

    _check_input(sentences, pos)
    translator = Translator.from_path(
        model_path, parse_decode_config(beam, alpha, max_tokens), device, dtype
    )
    return _parse(translator, sentences, pos)


def _check_input(sentences: Sequence[Sequence[str]], pos: Sequence[Sequence[str]] | None) -> None:
    for i, words in enumerate(sentences, start=1):
        if not words:
            raise UserError(f"sentence {i}: empty; every sentence needs at least one word")
    if pos is None:
        return
    if len(pos) != len(sentences):
        raise UserError(f"{len(pos)} lines of POS tags for {len(sentences)} sentences")
    for i, (words, tags) in enumerate(zip(sentences, pos, strict=True), start=1):
        if len(tags) != len(words):
            raise UserError(f"sentence {i}: {len(tags)} POS tags for {len(words)} words")


@torch.inference_mode()
def _parse(translator, sentences: Sequence[Sequence[str]], pos) -> list[Tree]:
    start = time.perf_counter()
    outputs = translator.translate([" ".join(words) for words in sentences])
    predictions = [nbest[0].text for nbest in outputs]
    if pos is None:  # not the output's leaf tokens: ill-formed output may put any piece there
        pos = [[NORMALIZED_POS] * len(words) for words in sentences]
    leaves = leaf_mode(translator.loaded.tgt_lang)
    trees = trees_from_predictions(predictions, sentences, pos, leaves=leaves)
    n_repaired = sum(
        _needs_repair(p.split(), w, leaves) for p, w in zip(predictions, sentences, strict=True)
    )
    logger.info(
        "parsed %d sentences in %.1f s (beam %d, α %.2f); %d outputs needed repair",
        len(sentences), time.perf_counter() - start, translator.decode.beam_size,
        translator.decode.length_penalty, n_repaired,
    )  # fmt: skip
    return trees


def leaf_mode(tgt_lang: str) -> str:
    """What a parsing model writes for each word ("xx", "pos", "words"), from its target
    language (`parsing_data.TGT_LANGS`); a model of another target language is a UserError."""
    from transformer.parsing_data import TGT_LANGS

    for leaves, lang in TGT_LANGS.items():
        if lang == tgt_lang:
            return leaves
    raise UserError(
        f"not a parsing model: its target language is {tgt_lang!r}, not one of "
        f"{', '.join(TGT_LANGS.values())} (train it on `transformer prepare ptb` data)"
    )


def _needs_repair(tokens: Sequence[str], words: Sequence[str], leaves: str) -> bool:
    """Whether output tokens are not a well-formed linearized tree over exactly `words`."""
    stack: list[str] = []
    output_words = []
    for token in tokens:
        if token.startswith("("):
            stack.append(token[1:])
        elif token.startswith(")"):
            if not stack or stack.pop() != token[1:]:
                return True
        else:
            output_words.append(token)
    if leaves == "words" and output_words != list(words):
        return True
    return bool(stack) or len(output_words) != len(words) or not tokens


def read_gold(data: str | Path, split: str = "test") -> list[Tree]:
    """Gold trees: a PTB file, or `{split}.trees` of a `prepare ptb` directory."""
    path = Path(data)
    if path.is_dir():
        path = path / f"{split}.trees"
    if not path.is_file():
        raise UserError(f"{path}: no such tree file (prepare the data with `prepare ptb`)")
    try:
        return read_trees(path)
    except TreeFormatError as e:
        raise UserError(str(e)) from e


def evaluate_parser(
    model_path: str | Path,
    data: str | Path,
    split: str = "test",
    *,
    beam: int = PARSE_BEAM,
    alpha: float = PARSE_ALPHA,
    limit: int | None = None,
    max_tokens: int = PARSE_MAX_TOKENS,
    dtype: str = "fp32",
    output: str | Path | None = None,
) -> dict:
    """Parse the sentences of gold trees and score the result like EVALB (COLLINS.prm).

    The predicted trees get the gold trees' POS tags (see the module docstring).

    Args:
        model_path: a model file, or a run directory.
        data: a `prepare ptb` directory (reads `{split}.trees`) or a PTB tree file.
        split: "train", "valid" or "test" (section 22) for a directory.
        beam, alpha: §6.3 decoding (21, 0.3).
        limit: only the first `limit` trees.
        max_tokens: source tokens per decoding batch.
        dtype: "fp32", "bf16" or "int8".
        output: write the predicted trees here, one per line.

    Returns:
        `evalb.evaluate_parses` scores (recall, precision, f1 in percent, and "len<=40"),
        without the per-sentence scores, plus "split", "beam", "alpha" and "seconds".
    """
    gold = read_gold(data, split)
    if limit is not None:
        gold = gold[:limit]
    start = time.perf_counter()
    trees = parse_sentences(
        model_path, [t.leaves() for t in gold], [t.pos() for t in gold], beam, alpha,
        max_tokens=max_tokens, dtype=dtype,
    )  # fmt: skip
    seconds = time.perf_counter() - start
    if output is not None:
        Path(output).write_text("".join(f"{t}\n" for t in trees), encoding="utf-8")
    scores = evaluate_parses(gold, trees)
    scores.pop("sentence_scores")
    scores.update(split=split, beam=beam, alpha=alpha, seconds=seconds)
    return scores


def read_sentences(lines: Sequence[str], name: str) -> list[list[str]]:
    """Space-separated words per line; an empty line is a UserError naming the line."""
    sentences = []
    for number, line in enumerate(lines, start=1):
        words = line.split()
        if not words:
            raise UserError(f"{name}:{number}: empty line; one sentence per line expected")
        sentences.append(words)
    return sentences


def parse_file(
    model_path: str | Path,
    lines: Sequence[str],
    name: str,
    pos_lines: Sequence[str] | None = None,
    beam: int = PARSE_BEAM,
    alpha: float = PARSE_ALPHA,
    dtype: str = "fp32",
) -> list[str]:
    """`transformer parse`: sentence lines (and optional POS-tag lines) in, tree lines out."""
    sentences = read_sentences(lines, name)
    pos = None
    if pos_lines is not None:
        pos = [line.split() for line in pos_lines]
        if len(pos) != len(sentences):
            raise UserError(f"--pos: {len(pos)} lines for {len(sentences)} sentences in {name}")
        for number, (words, tags) in enumerate(zip(sentences, pos, strict=True), start=1):
            if len(tags) != len(words):
                raise UserError(f"--pos line {number}: {len(tags)} tags for {len(words)} words")
    trees = parse_sentences(model_path, sentences, pos, beam, alpha, dtype=dtype)
    return [str(tree) for tree in trees]
