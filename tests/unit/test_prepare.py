"""`prepare_corpus` on small synthetic corpora: filters, validation, reuse, download, CLI."""

from __future__ import annotations

import gzip
import json
import random

import pytest
from test_download import serve

from transformer import corpora
from transformer.cli import build_parser
from transformer.data import DataError, collate, load_prepared
from transformer.prepare import prepare_corpus

EN_DE = dict(
    zip(
        "the a man woman dog cat runs sits on in with red blue small big street park ball".split(),
        "der ein Mann Frau Hund Katze läuft sitzt auf im mit roten blauen kleinen großen Straße "
        "Park Ball".split(),
        strict=True,
    )
)


def _pairs(n, seed):
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        words = [rng.choice(list(EN_DE)) for _ in range(rng.randint(3, 10))]
        out.append((" ".join(words) + ".", " ".join(EN_DE[w] for w in words) + "."))
    return out


def _write(path, lines):
    data = "".join(line + "\n" for line in lines).encode()
    path.write_bytes(gzip.compress(data) if path.suffix == ".gz" else data)


BAD_TRAIN = [
    ("", "leer"),  # empty
    ("a dog.", "   "),  # empty (whitespace)
    (" ".join(["the big red dog"] * 30), " ".join(["der große rote Hund"] * 30)),  # too long
    ("dog", "der große rote Hund sitzt auf der Straße im Park mit einem Ball."),  # ratio
]


@pytest.fixture
def corpus(tmp_path):
    d = tmp_path / "raw"
    d.mkdir()
    train = _pairs(400, 0)
    train[10:10] = BAD_TRAIN
    valid = _pairs(30, 1) + [("", "")]  # an empty valid pair is kept (valid is never filtered)
    test = _pairs(20, 2)
    files = {}
    for split, pairs in (("train", train), ("valid", valid), ("test", test)):
        src, tgt = d / f"{split}.en", d / f"{split}.de.gz"
        _write(src, [p[0] for p in pairs])
        _write(tgt, [p[1] for p in pairs])
        files[split] = (src, tgt)
    return files, train, valid, test


def _prepare(files, out, **kw):
    kw.setdefault("vocab_size", 300)
    kw.setdefault("max_len", 100)
    kw.setdefault("max_ratio", 4.0)
    return prepare_corpus(
        "custom",
        "en",
        "de",
        out,
        train_files=files["train"],
        valid_files=files["valid"],
        test_files=files.get("test"),
        num_threads=1,
        **kw,
    )


def test_custom_prepare_filters_counts_and_binarizes(corpus, tmp_path):
    files, train, valid, test = corpus
    m = _prepare(files, tmp_path / "out")
    assert m.filters == {"train": {"empty": 2, "too_long": 1, "length_ratio": 1}}
    assert m.splits["train"]["input_pairs"] == 404 and m.splits["train"]["pairs"] == 400
    assert m.splits["valid"]["pairs"] == 31 and m.splits["valid"]["empty_kept"] == 1
    assert m.vocab_size == 300 and m.spm_model == "spm.model"
    assert json.loads((tmp_path / "out" / "manifest.json").read_text()) == m.to_dict()
    assert all(len(v["sha256"]) == 64 for v in m.inputs.values())

    data = load_prepared(tmp_path / "out")
    assert data.split_names == ["train", "valid", "test"]
    assert (data.src_lang, data.tgt_lang) == ("en", "de")
    tr = data.split("train")
    kept = [p for p in train if p not in BAD_TRAIN]
    assert tr.text("en") == [p[0] for p in kept] and tr.text("de") == [p[1] for p in kept]
    for i in (0, 17, 399):
        assert tr.src_tokens(i).tolist() == data.tokenizer.encode(kept[i][0])
        assert data.tokenizer.decode(tr.tgt_tokens(i)) == kept[i][1]
    va = data.split("valid")
    assert va.text("de") == [p[1] for p in valid]  # untouched, empty line included
    assert data.split("test").src_text(5) == test[5][0]
    batch = collate(tr, range(8))
    assert batch.src.shape[0] == 8
    assert not list(tmp_path.glob(".out.partial*"))


def test_same_inputs_reuse_and_other_settings_need_force(corpus, tmp_path):
    files, *_ = corpus
    out = tmp_path / "out"
    first = _prepare(files, out)
    stamp = (out / "spm.model").stat().st_mtime_ns
    assert _prepare(files, out) == first
    assert (out / "spm.model").stat().st_mtime_ns == stamp  # reused, not rebuilt
    with pytest.raises(DataError, match="other inputs or settings; pass --force"):
        _prepare(files, out, max_len=1000)
    rebuilt = _prepare(files, out, max_len=1000, force=True)
    assert rebuilt.settings["max_len"] == 1000 and rebuilt.filters["train"]["too_long"] == 0


def test_misaligned_corpus_never_produces_output(corpus, tmp_path):
    files, train, *_ = corpus
    _write(files["train"][0], [p[0] for p in train[:-1]])
    with pytest.raises(DataError, match=r"has 403 lines.*has 404 lines"):
        _prepare(files, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    assert not list(tmp_path.glob(".out.partial*"))


def test_invalid_utf8_in_valid_names_file_and_line(corpus, tmp_path):
    files, *_ = corpus
    src = files["valid"][0]
    lines = src.read_bytes().split(b"\n")
    lines[4] = b"caf\xe9"
    src.write_bytes(b"\n".join(lines))
    with pytest.raises(DataError, match=rf"{src}:5: invalid UTF-8"):
        _prepare(files, tmp_path / "out")


def test_refuses_to_overwrite_a_foreign_directory(corpus, tmp_path):
    files, *_ = corpus
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "notes.txt").write_text("mine")
    with pytest.raises(DataError, match="not a prepared-data directory"):
        _prepare(files, tmp_path / "out", force=True)


def test_custom_needs_train_and_valid(tmp_path):
    with pytest.raises(DataError, match="custom corpora need valid files"):
        prepare_corpus("custom", "en", "de", tmp_path / "o", train_files=["a", "b"])


def _multi30k_layout(d, pairs_by_stem, gz=False):
    d.mkdir(exist_ok=True)
    for stem, pairs in pairs_by_stem.items():
        for k, lang in enumerate(("en", "fr")):
            _write(d / (f"{stem}.{lang}" + (".gz" if gz else "")), [p[k] for p in pairs])


def test_named_corpus_from_dir_keeps_the_original_split_name(tmp_path):
    _multi30k_layout(
        tmp_path / "m",
        {"train": _pairs(300, 0), "val": _pairs(20, 1), "test_2016_flickr": _pairs(10, 2)},
    )
    m = prepare_corpus(
        "multi30k",
        "en",
        "fr",
        tmp_path / "out",
        from_dir=tmp_path / "m",
        vocab_size=300,
        num_threads=1,
    )
    assert {k: v["source"] for k, v in m.splits.items()} == {
        "train": "train",
        "valid": "val",
        "test": "test_2016_flickr",
    }
    # not the official Multi30k files: recorded, not silently accepted as verified
    assert m.inputs["train.en"]["verified"] is False


def test_named_corpus_missing_train_is_a_clear_error(tmp_path):
    _multi30k_layout(tmp_path / "m", {"val": _pairs(20, 1)})
    with pytest.raises(DataError, match=r"train split: missing train\.en\[\.gz\], train\.fr"):
        prepare_corpus("multi30k", "en", "fr", tmp_path / "out", from_dir=tmp_path / "m")


def test_named_corpus_is_downloaded(tmp_path, monkeypatch):
    site = tmp_path / "site"
    _multi30k_layout(site, {"train": _pairs(300, 0), "val": _pairs(20, 1)}, gz=True)
    with serve(site) as (url, server):
        monkeypatch.setattr(corpora, "_MULTI30K_URL", url)
        m = prepare_corpus("multi30k", "en", "fr", tmp_path / "out", vocab_size=300, num_threads=1)
    assert (tmp_path / "out.downloads" / "train.en.gz").is_file()
    assert m.splits["train"]["pairs"] == 300 and "test" not in m.splits  # test 404: skipped
    assert len(server.requests) == 6


def _prepare_cli(argv) -> int:
    """`transformer prepare ARGV` through the CLI's own parser, errors raised (not printed)."""
    args = build_parser().parse_args(["prepare", *argv])
    return args.func(args)


def test_cli_arguments(corpus, tmp_path):
    files, *_ = corpus
    args = [
        "custom",
        "--src",
        "en",
        "--tgt",
        "de",
        "--out",
        str(tmp_path / "o"),
        "--train",
        *map(str, files["train"]),
        "--valid",
        *map(str, files["valid"]),
        "--vocab-size",
        "300",
        "--max-len",
        "100",
        "--max-ratio",
        "4",
        "--spm-type",
        "unigram",
        "--threads",
        "1",
        "--spm-sample",
        "0",
    ]
    assert _prepare_cli(args) == 0
    manifest = load_prepared(tmp_path / "o").manifest
    assert manifest["spm_type"] == "unigram" and manifest["settings"]["spm_sample"] == 0
    assert manifest["filters"]["train"]["length_ratio"] == 1


def test_user_symbols_file_keeps_tokens_whole(corpus, tmp_path):
    files, *_ = corpus
    (tmp_path / "symbols.txt").write_text("(NP\n)NP\n\nXX\n", encoding="utf-8")
    argv = ["custom", "--src", "en", "--tgt", "de", "--out", str(tmp_path / "o"), "--threads", "1"]
    argv += ["--train", *map(str, files["train"]), "--valid", *map(str, files["valid"])]
    argv += ["--vocab-size", "300", "--max-len", "100", "--max-ratio", "4"]
    assert _prepare_cli([*argv, "--user-symbols", str(tmp_path / "symbols.txt")]) == 0
    data = load_prepared(tmp_path / "o")
    assert data.manifest["settings"]["user_symbols"] == ["(NP", ")NP", "XX"]
    assert len(data.tokenizer.encode("(NP XX )NP")) == 3


def test_user_symbols_file_with_spaces_names_the_line(corpus, tmp_path):
    files, *_ = corpus
    (tmp_path / "symbols.txt").write_text("(NP\n(N P\n", encoding="utf-8")
    argv = ["custom", "--src", "en", "--tgt", "de", "--out", str(tmp_path / "o")]
    argv += ["--train", *map(str, files["train"]), "--valid", *map(str, files["valid"])]
    with pytest.raises(DataError, match=r"symbols.txt:2: a user symbol holds no spaces"):
        _prepare_cli([*argv, "--user-symbols", str(tmp_path / "symbols.txt")])


def test_named_corpora_need_src_and_tgt(tmp_path):
    with pytest.raises(DataError, match="--src and --tgt are required"):
        _prepare_cli(["multi30k", "--out", str(tmp_path / "o")])
