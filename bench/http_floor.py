"""What the HTTP stack costs before any of our code: the time from a client's send to its first SSE chunk for a
quart-trio app on hypercorn (trio worker) whose view reads the JSON body and returns a two-chunk event stream at
once, against a bare trio socket server that parses the same request and writes the same bytes.

Both servers run in this process; the client runs in a process of its own, over one kept connection, 5 ms apart
(as a client between turns), and reports the median of 200 requests after 10 untimed ones. Rounds alternate the
two servers. No engine runs: these are the stack's costs on warm caches (in the server, where each request follows
an engine's sweep of the caches, the same code takes about half again as long: `bench/serve.py --stamps`).

    python bench/http_floor.py [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import sys
from functools import partial

import hypercorn
import hypercorn.trio
import trio
from quart import Response, request
from quart_trio import QuartTrio

CHUNK = b'data: {"choices":[{"delta":{"content":"hi"}}]}\n\n'
DONE = b"data: [DONE]\n\n"
HEAD = (b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncache-control: no-cache\r\n"
        b"transfer-encoding: chunked\r\n\r\n")


def make_app() -> QuartTrio:
    app = QuartTrio(__name__)

    @app.post("/v1/chat/completions")
    async def view() -> Response:
        json.loads(await request.get_data())

        async def body():  # type: ignore[no-untyped-def]
            yield CHUNK
            yield DONE

        return Response(body(), content_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    return app


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


async def bare(stream: trio.SocketStream) -> None:
    """One kept connection: each request's head and JSON body read, the same response written in two sends."""
    buffer = b""
    while data := await stream.receive_some(65536):
        buffer += data
        while b"\r\n\r\n" in buffer:
            head, rest = buffer.split(b"\r\n\r\n", 1)
            length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                          if line.lower().startswith(b"content-length"))
            if len(rest) < length:
                break
            json.loads(rest[:length])
            buffer = rest[length:]
            await stream.send_all(HEAD + _chunk(CHUNK))
            await stream.send_all(_chunk(DONE) + b"0\r\n\r\n")


CLIENT = r'''
import json, socket, statistics, sys, time
host, port, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
s = socket.create_connection((host, port))
s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
firsts = []
for i in range(n + 10):
    body = json.dumps({"messages": [{"role": "user", "content": f"Run {i}: a story about a lighthouse keeper."}],
                       "max_tokens": 1, "stream": True}).encode()
    sent = time.perf_counter()
    s.sendall(f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
              f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
    buffer, first = b"", None
    while not buffer.endswith(b"0\r\n\r\n"):
        buffer += s.recv(65536)
        if first is None and b'"content":"hi"' in buffer:
            first = time.perf_counter()
    firsts.append(first - sent)
    time.sleep(0.005)
print(json.dumps(statistics.median(firsts[10:])))
'''


async def main(rounds: int) -> None:
    config = hypercorn.Config()
    config.bind, config.accesslog, config.errorlog = ["127.0.0.1:0"], None, None
    async with trio.open_nursery() as nursery:
        binds = await nursery.start(partial(hypercorn.trio.serve, make_app(), config))
        host, port = binds[0].removeprefix("http://").split(":")
        listeners = await nursery.start(partial(trio.serve_tcp, bare, 0, host=host))
        bare_port = listeners[0].socket.getsockname()[1]
        print("| round | quart-trio on hypercorn ms | bare trio socket ms |\n|---|---|---|")
        for n in range(1, rounds + 1):
            medians = []
            for server_port in (int(port), bare_port):
                out = await trio.run_process([sys.executable, "-c", CLIENT, host, str(server_port), "200"],
                                             capture_stdout=True)
                medians.append(1e3 * json.loads(out.stdout))
            print(f"| {n} | {medians[0]:.3f} | {medians[1]:.3f} |", flush=True)
        nursery.cancel_scope.cancel()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    trio.run(main, parser.parse_args().rounds)
