"""Clients that send their headers and part of a body, then stall, trickle or hang up around the moment the body
timeout fires: each gets its 408 (or nothing, having gone), and the server neither logs a traceback nor stops."""

from __future__ import annotations

import random
import socket
import threading
import time

import httpx
from conftest import live_server, server_config
from fakes import ScriptedEngine

BODY_TIMEOUT = 0.1


def slow_client(url: str, trickle: bool, hang_up_after: float) -> bytes:
    """Headers and a partial body, then nothing (or a byte every few ms) until `hang_up_after` seconds; what the
    server sent back by then."""
    host, port = url.removeprefix("http://").split(":")
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
            "Content-Length: 10000\r\n\r\n").encode()
    received = b""
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(head + b'{"model": "m", ')
        sock.settimeout(0.005)
        deadline = time.monotonic() + hang_up_after
        while time.monotonic() < deadline:
            try:
                if trickle:
                    sock.sendall(b" ")
                chunk = sock.recv(65536)
            except TimeoutError:
                continue
            except OSError:
                break
            if not chunk:
                break
            received += chunk
    return received


def test_body_timeout_answers_408_and_the_server_keeps_serving(tokenizer, capfd):
    engine = ScriptedEngine(tokenizer, tokenizer.encode("fine"), n_ctx=512)
    rng = random.Random(0)
    replies: list[tuple[float, bytes]] = []

    def clients(url: str, trickle: bool) -> None:
        for _ in range(25):
            # Most hang up within a few ms of the timeout: the race between the 408 and the hang-up.
            hang_up_after = rng.uniform(0.8, 1.2) * BODY_TIMEOUT if rng.random() < 0.8 else 0.5
            try:
                replies.append((hang_up_after, slow_client(url, trickle, hang_up_after)))
            except ConnectionRefusedError:  # the server stopped
                replies.append((hang_up_after, b"refused"))

    with live_server(server_config(limits={"body_timeout": BODY_TIMEOUT}), engine, tokenizer) as server:
        threads = [threading.Thread(target=clients, args=(server.url, i % 2 == 1)) for i in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert httpx.get(server.url + "/health", timeout=10).status_code == 200
    log = capfd.readouterr().err
    assert "Traceback" not in log and "BusyResourceError" not in log, log
    assert all(reply == b"" or reply.startswith(b"HTTP/1.1 408") for _, reply in replies)
    # Those that stayed well past the timeout heard it.
    assert all(reply.startswith(b"HTTP/1.1 408") for after, reply in replies if after >= 0.5)
