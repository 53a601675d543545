"""What a connection may hold before its request is read: a cap on open connections and a deadline
for each request's head, on uvicorn's h11 protocol; the open-files limit the cap is sized from; and
asyncio's accept errors logged once per interval.

Why: a socket that sends nothing costs the server a file descriptor, and uvicorn bounds neither how
many such sockets it keeps nor how long (``timeout_keep_alive`` starts only after a response). Past
the open-files limit ``accept()`` fails, nobody is served, and asyncio logs every failed attempt.
Here a connection opened while ``max_connections`` are open is answered 503 at once and closed (its
descriptor is back before it could pile up: an HTTP-level 503 would wait for a request that an idle
socket never sends); a connection that has not sent a whole request head within ``header_timeout_s``
(of opening, or of the first byte of its next request on a kept-alive connection) is closed, as
uvicorn's keep-alive timer closes an idle one. Were the descriptors short all the same (a limit
lowered under a running server), accept errors cost one retry and at most one log line in a while
(``Listener``, ``AcceptErrors``). uvicorn's own answer to a malformed request (400) comes in the API's
error shape, and a request head over h11's ``max_incomplete_event_size`` (16 KiB) is refused even
when it arrives in one read.
"""
from __future__ import annotations

import asyncio
import errno
import http
import logging
import resource
import socket
import time
from dataclasses import dataclass, field

try:
    import h11
    from h11._connection import DEFAULT_MAX_INCOMPLETE_EVENT_SIZE
    from uvicorn.protocols.http.h11_impl import H11Protocol
except ImportError as exc:  # the serve extra
    raise ImportError("models.llama.serve needs the serve extra: pip install 'ms_rope_attention[serve]'") from exc

from .errors import APIError

log = logging.getLogger("models.llama.serve")

LINGER_S = 1.0          # a refused connection's read side stays open this long after its answer (see _close_with)
RESERVED_FILES = 128     # descriptors kept for the process's own files (checkpoint, logs, lockstep sockets)
MAX_DEFAULT_CONNECTIONS = 4096  # the default cap's ceiling: far more than the engine serves at once
ACCEPT_ERRORS = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)  # asyncio's, in _accept_connection


def raise_open_files_limit() -> tuple[int, int]:
    """Raises this process's soft RLIMIT_NOFILE to its hard limit: (before, after)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            return soft, hard
        except (ValueError, OSError) as exc:
            log.warning("could not raise the open-files limit from %d to %d: %s", soft, hard, exc)
    return soft, soft


def default_max_connections(open_files: int) -> int:
    """The cap a server with ``open_files`` descriptors keeps: its own files' share aside, at most
    ``MAX_DEFAULT_CONNECTIONS`` (idle sockets cost memory too)."""
    return max(1, min(open_files - RESERVED_FILES, MAX_DEFAULT_CONNECTIONS))


class Throttled:
    """A log message at most once per ``interval_s``, saying how many were held back since the last."""

    def __init__(self, level: int, message: str, interval_s: float = 10.0, clock=time.monotonic):
        self.level, self.message, self.interval_s, self.clock = level, message, interval_s, clock
        self._last: float | None = None
        self.held_back = 0

    def __call__(self, *args) -> None:
        now = self.clock()
        if self._last is not None and now - self._last < self.interval_s:
            self.held_back += 1
        elif self.held_back:
            log.log(self.level, self.message + " (and %d more in the %.0f s before)", *args, self.held_back,
                    now - self._last)
            self._last, self.held_back = now, 0
        else:
            log.log(self.level, self.message, *args)
            self._last = now


class Listener(socket.socket):
    """The listening socket, whose ``accept()`` ends asyncio's accept loop at the first failure for want
    of descriptors: Python 3.11's ``_accept_connection`` reports it, schedules a retry in a second and
    goes on trying, up to ``backlog`` (2048) times (CPython gh-151615, fixed upstream): thousands of
    reports and retries a second, each stale retry failing again once the server has closed the socket.
    Here the call after such a failure says the queue is empty, so one retry a second is left."""

    _exhausted = False

    def accept(self):
        if self._exhausted:
            self._exhausted = False
            raise BlockingIOError(errno.EAGAIN, "accept() waits for a descriptor to free up")
        try:
            return super().accept()
        except OSError as exc:
            self._exhausted = exc.errno in ACCEPT_ERRORS
            raise

    @classmethod
    def bind(cls, config) -> Listener:
        """uvicorn's socket for ``config`` (host, port), listening (connections queue until the server accepts)."""
        sock = config.bind_socket()
        sock.listen(config.backlog)
        return cls(sock.family, sock.type, sock.proto, fileno=sock.detach())


class AcceptErrors:
    """The event loop's exception handler: asyncio reports each failed ``accept()`` of a listening
    socket out of descriptors with a traceback (``BaseSelectorEventLoop._accept_connection``, once a
    second on a ``Listener`` while they are short); here they are logged once per interval. Every
    other report goes to the handler before it (or the loop's default)."""

    MESSAGE = "socket.accept() out of system resource"

    def __init__(self, loop: asyncio.AbstractEventLoop, interval_s: float = 10.0):
        self.previous = loop.get_exception_handler()
        self.log = Throttled(logging.ERROR, "accept() failed: %s; the server takes no new connection until "
                             "descriptors free up (open-files limit %d)", interval_s)

    def __call__(self, loop: asyncio.AbstractEventLoop, context: dict) -> None:
        exc = context.get("exception")
        if context.get("message") == self.MESSAGE and isinstance(exc, OSError) and exc.errno in ACCEPT_ERRORS:
            self.log(exc, resource.getrlimit(resource.RLIMIT_NOFILE)[0])
        elif self.previous is not None:
            self.previous(loop, context)
        else:
            loop.default_exception_handler(context)


@dataclass
class ConnectionLimits:
    """The bounds every connection of one server shares."""
    max_connections: int
    header_timeout_s: float = 10.0
    refusals: Throttled = field(default_factory=lambda: Throttled(
        logging.WARNING, "refused a connection: %d open, the most --max-connections allows"))


def _error_response(error: APIError) -> bytes:
    """A whole HTTP/1.1 response carrying ``error`` that closes its connection: written directly, where
    h11's state machine has no request to answer (a refused connection) or has given up (a malformed one)."""
    body = error.json()
    head = (f"HTTP/1.1 {error.status} {http.HTTPStatus(error.status).phrase}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\nconnection: close\r\n\r\n")
    return head.encode() + body


class LimitedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with ``ConnectionLimits`` (the module's docstring); uvicorn builds one per
    connection: ``uvicorn.Config(http=functools.partial(LimitedH11Protocol, limits=...))``."""

    def __init__(self, config, server_state, app_state, _loop=None, *, limits: ConnectionLimits):
        super().__init__(config, server_state, app_state, _loop)
        self.limits = limits
        self.max_head_bytes = config.h11_max_incomplete_event_size or DEFAULT_MAX_INCOMPLETE_EVENT_SIZE
        self.timeout_header_task: asyncio.TimerHandle | None = None
        self.closing_after_answer = False

    def connection_made(self, transport: asyncio.Transport) -> None:
        super().connection_made(transport)
        if len(self.connections) > self.limits.max_connections:
            self.limits.refusals(len(self.connections) - 1)
            self._close_with(APIError(
                503, f"the server has {self.limits.max_connections} connections open, its most "
                     "(--max-connections); retry shortly", code="too_many_connections"))
            return
        self._watch_request_head()

    def data_received(self, data: bytes) -> None:
        if self.closing_after_answer:  # answered and refused: what the client still sends is read and dropped
            return
        # h11 bounds a request head only while it is incomplete: one that arrives whole in one read (10,000
        # headers in 90 KB) would pass. While a head is awaited, h11 is handed one byte past its bound at most.
        while self.conn.their_state is h11.IDLE and not self._done():
            room = self.max_head_bytes + 1 - len(self.conn.trailing_data[0])
            if len(data) <= room:
                break
            super().data_received(data[:room])
            data = data[room:]
        if not self._done():
            super().data_received(data)
            self._watch_request_head()

    def _done(self) -> bool:
        """Closing, or answered with a refusal and lingering (``_close_with``)."""
        return self.closing_after_answer or self.transport.is_closing()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_header_timeout()
        super().connection_lost(exc)

    def send_400_response(self, msg: str) -> None:
        """uvicorn's answer to a request h11 cannot parse, in the API's error shape."""
        self._close_with(APIError(
            400, f"not a valid HTTP/1.1 request: a malformed request line or header, or a request head over "
                 f"{self.max_head_bytes} bytes", code="invalid_http_request"))

    def _close_with(self, error: APIError) -> None:
        """Answers ``error`` and closes the connection, lingering: closed at once, a socket holding bytes
        the client sent and nobody read is reset, and a reset discards the answer from the client's
        receive buffer before it is read (an async client sends its request after connecting, so it always
        loses the race). So the write side is shut after the answer, what arrives is dropped, and the
        socket closes after ``LINGER_S``, or sooner when the client closes."""
        self._cancel_header_timeout()
        self.closing_after_answer = True
        self.transport.write(_error_response(error))
        if self.transport.can_write_eof():
            self.transport.write_eof()
            self.loop.call_later(LINGER_S, self.transport.close)
        else:
            self.transport.close()

    def _watch_request_head(self) -> None:
        """Arms the header timeout while a request head is awaited, cancels it once the head is read.
        Called when the connection opens and when bytes arrive: a kept-alive connection's clock starts
        with its next request's first byte (until then, uvicorn's keep-alive timeout runs)."""
        if self.conn.their_state is not h11.IDLE or self._done():
            self._cancel_header_timeout()
        elif self.timeout_header_task is None:  # closed as uvicorn closes an idle kept-alive connection
            self.timeout_header_task = self.loop.call_later(self.limits.header_timeout_s,
                                                            self.timeout_keep_alive_handler)

    def _cancel_header_timeout(self) -> None:
        if self.timeout_header_task is not None:
            self.timeout_header_task.cancel()
            self.timeout_header_task = None
