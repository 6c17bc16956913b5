from __future__ import annotations

import pytest

from transformer.parsing.trees import (
    Tree,
    TreeFormatError,
    clean_tree,
    delinearize,
    linearize,
    parse_tree,
    parse_trees,
    read_trees,
    strip_function_tags,
    trees_from_predictions,
    write_trees,
)

# Figure 2 of Vinyals & Kaiser et al. (2015), "Grammar as a foreign language".
JOHN = "(TOP (S (NP (NNP John)) (VP (VBZ has) (NP (DT a) (NN dog))) (. .)))"
JOHN_WORDS = ["John", "has", "a", "dog", "."]
JOHN_XX = "(S (NP XX )NP (VP XX (NP XX XX )NP )VP XX )S".split()

MRG = """\
( (S
    (NP-SBJ-1 (NNP Mr.) (NNP Vinken) )
    (VP (VBZ is)
      (NP-PRD (NN chairman) ))
    (. .) ))
((S (NP-SBJ (-NONE- *-1) )
    (VP (VBD left) )))
"""


# --- reading -----------------------------------------------------------------------------------


def test_parse_one_line_tree_and_print_it_back():
    tree = parse_tree(JOHN)
    assert str(tree) == JOHN
    assert tree.leaves() == JOHN_WORDS
    assert tree.pos() == ["NNP", "VBZ", "DT", "NN", "."]


def test_parse_mrg_multiline_with_empty_root_label():
    trees = parse_trees(MRG)
    assert [str(t) for t in trees] == [
        "(TOP (S (NP (NNP Mr.) (NNP Vinken)) (VP (VBZ is) (NP (NN chairman))) (. .)))",
        "(TOP (S (VP (VBD left))))",  # the -NONE- subject and its empty NP are gone
    ]


def test_parse_without_cleaning_keeps_everything_but_names_the_root_top():
    trees = parse_trees(MRG, clean=False)
    assert trees[1].label == "TOP"
    assert str(trees[1]) == "(TOP (S (NP-SBJ (-NONE- *-1)) (VP (VBD left))))"


def test_a_tree_without_root_wrapper_gets_top():
    assert str(parse_tree("(S (NP (PRP It)) (VP (VBZ works)))")) == (
        "(TOP (S (NP (PRP It)) (VP (VBZ works))))"
    )


@pytest.mark.parametrize(
    ("label", "expected"),
    [
        ("NP-SBJ-1", "NP"),
        ("PP-LOC=2", "PP"),
        ("NP=3", "NP"),
        ("S-TPC-1", "S"),
        ("ADVP|PRT", "ADVP"),
        ("-LRB-", "-LRB-"),
        ("-RRB-", "-RRB-"),
        ("-NONE-", "-NONE-"),
        ("PRP$", "PRP$"),
        ("WHNP", "WHNP"),
    ],
)
def test_strip_function_tags(label, expected):
    assert strip_function_tags(label) == expected


def test_clean_removes_none_and_every_constituent_left_empty():
    tree = parse_tree(
        "( (S (S-ADV (NP-SBJ (-NONE- *-2)) (VP (-NONE- *T*-1))) (NP-SBJ-2 (PRP We))"
        " (VP (VBD won) (SBAR (-NONE- 0) (S (-NONE- *T*-3)))) (. .)))",
        clean=False,
    )
    assert str(clean_tree(tree)) == "(TOP (S (NP (PRP We)) (VP (VBD won)) (. .)))"
    assert str(clean_tree(tree)) == str(parse_tree(str(tree)))


def test_clean_keeps_bracket_pos_tags():
    tree = parse_tree("( (PRN (-LRB- -LRB-) (NP-1 (NNP D.)) (-RRB- -RRB-)))")
    assert str(tree) == "(TOP (PRN (-LRB- -LRB-) (NP (NNP D.)) (-RRB- -RRB-)))"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("( (S (NP (NN a))\n( (S (NN b)))\n", "tree 1 (line 1): unbalanced"),
        ("(S (NN a))\n(S (NN b)\n", "tree 2 (line 2): unbalanced brackets: the tree is not closed"),
        ("(S (NN a)))\n", "after tree 1: unbalanced brackets: ')'"),
        ("(S (NN a))\n(S ())\n", "tree 2 (line 2): empty brackets"),
        ("(S (NN a))\n\n( )\n", "tree 2 (line 3): empty brackets at line 3"),
        ("(S (NN a))\n(S (NP ))\n", "tree 2 (line 2): empty brackets"),
        ("(S (NN a))\nhello (S (NN b))\n", "after tree 1: text 'hello' outside brackets"),
        ("(S (NP Pierre Vinken))\n", "tree 1 (line 1): (NP has more than one word"),
        ("(S (NP word (NN x)))\n", "has both a word and subtrees"),
        ("(S (NP (NN x) word))\n", "has both subtrees and the word 'word'"),
        ("\n\n", "no trees found"),
        ("(S (NN a))\n( (S (NP-SBJ (-NONE- *))))\n", "tree 2 (line 2): no words left"),
        ("( (S (NP (NN a))\n(NN b)\n", "tree 1 (line 1): unbalanced brackets: the tree is not"),
        ("(S (NN a)\n", "tree 1 (line 1): unbalanced brackets: the tree is not closed at the end"),
    ],
)
def test_malformed_input_names_file_tree_and_line(tmp_path, text, message):
    path = tmp_path / "bad.mrg"
    path.write_text(text)
    with pytest.raises(TreeFormatError) as error:
        read_trees(path)
    assert str(path) in str(error.value)
    assert message in str(error.value)


def test_a_preterminal_reads_the_same_in_one_token_or_spread_out():
    """ "(TAG word)" is read in one step, any other spelling token by token: the same trees."""
    compact = "( (S (NP-SBJ (NNP John) (-NONE- *T*-1)) (VP (VBZ runs)) (. .)) )\n"
    spread = "( (S (NP-SBJ ( NNP John ) (-NONE-\n*T*-1)) (VP (VBZ\truns ) ) (. .)) )\n"
    for clean in (True, False):
        assert str(parse_tree(compact, clean=clean)) == str(parse_tree(spread, clean=clean))
    assert str(parse_tree(compact)) == "(TOP (S (NP (NNP John)) (VP (VBZ runs)) (. .)))"


def test_a_tree_deeper_than_the_recursion_limit_reads_and_prints_back():
    """The reader cleaned each tree recursively: 5,000 nested constituents were a bare
    RecursionError; now the nodes are cleaned as they close, without recursion."""
    deep = "(S " * 5000 + "(NN a) (-NONE- *)" + ")" * 5000
    (tree,) = parse_trees(deep)
    assert tree.leaves() == ["a"]
    assert str(tree) == "(TOP " + "(S " * 5000 + "(NN a)" + ")" * 5001
    assert linearize(tree) == ["(S"] * 5000 + ["XX"] + [")S"] * 5000  # prepare ptb's next step


def test_reading_pauses_the_cycle_collector_and_leaves_it_as_it_was():
    import gc

    text = "(S (NP (NN a)) (VP (VBZ b)))\n" * 3
    assert gc.isenabled()
    assert len(parse_trees(text)) == 3 and gc.isenabled()
    gc.disable()
    try:
        assert len(parse_trees(text)) == 3 and not gc.isenabled()
    finally:
        gc.enable()
    with pytest.raises(TreeFormatError):
        parse_trees("(S (NN a)\n")
    assert gc.isenabled()


def test_write_and_read_back(tmp_path):
    trees = parse_trees(MRG)
    path = tmp_path / "out.trees"
    assert write_trees(trees, path) == 2
    assert [str(t) for t in read_trees(path)] == [str(t) for t in trees]


# --- linearization -----------------------------------------------------------------------------


def test_linearize_as_grammar_as_a_foreign_language():
    tree = parse_tree(JOHN)
    assert linearize(tree) == JOHN_XX
    # With POS tags kept this is exactly Figure 2 of the GAF paper.
    assert linearize(tree, leaves="pos") == (
        "(S (NP NNP )NP (VP VBZ (NP DT NN )NP )VP . )S".split()
    )


def test_linearize_keeps_unary_chains():
    tree = parse_tree("(TOP (S (VP (VB Go))))")
    assert linearize(tree) == ["(S", "(VP", "XX", ")VP", ")S"]


def test_delinearize_inverts_linearize():
    tree = parse_tree(JOHN)
    assert str(delinearize(JOHN_XX, JOHN_WORDS, tree.pos())) == JOHN
    assert str(delinearize(linearize(tree, leaves="pos"), JOHN_WORDS)) == JOHN
    assert str(delinearize(JOHN_XX, JOHN_WORDS)) == (
        "(TOP (S (NP (XX John)) (VP (XX has) (NP (XX a) (XX dog))) (XX .)))"
    )


def _bare(tree: Tree) -> str:
    """The bracketing with words in place of preterminals: `(TOP (S (NP John) ...))`."""
    if tree.is_preterminal:
        return tree.word
    return f"({tree.label} {' '.join(_bare(child) for child in tree.children)})"


def _repair(line: str, words: list[str] = JOHN_WORDS) -> str:
    tree = delinearize(line.split(), words)
    assert tree.leaves() == words
    assert set(tree.pos()) == {"XX"}
    return _bare(tree)


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        # too few leaves: the missing words go to the innermost open constituent
        ("(S (NP XX )NP (VP XX (NP XX", "(TOP (S (NP John) (VP has (NP a dog .))))"),
        # too few leaves, all closed: they go to the last top-level constituent
        ("(S (NP XX )NP (VP XX )VP )S", "(TOP (S (NP John) (VP has) a dog .))"),
        # too many leaves are dropped
        (
            "(S (NP XX XX XX )NP (VP XX XX XX )VP XX )S",
            "(TOP (S (NP John has a) (VP dog .)))",
        ),
        # unclosed brackets are closed at the end
        ("(S (NP XX )NP (VP XX (NP XX XX )NP XX", "(TOP (S (NP John) (VP has (NP a dog) .)))"),
        # stray closing brackets are dropped
        (")S (S (NP XX )NP )NP )VP XX XX XX XX", "(TOP (S (NP John)) has a dog .)"),
        # a mismatched closing label closes the innermost constituent; the opening label wins
        (
            "(S (NP XX )VP (VP XX (NP XX XX )S )S XX )S",
            "(TOP (S (NP John) (VP has (NP a dog)) .))",
        ),
        # constituents without words are removed, also nested ones
        (
            "(S (ADVP )ADVP (NP XX )NP (VP (PP (NP )NP )PP XX (NP XX XX )NP )VP XX )S",
            "(TOP (S (NP John) (VP has (NP a dog)) .))",
        ),
        # a bare "(" opens an X constituent, a bare ")" closes
        ("(S ( XX ) (VP XX XX XX )VP XX )S", "(TOP (S (X John) (VP has a dog) .))"),
        # nothing at all: a flat tree
        ("", "(TOP John has a dog .)"),
        # only brackets: the words go into the last constituent
        ("(S )S (FRAG )FRAG", "(TOP (FRAG John has a dog .))"),
    ],
)
def test_delinearize_repairs_ill_formed_output(line, expected):
    assert _repair(line) == expected


def test_linearize_with_words_as_leaves_inverts():
    tree = parse_tree(JOHN)
    tokens = linearize(tree, leaves="words")
    assert " ".join(tokens) == "(S (NP John )NP (VP has (NP a dog )NP )VP . )S"
    assert str(delinearize(tokens, JOHN_WORDS, tree.pos(), leaves="words")) == JOHN


def _repair_words(line: str, words: list[str] = JOHN_WORDS) -> str:
    tree = delinearize(line.split(), words, leaves="words")
    assert tree.leaves() == words
    return _bare(tree)


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        # a skipped word goes where the output goes on: into the constituent open at the next
        # aligned word (here the NP), not to the end as a count of XX would put it
        (
            "(S (NP John )NP (VP has (NP dog )NP )VP . )S",
            "(TOP (S (NP John) (VP has (NP a dog)) .))",
        ),
        # a repeated word is dropped, the rest stays in place
        (
            "(S (NP John )NP (VP has has (NP a dog )NP )VP . )S",
            "(TOP (S (NP John) (VP has (NP a dog)) .))",
        ),
        # a misspelled word between two aligned ones stands for the sentence's word
        (
            "(S (NP Jon )NP (VP has (NP a dog )NP )VP . )S",
            "(TOP (S (NP John) (VP has (NP a dog)) .))",
        ),
        # an extra word that is not in the sentence is dropped
        (
            "(S (NP John )NP (VP has (NP a big dog )NP )VP . )S",
            "(TOP (S (NP John) (VP has (NP a dog)) .))",
        ),
        # the words missing at the end go to the innermost open constituent, as with XX
        ("(S (NP John )NP (VP has (NP a", "(TOP (S (NP John) (VP has (NP a dog .))))"),
        # out of order: the longest matching run is kept, the rest attached at the end
        ("(S (NP dog )NP (VP John has a )VP )S", "(TOP (S (VP John has a) dog .))"),
    ],
)
def test_delinearize_aligns_output_words_to_the_sentence(line, expected):
    assert _repair_words(line) == expected


def test_delinearize_rejects_an_unknown_leaf_mode():
    with pytest.raises(ValueError, match="leaves must be one of xx, pos, words"):
        delinearize(["XX"], ["Go"], leaves="tags")


def test_delinearize_uses_given_pos_even_for_repaired_words():
    tree = delinearize(["(S", "XX"], ["Go", "!"], pos=["VB", "."])
    assert str(tree) == "(TOP (S (VB Go) (. !)))"


def test_delinearize_rejects_pos_of_wrong_length():
    with pytest.raises(ValueError, match="2 POS tags for 1 words"):
        delinearize(["XX"], ["Go"], pos=["VB", "."])


def test_trees_from_predictions():
    lines = [" ".join(JOHN_XX), "(S XX"]
    trees = trees_from_predictions(lines, [JOHN_WORDS, ["Hi", "!"]])
    assert [_bare(t) for t in trees] == [
        "(TOP (S (NP John) (VP has (NP a dog)) .))",
        "(TOP (S Hi !))",
    ]
    tagged = trees_from_predictions(
        lines, [JOHN_WORDS, ["Hi", "!"]], [parse_tree(JOHN).pos(), ["UH", "."]]
    )
    assert [str(t) for t in tagged] == [JOHN, "(TOP (S (UH Hi) (. !)))"]
    with pytest.raises(ValueError, match="1 predictions for 2 sentences"):
        trees_from_predictions(["(S XX )S"], [["a"], ["b"]])


def test_tree_leaves_of_hand_built_tree():
    tree = Tree("TOP", [Tree("S", [Tree("NN", word="a"), Tree("VP", [Tree("VB", word="b")])])])
    assert tree.leaves() == ["a", "b"]
    assert str(tree) == "(TOP (S (NN a) (VP (VB b))))"


# --- real trees ---------------------------------------------------------------------------------


def test_deeply_nested_output_is_repaired_and_printed_without_recursion_errors():
    # A garbage output that opens 5,000 constituents: far deeper than Python's recursion limit.
    tokens = ["(NP"] * 5000 + ["XX", "(VP", ")VP"]
    tree = delinearize(tokens, ["a", "b"])
    text = str(tree)
    assert text.startswith("(TOP (NP (NP") and text.endswith("(XX a) (XX b)" + ")" * 5001)
    assert text.count("(NP") == 5000 and "(VP" not in text  # the empty VP removed
    from transformer.parsing.evalb import evaluate_parses

    scores = evaluate_parses([parse_tree("(TOP (NP (DT a) (NN b)))")], [tree])
    assert scores["recall"] == 100.0 and scores["precision"] == pytest.approx(100 / 5000)
