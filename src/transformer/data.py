"""Read and validate parallel corpora, binarize them, load prepared data, collate batches.

A prepared-data directory (written by `prepare.prepare_corpus`) holds:

- `manifest.json`: languages, vocabulary, per-split counts, filter counts, input hashes, settings;
- `spm.model` / `spm.vocab`: the joint sentencepiece model (`tokenizer.Tokenizer`);
- per split and language: `{split}.{lang}.txt` (the raw lines kept, untouched),
  `{split}.{lang}.bin` (flat little-endian int32 subword ids, no BOS/EOS) and
  `{split}.{lang}.idx.npy` (int64 offsets, n + 1 of them) — both memory-mapped on load.
"""

from __future__ import annotations

import gzip
import itertools
import json
import os
import select
import stat
import zlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO

import numpy as np

from transformer.errors import UserError
from transformer.tokenizer import BOS_ID, EOS_ID, PAD_ID, Tokenizer

if TYPE_CHECKING:  # torch is imported where a batch is made (`collate`): reading and writing
    # corpora (`prepare`, `score`, `--help`) starts without its ~2 s of imports
    import torch

MANIFEST = "manifest.json"
FORMAT_VERSION = 1
TOKEN_DTYPE = np.dtype("<i4")
FILTER_REASONS = ("empty", "too_long", "length_ratio")


class DataError(UserError):
    """Bad user data. The message names the file, the line (where there is one) and the problem."""

    def __init__(self, path: str | Path, problem: str, line: int | None = None) -> None:
        where = f"{path}:{line}" if line is not None else f"{path}"
        super().__init__(f"{where}: {problem}")
        self.path = Path(path)
        self.line = line


# --------------------------------------------------------------------------------------------
# Reading and validating text
# --------------------------------------------------------------------------------------------


def open_binary(path: str | Path) -> BinaryIO:
    """Open a plain or gzip-compressed (`.gz`) file for reading bytes."""
    path = Path(path)
    if path.is_dir():
        raise DataError(path, "is a directory, not a file")
    if not path.exists():  # a pipe (`<(zcat f.gz)`, /dev/stdin) is read as a file is
        raise DataError(path, "file not found")
    try:
        f = open(path, "rb")
    except OSError as e:
        raise DataError(path, f"cannot open: {e.strerror}") from None
    return gzip.GzipFile(fileobj=f, mode="rb") if path.suffix == ".gz" else f  # type: ignore


# The line model, the same in every pass and every reader (docs/data.md, "Lines"): a line ends
# at "\n" only; a "\r" before that "\n" is part of the line ending ("\r\n" is one ending); a lone
# "\r" anywhere else becomes a space; a UTF-8 byte-order mark opening the file is dropped.
BOM = "\ufeff"


def decode_line(raw: bytes, name: str | Path, number: int) -> str:
    """One raw line (with or without its ending) as text, by the line model above.

    Args:
        raw: the bytes of line `number`, as split on b"\n".
        name: the file (or stream) it came from, for errors.
        number: its 1-based line number; line 1 loses a leading byte-order mark.

    Raises:
        DataError: naming the file and line of an invalid UTF-8 byte sequence.
    """
    if raw.endswith(b"\n"):
        raw = raw[:-2] if raw.endswith(b"\r\n") else raw[:-1]
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DataError(name, f"invalid UTF-8 at byte {e.start}: {raw[:60]!r}", number) from None
    if number == 1 and text.startswith(BOM):
        text = text[1:]
    return text.replace("\r", " ")


def _iter_lines(stream: BinaryIO, name: str | Path, pauses: bool = False) -> Iterator[str | None]:
    """The lines of an open byte stream, by the line model (see `decode_line`); with `pauses`,
    also None wherever a pipe, terminal or socket has had nothing to read for PAUSE_S seconds
    (`_raw_lines`).

    Raises:
        DataError: invalid UTF-8 (file and line), or a truncated / corrupt gzip stream.
    """
    number = 0
    try:
        for raw in _raw_lines(stream) if pauses else stream:  # split on b"\n" only
            if raw is None:
                yield None
                continue
            number += 1
            yield decode_line(raw, name, number)
    except (EOFError, zlib.error, gzip.BadGzipFile) as e:
        raise DataError(name, f"truncated or corrupt gzip data after line {number}: {e}") from None
    except OSError as e:
        raise DataError(name, f"cannot read after line {number}: {e.strerror or e}") from None


def read_lines(source: str | Path | BinaryIO, name: str | None = None) -> Iterator[str]:
    """Yield the lines of UTF-8 text by the line model (`decode_line`): a file (plain or `.gz`)
    or an open byte stream (stdin), named `name` in errors. The one line reader of the product.

    Raises:
        DataError: naming the file and line of the first invalid UTF-8 byte sequence, or a
            truncated gzip file.
    """
    if isinstance(source, str | Path):
        with open_binary(source) as f:
            yield from _iter_lines(f, str(source))
        return
    yield from _iter_lines(source, name or "<stream>")


# A window of input lines (`read_windows`) ends early where a pipe, terminal or socket has no more
# bytes for this long: a user typing, or a program that sends a line and waits for its answer, gets
# it at once, while a producer that writes steadily (even slowly: a line every few milliseconds)
# fills whole windows. The lines that piled up while a window was translated make the next one.
PAUSE_S = 0.1


def read_windows(
    stream: BinaryIO, name: str | Path, max_lines: int
) -> Iterator[tuple[int, list[str]]]:
    """The lines of an open byte stream by the line model (`decode_line`), in windows of at
    most `max_lines`, each with the 1-based number of its first line.

    A window ends early where the stream is a pipe, terminal or socket that has had nothing
    more to read for PAUSE_S seconds; a file (or BytesIO) gives full windows.

    Raises:
        DataError: as `read_lines`, once the window of the lines before the bad one has been
            yielded (nothing read is lost).
    """
    if max_lines < 1:
        raise ValueError(f"max_lines must be at least 1, got {max_lines}")
    window: list[str] = []
    first = 1
    try:
        for line in _iter_lines(stream, name, pauses=True):
            if line is not None:
                window.append(line)
            if window and (line is None or len(window) >= max_lines):
                yield first, window
                first, window = first + len(window), []
    except DataError:
        if window:
            yield first, window
        raise
    if window:
        yield first, window


def _raw_lines(stream: BinaryIO) -> Iterator[bytes | None]:
    """The raw lines of `stream` (split after b"\n"; the last one may lack it), with None
    wherever a pipe, terminal or socket has had nothing to read for PAUSE_S seconds."""
    try:
        fd = stream.fileno()
        regular = stat.S_ISREG(os.fstat(fd).st_mode)
    except (AttributeError, OSError, ValueError):  # BytesIO, a closed or wrapped stream
        fd, regular = -1, True
    read1 = getattr(stream, "read1", None)
    if regular or read1 is None or isinstance(stream, gzip.GzipFile):  # gzip: its own buffers
        yield from stream
        return
    ready = select.poll()  # poll, not select: any descriptor number
    ready.register(fd, select.POLLIN)
    pending = bytearray()
    while True:
        start = 0
        while (end := pending.find(b"\n", start)) >= 0:
            yield bytes(pending[start : end + 1])
            start = end + 1
        del pending[:start]
        # read1 hands out the stream's buffer first: once it is empty the descriptor says
        # whether more is ready (DEFAULT_BUFFER_SIZE or less is buffered, and this reads more).
        if not ready.poll(PAUSE_S * 1000):  # an end of input (POLLHUP) is an event too
            yield None
        chunk = read1(1 << 16)
        if not chunk:
            if pending:
                yield bytes(pending)
            return
        pending += chunk


def write_output(path: str | Path, text: str) -> None:
    """Write a text output (translations, trees); a full disk or a path that cannot be written
    is a DataError naming the file."""
    try:
        Path(path).write_text(text, encoding="utf-8")
    except OSError as e:
        raise DataError(path, f"cannot write: {e.strerror or e}") from e


def read_parallel(src_path: str | Path, tgt_path: str | Path) -> Iterator[tuple[str, str]]:
    """Yield aligned (source, target) lines of two files, validating UTF-8 and alignment.

    Raises:
        DataError: invalid UTF-8 (file and line), or different line counts (both files and
            both counts; raised when the shorter file ends, before anything misaligned is used).
    """
    src_lines, tgt_lines = read_lines(src_path), read_lines(tgt_path)
    number = 0
    for number, (s, t) in enumerate(itertools.zip_longest(src_lines, tgt_lines), start=1):
        if s is None or t is None:
            n_src = number - 1 + (sum(1 for _ in src_lines) + 1 if s is not None else 0)
            n_tgt = number - 1 + (sum(1 for _ in tgt_lines) + 1 if t is not None else 0)
            raise DataError(
                src_path,
                f"line counts differ: {src_path} has {n_src} lines, "
                f"{tgt_path} has {n_tgt} lines (the corpus is misaligned)",
            )
        yield s, t


def filter_reason(src_text: str, tgt_text: str) -> str | None:
    """The text-level filter: "empty" if either side is empty or whitespace, else None."""
    if not src_text.strip() or not tgt_text.strip():
        return "empty"
    return None


def length_filter_reason(src_len: int, tgt_len: int, max_len: int, max_ratio: float) -> str | None:
    """The length-level filter on subword counts (without EOS).

    Args:
        src_len, tgt_len: subword counts of the pair.
        max_len: longest allowed sequence, counting the EOS that collate appends.
        max_ratio: largest allowed max(src_len, tgt_len) / min(src_len, tgt_len).

    Returns:
        "too_long", "length_ratio", or None when the pair is kept.
    """
    if src_len + 1 > max_len or tgt_len + 1 > max_len:
        return "too_long"
    if max(src_len, tgt_len) > max_ratio * max(1, min(src_len, tgt_len)):
        return "length_ratio"
    return None


# --------------------------------------------------------------------------------------------
# Binarized storage
# --------------------------------------------------------------------------------------------


class TokenWriter:
    """Stream sequences of subword ids to `{prefix}.bin` + `{prefix}.idx.npy`, chunk by chunk."""

    def __init__(self, prefix: str | Path) -> None:
        self.prefix = Path(prefix)
        self._bin = open(f"{self.prefix}.bin", "wb")
        self._lengths: list[np.ndarray] = []
        self.n_tokens = 0

    def add(self, sequences: Sequence[Sequence[int]]) -> None:
        """Append a chunk of sequences (ids without BOS/EOS)."""
        lengths = np.fromiter((len(s) for s in sequences), dtype=np.int64, count=len(sequences))
        total = int(lengths.sum())
        flat = np.fromiter((t for s in sequences for t in s), dtype=TOKEN_DTYPE, count=total)
        flat.tofile(self._bin)
        self._lengths.append(lengths)
        self.n_tokens += total

    def close(self) -> int:
        """Finish both files; returns the number of sequences written."""
        self._bin.close()
        lengths = np.concatenate(self._lengths) if self._lengths else np.zeros(0, np.int64)
        offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        np.save(f"{self.prefix}.idx.npy", offsets)
        return len(lengths)


def _load_tokens(prefix: Path) -> tuple[np.ndarray, np.ndarray]:
    offsets = np.load(f"{prefix}.idx.npy")
    bin_path = Path(f"{prefix}.bin")
    n_bytes = bin_path.stat().st_size
    if n_bytes != int(offsets[-1]) * TOKEN_DTYPE.itemsize:
        raise DataError(bin_path, f"{n_bytes} bytes, expected {int(offsets[-1])} int32 tokens")
    if n_bytes == 0:
        return np.zeros(0, TOKEN_DTYPE), offsets
    return np.memmap(bin_path, dtype=TOKEN_DTYPE, mode="r"), offsets


def read_text_file(path: str | Path) -> list[str]:
    """Lines of a prepared `{split}.{lang}.txt` (split on "\\n" only, as it was written)."""
    with open(path, encoding="utf-8", newline="") as f:
        lines = f.read().split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    return lines


class ParallelSplit:
    """One binarized split of a prepared corpus (memory-mapped).

    Attributes:
        src_lens, tgt_lens: (N,) int64 sequence lengths including the EOS collate appends.
    """

    def __init__(self, directory: Path, name: str, src_lang: str, tgt_lang: str) -> None:
        self.directory, self.name = directory, name
        self.src_lang, self.tgt_lang = src_lang, tgt_lang
        self._src, self._src_off = _load_tokens(directory / f"{name}.{src_lang}")
        self._tgt, self._tgt_off = _load_tokens(directory / f"{name}.{tgt_lang}")
        if len(self._src_off) != len(self._tgt_off):
            raise DataError(directory / f"{name}.{tgt_lang}.idx.npy", "split is misaligned")
        self.src_lens = np.diff(self._src_off) + 1
        self.tgt_lens = np.diff(self._tgt_off) + 1
        self._texts: dict[str, list[str]] = {}

    def __len__(self) -> int:
        return len(self._src_off) - 1

    def src_tokens(self, i: int) -> np.ndarray:
        """(L,) int32 subword ids of source i, without BOS/EOS."""
        return self._src[self._src_off[i] : self._src_off[i + 1]]

    def tgt_tokens(self, i: int) -> np.ndarray:
        """(L,) int32 subword ids of target i, without BOS/EOS."""
        return self._tgt[self._tgt_off[i] : self._tgt_off[i + 1]]

    def text(self, lang: str) -> list[str]:
        """The raw lines of one side, as in the input (loaded once, then cached)."""
        if lang not in self._texts:
            self._texts[lang] = read_text_file(self.directory / f"{self.name}.{lang}.txt")
        return self._texts[lang]

    def src_text(self, i: int) -> str:
        return self.text(self.src_lang)[i]

    def tgt_text(self, i: int) -> str:
        return self.text(self.tgt_lang)[i]


class PreparedData:
    """A prepared-data directory: manifest, tokenizer and splits."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        manifest_path = self.path / MANIFEST
        if not manifest_path.is_file():
            raise DataError(manifest_path, "not found: run `transformer prepare` first")
        try:
            self.manifest: dict = json.loads(manifest_path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, ValueError) as e:
            raise DataError(manifest_path, f"unreadable ({e}); prepare the data again") from e
        if not isinstance(self.manifest, dict):
            raise DataError(manifest_path, "not a prepared-data manifest")
        if self.manifest.get("format_version") != FORMAT_VERSION:
            raise DataError(manifest_path, f"format_version is not {FORMAT_VERSION}; re-prepare")
        self.src_lang: str = self.manifest["src_lang"]
        self.tgt_lang: str = self.manifest["tgt_lang"]
        settings = self.manifest.get("settings", {})
        self.lowercase = bool(settings.get("lowercase", False))  # `prepare --lowercase`
        self.tokenizer = Tokenizer(self.path / self.manifest["spm_model"], lowercase=self.lowercase)
        self._splits: dict[str, ParallelSplit] = {}

    @property
    def split_names(self) -> list[str]:
        return list(self.manifest["splits"])

    def split(self, name: str) -> ParallelSplit:
        """The split `name` ("train", "valid" or "test"), loaded on first use."""
        if name not in self.manifest["splits"]:
            raise KeyError(f"{self.path}: no split {name!r}; have {self.split_names}")
        if name not in self._splits:
            self._splits[name] = ParallelSplit(self.path, name, self.src_lang, self.tgt_lang)
        return self._splits[name]


def load_prepared(path: str | Path) -> PreparedData:
    """Open a prepared-data directory written by `prepare.prepare_corpus`."""
    return PreparedData(path)


# --------------------------------------------------------------------------------------------
# Collation
# --------------------------------------------------------------------------------------------


@dataclass
class Batch:
    """A padded batch of pairs.

    Attributes:
        src: (B, S) int64, tokens + [EOS], right-padded with PAD_ID.
        tgt_in: (B, T) int64, [BOS] + tokens (decoder input, teacher forcing).
        tgt_out: (B, T) int64, tokens + [EOS] (what the decoder predicts).
        src_mask: (B, S) bool, True at real (non-pad) source positions.
        n_src_tokens, n_tgt_tokens: real (non-pad) token counts, EOS included.
        indices: the pairs' indices in their split.
    """

    src: torch.Tensor
    tgt_in: torch.Tensor
    tgt_out: torch.Tensor
    src_mask: torch.Tensor
    n_src_tokens: int
    n_tgt_tokens: int
    indices: list[int]

    def to(self, device: torch.device | str, non_blocking: bool = False) -> Batch:
        """A copy with every tensor on `device`."""
        return Batch(
            src=self.src.to(device, non_blocking=non_blocking),
            tgt_in=self.tgt_in.to(device, non_blocking=non_blocking),
            tgt_out=self.tgt_out.to(device, non_blocking=non_blocking),
            src_mask=self.src_mask.to(device, non_blocking=non_blocking),
            n_src_tokens=self.n_src_tokens,
            n_tgt_tokens=self.n_tgt_tokens,
            indices=self.indices,
        )


def collate(split: ParallelSplit, indices: Sequence[int]) -> Batch:
    """Pad the pairs `indices` of `split` into a Batch (see `Batch` for the shapes)."""
    indices = [int(i) for i in indices]
    src_lens = split.src_lens[indices]
    tgt_lens = split.tgt_lens[indices]
    n_batch = len(indices)
    src = np.full((n_batch, int(src_lens.max(initial=1))), PAD_ID, dtype=np.int64)  # (B, S)
    tgt_in = np.full((n_batch, int(tgt_lens.max(initial=1))), PAD_ID, dtype=np.int64)  # (B, T)
    tgt_out = np.full_like(tgt_in, PAD_ID)  # (B, T)
    for row, i in enumerate(indices):
        s, t = split.src_tokens(i), split.tgt_tokens(i)
        src[row, : len(s)] = s
        src[row, len(s)] = EOS_ID
        tgt_in[row, 0] = BOS_ID
        tgt_in[row, 1 : len(t) + 1] = t
        tgt_out[row, : len(t)] = t
        tgt_out[row, len(t)] = EOS_ID
    src_mask = np.arange(src.shape[1])[None, :] < src_lens[:, None]  # (B, S)
    import torch  # here, not at the top: see TYPE_CHECKING above

    return Batch(
        src=torch.from_numpy(src),
        tgt_in=torch.from_numpy(tgt_in),
        tgt_out=torch.from_numpy(tgt_out),
        src_mask=torch.from_numpy(src_mask),
        n_src_tokens=int(src_lens.sum()),
        n_tgt_tokens=int(tgt_lens.sum()),
        indices=indices,
    )
