"""`POST /v1/chat/completions` through a live hypercorn server, with a scripted engine whose model writes known
text: exact chunk sequences, the official `openai` client (sync and async, streaming and not), tool calls and
reasoning."""

from __future__ import annotations

import json
from typing import Any

import httpx
import openai
import pytest

from strata.api import sse

USER = [{"role": "user", "content": "hi"}]
TOOLS = [{"type": "function", "function": {"name": "get", "description": "Fetch a thing.",
                                           "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}}}}]


def stream_chunks(url: str, body: dict[str, Any]) -> list[Any]:
    """The SSE data of a streamed request: parsed JSON chunks, then the literal "[DONE]"."""
    with httpx.stream("POST", url + "/v1/chat/completions", json={**body, "stream": True}, timeout=30) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        raw = b"".join(response.iter_bytes())
    events = sse.decode(raw)
    assert all(name is None for name, _ in events)
    return [data if data == "[DONE]" else json.loads(data) for _, data in events]


def deltas(chunks: list[Any]) -> list[dict[str, Any]]:
    return [chunk["choices"][0]["delta"] for chunk in chunks if isinstance(chunk, dict) and chunk["choices"]]


def test_streamed_reasoning_and_text_chunk_by_chunk(serve_script, tokenizer):
    script = "<think>\nhm\n</think>\n\nHi!"
    with serve_script(script) as server:
        chunks = stream_chunks(server.url, {"model": "m", "messages": USER,
                                            "stream_options": {"include_usage": True}})
    # One byte-level token per character: each becomes one delta; the tags and their newlines are format.
    assert deltas(chunks) == [{"role": "assistant", "content": ""}, {"reasoning_content": "h"},
                              {"reasoning_content": "m"}, {"content": "H"}, {"content": "i"}, {"content": "!"}, {}]
    assert [chunk["choices"][0]["finish_reason"] for chunk in chunks[:-2]] == [None] * 6 + ["stop"]
    assert all(chunk["usage"] is None for chunk in chunks[:-2])
    usage = chunks[-2]["usage"]
    assert chunks[-2]["choices"] == []
    assert usage["completion_tokens"] == len(tokenizer.encode(script, special=True))
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    assert chunks[-1] == "[DONE]"
    assert len({chunk["id"] for chunk in chunks[:-1]}) == 1


def test_streamed_tool_call_name_first_then_arguments(serve_script):
    arguments = '{"a": 1}'
    with serve_script(f'<tool_call>\n{{"name": "get", "arguments": {arguments}}}\n</tool_call>') as server:
        chunks = stream_chunks(server.url, {"messages": USER, "tools": TOOLS})
    calls = [delta["tool_calls"] for delta in deltas(chunks) if "tool_calls" in delta]
    first = calls[0][0]
    assert first["index"] == 0 and first["type"] == "function" and first["id"].startswith("call_")
    assert first["function"] == {"name": "get", "arguments": ""}
    assert all(call == [{"index": 0, "function": {"arguments": call[0]["function"]["arguments"]}}]
               for call in calls[1:])
    assert "".join(call[0]["function"]["arguments"] for call in calls[1:]) == arguments
    assert chunks[-2]["choices"][0]["finish_reason"] == "tool_calls"
    assert "usage" not in chunks[-2]


def test_openai_client_sync_not_streamed(serve_script):
    with serve_script("<think>\nok\n</think>\n\nDone.") as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused")
        with client:
            reply = client.chat.completions.create(model="m", messages=USER, max_completion_tokens=100)
            again = client.chat.completions.create(model="m", messages=USER)
    message = reply.choices[0].message
    assert (message.content, message.model_extra["reasoning_content"]) == ("Done.", "ok")
    assert reply.choices[0].finish_reason == "stop"
    assert reply.usage.prompt_tokens_details.cached_tokens == 0
    # The same prompt again: everything but its last token comes from the cache.
    assert again.usage.prompt_tokens_details.cached_tokens == again.usage.prompt_tokens - 1
    assert again.choices[0].message.content == "Done."


def test_openai_client_sync_streamed_tool_call(serve_script):
    script = '<tool_call>\n{"name": "get", "arguments": {"a": 7}}\n</tool_call>'
    with serve_script(script) as server, openai.OpenAI(base_url=server.url + "/v1", api_key="unused") as client:
        stream = client.chat.completions.create(model="m", messages=USER, tools=TOOLS, stream=True)
        pieces = [chunk.choices[0].delta for chunk in stream if chunk.choices]
        reply = client.chat.completions.create(model="m", messages=USER, tools=TOOLS)
    names = [call.function.name for delta in pieces for call in delta.tool_calls or [] if call.function.name]
    assert names == ["get"]
    arguments = "".join(call.function.arguments or "" for delta in pieces for call in delta.tool_calls or [])
    assert json.loads(arguments) == {"a": 7}
    call = reply.choices[0].message.tool_calls[0]
    assert (call.function.name, json.loads(call.function.arguments)) == ("get", {"a": 7})
    assert reply.choices[0].finish_reason == "tool_calls"
    assert reply.choices[0].message.content is None


# The async client leaves its streaming async generators (its own and its HTTP library's) to the garbage
# collector, which trio reports as a ResourceWarning.
@pytest.mark.filterwarnings("ignore:Async generator:ResourceWarning")
async def test_openai_client_async_streamed_and_not(serve_script):
    with serve_script("Bonjour") as server:
        async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused") as client:
            text, usage = "", None
            async with await client.chat.completions.create(
                    model="m", messages=USER, stream=True, stream_options={"include_usage": True}) as stream:
                async for chunk in stream:
                    if chunk.choices:
                        text += chunk.choices[0].delta.content or ""
                    usage = chunk.usage or usage
            reply = await client.chat.completions.create(model="m", messages=USER, max_tokens=3)
    assert text == "Bonjour"
    assert usage.completion_tokens == len("Bonjour")
    assert reply.choices[0].message.content == "Bon"
    assert reply.choices[0].finish_reason == "length"


def test_reasoning_effort_none_disables_thinking_in_the_template(serve_script, tokenizer):
    empty_thinking = tokenizer.encode("<think>\n\n</think>\n\n", special=True)
    variants = [({"reasoning_effort": "none"}, True),
                ({"extra_body": {"chat_template_kwargs": {"enable_thinking": False}}}, True),
                ({"reasoning_effort": "high"}, False)]
    with serve_script("x") as server, openai.OpenAI(base_url=server.url + "/v1", api_key="unused") as client:
        for options, disabled in variants:
            client.chat.completions.create(model="m", messages=USER, **options)
            # The cache now holds the prompt and the answer "x".
            prompt = server.call(lambda: list(server.service.engine.kv[:-1]))
            assert (prompt[-len(empty_thinking):] == empty_thinking) is disabled


def test_tool_results_and_history_render_into_the_prompt(serve_script, tokenizer):
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "What is a?"}]},
        {"role": "assistant", "content": None,
         "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "get", "arguments": '{"a": 1}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "42"},
    ]
    with serve_script("42.") as server:
        with openai.OpenAI(base_url=server.url + "/v1", api_key="unused") as client:
            reply = client.chat.completions.create(model="m", messages=messages, tools=TOOLS)
        engine = server.service.engine
        # The prompt is longer than one engine batch: it went in over several calls; the cache holds it all.
        prompt = tokenizer.decode(server.call(lambda: engine.kv[:reply.usage.prompt_tokens]))
    assert reply.choices[0].message.content == "42."
    assert "Be brief." in prompt and '"a": 1' in prompt and "<tool_response>\n42\n</tool_response>" in prompt
    assert '"name": "get"' in prompt  # the tool definition


def test_stop_strings_over_openai_and_anthropic(serve_script):
    with serve_script("one two three") as server:
        with openai.OpenAI(base_url=server.url + "/v1", api_key="unused") as client:
            reply = client.chat.completions.create(model="m", messages=USER, stop=["three", " two"])
        message = httpx.post(server.url + "/v1/messages", timeout=30, json={
            "model": "m", "max_tokens": 50, "messages": USER, "stop_sequences": ["thr"]}).json()
    assert (reply.choices[0].message.content, reply.choices[0].finish_reason) == ("one", "stop")
    assert message["content"] == [{"type": "text", "text": "one two "}]
    assert (message["stop_reason"], message["stop_sequence"]) == ("stop_sequence", "thr")
