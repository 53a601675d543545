"""uvicorn's server with a drain: the first SIGTERM (or SIGINT) stops new requests (503, and
``/ready`` answers 503) while the requests already taken run to their end; once none is left (or
``drain_timeout_s`` passed) uvicorn's own graceful shutdown closes the connections and the process
exits 0. A second signal is uvicorn's: stop now. An engine thread that dies drains the server the
same way (its requests have ended with its error), and the process exits ``ENGINE_DIED`` so that a
supervisor restarts it. Connections are bounded before their first request (connections.py).
"""
from __future__ import annotations

import asyncio
import functools
import logging
import os
import signal
import time

try:
    import uvicorn
except ImportError as exc:  # the serve extra
    raise ImportError("models.llama.serve needs the serve extra: pip install 'ms_rope_attention[serve]'") from exc

from .connections import (RESERVED_FILES, AcceptErrors, ConnectionLimits, LimitedH11Protocol, Listener,
                          default_max_connections, raise_open_files_limit)
from .scheduler import EngineService

# The exit status after the engine thread died: sysexits' "internal software error", not 1 (any uncaught
# exception) nor 3 (uvicorn's failure to start), so a supervisor's log tells the three apart.
ENGINE_DIED = os.EX_SOFTWARE

log = logging.getLogger("models.llama.serve")


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, service: EngineService, drain_timeout_s: float = 300.0):
        super().__init__(config)
        self.service, self.drain_timeout_s = service, drain_timeout_s
        self._drain_started: float | None = None
        self.exit_status = 0

    async def startup(self, sockets=None) -> None:
        loop = asyncio.get_running_loop()
        loop.set_exception_handler(AcceptErrors(loop))
        await super().startup(sockets)

    def handle_exit(self, sig: int, frame) -> None:
        if self._drain_started is None:
            log.info("%s: draining (no new requests; %d in flight finish first)", signal.Signals(sig).name,
                     self.service.in_flight)
            self._drain()
            return
        super().handle_exit(sig, frame)

    def _drain(self) -> None:
        self.service.start_drain()
        self._drain_started = time.monotonic()

    async def on_tick(self, counter: int) -> bool:
        if not self.service.alive and self.exit_status == 0:
            log.error("the engine thread stopped (%r): draining, then exiting with status %d", self.service.error,
                      ENGINE_DIED)
            self.exit_status = ENGINE_DIED
            if self._drain_started is None:
                self._drain()
        if self._drain_started is not None and not self.should_exit:
            # a dead engine has ended its requests and holds nothing: only their HTTP answers are left
            drained = self.service.in_flight == 0 if self.exit_status == ENGINE_DIED else self.service.idle()
            if drained:
                log.info("drained: shutting down")
                self.should_exit = True
            elif time.monotonic() - self._drain_started > self.drain_timeout_s:
                log.warning("drain timeout (%.0f s): shutting down with %d requests in flight",
                            self.drain_timeout_s, self.service.in_flight)
                self.should_exit = True
        return await super().on_tick(counter)


def run(app, service: EngineService, *, host: str, port: int, timeout_keep_alive: int = 5,
        drain_timeout_s: float = 300.0, max_connections: int | None = None, header_timeout_s: float = 10.0,
        log_level: str = "info") -> int:
    """Serves ``app`` until a signal drains it or its engine dies (the module's docstring); returns the
    process's exit status. The soft open-files limit is raised to the hard one first, and the default
    ``max_connections`` sized from it."""
    before, open_files = raise_open_files_limit()
    limits = ConnectionLimits(max_connections or default_max_connections(open_files), header_timeout_s)
    log.info("open files: at most %d%s; connections: at most %d (--max-connections), each with %g s to send a "
             "request's head (--header-timeout)", open_files, f" (raised from {before})" if before < open_files else "",
             limits.max_connections, header_timeout_s)
    if limits.max_connections > open_files - RESERVED_FILES:
        log.warning("--max-connections %d leaves fewer than %d of the %d open files for the server's own: past "
                    "them, accept() fails", limits.max_connections, RESERVED_FILES, open_files)
    config = uvicorn.Config(app, host=host, port=port, http=functools.partial(LimitedH11Protocol, limits=limits),
                            timeout_keep_alive=timeout_keep_alive, timeout_graceful_shutdown=30, log_level=log_level)
    server = DrainingServer(config, service, drain_timeout_s)
    server.run(sockets=[Listener.bind(config)])
    return server.exit_status
