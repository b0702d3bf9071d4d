"""`batchspec serve` against clients that hold sockets: idle, slow headers, short or endless bodies, too many
connections, a malformed request head. Deadlines are set small (0.5 s); the only waits are those deadlines.

Before `serving.http_server` and BodyGuard's deadline, every one of these sockets stayed open for good.
"""

from __future__ import annotations

import json
import socket
import time

import pytest
from test_server import CONTEXT, MODEL, LiveServer, _completion, tiny_target  # noqa: F401 (a fixture)

from batchspec import Engine
from batchspec.serving.app import ServerConfig, create_app

DEADLINE_S = 0.5
SOCKET_TIMEOUT_S = 30.0  # far past every deadline: reaching it means the server never reacted


def limited_server(target, **limits) -> LiveServer:
    config = ServerConfig(model_name=MODEL, max_model_len=CONTEXT, header_timeout_s=DEADLINE_S,
                          body_timeout_s=DEADLINE_S, keep_alive_s=DEADLINE_S, drain_timeout_s=1.0, **limits)
    return LiveServer(create_app(Engine(target, max_batch_size=2), config))


@pytest.fixture(scope="module")
def live(tiny_target):
    server = limited_server(tiny_target)
    yield server
    server.stop()


def connect(live: LiveServer) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", live.port), timeout=SOCKET_TIMEOUT_S)
    return sock


def read_until_closed(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection (a socket timeout fails the test)."""
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    sock.close()
    return data


def response_of(raw: bytes) -> tuple[int, dict]:
    head, _, body = raw.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    return status, json.loads(body)


def test_an_idle_connection_is_closed(live):
    sock = connect(live)
    assert read_until_closed(sock) == b""  # closed without a word, as a keep-alive timeout


def test_slow_headers_get_408(live):
    socks = [connect(live) for _ in range(8)]
    for sock in socks:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
    for _ in range(20):  # a header line every 0.1 s, past the 0.5 s deadline
        time.sleep(0.1)
        for sock in socks:
            try:
                sock.sendall(b"X-Slow: 1\r\n")
            except OSError:  # already answered and closed
                pass
    for sock in socks:
        status, body = response_of(read_until_closed(sock))
        assert status == 408 and body["error"]["code"] == "request_timeout"


def test_a_body_shorter_than_its_content_length_gets_408(live):
    sock = connect(live)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: 100\r\n\r\n{\"model\": ")
    status, body = response_of(read_until_closed(sock))
    assert status == 408 and body["error"]["code"] == "request_timeout" and "10 bytes" in body["error"]["message"]


def test_an_endless_chunked_body_gets_408(live):
    sock = connect(live)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n")
    sock.settimeout(0.1)
    answer = b""
    started = time.monotonic()
    while time.monotonic() - started < SOCKET_TIMEOUT_S:  # keeps sending: the deadline is for the whole body
        try:
            sock.sendall(b"1\r\n \r\n")
            answer += sock.recv(65536)
        except TimeoutError:
            continue
        except OSError:
            break
        if b"\r\n\r\n" in answer and answer.endswith(b"}"):
            break
    sock.close()
    status, body = response_of(answer)
    assert status == 408 and body["error"]["code"] == "request_timeout"


def test_keep_alive_connections_are_closed_when_idle(live):
    sock = connect(live)
    body = _completion(max_tokens=2)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    status, answer = response_of(read_until_closed(sock))  # answered, then closed once idle
    assert status == 200 and answer["choices"][0]["finish_reason"] in ("stop", "length")


def test_a_malformed_request_head_gets_a_json_400(live):
    sock = connect(live)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: abc\r\n\r\n{}")
    status, body = response_of(read_until_closed(sock))
    assert status == 400 and body["error"]["code"] == "bad_request"


def test_connections_past_the_limit_get_503(tiny_target):
    server = limited_server(tiny_target, max_connections=3)
    try:
        held = [connect(server) for _ in range(3)]
        status, body = response_of(read_until_closed(connect(server)))
        assert status == 503 and body["error"]["code"] == "too_many_connections"
        for sock in held:
            sock.close()
        time.sleep(0.1)
        assert server.request("POST", "/v1/completions", _completion(max_tokens=2))[0] == 200
    finally:
        server.stop()


def test_serving_goes_on(live):
    status, data = live.request("POST", "/v1/completions", _completion(max_tokens=3))
    assert status == 200 and json.loads(data)["usage"]["completion_tokens"] >= 1
