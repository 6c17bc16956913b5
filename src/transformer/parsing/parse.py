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
from transformer.data import write_output
from transformer.errors import UserError
from transformer.parsing.evalb import evaluate_parses
from transformer.parsing.trees import (
    CLOSE,
    NORMALIZED_POS,
    OPEN,
    Tree,
    TreeFormatError,
    read_trees,
    trees_from_predictions,
)
from transformer.search import NEG_INF
from transformer.tokenizer import BOS_ID, EOS_ID, PAD_ID, WORD_MARK

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
    constrain: bool = False,
    verify: bool = True,
    threads: int | str | None = None,
) -> list[Tree]:
    """Parse tokenized sentences into trees (§6.3).

    Args:
        model_path: a model file, or a run directory (`rundir.resolve_model`).
        sentences: the words of each sentence, tokenized as in the treebank (`-LRB-`, `n't`).
        pos: POS tags per sentence for the output trees (e.g. from a tagger or gold trees);
            None writes `XX` (then EVALB cannot remove punctuation from the predicted trees).
        beam, alpha: beam size and length penalty α (§6.3: 21 and 0.3).
        max_tokens: source tokens per decoding batch (padding counted).
        dtype: "fp32", "bf16" or "int8" (`translate.Translator`).
        device: where to decode.
        constrain: search only well-formed trees over the sentence's words (`TreeConstraint`;
            models whose trees write the words only; off by default, docs/parsing.md measures it).
        verify: check the model file's checksum (`modelfile.load_model`).
        threads: CPU threads: a count, "auto" (OMP_NUM_THREADS if set, else tuned to the
            machine's load as it decodes, threads.py; the CLI's default) or None (torch's
            setting, untouched).

    Returns:
        One tree per sentence, root `TOP`, whose leaves are exactly the sentence's words.

    Raises:
        UserError: an empty sentence, `pos` that does not match the sentences, a model that is
            not a parsing model, or `constrain` for an XX model.
    """
    from transformer.translate import Translator

    _check_input(sentences, pos)
    translator = Translator.from_path(
        model_path, parse_decode_config(beam, alpha, max_tokens), device, dtype, verify, threads
    )
    leaves = leaf_mode(translator.loaded.tgt_lang)
    if constrain:
        if leaves != "words":
            raise UserError(
                "the constrained search needs a model whose trees write the words "
                f"(`prepare ptb --leaves words`); this one writes {leaves.upper()}"
            )
        translator.constrain = TreeConstraint.for_tokenizer(translator.tokenizer)
    return _parse(translator, sentences, pos, leaves)


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
def _parse(translator, sentences: Sequence[Sequence[str]], pos, leaves: str) -> list[Tree]:
    start = time.perf_counter()
    outputs = translator.translate([" ".join(words) for words in sentences])
    predictions = [nbest[0].text for nbest in outputs]
    if pos is None:  # not the output's leaf tokens: ill-formed output may put any piece there
        pos = [[NORMALIZED_POS] * len(words) for words in sentences]
    trees = trees_from_predictions(predictions, sentences, pos, leaves=leaves)
    n_repaired = sum(
        _needs_repair(p.split(), w, leaves) for p, w in zip(predictions, sentences, strict=True)
    )
    logger.info(
        "parsed %d sentences in %.1f s (beam %d, α %.2f%s); %d outputs needed repair",
        len(sentences), time.perf_counter() - start, translator.decode.beam_size,
        translator.decode.length_penalty, ", constrained" if translator.constrain else "",
        n_repaired,
    )  # fmt: skip
    return trees


def leaf_mode(tgt_lang: str) -> str:
    """What a parsing model writes for each word ("xx", "pos", "words"), from its target
    language (`parsing_data.TGT_LANGS`); a model of another target language is a UserError."""
    from transformer.parsing.corpus import TGT_LANGS

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
    constrain: bool = False,
    verify: bool = True,
    threads: int | str | None = None,
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
        constrain: the constrained search (`parse_sentences`).
        threads: CPU threads (`parse_sentences`).

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
        max_tokens=max_tokens, dtype=dtype, constrain=constrain, verify=verify, threads=threads,
    )  # fmt: skip
    seconds = time.perf_counter() - start
    if output is not None:
        write_output(output, "".join(f"{t}\n" for t in trees))
    scores = evaluate_parses(gold, trees)
    scores.pop("sentence_scores")
    scores.update(split=split, beam=beam, alpha=alpha, seconds=seconds, constrain=constrain)
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
    constrain: bool = False,
    verify: bool = True,
    threads: int | str | None = None,
) -> list[str]:
    """`transformer parse`: sentence lines (and optional POS-tag lines) in, tree lines out
    (`threads`: as `parse_sentences`)."""
    sentences = read_sentences(lines, name)
    pos = None
    if pos_lines is not None:
        pos = [line.split() for line in pos_lines]
        if len(pos) != len(sentences):
            raise UserError(f"--pos: {len(pos)} lines for {len(sentences)} sentences in {name}")
        for number, (words, tags) in enumerate(zip(sentences, pos, strict=True), start=1):
            if len(tags) != len(words):
                raise UserError(f"--pos line {number}: {len(tags)} tags for {len(words)} words")
    trees = parse_sentences(
        model_path, sentences, pos, beam, alpha, dtype=dtype, constrain=constrain, verify=verify,
        threads=threads,
    )  # fmt: skip
    return [str(tree) for tree in trees]


class TreeConstraint:
    """A search constraint for models whose trees write the words (`leaves="words"`): every
    output is a well-formed tree over exactly the sentence's subword pieces.

    At each step a row may emit only
      - the next piece of its sentence, inside a constituent (the words are copied in order);
      - at a word boundary, an opening bracket while words remain (at most MAX_OPEN_RUN in a
        row), or the closing bracket of its innermost open constituent once that holds a word
        (the outermost one only once every word is placed);
      - EOS once every word is placed and every constituent closed.
    The model still chooses where the brackets go and with which labels; the search scores
    its log-probabilities of the allowed tokens as they are (no renormalization). The words of
    a source piece sequence are the target's too: both sides share one sentencepiece model, and
    it segments a word the same way wherever it stands.

    Usage: `translator.constrain = TreeConstraint.for_tokenizer(tokenizer)`; the search calls
    it with (stepper, src, src_mask) and steps the returned wrapper.
    """

    def __init__(self, pieces: Sequence[str]):
        """pieces: the vocabulary, `pieces[i]` the sentencepiece string of id i."""
        V = len(pieces)
        self.open_label = torch.full((V,), -1, dtype=torch.long)
        self.close_label = torch.full((V,), -1, dtype=torch.long)
        closes = {p.lstrip(WORD_MARK)[1:]: i for i, p in enumerate(pieces) if _is_close(p)}
        labels: list[str] = []
        for i, piece in enumerate(pieces):
            label = piece.lstrip(WORD_MARK)[1:]
            if _is_open(piece) and label in closes:  # a label that can be closed
                self.open_label[i] = len(labels)
                self.close_label[closes[label]] = len(labels)
                labels.append(label)
        self.close_id = torch.full((len(labels),), -1, dtype=torch.long)
        for i in (self.close_label >= 0).nonzero().squeeze(1).tolist():
            self.close_id[self.close_label[i]] = i
        self.open_ids = (self.open_label >= 0).nonzero().squeeze(1)
        self.word_start = torch.tensor([p.startswith(WORD_MARK) for p in pieces])
        self.is_piece = torch.ones(V, dtype=torch.bool)  # a word piece, not a bracket or special
        self.is_piece[self.open_ids] = False
        self.is_piece[self.close_label >= 0] = False
        self.is_piece[[PAD_ID, BOS_ID, EOS_ID]] = False
        if not labels:
            raise ValueError("the vocabulary holds no bracket pieces (`(NP` with its `)NP`)")

    @classmethod
    def for_tokenizer(cls, tokenizer) -> TreeConstraint:
        return cls([tokenizer.id_to_piece(i) for i in range(tokenizer.vocab_size)])

    def __call__(self, stepper, src: torch.Tensor, src_mask: torch.Tensor) -> _TreeStepper:
        return _TreeStepper(self, stepper, src, src_mask)


# Opening brackets in a row before a word: at most 6 in the training, dev and section 22 trees
# (`(S (NP (NP (QP ...`); twice that bounds the search without cutting any real tree.
MAX_OPEN_RUN = 12


def _is_open(piece: str) -> bool:
    p = piece.lstrip(WORD_MARK)
    return len(p) > 1 and p[0] == OPEN


def _is_close(piece: str) -> bool:
    p = piece.lstrip(WORD_MARK)
    return len(p) > 1 and p[0] == CLOSE


class _TreeStepper:
    """A stepper that masks another's scores to the tokens `TreeConstraint` allows.

    State per row: `pos`, the next source piece to copy; `depth`, the open constituents;
    `labels` and `starts`, each open constituent's label index and `pos` when it opened
    (innermost at depth - 1); `opens`, opening brackets since the last word piece.
    """

    def __init__(self, rule: TreeConstraint, inner, src: torch.Tensor, src_mask: torch.Tensor):
        self.inner = inner
        device = src.device
        for name in ("open_label", "close_label", "close_id", "open_ids", "word_start", "is_piece"):
            setattr(self, name, getattr(rule, name).to(device))
        self.src = src  # (R, S): the row's source pieces, EOS and padding after them
        self.n = src_mask.sum(1) - 1  # (R,) pieces before EOS
        R = src.size(0)
        zeros = torch.zeros(R, dtype=torch.long, device=device)
        self.pos, self.depth, self.opens = zeros, zeros.clone(), zeros.clone()
        self.labels = torch.zeros(R, 16, dtype=torch.long, device=device)
        self.starts = torch.zeros_like(self.labels)

    def _advance(self, tokens: torch.Tensor) -> None:
        """Update the state with the token each row just emitted (BOS: nothing)."""
        opening = self.open_label[tokens]
        rows = (opening >= 0).nonzero().squeeze(1)
        if rows.numel():
            if int(self.depth.max()) >= self.labels.size(1):
                self.labels = torch.cat([self.labels, torch.zeros_like(self.labels)], 1)
                self.starts = torch.cat([self.starts, torch.zeros_like(self.starts)], 1)
            self.labels[rows, self.depth[rows]] = opening[rows]
            self.starts[rows, self.depth[rows]] = self.pos[rows]
            self.depth[rows] += 1
        self.depth -= (self.close_label[tokens] >= 0).long()
        piece = self.is_piece[tokens]
        self.pos += piece.long()
        self.opens = torch.where(piece, 0, self.opens + (opening >= 0).long())

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        self._advance(tokens)
        scores = self.inner.step(tokens)
        R, V = scores.shape
        rows = torch.arange(R, device=scores.device)
        remaining = self.pos < self.n
        inside = self.depth > 0
        next_piece = self.src[rows, self.pos.clamp(max=self.src.size(1) - 1)]
        boundary = ~remaining | self.word_start[next_piece]
        allowed = torch.zeros(R, V, dtype=torch.bool, device=scores.device)
        copy = (remaining & inside).nonzero().squeeze(1)
        allowed[copy, next_piece[copy]] = True
        opens = (remaining & boundary & (self.opens < MAX_OPEN_RUN)).nonzero().squeeze(1)
        allowed[opens[:, None], self.open_ids[None, :]] = True
        innermost = (self.depth - 1).clamp(min=0)[:, None]
        has_word = self.pos > self.starts.gather(1, innermost).squeeze(1)
        closable = boundary & inside & has_word & ((self.depth > 1) | ~remaining)
        close = closable.nonzero().squeeze(1)
        top = self.labels[close, self.depth[close] - 1]
        allowed[close, self.close_id[top]] = True
        allowed[:, EOS_ID] = ~remaining & ~inside
        return scores.masked_fill(~allowed, NEG_INF)

    def reorder(self, index: torch.Tensor, same_sentences: bool = False) -> None:
        self.inner.reorder(index, same_sentences)
        for name in ("src", "n", "pos", "depth", "opens", "labels", "starts"):
            setattr(self, name, getattr(self, name).index_select(0, index))
