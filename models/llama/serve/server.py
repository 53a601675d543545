"""uvicorn's server with a drain: the first SIGTERM (or SIGINT) stops new requests (503, and
``/ready`` answers 503) while the requests already taken run to their end; once none is left (or
``drain_timeout_s`` passed) uvicorn's own graceful shutdown closes the connections and the process
exits 0. A second signal is uvicorn's: stop now.
"""
from __future__ import annotations

import logging
import signal
import time

try:
    import uvicorn
except ImportError as exc:  # the serve extra
    raise ImportError("models.llama.serve needs the serve extra: pip install 'ms_rope_attention[serve]'") from exc

from .scheduler import EngineService

log = logging.getLogger("models.llama.serve")


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, service: EngineService, drain_timeout_s: float = 300.0):
        super().__init__(config)
        self.service, self.drain_timeout_s = service, drain_timeout_s
        self._drain_started: float | None = None

    def handle_exit(self, sig: int, frame) -> None:
        if self._drain_started is None:
            log.info("%s: draining (no new requests; %d in flight finish first)", signal.Signals(sig).name,
                     self.service.in_flight)
            self.service.start_drain()
            self._drain_started = time.monotonic()
            return
        super().handle_exit(sig, frame)

    async def on_tick(self, counter: int) -> bool:
        if self._drain_started is not None and not self.should_exit:
            if self.service.idle():
                log.info("drained: shutting down")
                self.should_exit = True
            elif time.monotonic() - self._drain_started > self.drain_timeout_s:
                log.warning("drain timeout (%.0f s): shutting down with %d requests in flight",
                            self.drain_timeout_s, self.service.in_flight)
                self.should_exit = True
        return await super().on_tick(counter)


def run(app, service: EngineService, *, host: str, port: int, timeout_keep_alive: int = 5,
        drain_timeout_s: float = 300.0, log_level: str = "info") -> None:
    """Serves ``app`` until a signal drains it (see the module's docstring)."""
    config = uvicorn.Config(app, host=host, port=port, timeout_keep_alive=timeout_keep_alive,
                            timeout_graceful_shutdown=30, log_level=log_level)
    DrainingServer(config, service, drain_timeout_s).run()
