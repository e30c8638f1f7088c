"""Structured outputs and tool choice end to end: hypercorn, the real C engine and the official clients, on the
shipped demo model (whose short answers a schema or a forced tool really changes) and on a generated model with
the 151k-token Qwen vocabulary. Every JSON answer is validated with `jsonschema`, streamed and not, greedy and
sampled."""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import anthropic
import httpx
import jsonschema
import openai
import pytest
from conftest import live_server, server_config

import strata

DEMO = Path(strata.__file__).parent / "models" / "demo.gguf"
SCHEMA = {"type": "object", "properties": {
    "answer": {"type": "string", "maxLength": 24},
    "confidence": {"type": "integer", "minimum": 0, "maximum": 100},
    "colours": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3},
}, "required": ["answer", "confidence", "colours"], "additionalProperties": False}
RESPONSE_FORMAT = {"type": "json_schema", "json_schema": {"name": "verdict", "schema": SCHEMA, "strict": True}}
UNSUPPORTED = {"type": "object", "dependentSchemas": {"a": {"required": ["b"]}}}
QUESTION = [{"role": "user", "content": "What colour is the sky?"}]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather for a city.", "strict": True,
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                   "required": ["city"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "Current time in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                   "required": ["city"], "additionalProperties": False}}}
TOOLS = [WEATHER, TIME]
ANTHROPIC_TOOLS = [{"name": t["function"]["name"], "description": t["function"]["description"],
                    "input_schema": t["function"]["parameters"]} for t in TOOLS]
RESPONSES_TOOLS = [{"type": "function", **t["function"]} for t in TOOLS]


@pytest.fixture(scope="module")
def qwen_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from strata.modelgen import write_random_model

    return write_random_model(tmp_path_factory.mktemp("qwen") / "qwen.gguf", arch="qwen3", size="tiny",
                              dtype="q8_0", vocab="qwen", seed=3)


@pytest.fixture(scope="module")
def demo():
    with live_server(server_config(model=str(DEMO), context=1024)) as live:
        yield live


@pytest.fixture(scope="module")
def qwen(qwen_model: Path):
    with live_server(server_config(model=str(qwen_model), context=1024)) as live:
        yield live


def chat_client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def messages_client(server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0)


def message(server, stream: bool, **request: Any) -> anthropic.types.Message:
    """An Anthropic message, streamed (the SDK's final message) or not."""
    with messages_client(server) as client:
        if stream:
            with client.messages.stream(**request) as events:
                return events.get_final_message()
        return client.messages.create(**request)


def chat(server, stream: bool, **request: Any) -> tuple[str, list[tuple[str, str]], str]:
    """(content, [(tool name, arguments JSON)], finish_reason) of a chat completion, streamed or not."""
    request = {"model": "m", "max_tokens": 200, **request}
    with chat_client(server) as client:
        if not stream:
            choice = client.chat.completions.create(**request).choices[0]
            calls = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls or []]
            return choice.message.content or "", calls, choice.finish_reason
        text, finish, calls = "", "", {}
        for chunk in client.chat.completions.create(stream=True, **request):
            for choice in chunk.choices:
                text += choice.delta.content or ""
                for call in choice.delta.tool_calls or []:
                    name, arguments = calls.get(call.index, ("", ""))
                    calls[call.index] = (call.function.name or name, arguments + (call.function.arguments or ""))
                finish = choice.finish_reason or finish
        return text, [calls[i] for i in sorted(calls)], finish


# --- JSON answers


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("model", ["demo", "qwen"])
def test_chat_json_schema_answers_validate(request, model, temperature, stream):
    server = request.getfixturevalue(model)
    # The random-weight model is kept from thinking: its thoughts would never end.
    effort = {"reasoning_effort": "none"} if model == "qwen" else {}
    text, calls, finish = chat(server, stream, messages=QUESTION, response_format=RESPONSE_FORMAT,
                               temperature=temperature, seed=11, **effort)
    assert (finish, calls) == ("stop", [])
    jsonschema.validate(json.loads(text), SCHEMA)


def test_without_a_format_the_demo_model_answers_in_words(demo):
    text, _, _ = chat(demo, False, messages=QUESTION, temperature=0)
    with pytest.raises(ValueError):
        json.loads(text)


def test_the_demo_model_thinks_freely_before_a_json_answer(demo):
    with chat_client(demo) as client:
        reply = client.chat.completions.create(model="m", messages=QUESTION, response_format=RESPONSE_FORMAT,
                                               temperature=0, max_tokens=200)
    message = reply.choices[0].message
    assert message.model_extra.get("reasoning_content")  # free text, not JSON
    jsonschema.validate(json.loads(message.content), SCHEMA)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_chat_json_object(demo, stream):
    text, _, finish = chat(demo, stream, messages=QUESTION, response_format={"type": "json_object"}, temperature=0,
                           max_tokens=300)
    assert finish == "stop" and isinstance(json.loads(text), dict)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_responses_text_format(demo, stream):
    text_format = {"format": {"type": "json_schema", "name": "verdict", "schema": SCHEMA, "strict": True}}
    # thinking off: the demo's thinking about a question it was not taught can ramble past the token budget
    options = {"text": text_format, "temperature": 0.8, "max_output_tokens": 200, "reasoning": {"effort": "none"}}
    with chat_client(demo) as client:
        if stream:
            with client.responses.stream(model="m", input="What colour is the sky?", **options) as events:
                response = events.get_final_response()
        else:
            response = client.responses.create(model="m", input="What colour is the sky?", **options)
    assert response.status == "completed"
    jsonschema.validate(json.loads(response.output_text), SCHEMA)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_anthropic_output_config_format(demo, stream):
    reply = message(demo, stream, model="m", max_tokens=200, messages=QUESTION, extra_body={
        "temperature": 0.7, "output_config": {"format": {"type": "json_schema", "schema": SCHEMA}}})
    assert reply.stop_reason == "end_turn"
    jsonschema.validate(json.loads("".join(b.text for b in reply.content if b.type == "text")), SCHEMA)


def test_llama_cpp_json_schema_and_grammar_fields(demo):
    with httpx.Client(base_url=demo.url, timeout=60) as client:
        by_schema = client.post("/v1/chat/completions", json={
            "messages": QUESTION, "json_schema": SCHEMA, "max_tokens": 200, "temperature": 0.9, "seed": 1})
        by_grammar = client.post("/v1/chat/completions", json={
            "messages": QUESTION, "grammar": 'root ::= ("yes" | "no") " because " [a-z]{1,12}', "max_tokens": 60,
            "reasoning_effort": "none"})
    jsonschema.validate(json.loads(by_schema.json()["choices"][0]["message"]["content"]), SCHEMA)
    answer = by_grammar.json()["choices"][0]["message"]["content"]
    head, _, word = answer.partition(" because ")
    assert head in ("yes", "no") and word.isalpha() and word.islower()


def test_unsupported_schemas_are_400s_naming_the_field(demo):
    with chat_client(demo) as client:
        with pytest.raises(openai.BadRequestError) as chat_error:
            client.chat.completions.create(model="m", messages=QUESTION, response_format={
                "type": "json_schema", "json_schema": {"name": "x", "schema": UNSUPPORTED}})
        with pytest.raises(openai.BadRequestError) as responses_error:
            client.responses.create(model="m", input="hi", text={
                "format": {"type": "json_schema", "name": "x", "schema": UNSUPPORTED}})
        with pytest.raises(openai.BadRequestError) as kind_error:
            client.chat.completions.create(model="m", messages=QUESTION, response_format={"type": "sound"})
        with pytest.raises(openai.BadRequestError) as tool_error:
            client.chat.completions.create(model="m", messages=QUESTION, tool_choice="required", tools=[
                {"type": "function", "function": {"name": "f", "strict": True, "parameters": UNSUPPORTED}}])
        with pytest.raises(openai.BadRequestError) as responses_tool_error:  # strict by default there
            client.responses.create(model="m", input="hi", tool_choice="required", tools=[
                {"type": "function", "name": "g", "parameters": {"type": "object"}},
                {"type": "function", "name": "f", "parameters": UNSUPPORTED}])
    with messages_client(demo) as client:
        with pytest.raises(anthropic.BadRequestError) as messages_error:
            client.messages.create(model="m", max_tokens=50, messages=QUESTION, extra_body={
                "output_config": {"format": {"type": "json_schema", "schema": UNSUPPORTED}}})
        with pytest.raises(anthropic.BadRequestError) as messages_tool_error:
            client.messages.create(model="m", max_tokens=50, messages=QUESTION, tool_choice={"type": "any"},
                                   tools=[{"name": "f", "input_schema": UNSUPPORTED, "strict": True}])
    assert chat_error.value.body["param"] == "response_format.json_schema.schema"
    assert responses_error.value.body["param"] == "text.format.schema"
    assert kind_error.value.body["param"] == "response_format.type"
    assert tool_error.value.body["param"] == "tools[0].function.parameters"
    assert responses_tool_error.value.body["param"] == "tools[1].parameters"
    assert messages_tool_error.value.body["error"]["message"].startswith("tools[0].input_schema")
    assert "dependentSchemas" in chat_error.value.body["message"]
    assert "output_config.format.schema" in messages_error.value.body["error"]["message"]
    # The server keeps serving.
    assert chat(demo, False, messages=QUESTION, max_tokens=5)[2] in ("stop", "length")


def test_integers_beyond_64_bits_are_400s_naming_the_path(demo):
    # llguidance clamps such bounds to 64 bits: this schema's answer came out as 9223372036854775807.
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 2**64, "maximum": 2**70}},
              "required": ["n"], "additionalProperties": False}
    with chat_client(demo) as client, pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model="m", messages=QUESTION, max_tokens=50, response_format={
            "type": "json_schema", "json_schema": {"name": "n", "schema": schema}})
    assert caught.value.body["param"] == "response_format.json_schema.schema.properties.n.minimum"


def test_a_schema_whose_instances_contain_themselves_is_a_400_naming_the_ref(demo):
    # No finite JSON satisfies it: llguidance gave up after `{"`, which came back with finish_reason "stop".
    endless = {"type": "object", "properties": {"x": {"$ref": "#"}}, "required": ["x"]}
    with chat_client(demo) as client, pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model="m", messages=QUESTION, max_tokens=50, response_format={
            "type": "json_schema", "json_schema": {"name": "x", "schema": endless}})
    assert caught.value.body["param"] == "response_format.json_schema.schema.properties.x.$ref"


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_schema_no_answer_satisfies_fails_rather_than_stopping(demo, stream):
    # The same through branches, which the plan's check does not follow: llguidance gives up after `{"`.
    endless = {"type": "object", "properties": {"x": {"anyOf": [{"$ref": "#"}, {"$ref": "#"}]}}, "required": ["x"]}
    response_format = {"type": "json_schema", "json_schema": {"name": "x", "schema": endless}}
    error = openai.APIError if stream else openai.BadRequestError
    with pytest.raises(error) as caught:
        chat(demo, stream, messages=QUESTION, response_format=response_format, temperature=0,
             reasoning_effort="none")
    body = caught.value.body
    assert body["param"] == "response_format.json_schema.schema" and body["code"] == "constraint_failed"
    assert "constraint failed" in body["message"]
    assert chat(demo, False, messages=QUESTION, max_tokens=5)[2] in ("stop", "length")  # still serving


def test_a_grammar_over_the_limits_is_a_400_naming_it(demo):
    chain = "\n".join(["root ::= r0", *(f'r{i} ::= "t{i}" | r{i + 1}' for i in range(1500)), 'r1500 ::= "end"'])
    with httpx.Client(base_url=demo.url, timeout=60) as client:
        too_long = client.post("/v1/chat/completions", json={
            "messages": QUESTION, "grammar": 'root ::= "' + "a" * 70_000 + '"', "max_tokens": 5})
        too_many = client.post("/v1/chat/completions", json={"messages": QUESTION, "grammar": chain,
                                                              "max_tokens": 5})
    assert too_long.status_code == too_many.status_code == 400
    assert too_long.json()["error"]["param"] == too_many.json()["error"]["param"] == "grammar"
    assert "limits.max_grammar_bytes" in too_long.json()["error"]["message"]
    assert "limits.max_grammar_rules" in too_many.json()["error"]["message"]


def test_a_grammar_is_converted_off_the_event_loop(demo, monkeypatch):
    import llguidance

    threads = []
    convert = llguidance.grammar_from

    def recording(*args: Any) -> str:
        threads.append(threading.current_thread().name)
        return convert(*args)

    monkeypatch.setattr(llguidance, "grammar_from", recording)
    loop_thread = demo.call(lambda: threading.current_thread().name)
    with httpx.Client(base_url=demo.url, timeout=60) as client:
        reply = client.post("/v1/chat/completions", json={
            "messages": QUESTION, "grammar": 'root ::= "yes" | "no"', "max_tokens": 5, "reasoning_effort": "none"})
    assert reply.status_code == 200 and reply.json()["choices"][0]["message"]["content"] in ("yes", "no")
    assert threads and loop_thread not in threads


# --- tool choice


def test_auto_calls_tools_and_never_reports_an_undeclared_one(demo):
    _, calls, finish = chat(demo, False, messages=[{"role": "user", "content": "What's the weather in Paris?"}],
                            tools=TOOLS, temperature=0)
    assert (finish, [name for name, _ in calls]) == ("tool_calls", ["get_weather"])
    # The demo model answers sums with a call to an `add` tool; none is declared here, so that is text. (No tool
    # is strict: with one, every call the model starts would be constrained to a declared tool.)
    text, calls, finish = chat(demo, False, messages=[{"role": "user", "content": "What is 2+3?"}], tools=[TIME],
                               temperature=0)
    assert (finish, calls) == ("stop", []) and '"add"' in text


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_chat_tool_choice_holds(demo, stream):
    hello = [{"role": "user", "content": "Hello"}]
    paris = [{"role": "user", "content": "What's the weather in Paris?"}]
    _, required, finish = chat(demo, stream, messages=hello, tools=TOOLS, tool_choice="required", temperature=0.8)
    assert finish == "tool_calls" and required and all(name in ("get_weather", "get_time") for name, _ in required)
    named = {"type": "function", "function": {"name": "get_time"}}
    _, calls, _ = chat(demo, stream, messages=paris, tools=TOOLS, tool_choice=named, temperature=0)
    assert [name for name, _ in calls] == ["get_time"]
    jsonschema.validate(json.loads(calls[0][1]), TIME["function"]["parameters"])
    # thinking off: the demo, told not to call the tool it was taught to call, thinks on without end
    text, calls, finish = chat(demo, stream, messages=paris, tools=TOOLS, tool_choice="none", temperature=0,
                               reasoning_effort="none")
    assert (calls, finish) == ([], "stop") and text
    _, calls, _ = chat(demo, stream, messages=hello, tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
                       temperature=1.0, seed=5)
    assert len(calls) == 1


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_anthropic_tool_choice_holds(demo, stream):
    def ask(content: str, tool_choice: dict[str, Any]) -> anthropic.types.Message:
        return message(demo, stream, model="m", max_tokens=200, messages=[{"role": "user", "content": content}],
                       tools=ANTHROPIC_TOOLS, tool_choice=tool_choice, extra_body={"temperature": 0})

    def uses(message: anthropic.types.Message) -> list[str]:
        return [block.name for block in message.content if block.type == "tool_use"]

    forced = ask("Hello", {"type": "any"})
    assert forced.stop_reason == "tool_use" and uses(forced)
    assert uses(ask("What's the weather in Paris?", {"type": "tool", "name": "get_time"})) == ["get_time"]
    refused = ask("What's the weather in Paris?", {"type": "none"})
    assert refused.stop_reason == "end_turn" and uses(refused) == []
    single = ask("What is the weather in Paris and the time in Tokyo?",
                 {"type": "any", "disable_parallel_tool_use": True})
    assert len(uses(single)) == 1


def test_responses_tool_choice_holds(demo):
    def ask(content: str, **request: Any) -> list[str]:
        with chat_client(demo) as client:
            response = client.responses.create(model="m", input=content, tools=RESPONSES_TOOLS, temperature=0,
                                               max_output_tokens=200, **request)
        return [item.name for item in response.output if item.type == "function_call"]

    assert ask("Hello", tool_choice="required")
    assert ask("What's the weather in Paris?", tool_choice={"type": "function", "name": "get_time"}) == ["get_time"]
    assert ask("What's the weather in Paris?", tool_choice="none") == []


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_forced_strict_call_on_the_qwen_vocabulary(qwen, stream):
    _, calls, finish = chat(qwen, stream, messages=QUESTION, tools=TOOLS, tool_choice="required",
                            parallel_tool_calls=False, temperature=1.0, seed=2, reasoning_effort="none")
    assert finish == "tool_calls" and len(calls) == 1
    name, arguments = calls[0]
    tool = next(t["function"] for t in TOOLS if t["function"]["name"] == name)
    jsonschema.validate(json.loads(arguments), tool["parameters"])


def test_the_readme_examples_print_what_they_say(demo, capsys):
    """The README's JSON-schema and forced-tool examples, run verbatim (each makes its own client; only the
    server's address is this server's): each prints exactly what its comment says."""
    readme = (Path(__file__).parents[2] / "README.md").read_text()
    blocks = [block.split("```", 1)[0] for block in readme.split("```python\n")[1:]]
    examples = [block for block in blocks if "response_format=" in block or "tool_choice=" in block]
    assert len(examples) == 2
    for example in examples:
        exec(example.replace("http://127.0.0.1:8080", demo.url), {})
        printed = capsys.readouterr().out.strip()
        expected = example.rsplit("# ", 1)[1].strip()
        assert printed == expected


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_the_qwen_vocabulary_in_the_other_dialects(qwen, stream):
    """Responses' text.format and Anthropic's output_config.format and `any` tool choice, sampled."""
    text_format = {"format": {"type": "json_schema", "name": "verdict", "schema": SCHEMA}}
    responses = dict(model="m", input="Judge.", text=text_format, temperature=1.0, max_output_tokens=300,
                     reasoning={"effort": "none"})
    anthropic_json = dict(model="m", max_tokens=300, messages=QUESTION, extra_body={
        "temperature": 1.0, "output_config": {"format": {"type": "json_schema", "schema": SCHEMA}}})
    anthropic_tool = dict(model="m", max_tokens=300, messages=QUESTION,
                          tool_choice={"type": "any", "disable_parallel_tool_use": True},
                          tools=[{**ANTHROPIC_TOOLS[0], "strict": True}], extra_body={"temperature": 1.0})
    with chat_client(qwen) as client:
        if stream:
            with client.responses.stream(**responses) as events:
                response = events.get_final_response()
        else:
            response = client.responses.create(**responses)
    answer, called = message(qwen, stream, **anthropic_json), message(qwen, stream, **anthropic_tool)
    jsonschema.validate(json.loads(response.output_text), SCHEMA)
    jsonschema.validate(json.loads("".join(b.text for b in answer.content if b.type == "text")), SCHEMA)
    uses = [block for block in called.content if block.type == "tool_use"]
    assert called.stop_reason == "tool_use" and [use.name for use in uses] == ["get_weather"]
    jsonschema.validate(uses[0].input, WEATHER["function"]["parameters"])


def test_responses_functions_are_strict_unless_the_request_says_not(demo):
    """The Responses API's default is `strict: true`: the demo model's call (Paris) must follow the schema,
    which only knows Lyon and Rome; with `strict: false` it writes what it likes."""
    schema = {"type": "object", "properties": {"city": {"enum": ["Lyon", "Rome"]}}, "required": ["city"],
              "additionalProperties": False}
    tool = {"type": "function", "name": "get_weather", "description": "Current weather for a city.",
            "parameters": schema}

    def call(**extra: Any) -> tuple[dict[str, Any], bool | None]:
        with chat_client(demo) as client:
            response = client.responses.create(model="m", input="What's the weather in Paris?", temperature=0,
                                               max_output_tokens=200, tools=[{**tool, **extra}])
        calls = [item for item in response.output if item.type == "function_call"]
        assert [item.name for item in calls] == ["get_weather"]
        return json.loads(calls[0].arguments), response.tools[0].strict

    arguments, strict = call()
    jsonschema.validate(arguments, schema)
    assert strict is True
    assert call(strict=False) == ({"city": "Paris"}, False)


# --- a prefilled answer


PREFILL = '{"answer": "'


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_prefilled_answer_is_continued_in_the_format(demo, stream):
    """The schema applies to the prefilled text and its continuation together: Anthropic's prefill and OpenAI's
    continue_final_message each return a continuation that completes a valid answer."""
    prefilled = [*QUESTION, {"role": "assistant", "content": PREFILL}]
    reply = message(demo, stream, model="m", max_tokens=200, messages=prefilled, extra_body={
        "temperature": 0.7, "output_config": {"format": {"type": "json_schema", "schema": SCHEMA}}})
    assert reply.stop_reason == "end_turn"
    jsonschema.validate(json.loads(PREFILL + "".join(b.text for b in reply.content if b.type == "text")), SCHEMA)
    text, calls, finish = chat(demo, stream, messages=prefilled, response_format=RESPONSE_FORMAT, temperature=0.7,
                               extra_body={"continue_final_message": True})
    assert (finish, calls) == ("stop", [])
    jsonschema.validate(json.loads(PREFILL + text), SCHEMA)


def test_a_prefill_the_format_or_a_forced_tool_cannot_continue_is_a_400(demo):
    with messages_client(demo) as client:
        with pytest.raises(anthropic.BadRequestError) as not_json:
            client.messages.create(model="m", max_tokens=50, messages=[
                *QUESTION, {"role": "assistant", "content": "The sky is"}], extra_body={
                "output_config": {"format": {"type": "json_schema", "schema": SCHEMA}}})
        with pytest.raises(anthropic.BadRequestError) as forced:
            client.messages.create(model="m", max_tokens=50, tools=ANTHROPIC_TOOLS, tool_choice={"type": "any"},
                                   messages=[*QUESTION, {"role": "assistant", "content": "Let me check."}])
    assert "messages" in not_json.value.body["error"]["message"]
    assert "cannot begin an answer" in not_json.value.body["error"]["message"]
    assert "tool_choice" in forced.value.body["error"]["message"]
    # A prefill without a format or a forced tool is as before: continued freely.
    with messages_client(demo) as client:
        message = client.messages.create(model="m", max_tokens=20, messages=[
            *QUESTION, {"role": "assistant", "content": "The sky is"}], extra_body={"temperature": 0})
    assert message.content and message.content[0].text
