"""Reading, validation, filters, binarized storage and collation."""

from __future__ import annotations

import gzip
import io
import os
import threading

import numpy as np
import pytest
import torch

from transformer import data
from transformer.data import (
    DataError,
    ParallelSplit,
    TokenWriter,
    collate,
    decode_line,
    filter_reason,
    length_filter_reason,
    load_prepared,
    read_lines,
    read_parallel,
    read_text_file,
    read_windows,
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


# --- The line model (issue 18, item 1): one rule for every reader ---------------------------


def test_line_model_lone_cr_is_a_space_crlf_is_one_ending_and_a_leading_bom_goes(tmp_path):
    raw = "\ufeffone\r\ntwo\rhalves\n\ufeffthree\r\r\nfour\r".encode()
    (tmp_path / "a.txt").write_bytes(raw)
    with gzip.open(tmp_path / "a.txt.gz", "wb") as f:
        f.write(raw)
    # "\r\n" ends a line, a lone "\r" (even before "\r\n") is a space, only the file's BOM goes
    expected = ["one", "two halves", "\ufeffthree ", "four "]
    assert list(read_lines(tmp_path / "a.txt")) == expected
    assert list(read_lines(tmp_path / "a.txt.gz")) == expected
    assert list(read_lines(io.BytesIO(raw), "<stdin>")) == expected
    assert decode_line(b"\xef\xbb\xbfa\rb\r\n", "x", 1) == "a b"
    assert decode_line(b"\xef\xbb\xbfa\rb\r\n", "x", 2) == "\ufeffa b"


def test_lone_cr_on_both_sides_keeps_pairs_aligned(tmp_path):
    src = [f"source {i}" for i in range(10)]
    tgt = [f"target {i}" for i in range(10)]
    src[2], tgt[7] = "so\rurce 2", "tar\rget 7"  # one lone "\r" in each side, different lines
    (tmp_path / "s.en").write_bytes("".join(s + "\n" for s in src).encode())
    (tmp_path / "s.de").write_bytes("".join(t + "\r\n" for t in tgt).encode())
    pairs = list(read_parallel(tmp_path / "s.en", tmp_path / "s.de"))
    assert len(pairs) == 10
    assert pairs[2] == ("so urce 2", "target 2") and pairs[7] == ("source 7", "tar get 7")
    assert all(s.split()[-1] == t.split()[-1] for s, t in pairs)


def test_truncated_gzip_names_the_file(tmp_path):
    path = tmp_path / "train.de.gz"
    path.write_bytes(gzip.compress(b"".join(b"line %d\n" % i for i in range(5000)))[:-40])
    with pytest.raises(DataError, match=r"train\.de\.gz: truncated or corrupt gzip"):
        list(read_lines(path))


def test_directory_and_unreadable_inputs_are_data_errors(tmp_path, monkeypatch):
    with pytest.raises(DataError, match="is a directory"):
        list(read_lines(tmp_path))
    (tmp_path / "locked.en").write_text("a\n")

    def denied(*args, **kwargs):
        raise PermissionError(13, "Permission denied", str(tmp_path / "locked.en"))

    monkeypatch.setattr(data, "open", denied, raising=False)  # root ignores chmod 000
    with pytest.raises(DataError, match=r"locked\.en: cannot open: Permission denied"):
        list(read_lines(tmp_path / "locked.en"))


def test_a_corrupt_manifest_is_a_data_error(tmp_path):
    (tmp_path / "manifest.json").write_text('{"format_version": 1, "spl')
    with pytest.raises(DataError, match=r"manifest\.json: unreadable"):
        load_prepared(tmp_path)
    (tmp_path / "manifest.json").write_text("[1]")
    with pytest.raises(DataError, match=r"manifest\.json: not a prepared-data manifest"):
        load_prepared(tmp_path)


# --- Windows of lines (`transformer translate`'s input) ---------------------------------------


def test_read_windows_numbers_each_window_and_keeps_the_line_model():
    raw = b"\xef\xbb\xbfone\r\ntwo\rx\n\n\xef\xbb\xbffour\nfive"
    windows = list(read_windows(io.BytesIO(raw), "in", 2))
    assert windows == [(1, ["one", "two x"]), (3, ["", "\ufefffour"]), (5, ["five"])]
    assert [w for _, lines in windows for w in lines] == list(read_lines(io.BytesIO(raw), "in"))
    assert list(read_windows(io.BytesIO(b""), "in", 3)) == []
    with pytest.raises(ValueError, match="at least 1"):
        next(read_windows(io.BytesIO(b"a\n"), "in", 0))


def test_read_windows_gives_the_lines_before_a_bad_one_then_names_it():
    windows = read_windows(io.BytesIO(b"a\nb\nc\n\xff\nd\n"), "in.txt", 2)
    assert next(windows) == (1, ["a", "b"])
    assert next(windows) == (3, ["c"])  # read before line 4 failed: not lost
    with pytest.raises(DataError, match=r"in\.txt:4: invalid UTF-8"):
        next(windows)


def test_read_windows_of_a_pipe_ends_a_window_where_the_writer_pauses():
    r, w = os.pipe()
    os.write(w, b"first\r\nsecond\n")  # then nothing until the first window is out
    long_line = b"x" * 200_000  # several reads of the pipe, more than it holds
    with os.fdopen(r, "rb") as stream:
        windows = read_windows(stream, "<stdin>", 100)
        assert next(windows) == (1, ["first", "second"])

        def writer():
            with os.fdopen(w, "wb") as f:
                f.write(b"third\n" + long_line + b"\nlast, no ending")

        thread = threading.Thread(target=writer)
        thread.start()
        rest = list(windows)
        thread.join()
    # Lines from here on, whole, in one window unless the writer paused again (a loaded host).
    assert [line for _, lines in rest for line in lines] == [
        "third", long_line.decode(), "last, no ending"]  # fmt: skip
    starts = [3]
    for _, lines in rest[:-1]:
        starts.append(starts[-1] + len(lines))
    assert [first for first, _ in rest] == starts


def test_read_windows_of_a_pipe_keeps_its_windows_full_while_lines_come():
    r, w = os.pipe()
    with os.fdopen(w, "wb") as f:
        f.write(b"".join(b"line %d\n" % i for i in range(7)))
    with os.fdopen(r, "rb") as stream:
        windows = list(read_windows(stream, "<stdin>", 3))
    assert [first for first, _ in windows] == [1, 4, 7]
    assert windows[-1] == (7, ["line 6"])


def test_open_binary_reads_a_pipe_given_as_a_path(tmp_path):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    # daemon: where the pipe is never opened (the old "file not found"), its writer waits on
    thread = threading.Thread(target=lambda: fifo.write_bytes(b"a dog\nruns\n"), daemon=True)
    thread.start()  # `transformer translate MODEL <(zcat in.gz)`: was "file not found"
    assert list(read_lines(fifo)) == ["a dog", "runs"]
    thread.join(30)
    with pytest.raises(DataError, match="file not found"):
        data.open_binary(tmp_path / "missing")
