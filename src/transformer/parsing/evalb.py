"""§6.3 labelled bracket scores exactly as EVALB (Sekine & Collins, 1997) with COLLINS.prm.

This follows `evalb.c` step by step, with the parameters of COLLINS.prm:

    LABELED 1, CUTOFF_LEN 40
    DELETE_LABEL TOP, -NONE-, `,`, `:`, ``` `` ```, `''`, `.`
    DELETE_LABEL_FOR_LENGTH -NONE-
    EQ_LABEL ADVP PRT

For each sentence pair, in each tree separately:
  1. Terminals (preterminal + word) whose POS tag is a DELETE_LABEL are removed: punctuation
     words are dropped *before* spans are computed, by each tree's own tags. The sentence
     length used for the `len<=40` scores counts every word except -NONE- (punctuation counts).
  2. Every other node is a bracket (start, end) over the remaining word positions. A bracket
     whose span is empty (only deleted words below it) is not counted. Labels are cut at the
     first `-` or `=` (`NP-SBJ-1` -> `NP`); a bracket whose label is then a DELETE_LABEL is not
     counted. So the root bracket `TOP` is never counted, but the `S` under it is. (A root with
     an empty label, `( (S ...))`, would be counted by EVALB; the readers here always write TOP.)
  3. If the test tree has no words the sentence is *skipped*; if the two trees have different
     numbers of words, or different words, the sentence is an *error*. Neither adds to the
     bracket totals (they still count in "Number of sentence").
  4. Matched brackets: a gold bracket matches an unmatched test bracket with the same span and
     an equal label, ADVP and PRT being equal. This greedy pass equals the size of the multiset
     intersection of (start, end, label) because label equality with ADVP = PRT is an
     equivalence relation.
  5. Crossing: test brackets that cross at least one gold bracket. Tagging accuracy compares
     the remaining terminals' tags.

Corpus scores are micro-averaged: recall = matched / gold brackets, precision = matched / test
brackets, F1 = 2PR / (P + R), over valid sentences; exact match ("complete match") is the share of
valid sentences with gold = test = matched bracket counts. `len<=40` restricts all of this to
sentences of at most 40 words (step 1). Not reproduced: EVALB's fixed-size buffers (200 words or
brackets per sentence) and its stop after MAX_ERROR (10) errors; here errors are only counted.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from transformer.parsing.trees import Tree

logger = logging.getLogger(__name__)

DELETE_LABELS = frozenset({"TOP", "-NONE-", ",", ":", "``", "''", "."})
DELETE_LABELS_FOR_LENGTH = frozenset({"-NONE-"})
EQUIVALENT_LABELS = {"PRT": "ADVP"}  # EQ_LABEL ADVP PRT: map both to one representative
CUTOFF_LEN = 40

OK, ERROR, SKIP = "ok", "error", "skip"


@dataclass(frozen=True)
class SentenceScore:
    """EVALB's counts for one sentence pair (one line of its per-sentence table)."""

    status: str  # OK, ERROR (length or words differ) or SKIP (empty test tree)
    length: int  # gold words except -NONE-, for the len<=CUTOFF_LEN scores
    matched: int = 0
    gold: int = 0  # counted gold brackets
    test: int = 0  # counted test brackets
    crossing: int = 0
    words: int = 0  # words after deleting punctuation
    correct_tags: int = 0

    @property
    def recall(self) -> float:
        return self.matched / self.gold if self.gold else 0.0

    @property
    def precision(self) -> float:
        return self.matched / self.test if self.test else 0.0

    @property
    def f1(self) -> float:
        return _f1(self.precision, self.recall)

    @property
    def exact_match(self) -> bool:
        return self.status == OK and self.gold == self.test == self.matched


def _f1(precision: float, recall: float) -> float:
    return 2 * precision * recall / (precision + recall) if precision + recall else 0.0


def _label(label: str) -> str:
    """evalb.c `modify_label`: cut at the first '-' or '='; then apply EQ_LABEL."""
    for i, char in enumerate(label):
        if char in "-=":
            label = label[:i]
            break
    return EQUIVALENT_LABELS.get(label, label)


def _read(tree: Tree) -> tuple[list[tuple[str, str]], list[tuple[int, int, str]], int]:
    """evalb.c `read_line` + `massage_data`: kept (word, tag)s, counted brackets, length."""
    terminals: list[tuple[str, str]] = []
    brackets: list[tuple[int, int, str]] = []
    length = 0

    # Depth first with an explicit stack (a repaired model output may nest deeper than the
    # recursion limit); a constituent's bracket is added after its children, as evalb.c does.
    stack: list[tuple[Tree, int | None]] = [(tree, None)]
    while stack:
        node, start = stack.pop()
        if node.is_preterminal:
            length += node.label not in DELETE_LABELS_FOR_LENGTH
            if node.label not in DELETE_LABELS:
                terminals.append((node.word, node.label))
        elif start is None:  # entering: come back after the children
            stack.append((node, len(terminals)))
            stack.extend((child, None) for child in reversed(node.children))
        else:  # leaving
            label = _label(node.label)
            if len(terminals) > start and label not in DELETE_LABELS:
                brackets.append((start, len(terminals), label))
    return terminals, brackets, length


def _crosses(a: tuple[int, int, str], b: tuple[int, int, str]) -> bool:
    return (a[0] < b[0] < a[1] < b[1]) or (b[0] < a[0] < b[1] < a[1])


def score_sentence(gold: Tree, test: Tree) -> SentenceScore:
    """EVALB's counts for one gold/test tree pair (see the module docstring)."""
    gold_terms, gold_brackets, length = _read(gold)
    test_terms, test_brackets, _ = _read(test)
    if not test_terms:
        return SentenceScore(SKIP, length)
    if len(gold_terms) != len(test_terms):
        logger.warning("length unmatch (%d|%d)", len(gold_terms), len(test_terms))
        return SentenceScore(ERROR, length)
    for (gold_word, _), (test_word, _) in zip(gold_terms, test_terms, strict=True):
        if gold_word != test_word:
            logger.warning("words unmatch (%s|%s)", gold_word, test_word)
            return SentenceScore(ERROR, length)
    matched = sum((Counter(gold_brackets) & Counter(test_brackets)).values())
    crossing = sum(any(_crosses(g, t) for g in gold_brackets) for t in test_brackets)
    correct_tags = sum(
        _label_equal(g_tag, t_tag)
        for (_, g_tag), (_, t_tag) in zip(gold_terms, test_terms, strict=True)
    )
    return SentenceScore(
        OK,
        length,
        matched=matched,
        gold=len(gold_brackets),
        test=len(test_brackets),
        crossing=crossing,
        words=len(gold_terms),
        correct_tags=correct_tags,
    )


def _label_equal(a: str, b: str) -> bool:
    """evalb.c `label_comp` on POS tags: equal, or an EQ_LABEL pair."""
    return EQUIVALENT_LABELS.get(a, a) == EQUIVALENT_LABELS.get(b, b)


def summarize(scores: Sequence[SentenceScore]) -> dict:
    """EVALB's summary block for a list of sentence scores (percentages, as EVALB prints)."""
    valid = [s for s in scores if s.status == OK]
    matched = sum(s.matched for s in valid)
    gold = sum(s.gold for s in valid)
    test = sum(s.test for s in valid)
    words = sum(s.words for s in valid)
    recall = 100.0 * matched / gold if gold else 0.0
    precision = 100.0 * matched / test if test else 0.0
    n_valid = len(valid)
    return {
        "sentences": len(scores),
        "error_sentences": sum(s.status == ERROR for s in scores),
        "skip_sentences": sum(s.status == SKIP for s in scores),
        "valid_sentences": n_valid,
        "recall": recall,
        "precision": precision,
        "f1": _f1(precision, recall),
        "exact_match": 100.0 * sum(s.exact_match for s in valid) / n_valid if n_valid else 0.0,
        "average_crossing": sum(s.crossing for s in valid) / n_valid if n_valid else 0.0,
        "tagging_accuracy": 100.0 * sum(s.correct_tags for s in valid) / words if words else 0.0,
        "matched": matched,
        "gold_brackets": gold,
        "test_brackets": test,
    }


def evaluate_parses(
    gold_trees: Sequence[Tree], pred_trees: Sequence[Tree], *, cutoff_len: int = CUTOFF_LEN
) -> dict:
    """Corpus EVALB scores (COLLINS.prm) of predicted trees against gold trees.

    Args:
        gold_trees: reference trees.
        pred_trees: predicted trees, one per gold tree, same words.
        cutoff_len: the length limit of the second block of scores (EVALB's CUTOFF_LEN).

    Returns:
        `summarize` of all sentences (recall, precision, f1, exact_match in percent, counts),
        with the same for sentences of at most `cutoff_len` words under key "len<=40" (the
        number is `cutoff_len`), and the per-sentence `SentenceScore`s under "sentence_scores".
    """
    if len(gold_trees) != len(pred_trees):
        raise ValueError(f"{len(pred_trees)} predicted trees for {len(gold_trees)} gold trees")
    scores = [score_sentence(g, p) for g, p in zip(gold_trees, pred_trees, strict=True)]
    result = summarize(scores)
    result[f"len<={cutoff_len}"] = summarize([s for s in scores if s.length <= cutoff_len])
    result["sentence_scores"] = scores
    return result
