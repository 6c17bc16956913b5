"""`transformer serve`: a translation HTTP server (Starlette + uvicorn, optional extra `serve`).

Endpoints: POST /v1/translate, POST /v1/attention, GET /v1/model, GET /health, and the web page
at GET / (static/, served locally: no CDN). Concurrent requests are gathered for a few
milliseconds into one decoding batch: an asyncio queue feeds a single worker thread that runs the
model (torch releases the GIL, so the event loop keeps serving meanwhile). Every limit gives a
JSON error {"error": {"code", "message"}}: malformed JSON 400, too large 413, invalid 422,
overloaded 503. See docs/serving.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

STATIC_DIR = Path(__file__).parent / "static"


@dataclass(frozen=True)
class ServeLimits:
    """Request limits and batching knobs of the server."""

    max_request_bytes: int = 256 * 1024  # whole JSON body -> 413
    max_sentences: int = 64  # sentences per request -> 413
    max_sentence_chars: int = 2000  # characters per sentence -> 413
    max_sentence_tokens: int = 250  # subword tokens per sentence (also <= model max_len) -> 413
    max_attention_tokens: int = 100  # per side for /v1/attention (weights are N*H*S*S) -> 413
    max_beam_size: int = 16  # -> 422
    max_pending: int = 1024  # sentences queued or decoding -> 503
    batch_wait_ms: float = 5.0  # how long the first request waits for company
    max_batch_sentences: int = 64  # sentences per decoding batch


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


@dataclass
class _Pending:
    lines: list[str]
    options: Options
    future: asyncio.Future


@dataclass
class BatchStats:
    """What the batching queue has done, for /health and the load test."""

    requests: int = 0
    sentences: int = 0
    batches: int = 0
    pending: int = 0
    largest_batch: int = 0
    errors: int = 0


class BatchingQueue:
    """Gathers concurrent requests into decoding batches run by one worker thread.

    The first request of a batch waits up to `wait_s` for others (up to `max_sentences`
    sentences in all); requests with different search options are decoded separately.

    Args:
        run: decodes a list of lines with one set of options, returning one result per line
            (called in the worker thread).
        wait_s: gathering window in seconds.
        max_sentences: sentences per batch.
        max_pending: sentences waiting or decoding before new requests get a 503.
    """

    def __init__(
        self,
        run: Callable[[list[str], Options], list[Any]],
        wait_s: float = 0.005,
        max_sentences: int = 64,
        max_pending: int = 1024,
    ):
        self._run, self.wait_s = run, wait_s
        self.max_sentences, self.max_pending = max_sentences, max_pending
        self._queue: asyncio.Queue[_Pending] = asyncio.Queue()
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="decode")
        self._task: asyncio.Task | None = None
        self.stats = BatchStats()

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._loop())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        self._executor.shutdown(wait=True)

    async def call(self, fn: Callable[[], Any]) -> Any:
        """Run `fn` in the model's worker thread (e.g. attention weights)."""
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn)

    async def submit(self, lines: list[str], options: Options) -> list[Any]:
        """Queue lines for decoding; returns their results once their batch is done."""
        if self.stats.pending + len(lines) > self.max_pending:
            raise ApiError(503, "overloaded", f"more than {self.max_pending} sentences queued")
        future = asyncio.get_running_loop().create_future()
        self.stats.requests += 1
        self.stats.pending += len(lines)
        await self._queue.put(_Pending(lines, options, future))
        try:
            return await future
        finally:
            self.stats.pending -= len(lines)

    async def _gather(self) -> list[_Pending]:
        items = [await self._queue.get()]
        if self.wait_s > 0:
            await asyncio.sleep(self.wait_s)  # let concurrent requests join this batch
        n = len(items[0].lines)
        while n < self.max_sentences and not self._queue.empty():
            items.append(self._queue.get_nowait())
            n += len(items[-1].lines)
        return items

    async def _loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            items = await self._gather()
            groups: dict[Options, list[_Pending]] = {}
            for item in items:
                groups.setdefault(item.options, []).append(item)
            for options, group in groups.items():
                lines = [line for item in group for line in item.lines]
                self.stats.batches += 1
                self.stats.sentences += len(lines)
                self.stats.largest_batch = max(self.stats.largest_batch, len(lines))
                try:
                    results = await loop.run_in_executor(self._executor, self._run, lines, options)
                except Exception as e:  # noqa: BLE001 - handed to every waiting request
                    logger.exception("decoding batch of %d sentences failed", len(lines))
                    self.stats.errors += 1
                    for item in group:
                        if not item.future.done():
                            item.future.set_exception(e)
                    continue
                start = 0
                for item in group:
                    if not item.future.done():  # the client may have gone away
                        item.future.set_result(results[start : start + len(item.lines)])
                    start += len(item.lines)


# ---------------------------------------------------------------------------------------------
# Request validation: pure functions, tested without a server.
# ---------------------------------------------------------------------------------------------

_TRANSLATE_KEYS = {"text", "texts", "beam_size", "length_penalty", "n_best", "attention"}
_ATTENTION_KEYS = {"source", "target"}


def parse_json(body: bytes) -> dict[str, Any]:
    """The request body as a JSON object; 400 when it is not JSON, 422 when not an object."""
    try:
        data = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ApiError(400, "malformed_json", f"request body is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise ApiError(422, "invalid_request", "request body must be a JSON object")
    return data


def _check_keys(data: dict[str, Any], known: set[str]) -> None:
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
    _check_keys(data, _TRANSLATE_KEYS)
    if ("text" in data) == ("texts" in data):
        raise ApiError(422, "invalid_request", 'give exactly one of "text" or "texts"')
    texts = [data["text"]] if "text" in data else data["texts"]
    if not isinstance(texts, list) or not all(isinstance(t, str) for t in texts):
        raise ApiError(422, "invalid_request", '"text" must be a string, "texts" a list of them')
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


# ---------------------------------------------------------------------------------------------
# The application.
# ---------------------------------------------------------------------------------------------


@dataclass
class _State:
    translator: Any
    limits: ServeLimits
    queue: BatchingQueue
    info: dict[str, Any] = field(default_factory=dict)
    started: float = field(default_factory=time.time)


def _model_info(translator, limits: ServeLimits) -> dict[str, Any]:
    loaded = translator.loaded
    return {
        "name": Path(loaded.path).name,
        "src_lang": loaded.src_lang,
        "tgt_lang": loaded.tgt_lang,
        "parameters": loaded.model.num_parameters(),
        "vocab_size": translator.tokenizer.vocab_size,
        "model": asdict(loaded.config.model),
        "decode": asdict(translator.decode),
        "dtype": str(translator.dtype).removeprefix("torch."),
        "limits": asdict(limits),
    }


def _round(value: Any) -> Any:
    """Floats in nested dicts and lists rounded to 4 decimals (a third of the JSON)."""
    if isinstance(value, dict):
        return {k: _round(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_round(v) for v in value]
    return round(value, 4) if isinstance(value, float) else value


def _result_json(nbest) -> list[dict[str, Any]]:
    return [{"text": t.text, "score": round(t.score, 4), "tokens": t.tokens} for t in nbest]


def create_app(translator, limits: ServeLimits | None = None):
    """The Starlette application serving `translator` (a `translate.Translator`)."""
    from starlette.applications import Starlette
    from starlette.exceptions import HTTPException
    from starlette.responses import FileResponse, JSONResponse
    from starlette.routing import Mount, Route
    from starlette.staticfiles import StaticFiles

    limits = limits or ServeLimits()
    max_tokens = min(limits.max_sentence_tokens, translator.loaded.model.cfg.max_len - 1)
    limits = ServeLimits(**{**asdict(limits), "max_sentence_tokens": max_tokens})

    def run(lines: list[str], options: Options):
        return translator.translate(
            lines, options.beam_size, options.length_penalty, options.n_best
        )

    queue = BatchingQueue(
        run, limits.batch_wait_ms / 1000, limits.max_batch_sentences, limits.max_pending
    )
    state = _State(translator, limits, queue, _model_info(translator, limits))

    async def read_json(request) -> dict[str, Any]:
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limits.max_request_bytes:
            raise ApiError(413, "request_too_large", f"body > {limits.max_request_bytes} bytes")
        body = bytearray()
        async for chunk in request.stream():
            body += chunk
            if len(body) > limits.max_request_bytes:
                raise ApiError(413, "request_too_large", f"body > {limits.max_request_bytes} bytes")
        return parse_json(bytes(body))

    async def translate(request):
        t0 = time.perf_counter()
        texts, options, want_attention = parse_translate(await read_json(request), limits)
        encode = translator.tokenizer.encode
        check_lengths(texts, encode, limits.max_sentence_chars, limits.max_sentence_tokens)
        if want_attention:
            check_lengths(texts, encode, limits.max_sentence_chars, limits.max_attention_tokens)
        nbests = await queue.submit(texts, options)
        results = [
            {"source": s, "translations": _result_json(n)}
            for s, n in zip(texts, nbests, strict=True)
        ]
        if want_attention:
            for result in results:
                src, tgt = result["source"], result["translations"][0]["text"]
                weights = await queue.call(lambda s=src, t=tgt: translator.attention(s, t))
                result["attention"] = _round(weights)
        elapsed = round(1000 * (time.perf_counter() - t0), 2)
        return JSONResponse({"results": results, "elapsed_ms": elapsed})

    async def attention(request):
        data = await read_json(request)
        _check_keys(data, _ATTENTION_KEYS)
        source, target = data.get("source"), data.get("target")
        if not isinstance(source, str) or not (target is None or isinstance(target, str)):
            raise ApiError(422, "invalid_request", '"source" (and optional "target") are strings')
        if not source.strip():
            raise ApiError(422, "empty_input", "nothing to show: the source is empty")
        sides = [source] if target is None else [source, target]
        check_lengths(
            sides, translator.tokenizer.encode, limits.max_sentence_chars,
            limits.max_attention_tokens,
        )  # fmt: skip
        weights = await queue.call(lambda: translator.attention(source, target))
        return JSONResponse(_round(weights))

    async def health(request):  # noqa: ARG001
        uptime = round(time.time() - state.started, 1)
        return JSONResponse({"status": "ok", "uptime_s": uptime, **asdict(queue.stats)})

    async def model_info(request):  # noqa: ARG001
        return JSONResponse(state.info)

    async def index(request):  # noqa: ARG001
        return FileResponse(STATIC_DIR / "index.html")

    async def api_error(request, exc: ApiError):  # noqa: ARG001
        body = {"error": {"code": exc.code, "message": exc.message}}
        headers = {"Retry-After": "1"} if exc.status == 503 else None
        return JSONResponse(body, status_code=exc.status, headers=headers)

    async def http_error(request, exc: HTTPException):  # noqa: ARG001
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
        body = {"error": {"code": code, "message": str(exc.detail)}}
        return JSONResponse(body, status_code=exc.status_code)

    @contextlib.asynccontextmanager
    async def lifespan(app):  # noqa: ARG001
        queue.start()
        yield
        await queue.stop()

    routes = [
        Route("/", index),
        Route("/health", health),
        Route("/v1/model", model_info),
        Route("/v1/translate", translate, methods=["POST"]),
        Route("/v1/attention", attention, methods=["POST"]),
        Mount("/static", StaticFiles(directory=STATIC_DIR), name="static"),
    ]
    handlers = {ApiError: api_error, HTTPException: http_error}
    app = Starlette(routes=routes, exception_handlers=handlers, lifespan=lifespan)
    app.state.serve = state
    return app


def serve(
    model_path: Path,
    host: str = "127.0.0.1",
    port: int = 8000,
    limits: ServeLimits | None = None,
    dtype: str = "fp32",
    threads: int | None = None,
) -> None:
    """Load a model file (or run directory) and serve it until interrupted.

    Args:
        model_path: a model file or a run directory (`rundir.resolve_model`).
        host: interface to bind; loopback by default, use 0.0.0.0 deliberately.
        port: TCP port.
        limits: request limits and batching (ServeLimits defaults when None).
        dtype: "fp32", "bf16" or "int8" (see translate.Translator).
        threads: torch intra-op threads for decoding (None = torch's default).
    """
    try:
        import uvicorn
    except ImportError as e:
        from transformer.errors import UserError

        raise UserError(
            "serving needs starlette and uvicorn: pip install 'transformer[serve]'"
        ) from e
    import torch

    from transformer.translate import Translator

    if threads is not None:
        torch.set_num_threads(threads)
    translator = Translator.from_path(model_path, dtype=dtype)
    app = create_app(translator, limits)
    logger.info("serving %s on http://%s:%d", model_path, host, port)
    uvicorn.run(app, host=host, port=port, log_level="info", access_log=False)
