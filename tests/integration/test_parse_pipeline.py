"""§6.3 end to end on the real treebank data: `prepare ptb`, a few training steps of a tiny
model, `average` (or none: `parse` reads the run directory), then `parse` (plain sentences and
`--eval` on dev trees with EVALB)."""

from __future__ import annotations

import json

import pytest

from fixtures import run_cli
from transformer.parsing.trees import read_trees

pytestmark = pytest.mark.integration


@pytest.mark.parametrize("leaves", ["xx", "words"])
def test_prepare_train_average_parse(shared_data, tmp_path, leaves):
    if not (shared_data / "ptb_sample").is_dir() or not (shared_data / "ptb_wsj").is_dir():
        pytest.skip("treebank data not found")
    data = tmp_path / "ptb"
    res = run_cli(
        "prepare", "ptb", "--from", str(shared_data), "--out", str(data), "--leaves", leaves
    )  # fmt: skip
    assert res.returncode == 0, res.stderr.decode()
    manifest = json.loads((data / "manifest.json").read_text())
    # Sentence counts of the split in parsing_data (NLTK sample files 0001-0169 / 0170-0199,
    # and section 22's 1,700 trees); no training pair is filtered.
    assert {k: v["pairs"] for k, v in manifest["splits"].items()} == {
        "train": 3501,
        "valid": 413,
        "test": 1700,
    }
    assert manifest["tgt_lang"] == {"xx": "tree", "words": "tree_words"}[leaves]
    assert len(manifest["settings"]["user_symbols"]) > 40  # the tree symbols, kept whole
    assert len(read_trees(data / "valid.trees")) == 413

    run = tmp_path / "run"
    res = run_cli("train", str(data), "--preset", "tiny", "--out", str(run), "--max-steps", "4",
               "--device", "cpu", "train.max_tokens=800", "train.save_every_steps=2",
               "model.max_len=1024")  # fmt: skip
    assert res.returncode == 0, res.stderr.decode()
    if leaves == "words":
        model = str(tmp_path / "model.safetensors")
        res = run_cli("average", str(run), "--last", "2", "--out", model)
        assert res.returncode == 0, res.stderr.decode()
    else:  # `parse` takes a run directory too (its latest checkpoint): the same steps follow
        model = str(run)

    gold = read_trees(data / "valid.trees")[:3]
    text = "".join(" ".join(t.leaves()) + "\n" for t in gold)
    res = run_cli("parse", model, "--beam", "2", stdin=text.encode())
    assert res.returncode == 0, res.stderr.decode()
    out = res.stdout.decode().splitlines()
    assert [t.leaves() for t in map(_one_tree, out)] == [t.leaves() for t in gold]

    res = run_cli("parse", model, "--eval", str(data), "--split", "valid", "--limit", "3",
               "--beam", "2")  # fmt: skip
    assert res.returncode == 0, res.stderr.decode()
    lines = res.stdout.decode().splitlines()
    assert lines[0].startswith("valid: 3 sentences")
    assert "EVALB all: P" in lines[1] and "errors 0" in lines[1]

    # The constrained search: words-as-leaves models only, a clear error for XX ones.
    res = run_cli("parse", model, "--beam", "2", "--constrain", stdin=text.encode())
    if leaves == "xx":
        assert res.returncode != 0
        assert "needs a model whose trees write the words" in res.stderr.decode()
    else:
        assert res.returncode == 0, res.stderr.decode()
        out = res.stdout.decode().splitlines()
        assert [t.leaves() for t in map(_one_tree, out)] == [t.leaves() for t in gold]


def _one_tree(line: str):
    from transformer.parsing.trees import parse_tree

    return parse_tree(line)
