"""CORS for the API (config `cors_origins`): browser pages from the listed origins may call it. A preflight
(`OPTIONS` with `Access-Control-Request-Method`) is answered before the API key is checked, since browsers send
it without credentials; every other request still needs the key."""

from __future__ import annotations

from collections.abc import Sequence

from quart import Quart, Response, request

_MAX_AGE = "600"  # seconds a browser may keep a preflight's answer


def add_cors(app: Quart, origins: Sequence[str]) -> None:
    """Answer preflights and mark responses for `origins` ("*" allows any). Register before the API key check."""
    allowed = frozenset(origins)

    def allowed_origin() -> str | None:
        origin = request.headers.get("origin")
        if origin and ("*" in allowed or origin in allowed):
            return origin
        return None

    @app.before_request
    async def preflight() -> Response | None:
        if request.method != "OPTIONS" or "access-control-request-method" not in request.headers:
            return None
        origin = allowed_origin()
        if origin is None:
            return Response("", status=403)
        headers = {
            "Access-Control-Allow-Origin": origin,
            "Access-Control-Allow-Methods": "GET, POST, OPTIONS",
            "Access-Control-Allow-Headers": request.headers.get("access-control-request-headers",
                                                                "authorization, content-type, x-api-key"),
            "Access-Control-Max-Age": _MAX_AGE,
            "Vary": "Origin",
        }
        return Response("", status=204, headers=headers)

    @app.after_request
    async def mark(response: Response) -> Response:
        origin = allowed_origin()
        if origin is not None:
            response.headers["Access-Control-Allow-Origin"] = origin
            response.headers["Vary"] = "Origin"
        return response
