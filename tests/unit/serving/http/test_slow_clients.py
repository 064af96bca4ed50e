"""Slow and idle clients (slowloris) against a real uvicorn server, with raw sockets: headers
that never finish close the connection, a body that never comes is a 408, and connections past
the limit are answered 503."""

from __future__ import annotations

import socket
import time

import pytest

from tessera.serving.http.app import create_app
from tests.serving_helper import running_server

from ..fake_engine import FakeEngine

TIMEOUT = 0.5


@pytest.fixture(scope="module")
def port():
    app = create_app(FakeEngine(), model_name="fake", body_timeout_s=TIMEOUT)
    with running_server(app, header_timeout_s=TIMEOUT, keep_alive_s=TIMEOUT,
                        max_connections=6) as port:
        yield port


def _connect(port: int) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=5)


def _read_all(sock: socket.socket) -> tuple[bytes, float]:
    """Everything until the server closes the connection, and when it did."""
    chunks = []
    while chunk := sock.recv(4096):
        chunks.append(chunk)
    return b"".join(chunks), time.monotonic()


def test_unfinished_headers_and_silent_connections_are_closed(port):
    socks = [_connect(port) for _ in range(3)]
    socks[1].sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")  # headers never end
    socks[2].sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")  # then idle (keep-alive)
    start = time.monotonic()
    for sock in socks:
        data, closed = _read_all(sock)
        assert closed - start < 4 * TIMEOUT + 1
        sock.close()
    assert data.startswith(b"HTTP/1.1 200")


def test_a_body_that_never_comes_is_a_408(port):
    with _connect(port) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                     b"\r\nContent-Length: 50\r\n\r\n{\"prompt\":")
        start = time.monotonic()
        data, closed = _read_all(sock)
    assert data.startswith(b"HTTP/1.1 408") and b"did not arrive" in data
    assert closed - start < 4 * TIMEOUT + 1


def test_connections_past_the_limit_get_503(port):
    socks = [_connect(port) for _ in range(8)]
    try:
        time.sleep(0.1)
        with _connect(port) as extra:
            extra.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            data, _ = _read_all(extra)
        assert data.startswith(b"HTTP/1.1 503")
    finally:
        for sock in socks:
            sock.close()
    time.sleep(0.2)
    with _connect(port) as again:  # the slots are free again
        again.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        assert _read_all(again)[0].startswith(b"HTTP/1.1 200")
