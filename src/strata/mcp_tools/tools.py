"""MCP tools as the model sees them, and tool results as the prompt and the client see them. Pure functions, no
I/O: which tools of a listing are usable, and what a `CallToolResult` becomes."""

from __future__ import annotations

import base64
import binascii
import json
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from strata.pictures.sources import ImageSource

if TYPE_CHECKING:  # the SDK's types are imported when first needed (see servers.py)
    import mcp_types

# What both APIs accept as a function name (OpenAI's rule; Anthropic's is the same with 128 characters).
_TOOL_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
MAX_RESULT_CHARS = 100_000  # of a tool result's text given to the model (the rest is cut, saying so)


@dataclass(frozen=True)
class McpTool:
    """One usable tool of an MCP server: its name there (the model calls it by this name), description, schema."""

    name: str
    description: str | None
    input_schema: dict[str, Any]

    def listing(self) -> dict[str, Any]:
        """The tool as both APIs list it (`mcp_list_tools` items, `mcp_tool_listing` blocks)."""
        return {"name": self.name, "description": self.description, "input_schema": self.input_schema}

    def function(self) -> dict[str, Any]:
        """The tool in the OpenAI chat shape the chat template renders."""
        function: dict[str, Any] = {"name": self.name, "parameters": self.input_schema}
        if self.description:
            function["description"] = self.description
        return {"type": "function", "function": function}


def unusable(tool: mcp_types.Tool) -> str | None:
    """Why a listed tool cannot be offered to the model (None: it can).

    A tool's input schema must be a valid JSON Schema for an object; its name must be a function name both APIs
    accept.
    """
    from jsonschema import SchemaError
    from jsonschema.validators import validator_for

    if not _TOOL_NAME.fullmatch(tool.name):
        return f"its name {tool.name[:80]!r} is not 1-64 letters, digits, '_' or '-'"
    schema = tool.input_schema
    if not isinstance(schema, dict) or schema.get("type", "object") != "object":
        return "its input schema is not a JSON Schema of an object"
    try:
        validator_for(schema).check_schema(schema)
    except SchemaError as error:
        return f"its input schema is not valid JSON Schema: {error.message}"
    return None


def usable_tools(listing: list[mcp_types.Tool]) -> tuple[list[McpTool], list[tuple[str, str]]]:
    """The usable tools of a listing, and (name, reason) for each one skipped."""
    tools: list[McpTool] = []
    skipped: list[tuple[str, str]] = []
    seen: set[str] = set()
    for tool in listing:
        reason = unusable(tool)
        if reason is None and tool.name in seen:
            reason = "another tool of this server has the same name"
        if reason is not None:
            skipped.append((tool.name, reason))
            continue
        seen.add(tool.name)
        tools.append(McpTool(tool.name, tool.description, dict(tool.input_schema)))
    return tools, skipped


@dataclass
class ToolOutput:
    """What one tool call gave back.

    Attributes:
        text: the result as text, for the client (`mcp_call.output`, `mcp_tool_result` text); pictures are named
            in it as `[image: <type>]`.
        content: the tool message's content for the prompt: a string, or text and picture parts (pictures go
            through the image encoder like any tool-result picture).
        is_error: the tool failed, timed out, or its server was not available; `text` says why.
    """

    text: str
    content: str | list[dict[str, Any]] = ""
    is_error: bool = False

    @classmethod
    def error(cls, message: str) -> ToolOutput:
        return cls(message, message, is_error=True)


def tool_output(result: mcp_types.CallToolResult, where: str, pictures: bool) -> ToolOutput:
    """A `CallToolResult` as a `ToolOutput`.

    Args:
        where: names the result in messages about its pictures, e.g. "the result of echo.picture".
        pictures: whether pictures can be given to the model (the server has an image encoder); if not, each
            becomes the text `[image omitted: ...]`.
    """
    import mcp_types

    shown: list[str] = []
    parts: list[str | dict[str, Any]] = []
    for block in result.content:
        if isinstance(block, mcp_types.TextContent):
            shown.append(block.text)
            parts.append(block.text)
        elif isinstance(block, mcp_types.ImageContent):
            shown.append(f"[image: {block.mime_type}]")
            parts.append(_picture(block, where, pictures))
        elif isinstance(block, mcp_types.EmbeddedResource):
            resource = block.resource
            text = getattr(resource, "text", None)
            text = text if isinstance(text, str) else f"[resource: {resource.uri}]"
            shown.append(text)
            parts.append(text)
        elif isinstance(block, mcp_types.ResourceLink):
            shown.append(f"[resource: {block.uri}]")
            parts.append(f"[resource: {block.uri}]")
        else:
            kind = getattr(block, "type", type(block).__name__)
            shown.append(f"[{kind} omitted]")
            parts.append(f"[{kind} omitted: this server reads text and pictures]")
    if not result.content and result.structured_content is not None:
        text = json.dumps(result.structured_content, ensure_ascii=False)
        shown.append(text)
        parts.append(text)
    return ToolOutput("\n".join(shown), _content(parts), is_error=bool(result.is_error))


def _picture(block: mcp_types.ImageContent, where: str, pictures: bool) -> str | dict[str, Any]:
    if not pictures:
        return "[image omitted: this server has no image encoder]"
    try:
        data = base64.b64decode(block.data, validate=True)
    except (binascii.Error, ValueError):
        return "[image omitted: the tool sent invalid base64]"
    return {"type": "image", "image": ImageSource(where, data=data, in_tool_result=True)}


def _content(parts: list[str | dict[str, Any]]) -> str | list[dict[str, Any]]:
    """Texts joined (cut to MAX_RESULT_CHARS), or text and picture parts when there is a picture."""
    budget = MAX_RESULT_CHARS
    out: list[str | dict[str, Any]] = []
    for part in parts:
        if isinstance(part, str):
            if len(part) > budget:
                part = part[:budget] + f"\n[the result was cut at {MAX_RESULT_CHARS} characters]"
            budget = max(budget - len(part), 0)
        out.append(part)
    if all(isinstance(part, str) for part in out):
        return "\n".join(part for part in out if isinstance(part, str))
    return [{"type": "text", "text": part} if isinstance(part, str) else part for part in out]
