"""`transformer serve`: a translation HTTP server (Starlette + uvicorn, optional extra `serve`).

Endpoints: POST /v1/translate, POST /v1/attention, GET /v1/model, GET /health, and the web page
at GET / (static/, served locally: no CDN). Concurrent requests are gathered for a few
milliseconds into one decoding batch: an asyncio queue feeds a single worker thread that runs the
model (torch releases the GIL, so the event loop keeps serving meanwhile). Every limit gives a
JSON error {"error": {"code", "message"}}: malformed JSON 400, body too slow 408, too large
413, invalid 422, overloaded 503, and an unexpected failure 500 (the other requests of its
decoding batch are decoded again without it). Connection timeouts and limits: connections.py.
See docs/serving.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from transformer.serving.validation import (
    ATTENTION_KEYS,
    ApiError,
    Options,
    ServeLimits,
    check_attention_size,
    check_keys,
    check_lengths,
    check_text,
    parse_json,
    parse_translate,
)

logger = logging.getLogger(__name__)

STATIC_DIR = Path(__file__).parent / "static"

__all__ = [  # the requests' names are part of this module's API too
    "ApiError", "BatchingQueue", "Options", "ServeLimits", "check_attention_size",
    "check_lengths", "create_app", "parse_json", "parse_translate", "serve",
]  # fmt: skip


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


def decode_thread() -> ThreadPoolExecutor:
    """The one worker thread that runs a server's torch work: loading the model and decoding.

    Torch's CPU threads are an OpenMP team per Python thread that has run a parallel op, and
    GNU OpenMP cuts every waiting thread's spin to 100 turns once its teams hold more threads
    than there are CPUs (`gomp_managed_threads > gomp_available_cpus`). A model built on the
    main thread and decoded on a worker left two teams of two on 2 cores: each op's threads
    then slept between ops and were woken by the kernel, and the server decoded ~35% slower
    (docs/performance.md, "Round eight"). Everything torch does for a server runs here."""
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix="decode")


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
        executor: the worker thread (one worker); by default a new one. `serve` passes the
            thread that built the model (`decode_thread`).
    """

    def __init__(
        self,
        run: Callable[[list[str], Options], list[Any]],
        wait_s: float = 0.005,
        max_sentences: int = 64,
        max_pending: int = 1024,
        executor: ThreadPoolExecutor | None = None,
    ):
        self._run, self.wait_s = run, wait_s
        self.max_sentences, self.max_pending = max_sentences, max_pending
        self._queue: asyncio.Queue[_Pending] = asyncio.Queue()
        self._executor = executor or decode_thread()
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
        while True:
            items = await self._gather()
            groups: dict[Options, list[_Pending]] = {}
            for item in items:
                groups.setdefault(item.options, []).append(item)
            for options, group in groups.items():
                n = sum(len(item.lines) for item in group)
                self.stats.batches += 1
                self.stats.sentences += n
                self.stats.largest_batch = max(self.stats.largest_batch, n)
                await self._decode(group, options)

    async def _decode(self, group: list[_Pending], options: Options) -> None:
        """Decode a group of requests as one batch. If the batch fails, each request is decoded
        again alone, so that one bad request fails alone and the others get their answers."""
        lines = [line for item in group for line in item.lines]
        loop = asyncio.get_running_loop()
        try:
            results = await loop.run_in_executor(self._executor, self._run, lines, options)
        except Exception as e:  # noqa: BLE001 - handed to the waiting request, or retried
            if len(group) > 1:
                logger.warning(
                    "a batch of %d requests failed (%s: %s); decoding them one by one",
                    len(group), type(e).__name__, e,
                )  # fmt: skip
                for item in group:
                    await self._decode([item], options)
                return
            logger.exception("a request of %d sentences failed", len(lines))
            self.stats.errors += 1
            if not group[0].future.done():
                group[0].future.set_exception(e)
            return
        start = 0
        for item in group:
            if not item.future.done():  # the client may have gone away
                item.future.set_result(results[start : start + len(item.lines)])
            start += len(item.lines)


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
        "parameters": translator.num_parameters,
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


def _error_response(status: int, code: str, message: str, headers: dict | None = None):
    from starlette.responses import Response

    # ensure_ascii: a message that quotes the request stays valid UTF-8 whatever it holds.
    body = json.dumps({"error": {"code": code, "message": message}}, ensure_ascii=True)
    return Response(body, status, headers, media_type="application/json")


def _json_errors(endpoint: Callable) -> Callable:
    """An endpoint whose ApiErrors become their JSON errors, and any other exception a JSON 500
    (logged with its traceback), so that no request gets a plain-text answer."""

    async def guarded(request):
        try:
            return await endpoint(request)
        except ApiError as e:
            headers = {"Retry-After": "1"} if e.status == 503 else None
            if e.status == 408:  # the rest of the body may still arrive: do not read it
                headers = {"Connection": "close"}
            return _error_response(e.status, e.code, e.message, headers)
        except Exception as e:  # noqa: BLE001 - the client gets a JSON 500, the log the traceback
            logger.exception("%s %s failed", request.method, request.url.path)
            message = f"unexpected {type(e).__name__}; the server's log has the details"
            return _error_response(500, "internal_error", message)

    return guarded


def _resolve(translator, options: Options) -> Options:
    """The request's options completed with the model's and checked by DecodeConfig (the same
    validation as the CLI's), so that a bad combination is a 422 here, not a failed batch."""
    from transformer.config import ConfigError

    default_beam = translator.decode.beam_size
    if options.n_best is not None and options.beam_size is None and options.n_best > default_beam:
        raise ApiError(
            422, "invalid_option",
            f"n_best={options.n_best} must be <= beam_size (the model's is {default_beam})",
        )  # fmt: skip
    try:
        cfg = translator.options(options.beam_size, options.length_penalty, options.n_best)
    except ConfigError as e:
        raise ApiError(422, "invalid_option", str(e)) from None
    return Options(cfg.beam_size, cfg.length_penalty, cfg.n_best)


def create_app(translator, limits: ServeLimits | None = None, executor=None):
    """The Starlette application serving `translator` (a `translate.Translator`), decoding on
    `executor` (`decode_thread`; default a new one): pass the thread that built the model."""
    from starlette.applications import Starlette
    from starlette.exceptions import HTTPException
    from starlette.responses import FileResponse, JSONResponse
    from starlette.routing import Mount, Route
    from starlette.staticfiles import StaticFiles

    from transformer.config import MAX_BEAM_SIZE

    limits = limits or ServeLimits()
    cfg = translator.loaded.model.cfg
    max_tokens = min(limits.max_sentence_tokens, cfg.max_len - 1)
    max_beam = min(limits.max_beam_size, MAX_BEAM_SIZE)
    limits = ServeLimits(
        **{**asdict(limits), "max_sentence_tokens": max_tokens, "max_beam_size": max_beam}
    )

    def run(lines: list[str], options: Options):
        return translator.translate(
            lines, options.beam_size, options.length_penalty, options.n_best
        )

    queue = BatchingQueue(
        run, limits.batch_wait_ms / 1000, limits.max_batch_sentences, limits.max_pending,
        executor,
    )  # fmt: skip
    state = _State(translator, limits, queue, _model_info(translator, limits))
    too_large = ApiError(413, "request_too_large", f"body > {limits.max_request_bytes} bytes")

    async def read_json(request) -> dict[str, Any]:
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limits.max_request_bytes:
            raise too_large

        async def read() -> bytes:
            body = bytearray()
            async for chunk in request.stream():
                body += chunk
                if len(body) > limits.max_request_bytes:
                    raise too_large
            return bytes(body)

        try:
            body = await asyncio.wait_for(read(), limits.body_timeout_s)
        except asyncio.TimeoutError:
            message = f"the request body did not arrive within {limits.body_timeout_s:g} s"
            raise ApiError(408, "request_timeout", message) from None
        return parse_json(body)

    async def translate(request):
        t0 = time.perf_counter()
        texts, options, want_attention = parse_translate(await read_json(request), limits)
        options = _resolve(translator, options)
        encode = translator.tokenizer.encode
        check_lengths(texts, encode, limits.max_sentence_chars, limits.max_sentence_tokens)
        if want_attention:
            check_lengths(texts, encode, limits.max_sentence_chars, limits.max_attention_tokens)
            sources = [len(encode(t)) + 1 for t in texts]  # + EOS; the targets are not known yet
            check_attention_size(
                [(S, 0) for S in sources], cfg.n_layers, cfg.n_heads, limits.max_attention_weights
            )
        nbests = await queue.submit(texts, options)
        if want_attention:
            targets = [len(n[0].tokens) + 1 for n in nbests]
            check_attention_size(
                list(zip(sources, targets, strict=True)), cfg.n_layers, cfg.n_heads,
                limits.max_attention_weights,
            )  # fmt: skip
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
        check_keys(data, ATTENTION_KEYS)
        source, target = data.get("source"), data.get("target")
        if not isinstance(source, str) or not (target is None or isinstance(target, str)):
            raise ApiError(422, "invalid_request", '"source" (and optional "target") are strings')
        check_text(source, "source")
        if target is not None:
            check_text(target, "target")
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

    async def http_error(request, exc: HTTPException):  # noqa: ARG001
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
        return _error_response(exc.status_code, code, str(exc.detail))

    async def internal_error(request, exc: Exception):  # noqa: ARG001
        # Outside the endpoints (static files, routing): Starlette logs and re-raises after it.
        return _error_response(500, "internal_error", f"unexpected {type(exc).__name__}")

    @contextlib.asynccontextmanager
    async def lifespan(app):  # noqa: ARG001
        queue.start()
        yield
        await queue.stop()

    routes = [
        Route("/", index),
        Route("/health", _json_errors(health)),
        Route("/v1/model", _json_errors(model_info)),
        Route("/v1/translate", _json_errors(translate), methods=["POST"]),
        Route("/v1/attention", _json_errors(attention), methods=["POST"]),
        Mount("/static", StaticFiles(directory=STATIC_DIR), name="static"),
    ]
    handlers = {HTTPException: http_error, Exception: internal_error}
    app = Starlette(routes=routes, exception_handlers=handlers, lifespan=lifespan)
    app.state.serve = state
    return app


def serve(
    model_path: Path,
    host: str = "127.0.0.1",
    port: int = 8000,
    limits: ServeLimits | None = None,
    dtype: str = "fp32",
    threads: int | str | None = "auto",
    verify: bool = True,
) -> None:
    """Load a model file (or run directory) and serve it until interrupted.

    Args:
        model_path: a model file or a run directory (`rundir.resolve_model`).
        host: interface to bind; loopback by default, use 0.0.0.0 deliberately.
        port: TCP port.
        limits: request limits, timeouts and batching (ServeLimits defaults when None).
        dtype: "fp32", "bf16", "int8" or "auto" (see translate.Translator, translate.auto_dtype).
        threads: CPU threads for decoding: a count, "auto" (OMP_NUM_THREADS if set, else
            tuned decoder step by step to the machine's load, threads.py: beside another
            busy process, or the clients on the same cores, torch's default of every core
            waits at each op for a thread that is not running) or None (torch's setting).
        verify: check the model file's checksum before serving it (`modelfile.load_model`).
    """
    try:
        import uvicorn
    except ImportError as e:
        from transformer.errors import UserError

        raise UserError(
            "serving needs starlette and uvicorn: pip install 'transformer[serve]'"
        ) from e
    from transformer.serving.connections import (
        ensure_file_descriptors,
        guarded_protocol,
        quiet_repeats,
    )
    from transformer.translate import Translator

    limits = limits or ServeLimits()
    ensure_file_descriptors(limits.max_connections)
    decoder = decode_thread()  # the model is built on the thread that decodes with it
    try:
        translator = decoder.submit(
            Translator.from_path, model_path, dtype=dtype, verify=verify, threads=threads
        ).result()
    except BaseException:
        decoder.shutdown(wait=False, cancel_futures=True)
        raise
    app = create_app(translator, limits, decoder)
    protocol = guarded_protocol(
        limits.max_connections, limits.idle_timeout_s, limits.header_timeout_s
    )
    quiet_repeats()
    logger.info("serving %s on http://%s:%d", model_path, host, port)
    uvicorn.run(
        app, host=host, port=port, http=protocol, timeout_keep_alive=limits.idle_timeout_s,
        log_level="info", access_log=False,
    )  # fmt: skip
