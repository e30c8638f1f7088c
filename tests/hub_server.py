"""A local stand-in for the Hugging Face hub: the routes `huggingface_hub`'s client calls to list a model
repository and download its files, served from memory by a thread, so that `--hf` is tested with the real client
and no network.

Routes (as `huggingface_hub` 2.x calls them):
- `GET /api/models/{owner}/{name}[/revision/{rev}]`: the model info, with each file's size (`siblings`); an unknown
  repository is a 404 with `X-Error-Code: RepoNotFound`.
- `HEAD` and `GET /{owner}/{name}/resolve/{rev}/{path}`: the file, with `X-Repo-Commit`, `ETag` and
  `Content-Length`; a `Range: bytes=N-` GET (a resumed download) gets a 206 from byte N.

`python tests/hub_server.py REPO NAME FILE [COPIES]` serves one file from a process of its own (for
`bench/models.py`: the hub's side of a download then shares no interpreter with the client measured).
"""

from __future__ import annotations

import hashlib
import json
import re
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

COMMIT = "0123456789abcdef0123456789abcdef01234567"


class FakeHub:
    """The repositories served (`repos[repo][path] = bytes`), the URL, and the requests seen ("GET /path", with
    " (bytes=N-)" for a ranged one)."""

    def __init__(self, repos: dict[str, dict[str, bytes]], stall: float = 0.0, cut: int | None = None,
                 hold: threading.Event | None = None) -> None:
        self.repos = repos
        self.stall = stall  # seconds a file's GET waits before its bytes (a slow download)
        self.hold = hold  # set: a file's GET sends its bytes (a download that goes on until a test lets it end)
        self.cut = cut  # the first whole-file GET ends its connection after this many bytes (a network cut)
        self.requests: list[str] = []
        self.url = ""
        self._etags: dict[tuple[str, str], str] = {}  # as the hub, computed once per file, not per request

    def before_bytes(self) -> None:
        """What a file's GET waits for before it sends its bytes."""
        time.sleep(self.stall)
        if self.hold is not None:
            self.hold.wait(60)

    def etag(self, repo: str, path: str) -> str:
        key = (repo, path)
        if key not in self._etags:
            self._etags[key] = f'"{hashlib.sha256(self.repos[repo][path]).hexdigest()}"'
        return self._etags[key]


def _handler(hub: FakeHub) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: object) -> None:  # quiet
            pass

        def do_GET(self) -> None:
            self._answer(body=True)

        def do_HEAD(self) -> None:
            self._answer(body=False)

        def _answer(self, body: bool) -> None:
            asked = self.headers.get("Range")
            hub.requests.append(f"{self.command} {self.path}" + (f" ({asked})" if asked else ""))
            path = self.path.split("?")[0]
            info = re.fullmatch(r"/api/models/([^/]+/[^/]+)(?:/revision/[^/]+)?", path)
            if info:
                return self._info(info.group(1), body)
            resolve = re.fullmatch(r"/([^/]+/[^/]+)/resolve/[^/]+/(.+)", path)
            files = hub.repos.get(resolve.group(1), {}) if resolve else {}
            if not resolve or resolve.group(2) not in files:
                return self._send(404, b"", {"X-Error-Code": "EntryNotFound" if resolve else "RepoNotFound"}, body)
            data = files[resolve.group(2)]
            if body:
                hub.before_bytes()
            headers = {"X-Repo-Commit": COMMIT, "ETag": hub.etag(resolve.group(1), resolve.group(2))}
            start = re.fullmatch(r"bytes=(\d+)-", self.headers.get("Range", ""))
            if start and body:
                offset = int(start.group(1))
                headers["Content-Range"] = f"bytes {offset}-{len(data) - 1}/{len(data)}"
                return self._send(206, data[offset:], headers, body)
            if body and hub.cut is not None:
                cut, hub.cut = hub.cut, None
                self._send(200, data[:cut], {**headers, "Content-Length": str(len(data))}, body)
                self.close_connection = True
                return None
            return self._send(200, data, headers, body)

        def _info(self, repo: str, body: bool) -> None:
            if repo not in hub.repos:
                return self._send(404, b'{"error": "Repository not found"}', {"X-Error-Code": "RepoNotFound"}, body)
            siblings = [{"rfilename": name, "size": len(data)} for name, data in hub.repos[repo].items()]
            info = {"id": repo, "modelId": repo, "sha": COMMIT, "siblings": siblings, "private": False}
            return self._send(200, json.dumps(info).encode(), {"Content-Type": "application/json"}, body)

        def _send(self, status: int, data: bytes, headers: dict[str, str], body: bool) -> None:
            self.send_response(status)
            for key, value in {"Content-Length": str(len(data)), **headers}.items():
                self.send_header(key, value)
            self.end_headers()
            if body:
                self.wfile.write(data)

    return Handler


@contextmanager
def fake_hub(repos: dict[str, dict[str, bytes]], stall: float = 0.0, cut: int | None = None,
             hold: threading.Event | None = None) -> Iterator[FakeHub]:
    """Serve `repos` on a loopback port until the block ends."""
    hub = FakeHub(repos, stall, cut, hold)
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(hub))
    hub.url = f"http://127.0.0.1:{server.server_address[1]}"
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield hub
    finally:
        server.shutdown()
        server.server_close()
        thread.join()



def main(argv: list[str]) -> None:
    """Serve FILE (its bytes repeated COPIES times) as NAME in REPO; print the URL, then serve until stdin closes."""
    repo, name, path, *copies = argv
    data = Path(path).read_bytes() * int(copies[0] if copies else 1)
    with fake_hub({repo: {name: data}}) as hub:
        hub.etag(repo, name)  # hashed before any request, as the hub stores it
        print(hub.url, flush=True)
        sys.stdin.read()


if __name__ == "__main__":
    main(sys.argv[1:])
