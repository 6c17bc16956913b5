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
