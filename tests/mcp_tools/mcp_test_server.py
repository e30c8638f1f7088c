"""An MCP server for the tests, written with the SDK's server API: `python mcp_test_server.py stdio`, or `http`
(streamable HTTP on 127.0.0.1, an ephemeral port printed as the first line of stdout).

Tools: echo, get_weather (what the demo model knows), slow (records its start and its cancellation in the file
named by STRATA_TEST_MARK), crash (the process dies mid-call), picture (a PNG), fail (the tool raises), grow
(adds a tool and notifies the change), and `broken`, whose input schema is not valid JSON Schema.
STRATA_TEST_TOOLS (comma-separated) keeps only those; STRATA_TEST_WEATHER_PICTURE makes get_weather answer with a
picture. Attacks on the limits: STRATA_TEST_BIG adds `big` (a text of the characters asked for),
STRATA_TEST_MANY_TOOLS=N lists N more tools, STRATA_TEST_SCHEMA_PROPERTIES=N a tool `wide` whose schema has N
properties."""

from __future__ import annotations

import io
import json
import os
import socket
import sys
import time

import anyio
from mcp.server.mcpserver import Context, MCPServer
from mcp.server.mcpserver.utilities.types import Image as McpImage
from mcp_types import Tool
from PIL import Image, ImageDraw

MARK = os.environ.get("STRATA_TEST_MARK")


def mark(what: str) -> None:
    if MARK:
        with open(MARK, "a") as file:
            file.write(f"{what} {time.time():.6f}\n")


class TestServer(MCPServer):
    async def list_tools(self):  # type: ignore[override]
        tools = await super().list_tools()
        keep = os.environ.get("STRATA_TEST_TOOLS")
        if keep:
            tools = [tool for tool in tools if tool.name in keep.split(",")]
        for tool in tools:
            if tool.name == "broken":
                tool.input_schema = {"type": "object", "properties": {"x": {"type": "no-such-type"}}}
        return tools + extra_tools()


def extra_tools() -> list[Tool]:
    many = int(os.environ.get("STRATA_TEST_MANY_TOOLS", "0"))
    tools = [Tool(name=f"many_{i}", description=f"tool {i}", input_schema={"type": "object"}) for i in range(many)]
    wide = int(os.environ.get("STRATA_TEST_SCHEMA_PROPERTIES", "0"))
    if wide:
        properties = {f"p{i}": {"type": "string"} for i in range(wide)}
        tools.append(Tool(name="wide", input_schema={"type": "object", "properties": properties}))
    return tools


server = TestServer("strata-test")


@server.tool()
def echo(text: str) -> str:
    """Return the text."""
    return f"echo: {text}"


def red_circle_png() -> bytes:
    image = Image.new("RGB", (64, 64), "white")
    ImageDraw.Draw(image).ellipse((16, 16, 48, 48), fill=(230, 25, 25))
    out = io.BytesIO()
    image.save(out, "PNG")
    return out.getvalue()


if os.environ.get("STRATA_TEST_WEATHER_PICTURE"):  # the weather as a picture (a tool-result picture)

    @server.tool(name="get_weather")
    def weather_picture(city: str) -> McpImage:
        """Get the current weather in a city."""
        return McpImage(data=red_circle_png(), format="png")

else:

    @server.tool()
    def get_weather(city: str) -> str:
        """Get the current weather in a city."""
        return json.dumps({"temperature": 18, "condition": "sunny"})


@server.tool()
async def slow(seconds: float) -> str:
    """Wait, then answer."""
    mark("started")
    try:
        await anyio.sleep(seconds)
    except anyio.get_cancelled_exc_class():
        mark("cancelled")
        raise
    mark("finished")
    return "slept"


@server.tool()
def crash() -> str:
    """The process dies during the call."""
    mark("crash")
    os._exit(3)


if os.environ.get("STRATA_TEST_BIG"):

    @server.tool()
    def big(chars: int) -> str:
        """A text of `chars` characters."""
        return ("0123456789" * (chars // 10 + 1))[:chars]


@server.tool()
def picture() -> McpImage:
    """A red circle on white."""
    return McpImage(data=red_circle_png(), format="png")


@server.tool()
def fail(reason: str) -> str:
    """Always fails."""
    raise ValueError(f"failed on purpose: {reason}")


@server.tool()
async def grow(ctx: Context) -> str:
    """Adds the tool `extra` and says the tools changed."""

    def extra() -> str:
        """Added later."""
        return "extra"

    server.add_tool(extra)
    await ctx.notify_tools_changed()
    return "grown"


@server.tool()
def broken(x: str) -> str:
    """Listed with a bad schema."""
    return x


def serve_http() -> None:
    import uvicorn

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(64)
    print(sock.getsockname()[1], flush=True)
    config = uvicorn.Config(server.streamable_http_app(), log_level="warning")
    anyio.run(lambda: uvicorn.Server(config).serve(sockets=[sock]))


if __name__ == "__main__":
    if sys.argv[1:] == ["http"]:
        serve_http()
    else:
        server.run("stdio")
