"""serving/connections.py: the log without repeats, the file-descriptor limit, /health only.

The timeouts and the connection limit themselves are driven over real sockets in
tests/integration/test_serve_http.py.
"""

from __future__ import annotations

import asyncio
import json
import logging

import pytest

from transformer.errors import UserError
from transformer.serving import connections
from transformer.serving.connections import RepeatFilter, ensure_file_descriptors


def test_a_repeated_error_is_logged_once_per_interval_with_a_count():
    now = [0.0]
    repeat = RepeatFilter(interval_s=10, clock=lambda: now[0])
    log = logging.getLogger("test.repeat")
    log.addFilter(repeat)
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    log.addHandler(handler)
    try:
        for attempt in range(500):  # e.g. accept() out of file descriptors, every attempt
            now[0] = attempt * 0.01
            log.error("socket.accept() out of system resource\nsocket: %s", "fd 3")
        log.warning("another message")
        now[0] = 12.0
        log.error("socket.accept() out of system resource\nsocket: %s", "fd 3")
    finally:
        log.removeHandler(handler)
        log.removeFilter(repeat)
    messages = [r.getMessage() for r in records]
    assert len(messages) == 3 and messages[1] == "another message"
    assert messages[2].endswith("[and 499 more like this in 12 s]")


def test_the_file_limit_is_raised_for_the_connections_or_refused(monkeypatch):
    import resource

    calls = []
    monkeypatch.setattr(resource, "getrlimit", lambda _: (100, 1000))
    monkeypatch.setattr(resource, "setrlimit", lambda _, limits: calls.append(limits))
    ensure_file_descriptors(256)
    assert calls == [(256 + connections.HEALTH_RESERVE + 64, 1000)]
    with pytest.raises(UserError, match="--max-connections 5000 needs 5080 open files"):
        ensure_file_descriptors(5000)


def test_over_the_limit_only_health_is_served_and_the_connection_closes():
    async def app(scope, receive, send):  # noqa: ARG001
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b'{"status": "ok"}'})

    async def call(path):
        sent = []

        async def send(message):
            sent.append(message)

        await connections._health_only(app)({"type": "http", "path": path}, None, send)
        return sent

    health = asyncio.run(call("/health"))
    assert health[0]["status"] == 200 and (b"connection", b"close") in health[0]["headers"]
    busy = asyncio.run(call("/v1/translate"))
    assert busy[0]["status"] == 503 and (b"retry-after", b"1") in busy[0]["headers"]
    assert (b"connection", b"close") in busy[0]["headers"]
    assert json.loads(busy[1]["body"])["error"]["code"] == "overloaded"


class _Transport:
    """Enough of an asyncio transport for uvicorn's h11 protocol."""

    def __init__(self, port: int):
        self.port, self.written, self.closed = port, b"", False

    def get_extra_info(self, name, default=None):
        return {"peername": ("127.0.0.1", self.port), "sockname": ("127.0.0.1", 8000)}.get(
            name, default
        )

    def write(self, data: bytes) -> None:
        self.written += data

    def close(self) -> None:
        self.closed = True

    def is_closing(self) -> bool:
        return self.closed

    def pause_reading(self) -> None: ...

    def resume_reading(self) -> None: ...


def test_at_the_hard_limit_the_longest_idle_connection_goes_else_the_new_one_is_refused():
    from uvicorn.config import Config
    from uvicorn.server import ServerState

    async def app(scope, receive, send): ...  # never runs: the loop is not started

    loop = asyncio.new_event_loop()
    config, state = Config(app, lifespan="off"), ServerState()
    protocol = connections.guarded_protocol(
        max_connections=1, idle_timeout_s=60, header_timeout_s=60
    )
    total = 1 + connections.HEALTH_RESERVE

    def connect(port: int, request: bytes = b""):
        p = protocol(config=config, server_state=state, app_state={}, _loop=loop)
        p.connection_made(_Transport(port))
        if request:
            p.data_received(request)
        return p

    try:
        busy = b"POST /v1/translate HTTP/1.1\r\nHost: x\r\nContent-Length: 10\r\n\r\n"
        held = [connect(port, busy) for port in range(1, total)]  # heads in, bodies pending
        idle = connect(total)  # the one connection without a request in progress
        assert len(state.connections) == total and not idle.transport.closed
        newcomer = connect(total + 1)
        assert idle.transport.closed and not newcomer.transport.closed  # it took idle's place
        idle.connection_lost(None)
        newcomer.data_received(busy)
        refused = connect(total + 2)  # every connection busy: 503 before reading anything
        assert refused.transport.closed and refused.transport.written.startswith(b"HTTP/1.1 503")
        assert b'"code": "overloaded"' in refused.transport.written
        assert not any(p.transport.closed for p in held)
    finally:
        for task in state.tasks:
            task.cancel()
        loop.run_until_complete(asyncio.gather(*state.tasks, return_exceptions=True))
        loop.close()
