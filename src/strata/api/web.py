"""The web pages: the chat (`/`) and the monitor (`/monitor`), one single-page bundle from the package, served
with a policy that lets it load nothing from elsewhere. The pages themselves need no API key; every API call
they make sends one when the server has one."""

from __future__ import annotations

import mimetypes

from quart import Quart, Response

from strata.api.errors import ApiError
from strata.web import STATIC

PAGES = ("/", "/monitor")
# Nothing from outside: scripts, styles and requests only from this server; pictures also as data:/blob: URLs.
# No form submits anywhere (the pages' own forms are handled in script): a form in a model's answer that got past
# the sanitiser still could not send a typed-in key elsewhere.
_POLICY = ("default-src 'self'; img-src 'self' data: blob:; style-src 'self'; script-src 'self'; "
           "connect-src 'self'; object-src 'none'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'")


def is_page(path: str) -> bool:
    return path in PAGES or path.startswith("/assets/")


def add_routes(app: Quart) -> None:
    async def page() -> Response:
        return _file("index.html", cache="no-cache")

    for path in PAGES:
        app.add_url_rule(path, endpoint=f"page:{path}", view_func=page, methods=["GET"])

    @app.get("/assets/<name>")
    async def asset(name: str) -> Response:
        # Asset names carry their content hash: they can be cached for good.
        return _file(f"assets/{name}", cache="public, max-age=31536000, immutable")


def _file(name: str, cache: str) -> Response:
    path = STATIC / name
    if not path.is_file():
        raise ApiError(404, f"no such file: /{name}" if name != "index.html" else
                       "the web page is not built (./scripts/build-web.sh)", kind="not_found_error")
    content_type = mimetypes.guess_type(name)[0] or "application/octet-stream"
    if content_type.startswith("text/") or content_type.endswith("javascript"):
        content_type += "; charset=utf-8"
    return Response(path.read_bytes(), content_type=content_type,
                    headers={"Cache-Control": cache, "Content-Security-Policy": _POLICY,
                             "X-Content-Type-Options": "nosniff"})
