"""Requests to `transformer serve`: their limits, and the validation of their bodies.

Pure functions, tested without a server: each refusal is an ApiError that server.py turns into
a JSON error {"error": {"code", "message"}} with its HTTP status.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from transformer.errors import UserError


@dataclass(frozen=True)
class ServeLimits:
    """Request limits and batching knobs of the server."""

    max_request_bytes: int = 256 * 1024  # whole JSON body -> 413
    max_sentences: int = 64  # sentences per request -> 413
    max_sentence_chars: int = 2000  # characters per sentence -> 413
    max_sentence_tokens: int = 250  # subword tokens per sentence (also <= model max_len) -> 413
    max_attention_tokens: int = 100  # per side for /v1/attention (weights are N*H*S*S) -> 413
    max_attention_weights: int = 2_000_000  # in one /v1/translate answer (~14 MB JSON) -> 413
    max_beam_size: int = 16  # -> 422 (DecodeConfig bounds every caller at MAX_BEAM_SIZE)
    max_pending: int = 1024  # sentences queued or decoding -> 503
    batch_wait_ms: float = 5.0  # how long the first request waits for company
    max_batch_sentences: int = 64  # sentences per decoding batch
    max_connections: int = 256  # open connections; beyond: /health only, others 503
    idle_timeout_s: float = 5.0  # a connection that sends nothing between requests is closed
    header_timeout_s: float = 10.0  # from its first byte, a request head must arrive in this
    body_timeout_s: float = 30.0  # from its head, a request body must arrive in this -> 408

    def __post_init__(self) -> None:
        for key, value in asdict(self).items():
            # batch_wait_ms may be 0 (no gathering); every other limit must be positive.
            if not (math.isfinite(value) and (value > 0 or key == "batch_wait_ms" and value == 0)):
                raise UserError(f"serve: {key} must be a positive number, got {value}")


class ApiError(Exception):
    """A request the server refuses; becomes a JSON error response with `status`."""

    def __init__(self, status: int, code: str, message: str):
        super().__init__(message)
        self.status, self.code, self.message = status, code, message


@dataclass(frozen=True)
class Options:
    """Per-request search options (None = the model file's decode config)."""

    beam_size: int | None = None
    length_penalty: float | None = None
    n_best: int | None = None


TRANSLATE_KEYS = {"text", "texts", "beam_size", "length_penalty", "n_best", "attention"}
ATTENTION_KEYS = {"source", "target"}


def parse_json(body: bytes) -> dict[str, Any]:
    """The request body as a JSON object; 400 when it is not JSON, 422 when not an object."""
    try:
        data = json.loads(body)
    except RecursionError:
        raise ApiError(400, "malformed_json", "request body is JSON nested too deeply") from None
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError, an integer of > 4300 digits
        raise ApiError(400, "malformed_json", f"request body is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise ApiError(422, "invalid_request", "request body must be a JSON object")
    return data


def check_text(text: str, where: str) -> None:
    """422 for a string JSON allows but text cannot hold: a lone UTF-16 surrogate ("\\ud800")."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ApiError(
            422, "invalid_text",
            f"{where}: character {e.start} is a lone UTF-16 surrogate (U+{ord(text[e.start]):04X})",
        ) from None  # fmt: skip


def check_keys(data: dict[str, Any], known: set[str]) -> None:
    unknown = sorted(set(data) - known)
    if unknown:
        raise ApiError(
            422, "unknown_option", f"unknown option(s) {unknown}; known: {sorted(known)}"
        )


def _int_option(data: dict, key: str, low: int, high: int) -> int | None:
    value = data.get(key)
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        raise ApiError(422, "invalid_option", f"{key} must be an integer in [{low}, {high}]")
    return value


def parse_translate(data: dict[str, Any], limits: ServeLimits) -> tuple[list[str], Options, bool]:
    """Validate a /v1/translate body: {"text": str} or {"texts": [str, ...]} plus options.

    Returns:
        The sentences, the search options, and whether attention weights are wanted.
    """
    check_keys(data, TRANSLATE_KEYS)
    if ("text" in data) == ("texts" in data):
        raise ApiError(422, "invalid_request", 'give exactly one of "text" or "texts"')
    texts = [data["text"]] if "text" in data else data["texts"]
    if not isinstance(texts, list) or not all(isinstance(t, str) for t in texts):
        raise ApiError(422, "invalid_request", '"text" must be a string, "texts" a list of them')
    for i, text in enumerate(texts):
        check_text(text, f"sentence {i}")
    if not any(t.strip() for t in texts):
        raise ApiError(422, "empty_input", "nothing to translate: the input is empty")
    if len(texts) > limits.max_sentences:
        raise ApiError(
            413, "too_many_sentences", f"{len(texts)} sentences > limit {limits.max_sentences}"
        )
    beam = _int_option(data, "beam_size", 1, limits.max_beam_size)
    n_best = _int_option(data, "n_best", 1, limits.max_beam_size)
    if n_best is not None and beam is not None and n_best > beam:
        raise ApiError(422, "invalid_option", f"n_best={n_best} must be <= beam_size={beam}")
    alpha = data.get("length_penalty")
    if alpha is not None and (
        not isinstance(alpha, int | float) or isinstance(alpha, bool) or not 0 <= alpha <= 10
    ):
        raise ApiError(422, "invalid_option", "length_penalty (α) must be a number in [0, 10]")
    attention = data.get("attention", False)
    if not isinstance(attention, bool):
        raise ApiError(422, "invalid_option", "attention must be true or false")
    alpha = None if alpha is None else float(alpha)
    return texts, Options(beam, alpha, n_best), attention


def check_lengths(
    texts: Sequence[str], encode: Callable[[str], list[int]], max_chars: int, max_tokens: int
) -> None:
    """413 naming the first sentence (0-based) longer than the limits."""
    for i, text in enumerate(texts):
        if len(text) > max_chars:
            raise ApiError(
                413, "sentence_too_long", f"sentence {i}: {len(text)} characters > {max_chars}"
            )
        n = len(encode(text))
        if n > max_tokens:
            raise ApiError(
                413, "sentence_too_long", f"sentence {i}: {n} subword tokens > {max_tokens}"
            )


def check_attention_size(
    sides: Sequence[tuple[int, int]], n_layers: int, n_heads: int, limit: int
) -> None:
    """413 when the attention weights of these (source, target) token counts exceed `limit`.

    Per sentence: encoder N*H*S*S, decoder N*H*T*T and cross N*H*T*S weights.
    """
    total = sum(n_layers * n_heads * (S * S + T * T + T * S) for S, T in sides)
    if total > limit:
        raise ApiError(
            413, "attention_too_large",
            f"attention weights for these {len(sides)} sentences: {total:,} > limit {limit:,}; "
            "ask for fewer or shorter sentences, or one at a time with /v1/attention",
        )  # fmt: skip
