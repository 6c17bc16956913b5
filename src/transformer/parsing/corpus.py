"""§6.3 the parsing corpus: PTB trees -> parallel text (words -> linearized tree tokens).

The data here is smaller than the paper's (WSJ 02-21, ~40K sentences):
  - train: NLTK's 10% WSJ sample, files wsj_0001-wsj_0169 (sections 00-01, gold trees);
  - dev:   the same sample's files wsj_0170-wsj_0199, held out by file (whole articles, ~10%);
  - test:  WSJ section 22 (`22.auto.clean`, 1,700 trees), the paper's development section;
           section 23 is not available here.

For each split, `write_parsing_corpus` writes
  `{split}.src`   the words, space-separated, as tokenized in the treebank (`-LRB-` etc. kept);
  `{split}.tgt`   the linearized tree (`trees.linearize`), space-separated;
  `{split}.trees` the cleaned gold trees, one per line, for EVALB and for their POS tags;
and `tgt_symbols.txt`, the target-side symbols (one per line, most frequent first: the brackets,
and `XX` or the POS tags unless the leaves are the words themselves). Every
bracket token must stay one symbol: the target side needs a word-level vocabulary, or these
symbols as sentencepiece `user_defined_symbols`.

`prepare_parsing` (`transformer prepare ptb --from DATA_ROOT --out DIR`) writes that corpus to
`DIR.text/`, then prepares it like any custom corpus (train / valid = dev / test) with the
symbols kept whole in one joint vocabulary, and copies the gold trees to `DIR/{split}.trees`.
"""

from __future__ import annotations

import logging
import re
import shutil
from collections import Counter
from pathlib import Path

from transformer.parsing.trees import (
    LEAF_MODES,
    Tree,
    is_bracket,
    linearize,
    paused_gc,
    read_trees,
    write_trees,
)

logger = logging.getLogger(__name__)

PTB_SAMPLE_DIR = Path("ptb_sample") / "combined"  # under the shared data root
WSJ22_PATH = Path("ptb_wsj") / "22.auto.clean"
DEV_FIRST_FILE = 170  # wsj_0170 .. wsj_0199 are the dev split
SPLITS = ("train", "dev", "test")
PREPARED_SPLITS = {"train": "train", "dev": "valid", "test": "test"}  # ours -> prepare.py's
SRC_LANG, TGT_LANG = "en", "tree"
# The target "language" names what the trees write for each word, so that a model file (which
# stores its language pair) tells `transformer parse` how to read its output.
TGT_LANGS = {"xx": TGT_LANG, "pos": "tree_pos", "words": "tree_words"}
# Not the paper's 16K (WSJ only, ~40K sentences): ~3.5K training sentences here (11.2K word
# types) share a smaller joint vocabulary, so rare words in section 22 still split into known
# pieces.
PARSING_VOCAB_SIZE = 4000
PARSING_MAX_LEN = 1024  # keep every training tree (the longest is ~600 tokens); = model max_len
PARSING_MAX_RATIO = 100.0  # a tree is ~4x its sentence; the length-ratio filter is for MT

_MRG_NAME = re.compile(r"wsj_(\d{4})\.mrg")


def split_sample_files(sample_dir: str | Path) -> tuple[list[Path], list[Path]]:
    """The NLTK sample's `.mrg` files, split by file number into (train, dev).

    Raises:
        FileNotFoundError: `sample_dir` holds no `wsj_NNNN.mrg` file.
    """
    files = sorted(p for p in Path(sample_dir).iterdir() if _MRG_NAME.fullmatch(p.name))
    if not files:
        raise FileNotFoundError(f"{sample_dir}: no wsj_NNNN.mrg files")
    train = [p for p in files if int(_MRG_NAME.fullmatch(p.name).group(1)) < DEV_FIRST_FILE]
    dev = [p for p in files if int(_MRG_NAME.fullmatch(p.name).group(1)) >= DEV_FIRST_FILE]
    return train, dev


def load_parsing_splits(data_root: str | Path) -> dict[str, list[Tree]]:
    """Cleaned trees of the train, dev and test splits (see the module docstring)."""
    data_root = Path(data_root)
    train_files, dev_files = split_sample_files(data_root / PTB_SAMPLE_DIR)
    with paused_gc():  # one pause for the ~200 files, not one each (trees.paused_gc)
        return {
            "train": [tree for path in train_files for tree in read_trees(path)],
            "dev": [tree for path in dev_files for tree in read_trees(path)],
            "test": read_trees(data_root / WSJ22_PATH),
        }


def write_parsing_corpus(out_dir: str | Path, data_root: str | Path, *, leaves: str = "xx") -> dict:
    """Write the parallel parsing corpus (words -> linearized trees) for all splits.

    Args:
        out_dir: output directory, created if missing.
        data_root: the shared data directory holding `ptb_sample/` and `ptb_wsj/`.
        leaves: what the targets write for each word: "xx" (the paper's [37]), "pos" (the
            POS tag) or "words" (the word itself; `trees.linearize`).

    Returns:
        {split: {"src", "tgt", "trees": paths, "sentences": count, "max_src_len",
        "max_tgt_len": token counts}} and "tgt_symbols": the path of the symbol list.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    symbols: Counter[str] = Counter()
    result: dict = {}
    for split, trees in load_parsing_splits(data_root).items():
        paths = {kind: out_dir / f"{split}.{kind}" for kind in ("src", "tgt", "trees")}
        max_src = max_tgt = 0
        with (
            open(paths["src"], "w", encoding="utf-8") as src,
            open(paths["tgt"], "w", encoding="utf-8") as tgt,
        ):
            for tree in trees:
                words, tokens = tree.leaves(), linearize(tree, leaves=leaves)
                src.write(" ".join(words) + "\n")
                tgt.write(" ".join(tokens) + "\n")
                max_src, max_tgt = max(max_src, len(words)), max(max_tgt, len(tokens))
                if split == "train":
                    symbols.update(t for t in tokens if leaves != "words" or is_bracket(t))
        write_trees(trees, paths["trees"])
        result[split] = {
            **{kind: str(path) for kind, path in paths.items()},
            "sentences": len(trees),
            "max_src_len": max_src,
            "max_tgt_len": max_tgt,
        }
        logger.info("%s: %d sentences -> %s", split, len(trees), paths["tgt"])
    symbols_path = out_dir / "tgt_symbols.txt"
    symbols_path.write_text("".join(f"{s}\n" for s, _ in symbols.most_common()), encoding="utf-8")
    result["tgt_symbols"] = str(symbols_path)
    return result


def prepare_parsing(
    out_dir: str | Path,
    data_root: str | Path | None,
    *,
    vocab_size: int | None = None,
    leaves: str = "xx",
    force: bool = False,
):
    """§6.3 `transformer prepare ptb`: the parsing corpus as a prepared-data directory.

    Args:
        out_dir: the prepared-data directory; the parallel text goes to `{out_dir}.text/`.
        data_root: the shared data directory holding `ptb_sample/` and `ptb_wsj/`.
        vocab_size: joint sentencepiece vocabulary (default PARSING_VOCAB_SIZE).
        leaves: "xx" (the paper's [37]), "pos" or "words": what the trees write for each word;
            the target language is then "tree", "tree_pos" or "tree_words" (TGT_LANGS).
        force: rebuild `out_dir` even if it was prepared from other inputs.

    Returns:
        The prepare.Manifest; `out_dir` also holds `{train,valid,test}.trees`.
    """
    from transformer.data import DataError
    from transformer.prepare import CUSTOM, prepare_corpus

    if data_root is None:
        raise DataError("prepare ptb", "needs --from DATA_ROOT (holding ptb_sample/, ptb_wsj/)")
    if leaves not in LEAF_MODES:
        raise DataError("prepare ptb", f"--leaves must be one of {', '.join(LEAF_MODES)}")
    out_dir = Path(out_dir)
    text_dir = out_dir.with_name(out_dir.name + ".text")
    try:
        written = write_parsing_corpus(text_dir, data_root, leaves=leaves)
    except FileNotFoundError as e:
        raise DataError(data_root, f"not a PTB data root: {e}") from e
    files = {
        PREPARED_SPLITS[split]: (Path(written[split]["src"]), Path(written[split]["tgt"]))
        for split in SPLITS
    }
    symbols = Path(written["tgt_symbols"]).read_text(encoding="utf-8").split()
    manifest = prepare_corpus(
        CUSTOM,
        SRC_LANG,
        TGT_LANGS[leaves],
        out_dir,
        vocab_size=vocab_size or PARSING_VOCAB_SIZE,
        max_len=PARSING_MAX_LEN,
        max_ratio=PARSING_MAX_RATIO,
        train_files=files["train"],
        valid_files=files["valid"],
        test_files=files["test"],
        force=force,
        user_symbols=symbols,
    )
    for split, prepared in PREPARED_SPLITS.items():
        shutil.copyfile(written[split]["trees"], out_dir / f"{prepared}.trees")
    return manifest
