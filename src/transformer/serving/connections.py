"""Connection guards of `transformer serve`: timeouts, a connection limit, a log without repeats.

uvicorn closes a keep-alive connection after an idle time, but not one that never sends its
request or trickles it (slowloris), and its `limit_concurrency` answers /health with a plain-text
503 too. `guarded_protocol` extends uvicorn's h11 protocol:

- idle_timeout_s: a connection with no request in progress that receives nothing is closed
  (a fresh one, or one kept alive after a response);
- header_timeout_s: from its first byte, a request head must be complete within this time;
- max_connections: beyond it, a new connection may still ask GET /health (monitoring must see
  an overloaded server); any other request gets a JSON 503 with Retry-After and the connection
  is closed. At max_connections + HEALTH_RESERVE the process holds no more: a new connection
  closes the one that has waited longest without a request in progress (idle, or trickling its
  head), or, when every connection is busy with a request, gets that 503 at once. So the
  process never runs out of file descriptors, and a flood of idle connections cannot keep
  /health from answering.

The request body's timeout lives in the application (server.py answers 408). See
docs/serving.md.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from typing import Any

from transformer.errors import UserError

logger = logging.getLogger(__name__)

HEALTH_RESERVE = 16  # connections beyond max_connections that may still ask /health
_FILES_BESIDES_CONNECTIONS = 64  # the model, the log, torch's threads, the listening socket

_BUSY = json.dumps(
    {"error": {"code": "overloaded", "message": "too many open connections; retry later"}}
).encode()
_BUSY_HEADERS = [
    (b"content-type", b"application/json"),
    (b"content-length", str(len(_BUSY)).encode()),
    (b"retry-after", b"1"),
    (b"connection", b"close"),
]
_BUSY_RAW = (
    b"HTTP/1.1 503 Service Unavailable\r\n"
    + b"".join(name + b": " + value + b"\r\n" for name, value in _BUSY_HEADERS)
    + b"\r\n"
    + _BUSY
)


def _health_only(app: Callable) -> Callable:
    """An ASGI app that serves GET /health with `app`, answers anything else with a JSON 503,
    and closes the connection after either."""

    async def guarded(scope: dict[str, Any], receive: Callable, send: Callable) -> None:
        async def send_and_close(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                headers = [*message.get("headers", []), (b"connection", b"close")]
                message = {**message, "headers": headers}
            await send(message)

        if scope["type"] == "http" and scope["path"] == "/health":
            await app(scope, receive, send_and_close)
            return
        await send({"type": "http.response.start", "status": 503, "headers": _BUSY_HEADERS})
        await send({"type": "http.response.body", "body": _BUSY})

    return guarded


def guarded_protocol(max_connections: int, idle_timeout_s: float, header_timeout_s: float):
    """uvicorn's H11Protocol with idle and request-head timeouts and a connection limit.

    Returns:
        A protocol class for `uvicorn.run(..., http=...)`.
    """
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class GuardedH11Protocol(H11Protocol):
        def connection_made(self, transport) -> None:  # noqa: ANN001
            self._timer, self._waiting = None, None
            super().connection_made(transport)
            open_now = len(self.connections)
            if open_now > max_connections + HEALTH_RESERVE and not self._evict_one():
                logger.warning(
                    "%d connections open (limit %d + %d for /health), all busy: refusing new ones",
                    open_now, max_connections, HEALTH_RESERVE,
                )  # fmt: skip
                transport.write(_BUSY_RAW)
                transport.close()
                return
            if open_now > max_connections:
                logger.warning(
                    "%d connections open (limit %d): new ones may only ask /health",
                    open_now, max_connections,
                )  # fmt: skip
                self.app = _health_only(self.app)
            self._arm(idle_timeout_s, waiting="idle")

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def data_received(self, data: bytes) -> None:
            if self._waiting == "idle":  # the first byte of a request head: its clock starts
                self._arm(header_timeout_s, waiting="head")
            super().data_received(data)

        def handle_events(self) -> None:
            cycle = self.cycle
            super().handle_events()
            if self.cycle is not cycle:  # a complete request head arrived
                self._disarm()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing():
                self._arm(idle_timeout_s, waiting="idle")

        def _evict_one(self) -> bool:
            """Close the connection that has waited longest without a request in progress."""
            waiting = [c for c in self.connections if getattr(c, "_waiting", None) is not None]
            if not waiting:
                return False
            oldest = min(waiting, key=lambda c: c._since)
            logger.warning("connection limit reached: closing the longest-waiting idle connection")
            oldest._disarm()
            oldest.transport.close()
            return True

        def _arm(self, seconds: float, waiting: str) -> None:
            self._disarm()
            self._waiting, self._since = waiting, self.loop.time()
            self._timer = self.loop.call_later(seconds, self._expire)

        def _disarm(self) -> None:
            if self._timer is not None:
                self._timer.cancel()
            self._timer, self._waiting = None, None

        def _expire(self) -> None:
            idle = self._waiting == "idle"
            self._timer, self._waiting = None, None
            if not self.transport.is_closing():
                if idle:  # the ordinary end of a kept-alive connection
                    logger.debug("closing an idle connection")
                else:
                    logger.info("closing a connection whose request head did not arrive in time")
                self.transport.close()

    return GuardedH11Protocol


def ensure_file_descriptors(max_connections: int) -> None:
    """Raise the soft limit on open files to what max_connections needs, or a UserError."""
    try:
        import resource
    except ImportError:  # not Unix: nothing to raise
        return
    need = max_connections + HEALTH_RESERVE + _FILES_BESIDES_CONNECTIONS
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft >= need:
        return
    if hard != resource.RLIM_INFINITY and hard < need:
        raise UserError(
            f"--max-connections {max_connections} needs {need} open files but this process may "
            f"open {hard} (ulimit -n); lower --max-connections"
        )
    resource.setrlimit(resource.RLIMIT_NOFILE, (need, hard))


class RepeatFilter(logging.Filter):
    """Lets one record of a kind (logger, level, first line of the message template) through
    per `interval_s`; the next one let through says how many were held back meanwhile.

    An error that recurs on every attempt (a refused connection, `accept()` out of file
    descriptors) then costs one log line per interval, not one per attempt.
    """

    def __init__(self, interval_s: float = 10.0, clock: Callable[[], float] = time.monotonic):
        super().__init__()
        self.interval_s, self._clock = interval_s, clock
        self._seen: dict[tuple[str, int, str], list] = {}  # kind -> [last time let through, held]

    def filter(self, record: logging.LogRecord) -> bool:
        kind = (record.name, record.levelno, str(record.msg).split("\n", 1)[0])
        now = self._clock()
        seen = self._seen.get(kind)
        if seen is not None and now - seen[0] < self.interval_s:
            seen[1] += 1
            return False
        if len(self._seen) > 10_000:  # messages formatted before logging are each their own kind
            self._seen.clear()
        self._seen[kind] = [now, 0]
        if seen is not None and seen[1]:
            record.msg = f"{record.msg} [and {seen[1]} more like this in {now - seen[0]:.0f} s]"
        return True


QUIET_LOGGERS = ("uvicorn.error", "asyncio", __name__, "transformer.serving.server")


def quiet_repeats(interval_s: float = 10.0) -> RepeatFilter:
    """Install one RepeatFilter on the server's loggers (uvicorn, asyncio, ours); returns it."""
    repeat = RepeatFilter(interval_s)
    for name in QUIET_LOGGERS:
        logging.getLogger(name).addFilter(repeat)
    return repeat
