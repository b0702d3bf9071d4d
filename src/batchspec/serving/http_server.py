"""The HTTP server `batchspec serve` runs: uvicorn, with deadlines on connections and a shutdown that answers everyone.

uvicorn alone holds a socket forever while a client sends nothing, sends headers a line at a time, or never finishes
its body, and at shutdown it cancels handlers that are still running (the client gets a cut stream or a bare 500).
This module adds, around the app of `serving.app`:

- `GuardedH11Protocol`: a connection must finish its request headers within `header_timeout_s` of opening (or of
  the previous response): an idle socket is closed, one with half its headers gets 408. Past `max_connections`
  open sockets a new one gets 503 at once. A request line or header h11 cannot parse gets a JSON 400.
  (Request bodies have their own deadline in `serving.errors.BodyGuard`; idle keep-alive sockets are closed after
  `keep_alive_s` by uvicorn.)
- `Server.shutdown`: stop listening, refuse new requests (503), let in-flight ones run until `drain_timeout_s`, then
  cancel the rest through the engine thread, so that each ends with an OpenAI error body (non-streaming, 503) or an
  error event and `data: [DONE]` (streaming); only then uvicorn's own shutdown, which finds nothing to cancel.

Every error here is OpenAI JSON, as the app's own.
"""

from __future__ import annotations

import asyncio
import json
import time

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from batchspec.serving.protocol import error_body

FLUSH_S = 1.0  # after cancelling, time for handlers to write their last bytes before uvicorn's own shutdown


class Config(uvicorn.Config):
    """uvicorn's config plus the connection limits `GuardedH11Protocol` reads."""

    def __init__(self, app, *, header_timeout_s: float, max_connections: int, drain_timeout_s: float,
                 keep_alive_s: float, **kwargs) -> None:
        super().__init__(app, http=GuardedH11Protocol, timeout_keep_alive=keep_alive_s,
                         timeout_graceful_shutdown=FLUSH_S, **kwargs)
        self.header_timeout_s, self.max_connections = header_timeout_s, max_connections
        self.drain_timeout_s = drain_timeout_s


def server_for(app, server_config, host: str, port: int, log_level: str = "info") -> Server:
    """A `Server` for an app of `serving.app.create_app`, with the limits of its `ServerConfig`."""
    c = server_config
    return Server(Config(app, host=host, port=port, log_level=log_level, header_timeout_s=c.header_timeout_s,
                         max_connections=c.max_connections, drain_timeout_s=c.drain_timeout_s,
                         keep_alive_s=c.keep_alive_s))


class Server(uvicorn.Server):
    async def shutdown(self, sockets=None) -> None:
        engine_loop = _engine_loop(self.config)
        if engine_loop is not None:
            for server in self.servers:  # no new connections while draining
                server.close()
            await _drain(engine_loop, self.config.drain_timeout_s)
        await super().shutdown(sockets)


def _engine_loop(config):
    """The app's `EngineLoop` (create_app keeps it in app.state); None for another app."""
    app = config.app
    state = getattr(app, "state", None)
    return getattr(state, "engine_loop", None)


async def _drain(engine_loop, timeout_s: float) -> None:
    """Refuse new requests, wait for in-flight ones up to `timeout_s`, cancel the rest and let their handlers answer."""
    engine_loop.refuse_new()
    deadline = time.monotonic() + timeout_s
    while engine_loop.in_flight and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    if engine_loop.in_flight:
        engine_loop.cancel_all()  # the engine thread ends them after its current step
        while engine_loop.in_flight and engine_loop.thread_alive:
            await asyncio.sleep(0.02)
        await asyncio.sleep(0.1)  # the handlers turn their last delta into a response


class GuardedH11Protocol(H11Protocol):
    """uvicorn's HTTP/1.1 protocol with a deadline for request headers and a cap on open connections."""

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._header_deadline: asyncio.TimerHandle | None = None
        if len(self.connections) > self.config.max_connections:
            self._reply_and_close(503, error_body(
                f"the server has {self.config.max_connections} open connections, its limit; retry later",
                "server_error", code="too_many_connections"))
            return
        self._arm_header_deadline()

    def handle_events(self) -> None:
        super().handle_events()
        if self.cycle is not None and not self.cycle.response_complete:
            self._disarm_header_deadline()  # a whole request head arrived: the body has its own deadline

    def on_response_complete(self) -> None:
        self._arm_header_deadline()  # before uvicorn handles a pipelined request, which disarms it
        super().on_response_complete()

    def connection_lost(self, exc) -> None:
        self._disarm_header_deadline()
        super().connection_lost(exc)

    def send_400_response(self, msg: str) -> None:
        """h11 could not parse the request (a bad Content-Length, a malformed header): JSON, not plain text."""
        self._reply_and_close(400, error_body(f"malformed HTTP request: {msg.rstrip('.')}", code="bad_request"))

    def _arm_header_deadline(self) -> None:
        self._disarm_header_deadline()
        if not self.transport.is_closing():
            self._header_deadline = self.loop.call_later(self.config.header_timeout_s, self._headers_timed_out)

    def _disarm_header_deadline(self) -> None:
        handle = getattr(self, "_header_deadline", None)
        if handle is not None:
            handle.cancel()
            self._header_deadline = None

    def _headers_timed_out(self) -> None:
        self._header_deadline = None
        if self.transport.is_closing() or (self.cycle is not None and not self.cycle.response_complete):
            return
        if self.conn.trailing_data[0]:  # part of a request head arrived, not all of it
            self._reply_and_close(408, error_body(
                f"the request headers did not arrive within {self.config.header_timeout_s:g} s",
                code="request_timeout"))
        else:  # an idle connection: close it as a keep-alive timeout does
            self.transport.close()

    def _reply_and_close(self, status: int, body: dict) -> None:
        """Write a whole JSON response and close, outside h11's state machine (no request may have been parsed)."""
        payload = json.dumps(body).encode()
        head = (f"HTTP/1.1 {status} {_REASONS.get(status, 'Error')}\r\ncontent-type: application/json\r\n"
                f"content-length: {len(payload)}\r\nconnection: close\r\n\r\n").encode()
        if not self.transport.is_closing():
            self.transport.write(head + payload)
            self.transport.close()
        if self.conn.our_state is not h11.ERROR:
            try:
                self.conn.send(h11.ConnectionClosed())
            except h11.LocalProtocolError:
                pass


_REASONS = {400: "Bad Request", 408: "Request Timeout", 503: "Service Unavailable"}
