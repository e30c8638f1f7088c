"""Red-team cases as regression tests: bodies and headers that used to get a 500, leak the server's insides, or
reach the API from a web page (through a live server with a scripted engine)."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
from conftest import live_server, server_config
from fakes import FailingEngine, ScriptedEngine

from strata.api import body
from strata.api.hosts import host_name
from strata.api.translate import MAX_STOPS

USER = [{"role": "user", "content": "hi"}]
ROUTES = ["/v1/chat/completions", "/v1/messages", "/v1/responses"]


@pytest.fixture(scope="module")
def server(tokenizer):
    engine = ScriptedEngine(tokenizer, tokenizer.encode("fine"), n_ctx=512)
    with live_server(server_config(), engine, tokenizer) as live:
        yield live


def post(server: Any, path: str, data: bytes, content_type: str = "application/json", **headers: str
         ) -> httpx.Response:
    return httpx.post(server.url + path, content=data, headers={"content-type": content_type, **headers},
                      timeout=30)


def request_for(path: str, content: Any) -> dict[str, Any]:
    if path == "/v1/responses":
        return {"model": "m", "input": [{"role": "user", "content": content}]}
    return {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": content}]}


def error_message(reply: httpx.Response) -> str:
    return reply.json()["error"]["message"]


@pytest.mark.parametrize("path", ROUTES)
def test_a_lone_surrogate_is_a_400_naming_the_field(server, path):
    raw = json.dumps(request_for(path, "a\ud800b")).encode()
    assert b"\\ud800" in raw
    reply = post(server, path, raw)
    assert reply.status_code == 400, reply.text
    assert "lone surrogate" in error_message(reply) and "content" in error_message(reply)
    pair = post(server, path, json.dumps(request_for(path, "a\U0001f600b")).encode())  # \ud83d\ude00: fine
    assert pair.status_code == 200, pair.text


@pytest.mark.parametrize("path", ROUTES)
def test_a_lone_surrogate_in_a_tool_name_or_instructions(server, path):
    if path == "/v1/chat/completions":
        extra = {"tools": [{"type": "function", "function": {"name": "f\udfff", "parameters": {}}}]}
    elif path == "/v1/messages":
        extra = {"system": "be \ud800 brief"}
    else:
        extra = {"instructions": "be \ud800 brief"}
    reply = post(server, path, json.dumps({**request_for(path, "hi"), **extra}).encode())
    assert reply.status_code == 400, reply.text
    assert "lone surrogate" in error_message(reply)


@pytest.mark.parametrize("depth", [100, 5_000, 100_000])
def test_deeply_nested_json_is_a_400(server, depth):
    nested = b'{"model": "m", "messages": ' + b"[" * depth + b"]" * depth + b"}"
    reply = post(server, "/v1/chat/completions", nested)
    assert reply.status_code == 400, reply.text
    assert f"more than {body.MAX_DEPTH} levels" in error_message(reply)
    assert "RecursionError" not in reply.text


def test_too_many_values_is_a_400(server):
    many = json.dumps({"model": "m", "messages": USER, "stop": ["x"] * (body.MAX_VALUES + 1)}).encode()
    reply = post(server, "/v1/chat/completions", many)
    assert reply.status_code == 400 and "JSON values" in error_message(reply)


def test_large_bodies_are_checked_the_same_way(server):
    """Above INLINE_BYTES the body is parsed in a child process, with the same checks and answers."""
    filler = "x" * (body.INLINE_BYTES + 10)
    bad = json.dumps({"model": "m", "messages": [{"role": "user", "content": "\udc00"}], "user": filler}).encode()
    reply = post(server, "/v1/chat/completions", bad)
    assert reply.status_code == 400 and "messages[0].content: holds a lone surrogate" in error_message(reply)
    deep = b'{"user": "' + filler.encode() + b'", "messages": ' + b"[" * 5000 + b"]" * 5000 + b"}"
    assert "levels deep" in error_message(post(server, "/v1/chat/completions", deep))
    assert "not valid JSON" in error_message(post(server, "/v1/chat/completions", b"[" + filler.encode()))
    long = post(server, "/v1/chat/completions", json.dumps(request_for("/v1/chat/completions", "hi") | {
        "user": filler}).encode())
    assert long.status_code == 200, long.text


@pytest.mark.parametrize("path", [*ROUTES, "/v1/messages/count_tokens"])
@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded", ""])
def test_api_routes_require_application_json(server, path, content_type):
    """A page on another origin can send these types without a CORS preflight; the API refuses them."""
    reply = post(server, path, json.dumps(request_for(path, "hi")).encode(), content_type)
    assert reply.status_code == 415, reply.text
    assert "application/json" in reply.text
    ok = post(server, path, json.dumps(request_for(path, "hi")).encode(), "application/json; charset=utf-8")
    assert ok.status_code == 200, ok.text


@pytest.mark.parametrize("host", ["evil.example", "evil.example:8080", "127.0.0.1.evil.example", "10.0.0.1"])
def test_a_loopback_server_refuses_foreign_host_names(server, host):
    """DNS rebinding: a page's own name pointed at 127.0.0.1 arrives with that name in Host."""
    for path in ("/v1/models", "/v1/history", "/metrics"):
        reply = httpx.get(server.url + path, headers={"host": host}, timeout=30)
        assert reply.status_code == 403, (path, reply.text)
        assert "allowed_hosts" in reply.text
    reply = post(server, "/v1/chat/completions", json.dumps(request_for("/v1/chat/completions", "hi")).encode(),
                 host=host)
    assert reply.status_code == 403
    assert httpx.get(server.url + "/health", headers={"host": host}, timeout=30).status_code == 200


@pytest.mark.parametrize("host", ["localhost", "localhost:1234", "127.0.0.1:9", "[::1]:8080"])
def test_a_loopback_server_answers_loopback_names(server, host):
    assert httpx.get(server.url + "/v1/models", headers={"host": host}, timeout=30).status_code == 200


def test_allowed_hosts_from_the_config(tokenizer):
    config = server_config(allowed_hosts=["strata.lan"])
    with live_server(config, ScriptedEngine(tokenizer, tokenizer.encode("ok")), tokenizer) as live:
        assert httpx.get(live.url + "/v1/models", headers={"host": "strata.lan:80"}, timeout=30).status_code == 200
        assert httpx.get(live.url + "/v1/models", headers={"host": "localhost"}, timeout=30).status_code == 403


@pytest.mark.parametrize(("header", "name"), [("127.0.0.1:8080", "127.0.0.1"), ("[::1]:80", "::1"), ("::1", "::1"),
                                              ("LocalHost", "localhost"), ("", "")])
def test_host_name(header, name):
    assert host_name(header) == name


def test_a_server_error_names_no_exception_class(tokenizer):
    with live_server(server_config(), FailingEngine(tokenizer, KeyError("secret internals")), tokenizer) as live:
        reply = post(live, "/v1/chat/completions", json.dumps(request_for("/v1/chat/completions", "hi")).encode())
        assert reply.status_code == 500
        assert "KeyError" not in reply.text and "secret" not in reply.text
        assert error_message(reply) == "internal server error"


@pytest.mark.parametrize(("path", "field"), [("/v1/chat/completions", "stop"), ("/v1/messages", "stop_sequences")])
def test_stop_strings_are_bounded(server, path, field):
    """20,000 stop strings used to be matched against every token on the event loop."""
    many = post(server, path, json.dumps({**request_for(path, "hi"), field: ["zz"] * 20_000}).encode())
    assert many.status_code == 400 and f"at most {MAX_STOPS}" in many.text, many.text
    long = post(server, path, json.dumps({**request_for(path, "hi"), field: ["z" * 10_000]}).encode())
    assert long.status_code == 400 and f"{field}[0]" in long.text
    fine = post(server, path, json.dumps({**request_for(path, "hi"), field: ["zz"] * MAX_STOPS}).encode())
    assert fine.status_code == 200, fine.text


@pytest.mark.parametrize(("host", "checked"), [("127.0.0.1", True), ("127.0.0.1,::1", True), ("localhost", True),
                                               ("0.0.0.0", False), ("127.0.0.1,192.168.1.5", False)])
def test_the_check_applies_when_every_bind_is_loopback(host, checked):
    from strata.api.hosts import allowed_hosts

    assert (allowed_hosts(server_config(host=host)) is not None) is checked


@pytest.mark.parametrize("path", ["/health", "/v1/chat/completions"])
def test_connection_close_closes_the_socket(server, path):
    """hypercorn closes such a socket inside the app's last send, after the disconnect that makes quart-trio
    cancel the request's task: the close used to be cancelled (200 requests left 200 sockets open)."""
    import os
    import socket

    body = json.dumps(request_for("/v1/chat/completions", "hi")).encode()
    head = (f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n" if path == "/health" else
            f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\n\r\n")
    host, port = server.url.removeprefix("http://").split(":")
    fds_before = len(os.listdir("/proc/self/fd"))  # the server runs in this process
    for _ in range(20):
        with socket.create_connection((host, int(port)), timeout=10) as client:
            client.sendall(head.encode() + (b"" if path == "/health" else body))
            reply = b""
            while chunk := client.recv(65536):  # returns b"" only when the server closes its end
                reply += chunk
            assert reply.startswith(b"HTTP/1.1 200")
    assert len(os.listdir("/proc/self/fd")) <= fds_before + 2


def test_status_key_guards_history_and_metrics(tokenizer):
    """/v1/history and /metrics show every client's request ids and timings: status_key keeps them private while
    the API stays open."""
    config = server_config(status_key="s3cret")
    with live_server(config, ScriptedEngine(tokenizer, tokenizer.encode("ok")), tokenizer) as live:
        assert post(live, "/v1/chat/completions", json.dumps(request_for("/v1/chat/completions", "hi")).encode()
                    ).status_code == 200
        for path in ("/v1/history", "/metrics"):
            assert httpx.get(live.url + path, timeout=30).status_code == 401
            assert httpx.get(live.url + path, headers={"authorization": "Bearer s3cret"}, timeout=30).status_code == 200
        assert httpx.get(live.url + "/v1/models", timeout=30).status_code == 200
    both = server_config(status_key="s3cret", api_key="k")
    with live_server(both, ScriptedEngine(tokenizer, tokenizer.encode("ok")), tokenizer) as live:
        assert httpx.get(live.url + "/v1/history", headers={"x-api-key": "k"}, timeout=30).status_code == 200
        assert httpx.get(live.url + "/v1/models", headers={"x-api-key": "s3cret"}, timeout=30).status_code == 401


def test_a_job_the_batcher_cannot_start_fails_alone_and_the_next_one_runs(tokenizer):
    """A bug in the cache's bookkeeping (here: the engine's first answer about a sequence raises) fails the request
    it met with a 500, instead of leaving it waiting for tokens that never come; the next request is served."""

    class FirstLookFails(ScriptedEngine):
        failed = False

        def seq_n_past(self, seq: int) -> int:
            if not self.failed:
                self.failed = True
                raise RuntimeError("a bug in the cache bookkeeping")
            return super().seq_n_past(seq)

    engine = FirstLookFails(tokenizer, tokenizer.encode("fine"), n_ctx=512)
    with live_server(server_config(), engine, tokenizer) as live:
        chat = json.dumps(request_for("/v1/chat/completions", "hi")).encode()
        first = post(live, "/v1/chat/completions", chat)
        assert engine.failed and first.status_code == 500, first.text
        second = post(live, "/v1/chat/completions", chat)
        assert second.status_code == 200 and second.json()["choices"][0]["message"]["content"] == "fine"
