"""Chat messages to prompt text, through the model's own chat template (a jinja2 text from GGUF metadata).

Templates are rendered the way Hugging Face's `apply_chat_template` renders them (sandboxed environment,
trim_blocks and lstrip_blocks, `raise_exception`, a `tojson` that keeps non-ASCII text, `strftime_now`), so
templates written for it work here unchanged.
"""

from __future__ import annotations

import copy
import functools
import json
import re
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment


class PromptError(ValueError):
    """The chat template failed to compile or render (bad template, or messages it refuses)."""


# The variables `render_chat` gives every template from the request itself: extra template variables a request
# sends (`chat_template_kwargs`) may not set them. (`enable_thinking` they may: it is a setting, not the request.)
RESERVED_TEMPLATE_VARIABLES = frozenset({"messages", "tools", "add_generation_prompt"})

# What a template's own code can raise while rendering (`raise_exception`, undefined names, `'a' + 1`,
# `tojson` of something JSON cannot hold, a bad index).
_RENDER_ERRORS = (jinja2.TemplateError, TypeError, ValueError, LookupError, ArithmeticError)


def render_chat(template: str, messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] | None = None,
                add_generation_prompt: bool = True, enable_thinking: bool = True, **extra: Any) -> str:
    """Render `messages` (OpenAI chat shapes) and `tools` with the chat `template`.

    Args:
        template: the jinja2 source of the chat template.
        messages: dicts with `role` and `content`; assistant messages may carry `tool_calls` and
            `reasoning_content`. They are normalised first (see `normalise_messages`); the caller's dicts are not
            changed.
        tools: OpenAI tool definitions (`{"type": "function", "function": {...}}`), or None.
        add_generation_prompt: end with the opening of an assistant turn.
        enable_thinking: False asks a template that supports it to skip the reasoning phase.
        **extra: further template variables (e.g. `bos_token`).

    Raises:
        PromptError: the template does not compile, or raised while rendering.
    """
    compiled = _compile(template)
    try:
        return compiled.render(
            messages=normalise_messages(messages),
            tools=list(tools) if tools else None,
            add_generation_prompt=add_generation_prompt,
            enable_thinking=enable_thinking,
            **extra,
        )
    except _RENDER_ERRORS as exc:
        raise PromptError(f"chat template error: {exc}") from exc


# A line some agent clients put at the start of the system prompt, different on every request: left out of the
# prompt, where it would defeat prefix reuse from the first token on. Anthropic clients send it; a proxy that
# turns their requests into another dialect's carries it along.
_BILLING_HEADER = re.compile(r"^x-anthropic-billing-header:[^\n]*(\n|$)", re.MULTILINE)


def strip_billing_header(text: str) -> str:
    """`text` without its `x-anthropic-billing-header: ...` lines."""
    return _BILLING_HEADER.sub("", text) if "x-anthropic-billing-header:" in text else text


def normalise_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Copies of `messages` in the shape templates expect.

    A missing or None content becomes "", the `developer` role (OpenAI's newer name) becomes `system`, a system
    message loses its billing-header lines (`strip_billing_header`), and tool call arguments given as a JSON
    string become a dict (templates apply `tojson` to them; missing ones become {}). Arguments that are not a
    JSON object stay a string, for the template to print as they are.
    """
    out = []
    for original in messages:
        message = copy.deepcopy(dict(original))
        if message.get("content") is None:
            message["content"] = ""
        if message.get("role") == "developer":
            message["role"] = "system"
        if message.get("role") == "system":
            message["content"] = _without_billing_header(message["content"])
        for call in message.get("tool_calls") or ():
            function = call.get("function", call)
            function.setdefault("arguments", {})
            if isinstance(function["arguments"], str):
                function["arguments"] = _parse_arguments(function["arguments"])
        out.append(message)
    return out


def _without_billing_header(content: Any) -> Any:
    if isinstance(content, str):
        return strip_billing_header(content)
    if isinstance(content, list):
        parts = [dict(part, text=strip_billing_header(part["text"]))
                 if isinstance(part, dict) and isinstance(part.get("text"), str) else part for part in content]
        return [part for part in parts if not (isinstance(part, dict) and part.get("text") == "")]
    return content


def _parse_arguments(text: str) -> Any:
    try:
        value = json.loads(text)
    except ValueError:
        return text
    return value if isinstance(value, dict) else text


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@functools.lru_cache(maxsize=16)
def _compile(template: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(template)
    except jinja2.TemplateError as exc:
        raise PromptError(f"chat template does not compile: {exc}") from exc
