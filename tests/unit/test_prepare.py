"""`prepare_corpus` on small synthetic corpora: filters, validation, reuse, download, CLI."""

from __future__ import annotations

import gzip
import json
import os
import random

import pytest
from test_download import serve

from fixtures import dead_pid
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


def test_lowercase_prepares_lowercased_text_and_records_it(corpus, tmp_path):
    files, train, valid, test = corpus
    cased = _prepare(files, tmp_path / "cased")
    assert "lowercase" not in cased.settings  # manifests written before the option stay reusable
    assert not load_prepared(tmp_path / "cased").lowercase
    out = tmp_path / "lc"
    argv = ["custom", "--src", "en", "--tgt", "de", "--out", str(out), "--threads", "1"]
    argv += ["--train", *map(str, files["train"]), "--valid", *map(str, files["valid"])]
    argv += ["--test", *map(str, files["test"])]
    argv += ["--vocab-size", "300", "--max-len", "100", "--max-ratio", "4"]
    assert _prepare_cli([*argv, "--lowercase"]) == 0
    data = load_prepared(out)
    assert data.manifest["settings"]["lowercase"] is True
    assert data.lowercase and data.tokenizer.lowercase
    kept = [p for p in train if p not in BAD_TRAIN]
    assert any(c.isupper() for p in kept for c in p[1])  # the corpus has capitals to lose
    assert data.split("train").text("de") == [p[1].lower() for p in kept]
    assert data.split("valid").text("de") == [p[1].lower() for p in valid]  # references too
    assert data.split("test").text("en") == [p[0].lower() for p in test]
    pieces = [data.tokenizer.id_to_piece(i) for i in range(300)]
    words = [p for p in pieces if not p.startswith("<")]  # not <unk>, <0xC3> (byte fallback)
    assert words and not any(c.isupper() for c in "".join(words))
    assert data.tokenizer.encode("Der Hund") == data.tokenizer.encode("der hund")
    with pytest.raises(DataError, match="other inputs or settings; pass --force"):
        _prepare_cli(argv)  # the cased preparation never silently reuses the lowercased one


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


def test_custom_refuses_a_pipe_it_would_read_only_once(corpus, tmp_path):
    # open_binary reads a pipe (`translate MODEL <(zcat f.gz)`); prepare hashes each input and
    # reads it again, where a pipe would give an empty second pass: refused before it opens it.
    files, *_ = corpus
    fifo = tmp_path / "train.en"
    os.mkfifo(fifo)
    with pytest.raises(DataError, match=r"train\.en: is a pipe or device, not a file"):
        _prepare({**files, "train": [fifo, files["train"][1]]}, tmp_path / "out")
    assert not (tmp_path / "out").exists()


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


# --- issue 18: the line model in every pass, bad settings, --force, leftovers, full disks ----


def _write_raw(path, lines, ending=b"\n"):
    data = b"".join(line.encode() + ending for line in lines)
    path.write_bytes(gzip.compress(data) if path.suffix == ".gz" else data)


def _check_aligned(out, split, pairs):
    """The split's text and binarized ids are exactly `pairs`, in order (with "\r" → " ")."""
    expected = [(s.replace("\r", " "), t.replace("\r", " ")) for s, t in pairs]
    data = load_prepared(out)
    part = data.split(split)
    assert len(part) == len(expected)
    assert list(zip(part.text("en"), part.text("de"), strict=True)) == expected
    for i, (s, t) in enumerate(expected):
        assert part.src_tokens(i).tolist() == data.tokenizer.encode(s), (split, i)
        assert part.tgt_tokens(i).tolist() == data.tokenizer.encode(t), (split, i)
    return data


@pytest.mark.parametrize("sides", ["both", "source", "target"])
def test_lone_carriage_returns_keep_every_pass_aligned(corpus, tmp_path, sides):
    files, train, valid, test = corpus
    train, valid = list(train), list(valid)
    # before: pass 2 split "\r" too, so every pair between the two was shifted (both sides),
    # or zip() raised (one side), or valid had more token pairs than text lines
    if sides in ("both", "source"):
        train[20] = (train[20][0].replace(" ", "\r", 1), train[20][1])
        valid[3] = (valid[3][0].replace(" ", "\r", 1), valid[3][1])
    if sides in ("both", "target"):
        train[300] = (train[300][0], train[300][1].replace(" ", "\r", 1))
        valid[9] = (valid[9][0], valid[9][1].replace(" ", "\r", 1))
    for split, pairs in (("train", train), ("valid", valid)):
        _write_raw(files[split][0], [p[0] for p in pairs], b"\r\n")  # CRLF endings
        _write_raw(files[split][1], [p[1] for p in pairs])
    m = _prepare(files, tmp_path / "out")
    assert m.splits["train"]["input_pairs"] == 404 and m.splits["train"]["pairs"] == 400
    assert m.splits["valid"]["input_pairs"] == m.splits["valid"]["pairs"] == 31
    _check_aligned(tmp_path / "out", "train", [p for p in train if p not in BAD_TRAIN])
    _check_aligned(tmp_path / "out", "valid", valid)
    _check_aligned(tmp_path / "out", "test", test)


def test_a_leading_bom_is_dropped(corpus, tmp_path):
    files, train, *_ = corpus
    _write_raw(files["train"][0], ["\ufeff" + train[0][0]] + [p[0] for p in train[1:]])
    _prepare(files, tmp_path / "out")
    assert load_prepared(tmp_path / "out").split("train").text("en")[0] == train[0][0]


@pytest.mark.parametrize(
    ("setting", "match"),
    [
        ({"max_len": 0}, "--max-len: must be at least 2"),
        ({"max_len": 1}, "--max-len: must be at least 2"),
        ({"max_ratio": 0.5}, "--max-ratio: must be at least 1"),
        ({"max_ratio": float("nan")}, "--max-ratio: must be at least 1"),
        ({"vocab_size": 0}, "--vocab-size: must be positive"),
    ],
)
def test_impossible_settings_are_refused(corpus, tmp_path, setting, match):
    files, *_ = corpus
    with pytest.raises(DataError, match=match):
        _prepare(files, tmp_path / "out", **setting)
    assert not (tmp_path / "out").exists()


def test_no_training_pair_left_is_an_error_naming_the_filters(corpus, tmp_path):
    files, *_ = corpus
    with pytest.raises(DataError, match=r"no training pair is left after filtering 404 "
                       r"\(dropped: empty=2, too_long=402, length_ratio=0\)"):  # fmt: skip
        _prepare(files, tmp_path / "out", max_len=3)
    assert not (tmp_path / "out").exists()


def test_force_refuses_a_directory_prepare_did_not_write(corpus, tmp_path):
    files, *_ = corpus
    out = tmp_path / "out"
    _prepare(files, out)
    (out / "thesis.tex").write_text("months of work")
    with pytest.raises(DataError, match=r"holds 1 files that prepare did not write \(thesis\.tex"):
        _prepare(files, out, max_len=50, force=True)
    assert (out / "thesis.tex").read_text() == "months of work"
    (out / "thesis.tex").unlink()
    assert _prepare(files, out, max_len=50, force=True).settings["max_len"] == 50


def test_a_corrupt_manifest_in_out_is_a_data_error(corpus, tmp_path):
    files, *_ = corpus
    out = tmp_path / "out"
    _prepare(files, out)
    (out / "manifest.json").write_text('{"splits": {"tr')
    with pytest.raises(DataError, match=r"manifest\.json: unreadable"):
        _prepare(files, out)


def test_a_killed_preparation_is_cleaned_by_the_next(corpus, tmp_path):
    files, *_ = corpus
    dead = dead_pid()
    leftover = tmp_path / f".out.partial-{dead}"
    leftover.mkdir()
    (leftover / "train.en.stage1").write_text("x\n")
    other = tmp_path / ".other.partial-1"  # another output's leftover: not ours to remove
    other.mkdir()
    _prepare(files, tmp_path / "out")
    assert not leftover.exists() and other.exists()


def test_disk_full_while_preparing_is_one_error_and_leaves_nothing(corpus, tmp_path, monkeypatch):
    import errno

    from transformer import data

    files, *_ = corpus

    def full(self, sequences):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(data.TokenWriter, "add", full)
    with pytest.raises(DataError, match="cannot write the prepared data: No space left"):
        _prepare(files, tmp_path / "out")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["raw"]


def test_missing_directory_and_truncated_inputs_are_data_errors(corpus, tmp_path):
    files, *_ = corpus
    bad = dict(files, valid=(files["valid"][0], tmp_path / "nowhere.de"))
    with pytest.raises(DataError, match=r"nowhere\.de: file not found"):
        _prepare(bad, tmp_path / "out")
    bad = dict(files, valid=(files["valid"][0], tmp_path))
    with pytest.raises(DataError, match="is a directory"):
        _prepare(bad, tmp_path / "out")
    gz = files["train"][1]
    gz.write_bytes(gz.read_bytes()[:-30])
    with pytest.raises(DataError, match=r"train\.de\.gz: truncated or corrupt gzip"):
        _prepare(files, tmp_path / "out")
    assert not (tmp_path / "out").exists()
