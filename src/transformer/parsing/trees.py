"""§6.3 Penn Treebank trees: read, clean, linearize for a sequence model, and repair its output.

Trees are read from both PTB forms found here: multi-line `.mrg` files (`( (S ...) )`, an empty
root label) and one tree per line (`(TOP (S ...))`). Every tree read gets the root label `TOP`.

Cleaning is the standard preprocessing of the WSJ parsing setup: -NONE- empty elements are
removed, then every constituent left without words; function tags and indices are stripped
(`NP-SBJ-1` -> `NP`, `PP-LOC=2` -> `PP`; `-LRB-`, `-RRB-` and `-NONE-` stay intact because they
start with `-`); an uncertain label `ADVP|PRT` keeps its first alternative. Unary chains are kept.

Linearization follows "Grammar as a foreign language" (Vinyals & Kaiser et al., 2015, the
paper's reference [37]): a depth-first traversal that writes an opening token `(S` and a
closing token `)S` for every constituent, and one token per word. The POS tags are normalized to
`XX` as in that paper's final models (`leaves="pos"` writes the tag instead). The `TOP` root is
not written::

    (TOP (S (NP (NNP John)) (VP (VBZ has) (NP (DT a) (NN dog))) (. .)))
    -> (S (NP XX )NP (VP XX (NP XX XX )NP )VP XX )S

`leaves="words"` (not the paper's) writes the words themselves, `(S (NP John )NP (VP has (NP a
dog )NP )VP . )S`: the decoder then sees in its own prefix which word it has reached, and
`delinearize` aligns the output's words to the sentence's instead of counting `XX`.

`delinearize` turns any token sequence back into a tree whose leaves are exactly the sentence's
words; how it repairs ill-formed output is documented there.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import logging
import re
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from transformer.data import read_lines

logger = logging.getLogger(__name__)

ROOT_LABEL = "TOP"
NONE_LABEL = "-NONE-"
NORMALIZED_POS = "XX"  # Vinyals & Kaiser et al. (2015): every POS tag is written as XX
UNKNOWN_LABEL = "X"  # PTB's label for an unknown constituent; used for a bare "(" in output
OPEN, CLOSE = "(", ")"
LEAF_MODES = ("xx", "pos", "words")  # what a linearized tree writes for each word

# A token: "(TAG word)" whole (a preterminal, most of a treebank: the label and the word as
# groups 1 and 2) or else "(", ")" or any other text (group 3).
_TOKEN = re.compile(r"\(([^\s()]+)\s+([^\s()]+)\)|(\(|\)|[^\s()]+)")
_FUNCTION_TAG = re.compile(r"[-=|]")


class TreeFormatError(ValueError):
    """A malformed bracketed tree; the message names the file, the tree and the line."""


@dataclass
class Tree:
    """A constituency tree node.

    A preterminal has a `word` and no children (its `label` is the POS tag); every other node
    has children and no word.
    """

    label: str
    children: list[Tree] = field(default_factory=list)
    word: str | None = None

    @property
    def is_preterminal(self) -> bool:
        return self.word is not None

    def preterminals(self) -> Iterator[Tree]:
        """Yield the preterminals left to right."""
        stack = [self]
        while stack:
            node = stack.pop()
            if node.is_preterminal:
                yield node
            else:
                stack.extend(reversed(node.children))

    def leaves(self) -> list[str]:
        """The words, left to right."""
        return [node.word for node in self.preterminals()]

    def pos(self) -> list[str]:
        """The POS tags, left to right."""
        return [node.label for node in self.preterminals()]

    def __str__(self) -> str:
        """One-line PTB bracketing, e.g. `(TOP (S (NP (NNP John)) (VP (VBZ runs))))`.

        Iterative: a repaired model output may nest deeper than Python's recursion limit."""
        parts: list[str] = []
        stack: list[Tree | str] = [self]
        while stack:
            node = stack.pop()
            if isinstance(node, str):
                parts.append(node)
            elif node.is_preterminal:
                parts.append(f"({node.label} {node.word})")
            else:
                parts.append(f"({node.label} ")
                stack.append(")")
                for i, child in enumerate(reversed(node.children)):
                    stack.append(child)
                    if i < len(node.children) - 1:
                        stack.append(" ")
        return "".join(parts)


# ---------------------------------------------------------------------------------------------
# Reading


def read_trees(path: str | Path, *, clean: bool = True) -> list[Tree]:
    """Read every tree of a PTB file, in `.mrg` (multi-line) or one-tree-per-line form.

    Args:
        path: the file.
        clean: strip -NONE- elements, constituents left empty and function tags (`clean_tree`).

    Returns:
        The trees in file order, each with root label `TOP`.

    Raises:
        TreeFormatError: a malformed tree, a tree that is empty after cleaning, or a file with
            no tree; the message names the file, the tree number and its line.
    """
    path = Path(path)
    # The corpus line model (data.decode_line): "\n" ends a line, a lone "\r" is a space.
    return parse_trees("\n".join(read_lines(path)), source=str(path), clean=clean)


def parse_trees(text: str, source: str = "<string>", *, clean: bool = True) -> list[Tree]:
    """Parse every bracketed tree in `text` (see `read_trees`); `source` names it in errors."""
    trees = []
    with paused_gc():
        for number, line, tree in _parse_sexprs(text, source, clean):
            if tree is None:
                raise TreeFormatError(
                    f"{source}: tree {number} (line {line}): no words left after removing "
                    f"{NONE_LABEL} elements"
                )
            trees.append(tree)
    if not trees:
        raise TreeFormatError(f"{source}: no trees found")
    return trees


@contextlib.contextmanager
def paused_gc() -> Iterator[None]:
    """Python's cycle collector paused while trees are read: they hold no cycles, and each of
    the collections that their ~250,000 nodes would set off walks the whole heap (all of
    torch's objects in a process that imported it and did not freeze them, as the CLI does);
    with it the sample and section 22 read in ~2x the time. It runs again afterwards if it ran
    before (so the pauses nest)."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def parse_tree(text: str, source: str = "<string>", *, clean: bool = True) -> Tree:
    """Parse exactly one bracketed tree."""
    trees = parse_trees(text, source, clean=clean)
    if len(trees) != 1:
        raise TreeFormatError(f"{source}: expected one tree, found {len(trees)}")
    return trees[0]


def _parse_sexprs(text: str, source: str, clean: bool) -> Iterator[tuple[int, int, Tree | None]]:
    """Yield (tree number, first line, tree) for each top-level bracketing in `text`, its root
    labelled `TOP` and, with `clean`, cleaned as `clean_tree` does (None: no word left).

    A node on the stack is [label or None (not read yet), children, word, whether it had
    children]. A node is cleaned as it closes, so a tree is built once: a -NONE- preterminal
    and a constituent left without children are not added to their parent, which still counts
    them in the checks of its brackets. A tree starts with a "(" in column 0 in both PTB forms,
    so a "(" in column 0 inside an open tree means the previous tree was never closed; this
    keeps the error at the tree that is wrong.
    """
    stack: list[list] = []
    number, start, lineno = 0, 0, 0

    def fail(problem: str) -> TreeFormatError:
        where = f"tree {number} (line {start})" if stack else f"after tree {number}"
        return TreeFormatError(f"{source}: {where}: {problem} at line {lineno}")

    def step(token: str, column_0: bool) -> Tree | None | bool:
        """Take one token; the tree it closes (None: no word left), else False."""
        nonlocal number, start
        if token == OPEN:
            if not stack:
                number, start = number + 1, lineno
            else:
                top = stack[-1]
                if column_0:
                    raise fail("unbalanced brackets: the tree is not closed before a new one")
                if top[0] is None:
                    top[0] = ""  # "( (S ...))": the empty root label of .mrg files
                if top[2] is not None:
                    raise fail(f"({top[0]} {top[2]} has both a word and subtrees")
                top[3] = True
            stack.append([None, [], None, False])
            return False
        if token == CLOSE:
            if not stack:
                raise fail("unbalanced brackets: ')' without an open bracket")
            label, children, word, had_children = stack[-1]
            if label is None or (word is None and not had_children):
                raise fail("empty brackets")
            stack.pop()
            if not stack and label in ("", "ROOT"):
                label = ROOT_LABEL
            node = _cleaned(label, children, word) if clean else Tree(label, children, word)
            if stack:
                if node is not None:
                    stack[-1][1].append(node)
                return False
            return Tree(ROOT_LABEL, [node]) if label != ROOT_LABEL and node is not None else node
        if not stack:
            raise fail(f"text {token!r} outside brackets")
        top = stack[-1]
        if top[0] is None:
            top[0] = token
        elif top[3]:
            raise fail(f"({top[0]} ... has both subtrees and the word {token!r}")
        elif top[2] is not None:
            raise fail(f"({top[0]} has more than one word: {token!r}")
        else:
            top[2] = token
        return False

    for lineno, line in enumerate(text.split("\n"), 1):  # noqa: B007 (fail reads it)
        # text.split("\n"), not splitlines(): "\n" alone ends a line
        column_0 = line.startswith(OPEN)  # only the line's first token can start in column 0
        for tag, leaf, other in _TOKEN.findall(line):
            if tag and stack and not column_0 and stack[-1][2] is None:
                # "(TAG word)" inside a constituent, the common case: its four tokens at once
                top = stack[-1]
                if top[0] is None:
                    top[0] = ""
                top[3] = True
                node = _cleaned(tag, [], leaf) if clean else Tree(tag, [], leaf)
                if node is not None:
                    top[1].append(node)
                continue
            for token in (OPEN, tag, leaf, CLOSE) if tag else (other,):
                tree = step(token, column_0)
                column_0 = False
                if tree is not False:
                    yield number, start, tree
    if stack:
        raise fail("unbalanced brackets: the tree is not closed at the end of the file")


# ---------------------------------------------------------------------------------------------
# Cleaning


@functools.lru_cache(maxsize=4096)  # a treebank has a few hundred distinct labels
def strip_function_tags(label: str) -> str:
    """`NP-SBJ-1` -> `NP`, `PP-LOC=2` -> `PP`, `ADVP|PRT` -> `ADVP`; `-LRB-`, `-NONE-` kept."""
    if label.startswith("-"):
        return label
    return _FUNCTION_TAG.split(label, maxsplit=1)[0]


def clean_tree(tree: Tree) -> Tree | None:
    """Remove -NONE- elements and the constituents they leave empty; strip function tags.

    Returns a new tree, or None if no word is left. POS tags lose indices too (rare in the PTB).
    `read_trees` cleans the same way as it reads.
    """
    children = [c for c in map(clean_tree, tree.children) if c is not None]
    return _cleaned(tree.label, children, tree.word)


def _cleaned(label: str, children: list[Tree], word: str | None) -> Tree | None:
    """The cleaned node of `label` over its cleaned `children` (a preterminal: none, and its
    `word`): None for a -NONE- element or a constituent left without children, else the node
    with its function tags stripped. `clean_tree` and the reader both build nodes with it."""
    if word is not None:
        return None if label == NONE_LABEL else Tree(strip_function_tags(label), [], word)
    return Tree(strip_function_tags(label), children) if children else None


def write_trees(trees: Iterable[Tree], path: str | Path) -> int:
    """Write trees one per line (PTB bracketing); returns how many."""
    n = 0
    with open(path, "w", encoding="utf-8") as f:
        for tree in trees:
            f.write(f"{tree}\n")
            n += 1
    return n


# ---------------------------------------------------------------------------------------------
# Linearization (Vinyals & Kaiser et al., 2015)


def linearize(tree: Tree, *, leaves: str = "xx") -> list[str]:
    """Depth-first bracket tokens of a tree: `(S (NP XX )NP ... )S`.

    Args:
        tree: a tree; a `TOP` root is not written, its children are.
        leaves: what each word is written as: "xx" (`XX`, Vinyals & Kaiser et al.), "pos"
            (its POS tag) or "words" (the word itself).

    Returns:
        The target tokens, one per word plus two per constituent.
    """
    _check_leaves(leaves)
    tokens: list[str] = []
    # Iterative, as reading is: a closing token waits on the stack as a string.
    stack: list[Tree | str] = list(reversed(tree.children if tree.label == ROOT_LABEL else [tree]))
    while stack:
        node = stack.pop()
        if isinstance(node, str):
            tokens.append(node)
        elif node.is_preterminal:
            if leaves == "words":
                tokens.append(node.word)
            else:
                tokens.append(node.label if leaves == "pos" else NORMALIZED_POS)
        else:
            tokens.append(OPEN + node.label)
            stack.append(CLOSE + node.label)
            stack.extend(reversed(node.children))
    return tokens


def _check_leaves(leaves: str) -> None:
    if leaves not in LEAF_MODES:
        raise ValueError(f"leaves must be one of {', '.join(LEAF_MODES)}, not {leaves!r}")


def is_bracket(token: str) -> bool:
    """Whether a linearized-tree token opens or closes a constituent (`(NP`, `)NP`, `(`)."""
    return token.startswith((OPEN, CLOSE))


def delinearize(
    tokens: Sequence[str],
    words: Sequence[str],
    pos: Sequence[str] | None = None,
    *,
    leaves: str = "xx",
) -> Tree:
    """Build a tree from bracket tokens, repairing them so its leaves are exactly `words`.

    Every token that starts with "(" opens a constituent, every token that starts with ")"
    closes one, and any other token is a leaf. Which word a leaf is:
      - leaves "xx" or "pos" (the leaf is `XX` or a tag): the next word, by count; leaves
        beyond the number of words are dropped;
      - leaves "words" (the leaf is a word): the output's words are aligned to the sentence's
        (`difflib`, longest matching blocks first); a leaf paired with no word (an extra or
        repeated word) is dropped, and a sentence word the output skipped is attached where
        the output goes on, i.e. to the constituent open when the next aligned leaf comes;
        a misspelled word (one output word against one sentence word between two matches)
        stands for the sentence's word.
    Other repairs:
      - a closing token closes the innermost open constituent whatever its label (the opening
        label wins); a closing token with nothing open is dropped;
      - a bare "(" opens a constituent labelled `X` (PTB's unknown constituent);
      - words left over at the end are attached to the innermost constituent still open or,
        when all are closed, to the last top-level constituent, so the sentence keeps one
        spanning bracket;
      - constituents still open at the end are closed; constituents without words are removed.

    Args:
        tokens: model output, e.g. `["(S", "(NP", "XX", ")NP", ...]`.
        words: the sentence.
        pos: POS tags for the words; without them a leaf token is used as the tag (`XX` or the
            tag that a "pos" model predicted; `XX` for "words"), and `XX` for words attached
            by repair.
        leaves: what the model writes for a word: "xx", "pos" or "words" (`linearize`).

    Returns:
        A tree with root `TOP` and leaves `words`.
    """
    _check_leaves(leaves)
    if pos is not None and len(pos) != len(words):
        raise ValueError(f"{len(pos)} POS tags for {len(words)} words")
    root = Tree(ROOT_LABEL)
    stack = [root]
    n_leaves = 0
    leaf_tokens = [token for token in tokens if not is_bracket(token)]
    if leaves == "words":
        targets = _align_words(leaf_tokens, words)
    else:
        targets = [i if i < len(words) else None for i in range(len(leaf_tokens))]

    def add_leaf(node: Tree, tag: str) -> None:
        nonlocal n_leaves
        node.children.append(Tree(pos[n_leaves] if pos is not None else tag, word=words[n_leaves]))
        n_leaves += 1

    i_leaf = 0
    for token in tokens:
        if token.startswith(OPEN):
            node = Tree(token[1:] or UNKNOWN_LABEL)
            stack[-1].children.append(node)
            stack.append(node)
        elif token.startswith(CLOSE):
            if len(stack) > 1:
                stack.pop()
        else:
            target = targets[i_leaf]
            i_leaf += 1
            if target is None:
                continue
            while n_leaves < target:  # words the output skipped
                add_leaf(stack[-1], NORMALIZED_POS)
            add_leaf(stack[-1], NORMALIZED_POS if leaves == "words" else token)
    if n_leaves < len(words):
        last = stack[-1]
        if last is root and root.children and not root.children[-1].is_preterminal:
            last = root.children[-1]
        while n_leaves < len(words):
            add_leaf(last, NORMALIZED_POS)
    _remove_empty(root)
    assert root.leaves() == list(words), "delinearize must keep exactly the sentence's words"
    return root


def _align_words(output: Sequence[str], words: Sequence[str]) -> list[int | None]:
    """For each output word, the index of the sentence word it stands for, or None.

    The indices increase strictly: matching blocks of `difflib.SequenceMatcher` (no junk
    heuristic), plus one-for-one substitutions between them.
    """
    from difflib import SequenceMatcher

    targets: list[int | None] = [None] * len(output)
    matcher = SequenceMatcher(None, list(output), list(words), autojunk=False)
    for tag, i1, i2, j1, j2 in matcher.get_opcodes():
        if tag == "equal" or (tag == "replace" and i2 - i1 == j2 - j1):
            for k in range(i2 - i1):
                targets[i1 + k] = j1 + k
    return targets


def _remove_empty(node: Tree) -> bool:
    """Drop descendants without words; returns whether `node` has a word below it.

    Iterative (post-order): a repaired model output may nest deeper than the recursion limit."""
    order: list[Tree] = []
    stack = [node]
    while stack:
        current = stack.pop()
        order.append(current)
        stack.extend(c for c in current.children if not c.is_preterminal)
    has_word: dict[int, bool] = {}
    for current in reversed(order):  # children before their parents
        current.children = [c for c in current.children if c.is_preterminal or has_word[id(c)]]
        has_word[id(current)] = bool(current.children)
    return has_word[id(node)]


def trees_from_predictions(
    pred_lines: Sequence[str],
    sentences: Sequence[Sequence[str]],
    pos: Sequence[Sequence[str]] | None = None,
    *,
    leaves: str = "xx",
) -> list[Tree]:
    """Turn decoded lines of bracket tokens into repaired trees, one per sentence.

    Args:
        pred_lines: one line of space-separated target tokens per sentence.
        sentences: the words of each sentence.
        pos: optional POS tags per sentence. Pass the test file's tags so EVALB removes the
            same punctuation from both trees (it deletes words by each tree's own tags).
        leaves: what the model writes for a word: "xx", "pos" or "words" (`linearize`).

    Returns:
        One `TOP` tree per sentence (`delinearize`).
    """
    if len(pred_lines) != len(sentences):
        raise ValueError(f"{len(pred_lines)} predictions for {len(sentences)} sentences")
    if pos is not None and len(pos) != len(sentences):
        raise ValueError(f"{len(pos)} POS sequences for {len(sentences)} sentences")
    return [
        delinearize(line.split(), words, None if pos is None else pos[i], leaves=leaves)
        for i, (line, words) in enumerate(zip(pred_lines, sentences, strict=True))
    ]
