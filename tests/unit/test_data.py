"""Reading, validation, filters, binarized storage and collation."""

from __future__ import annotations

import gzip

import numpy as np
import pytest
import torch

from transformer.data import (
    DataError,
    ParallelSplit,
    TokenWriter,
    collate,
    filter_reason,
    length_filter_reason,
    read_lines,
    read_parallel,
    read_text_file,
)
from transformer.tokenizer import BOS_ID, EOS_ID, PAD_ID


def test_read_lines_plain_gz_and_crlf(tmp_path):
    (tmp_path / "a.txt").write_bytes(b"one\r\ntwo \n\nthree")
    with gzip.open(tmp_path / "a.txt.gz", "wb") as f:
        f.write("eins\nzwei\u2028drei\n".encode())
    assert list(read_lines(tmp_path / "a.txt")) == ["one", "two ", "", "three"]
    # only "\n" ends a line: U+2028 stays inside it
    assert list(read_lines(tmp_path / "a.txt.gz")) == ["eins", "zwei\u2028drei"]


def test_invalid_utf8_names_file_and_line(tmp_path):
    (tmp_path / "bad.de").write_bytes(b"gut\nauch gut\nschlecht \xff\xfe\n")
    with pytest.raises(DataError, match=r"bad\.de:3: invalid UTF-8") as e:
        list(read_lines(tmp_path / "bad.de"))
    assert e.value.line == 3


def test_invalid_utf8_in_parallel_names_the_right_file(tmp_path):
    (tmp_path / "s.en").write_text("a\nb\n")
    (tmp_path / "s.de").write_bytes(b"a\n\xc3\n")
    with pytest.raises(DataError, match=r"s\.de:2: invalid UTF-8"):
        list(read_parallel(tmp_path / "s.en", tmp_path / "s.de"))


@pytest.mark.parametrize(("n_src", "n_tgt"), [(5, 3), (3, 5), (0, 2)])
def test_line_count_mismatch_names_both_files_and_counts(tmp_path, n_src, n_tgt):
    src, tgt = tmp_path / "train.en", tmp_path / "train.de.gz"
    src.write_text("".join(f"s{i}\n" for i in range(n_src)))
    with gzip.open(tgt, "wt") as f:
        f.write("".join(f"t{i}\n" for i in range(n_tgt)))
    with pytest.raises(DataError) as e:
        list(read_parallel(src, tgt))
    msg = str(e.value)
    assert f"{src} has {n_src} lines" in msg and f"{tgt} has {n_tgt} lines" in msg


def test_missing_file_is_a_data_error(tmp_path):
    with pytest.raises(DataError, match="file not found"):
        list(read_lines(tmp_path / "nope.en"))


@pytest.mark.parametrize(
    ("src", "tgt", "reason"),
    [("a", "b", None), ("", "b", "empty"), ("a", "  ", "empty"), ("\t", "", "empty")],
)
def test_empty_filter(src, tgt, reason):
    assert filter_reason(src, tgt) == reason


@pytest.mark.parametrize(
    ("src_len", "tgt_len", "reason"),
    [
        (9, 9, None),  # 9 + EOS = 10 = max_len: kept
        (10, 9, "too_long"),  # 10 + EOS > 10
        (3, 10, "too_long"),
        (2, 6, None),  # ratio 3.0 = max_ratio: kept
        (2, 7, "length_ratio"),  # 3.5 > 3
        (7, 2, "length_ratio"),
        (0, 3, None),  # min side counted as 1: 3 / 1 = 3
        (0, 4, "length_ratio"),
    ],
)
def test_length_filter(src_len, tgt_len, reason):
    assert length_filter_reason(src_len, tgt_len, max_len=10, max_ratio=3.0) == reason


@pytest.fixture
def split(tmp_path):
    src = [[5, 6, 7], [8], [9, 10, 11, 12, 13], []]
    tgt = [[20, 21], [22, 23, 24, 25], [26], [27]]
    for lang, seqs in (("en", src), ("de", tgt)):
        w = TokenWriter(tmp_path / f"train.{lang}")
        w.add(seqs[:2])
        w.add(seqs[2:])
        assert w.close() == 4
        (tmp_path / f"train.{lang}.txt").write_text(
            "".join(f"{lang} line {i}\n" for i in range(4)), encoding="utf-8"
        )
    return ParallelSplit(tmp_path, "train", "en", "de"), src, tgt


def test_binarized_split_round_trips(split):
    s, src, tgt = split
    assert len(s) == 4
    assert s.src_lens.tolist() == [4, 2, 6, 1]  # EOS included
    assert s.tgt_lens.tolist() == [3, 5, 2, 2]
    for i in range(4):
        assert s.src_tokens(i).tolist() == src[i]
        assert s.tgt_tokens(i).tolist() == tgt[i]
    assert s.src_text(2) == "en line 2" and s.tgt_text(3) == "de line 3"
    assert len(s.text("de")) == 4


def test_collate_pads_and_shifts(split):
    s, _, _ = split
    b = collate(s, [1, 0, 3])
    assert b.src.dtype == torch.int64
    assert b.src.tolist() == [[8, EOS_ID, PAD_ID, PAD_ID], [5, 6, 7, EOS_ID], [EOS_ID, 0, 0, 0]]
    assert b.tgt_in.tolist() == [
        [BOS_ID, 22, 23, 24, 25],
        [BOS_ID, 20, 21, 0, 0],
        [BOS_ID, 27, 0, 0, 0],
    ]
    assert b.tgt_out.tolist() == [
        [22, 23, 24, 25, EOS_ID],
        [20, 21, EOS_ID, 0, 0],
        [27, EOS_ID, 0, 0, 0],
    ]
    assert b.src_mask.tolist() == [
        [True, True, False, False],
        [True, True, True, True],
        [True, False, False, False],
    ]
    assert (b.n_src_tokens, b.n_tgt_tokens) == (2 + 4 + 1, 5 + 3 + 2)
    assert b.n_tgt_tokens == int((b.tgt_out != PAD_ID).sum())
    assert b.indices == [1, 0, 3]
    moved = b.to("cpu")
    assert torch.equal(moved.tgt_out, b.tgt_out) and moved.indices == b.indices


def test_corrupt_binary_is_detected(split, tmp_path):
    with open(tmp_path / "train.de.bin", "ab") as f:
        f.write(b"\0\0")
    with pytest.raises(DataError, match="expected 8 int32 tokens"):
        ParallelSplit(tmp_path, "train", "en", "de")


def test_read_text_file_splits_on_newline_only(tmp_path):
    (tmp_path / "t.txt").write_bytes("a\rb\nc\u2028d\n\n".encode())
    assert read_text_file(tmp_path / "t.txt") == ["a\rb", "c\u2028d", ""]


def test_token_writer_empty(tmp_path):
    w = TokenWriter(tmp_path / "x")
    assert w.close() == 0
    assert np.load(tmp_path / "x.idx.npy").tolist() == [0]


def test_read_lines_of_a_stream_names_it():
    import io

    assert list(read_lines(io.BytesIO(b"a\r\n\nb"), "x")) == ["a", "", "b"]
    with pytest.raises(DataError, match=r"in\.txt:2: invalid UTF-8"):
        list(read_lines(io.BytesIO(b"ok\nbad \xff\n"), "in.txt"))
