"""§5.1 subword model: train, load, encode, decode (sentencepiece).

The paper uses a byte-pair encoding with a shared source-target vocabulary of ~37,000 tokens for
WMT14 En-De and a 32,000 word-piece vocabulary for En-Fr. Both are sentencepiece models here
(`bpe` and `unigram`), trained jointly on both sides of the training data.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from pathlib import Path

import sentencepiece as spm

from transformer.cpuinfo import usable_cores
from transformer.errors import UserError

logger = logging.getLogger(__name__)

# Special-token ids, defined here and nowhere else. sentencepiece is trained with these ids.
PAD_ID = 0
BOS_ID = 1
EOS_ID = 2
UNK_ID = 3
SPECIAL_IDS = frozenset({PAD_ID, BOS_ID, EOS_ID, UNK_ID})

MODEL_TYPES = ("bpe", "unigram")
WORD_MARK = "\u2581"  # sentencepiece's word-boundary mark


class Tokenizer:
    """A trained sentencepiece model with the project's special-token ids.

    Args:
        model_path: path to a sentencepiece `.model` file trained by `Tokenizer.train`.
        proto: the model's bytes instead of a path (as stored in a model file).
        lowercase: lowercase every text before encoding: the model was trained on lowercased
            text (`transformer prepare --lowercase`, the Multi30k literature's preprocessing), so
            its input is lowercased as its training data was, and it writes lowercased text.
    """

    def __init__(
        self,
        model_path: str | Path | None = None,
        *,
        proto: bytes | None = None,
        lowercase: bool = False,
    ) -> None:
        self.model_path = Path(model_path) if model_path is not None else None
        self.lowercase = lowercase
        source = (
            str(self.model_path) if self.model_path is not None else "the model file's tokenizer"
        )
        try:
            if proto is not None:
                self._sp = spm.SentencePieceProcessor(model_proto=proto)
            else:
                self._sp = spm.SentencePieceProcessor(model_file=str(self.model_path))
        except (OSError, RuntimeError) as e:
            raise UserError(f"{source}: not a readable sentencepiece model: {e}") from e
        ids = (self._sp.pad_id(), self._sp.bos_id(), self._sp.eos_id(), self._sp.unk_id())
        if ids != (PAD_ID, BOS_ID, EOS_ID, UNK_ID):
            raise UserError(
                f"{source}: special ids (pad, bos, eos, unk) are {ids}, "
                f"expected {(PAD_ID, BOS_ID, EOS_ID, UNK_ID)}; retrain with Tokenizer.train"
            )

    @classmethod
    def from_proto(cls, proto: bytes, lowercase: bool = False) -> Tokenizer:
        """The tokenizer from a serialized sentencepiece model (as stored in a model file)."""
        return cls(proto=proto, lowercase=lowercase)

    @classmethod
    def train(
        cls,
        inputs: Sequence[str | Path],
        model_prefix: str | Path,
        vocab_size: int,
        model_type: str = "bpe",
        input_sentence_size: int = 1_000_000,
        num_threads: int | None = None,
        seed_sentencepiece_size: int = 1_000_000,
        user_symbols: Sequence[str] = (),
    ) -> Tokenizer:
        """Train a joint subword model on plain-text files (one sentence per line).

        Normalization is the identity (no NFKC), and unknown characters fall back to UTF-8 bytes,
        so `decode(encode(x)) == x` for any sentence without leading, trailing or repeated
        spaces (sentencepiece collapses those).

        Args:
            inputs: plain UTF-8 text files; all are sampled together (shared vocabulary).
            model_prefix: writes `{model_prefix}.model` and `{model_prefix}.vocab`.
            vocab_size: total size including the 4 special tokens and 256 byte pieces.
            model_type: "bpe" (§5.1 En-De) or "unigram" (word-piece style, §5.1 En-Fr).
            input_sentence_size: sentences sampled from `inputs` for training (0 = all).
            num_threads: training threads; default min(4, the usable cores).
            seed_sentencepiece_size: unigram seed vocabulary size.
            user_symbols: whole space-separated tokens that must each be one subword, e.g. the
                §6.3 tree symbols `(NP`, `)NP`, `XX`; they count towards `vocab_size`.

        Returns:
            The trained tokenizer.
        """
        if model_type not in MODEL_TYPES:
            raise ValueError(f"model_type must be one of {MODEL_TYPES}, got {model_type!r}")
        threads = num_threads or min(4, usable_cores())
        bad = [s for s in user_symbols if not s or any(c.isspace() for c in s)]
        if bad:
            raise ValueError(f"user_symbols must be non-empty and without spaces, got {bad[:3]}")
        # A symbol is stored with its word-boundary mark ("▁(NP"): a space-separated token then
        # costs one piece, where a bare "(NP" would cost two ("▁", "(NP").
        extra = (
            {"user_defined_symbols": [WORD_MARK + s for s in user_symbols]} if user_symbols else {}
        )
        spm.SentencePieceTrainer.train(
            input=[str(p) for p in inputs],
            model_prefix=str(model_prefix),
            vocab_size=vocab_size,
            model_type=model_type,
            pad_id=PAD_ID,
            bos_id=BOS_ID,
            eos_id=EOS_ID,
            unk_id=UNK_ID,
            character_coverage=1.0,
            byte_fallback=True,
            normalization_rule_name="identity",
            input_sentence_size=input_sentence_size,
            shuffle_input_sentence=True,
            seed_sentencepiece_size=seed_sentencepiece_size,
            num_threads=threads,
            minloglevel=2,
            **extra,
        )
        model_file = Path(f"{model_prefix}.model")
        model_file.write_bytes(strip_build_paths(model_file.read_bytes()))
        logger.info("trained %s sentencepiece model %s (V=%d)", model_type, model_file, vocab_size)
        return cls(model_file)

    @property
    def vocab_size(self) -> int:
        """Number of ids, V (embedding rows needed)."""
        return self._sp.get_piece_size()

    def encode(self, text: str) -> list[int]:
        """Subword ids of one sentence, without BOS/EOS."""
        return self._sp.encode(text.lower() if self.lowercase else text, out_type=int)

    def encode_batch(self, texts: Sequence[str], num_threads: int = 1) -> list[list[int]]:
        """Subword ids of many sentences, without BOS/EOS."""
        texts = [t.lower() for t in texts] if self.lowercase else list(texts)
        return self._sp.encode(texts, out_type=int, num_threads=num_threads)

    def decode(self, ids: Sequence[int]) -> str:
        """Text of a sequence of ids; special ids (pad, bos, eos, unk) are dropped."""
        return self._sp.decode([int(i) for i in ids if int(i) not in SPECIAL_IDS])

    def decode_batch(self, batch: Sequence[Sequence[int]]) -> list[str]:
        """`decode` for many sequences."""
        return [self.decode(ids) for ids in batch]

    def id_to_piece(self, i: int) -> str:
        """The subword string of an id (for debugging and attention plots)."""
        return self._sp.id_to_piece(int(i))


# sentencepiece's ModelProto keeps its TrainerSpec (field 2), whose `input` (1) and
# `model_prefix` (2) are the paths it was trained with: a temporary directory of this machine.
_TRAINER_SPEC, _SPEC_PATHS = 2, (1, 2)


def strip_build_paths(proto: bytes) -> bytes:
    """A serialized sentencepiece model with its training paths reduced to file names, so that
    a model file does not carry the local (temporary) path it was built in. Bytes that do not
    parse as a protobuf message are returned unchanged."""
    try:
        fields = _fields(proto)
        out = bytearray()
        for number, wire, raw, value in fields:
            if number == _TRAINER_SPEC and wire == 2:
                spec = bytearray()
                for n, w, r, v in _fields(value):
                    if n in _SPEC_PATHS and w == 2:
                        name = os.path.basename(v.decode("utf-8")).encode("utf-8")
                        r = r[: len(r) - len(v) - _varint_size(len(v))]  # the tag alone
                        r += _varint(len(name)) + name
                    spec += r
                raw = raw[: len(raw) - len(value) - _varint_size(len(value))]
                raw += _varint(len(spec)) + bytes(spec)
            out += raw
        return bytes(out)
    except (IndexError, ValueError, UnicodeDecodeError):
        return proto


def _fields(buf: bytes) -> list[tuple[int, int, bytes, bytes]]:
    """(field number, wire type, the field's raw bytes, its length-delimited payload)."""
    out, i = [], 0
    while i < len(buf):
        start = i
        key, i = _read_varint(buf, i)
        number, wire = key >> 3, key & 7
        value = b""
        if wire == 0:
            _, i = _read_varint(buf, i)
        elif wire == 1:
            i += 8
        elif wire == 2:
            size, i = _read_varint(buf, i)
            value = buf[i : i + size]
            i += size
        elif wire == 5:
            i += 4
        else:
            raise ValueError(f"protobuf wire type {wire}")
        if i > len(buf) or number == 0:
            raise ValueError("truncated protobuf")
        out.append((number, wire, buf[start:i], value))
    return out


def _read_varint(buf: bytes, i: int) -> tuple[int, int]:
    value, shift = 0, 0
    while True:
        byte = buf[i]
        value |= (byte & 0x7F) << shift
        i += 1
        if byte < 0x80:
            return value, i
        shift += 7
        if shift > 63:
            raise ValueError("bad varint")


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


def _varint_size(value: int) -> int:
    return len(_varint(value))
