"""Constrained decoding without an engine: plans from request fields, and guides that mask random logits, so every
sampled answer must come out valid by construction (checked with `jsonschema` and the tool-call parser)."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import numpy as np
import pytest

from strata.events import TextDelta, ToolCallArgumentsDelta, ToolCallStart
from strata.text import constraints
from strata.text.constraints import AnswerFormat, GrammarError, GrammarLimits, Grammars, plan_constraint
from strata.text.families import QWEN3
from strata.text.sampling import Sampler, SamplingParams
from strata.text.toolcalls import ToolCallParser

SCHEMA = {"type": "object", "properties": {
    "colour": {"enum": ["red", "green", "blue"]},
    "count": {"type": "integer", "minimum": 0, "maximum": 99},
    "ok": {"type": "boolean"},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "maxItems": 3},
}, "required": ["colour", "count", "ok"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "strict": True, "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 8}}, "required": ["city"],
    "additionalProperties": False}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"zone": {"enum": ["utc", "cet"]}}, "required": ["zone"],
        "additionalProperties": False}}}]


@pytest.fixture(scope="module")
def grammars(tokenizer) -> Grammars:
    return Grammars(tokenizer, QWEN3, tokenizer.n_vocab)


def plan(grammars: Grammars, **fields: Any):
    options: dict[str, Any] = dict(answer_format=None, tools=[], tool_choice=None, parallel_tool_calls=True,
                                   thinking=False, in_reasoning=False)
    options.update(fields)
    return plan_constraint(tokens=grammars.tokens, **options)


def run(grammars: Grammars, the_plan, seed: int, *, max_tokens: int = 400, bias: dict[int, float] | None = None,
        first: int | None = None) -> list[int]:
    """Sample from random logits (temperature 1, plus `bias`; `first` strongly favoured first) through the plan's
    guide until an end-of-turn token."""
    rng = np.random.default_rng(seed)
    sampler = Sampler(SamplingParams(temperature=1.0, seed=seed), grammars.n_vocab, mask=grammars.guide(the_plan))
    out: list[int] = []
    for _ in range(max_tokens):
        logits = rng.normal(0, 3, grammars.n_vocab).astype(np.float32)
        for token, value in (bias or {}).items():
            logits[token] += value
        if first is not None and not out:
            logits[first] += 40.0
        token = sampler.sample(logits, out)
        if token in grammars.eos_ids:
            return out
        out.append(token)
    raise AssertionError(f"no end of turn in {max_tokens} tokens")


@pytest.mark.parametrize("overlap", [True, False], ids=["in-a-pool-thread", "in-advance"])
@pytest.mark.parametrize("few", [0, 40, 10**6], ids=["by-mask", "by-index", "allowed-ids"])
def test_the_guides_masks_are_llguidances(grammars, tokenizer, monkeypatch, few, overlap):
    """The masks the guide computes (beside the engine or not) and writes (by allowed ids, banned ids or a
    boolean mask, whichever `_FEW` picks) ban exactly what llguidance's own matcher, fed the same tokens, bans."""
    import llguidance
    import llguidance.numpy

    monkeypatch.setattr(constraints, "_FEW", few)
    monkeypatch.setattr(grammars, "overlap", overlap)
    the_plan = plan(grammars, answer_format=AnswerFormat("json_schema", json.dumps(SCHEMA)))
    reference = llguidance.LLMatcher(grammars.ll_tokenizer(), the_plan.answer, log_level=0)
    bits = llguidance.numpy.allocate_token_bitmask(1, grammars.n_vocab)
    sampler = Sampler(SamplingParams(temperature=1.0, seed=few), grammars.n_vocab, mask=grammars.guide(the_plan))
    rng = np.random.default_rng(few)
    out: list[int] = []
    while not out or out[-1] not in grammars.eos_ids:
        assert len(out) < 400
        logits = rng.normal(0, 3, grammars.n_vocab).astype(np.float32)
        token = sampler.sample(logits, out)  # masks `logits` in place
        if reference.is_stopped():
            expected = np.isin(np.arange(grammars.n_vocab), grammars.eos_ids)
        else:
            llguidance.numpy.fill_next_token_bitmask(reference, bits, 0)
            expected = np.unpackbits(bits.view(np.uint8), bitorder="little", count=grammars.n_vocab).view(bool)
        assert np.array_equal(np.isfinite(logits), expected)
        out.append(token)
        if token not in grammars.eos_ids:
            assert reference.consume_token(token)
    jsonschema.validate(json.loads(tokenizer.decode(out[:-1])), SCHEMA)


@pytest.mark.parametrize("seed", range(4))
def test_schema_answers_validate_at_temperature_one(grammars, tokenizer, seed):
    the_plan = plan(grammars, answer_format=AnswerFormat("json_schema", json.dumps(SCHEMA)))
    text = tokenizer.decode(run(grammars, the_plan, seed))
    jsonschema.validate(json.loads(text), SCHEMA)


def test_reasoning_stays_free_and_the_answer_follows_it(grammars, tokenizer):
    the_plan = plan(grammars, answer_format=AnswerFormat("json_schema", json.dumps(SCHEMA)), thinking=True)
    think_open, think_close = grammars.tokens.think_open, grammars.tokens.think_close
    # Push the model towards thinking, then towards ending: without the guide it would stop inside the thought.
    ids = run(grammars, the_plan, 7, bias={grammars.eos_ids[0]: 8.0, think_close: 6.0}, first=think_open)
    assert ids[0] == think_open and think_close in ids
    answer = tokenizer.decode(ids[ids.index(think_close) + 1:])
    jsonschema.validate(json.loads(answer), SCHEMA)


def test_a_grammar_in_gbnf(grammars, tokenizer):
    gbnf = 'root ::= "yes" | "no" | "maybe " [0-9]'
    the_plan = plan(grammars, answer_format=AnswerFormat("grammar", gbnf, "grammar"))
    answers = {tokenizer.decode(run(grammars, the_plan, seed)) for seed in range(8)}
    assert answers <= {"yes", "no"} | {f"maybe {d}" for d in range(10)} and len(answers) > 1


@pytest.mark.parametrize(("schema", "keyword"), [
    ({"type": "object", "dependentSchemas": {"a": {}}}, "dependentSchemas"),
    ({"type": "string", "format": "no-such-format"}, "format"),
])
def test_unsupported_schema_features_name_the_field(grammars, schema, keyword):
    answer_format = AnswerFormat("json_schema", json.dumps(schema), "response_format.json_schema.schema")
    with pytest.raises(GrammarError) as caught:
        grammars.guide(plan(grammars, answer_format=answer_format))
    assert caught.value.param == "response_format.json_schema.schema"
    assert keyword in str(caught.value)


def test_a_bad_grammar_names_the_field(grammars):
    with pytest.raises(GrammarError) as caught:
        grammars.guide(plan(grammars, answer_format=AnswerFormat("grammar", "root ::= undefined-rule", "grammar")))
    assert caught.value.param == "grammar" and "undefined" in str(caught.value)


def chained_gbnf(n_rules: int) -> str:
    """A GBNF grammar of `n_rules` rules each referring to the next: llguidance's conversion takes time quadratic
    in such a chain's length."""
    rules = [f'r{i} ::= "t{i}" | r{i + 1}' for i in range(n_rules - 1)]
    return "\n".join(["root ::= r0", *rules, f'r{n_rules - 1} ::= "end"'])


@pytest.mark.parametrize(("grammar", "key"), [
    ('root ::= "' + "a" * 70_000 + '"', "limits.max_grammar_bytes"),
    (chained_gbnf(1200), "limits.max_grammar_rules"),
], ids=["bytes", "rules"])
def test_a_grammar_over_the_limits_is_refused_before_it_is_converted(grammars, monkeypatch, grammar, key):
    monkeypatch.setattr("llguidance.grammar_from", lambda *_: pytest.fail("converted"))
    with pytest.raises(GrammarError) as caught:
        plan(grammars, answer_format=AnswerFormat("grammar", grammar, "grammar"))
    assert caught.value.param == "grammar" and key in str(caught.value)


def test_a_grammar_within_the_limits_is_converted(grammars):
    limits = GrammarLimits(max_bytes=64 * 1024, max_rules=1000)
    the_plan = plan(grammars, answer_format=AnswerFormat("grammar", chained_gbnf(999), "grammar"), limits=limits)
    assert the_plan is not None and the_plan.answer


@pytest.mark.parametrize(("schema", "where"), [
    ({"type": "integer", "minimum": 2**64, "maximum": 2**70}, ".minimum"),
    ({"type": "object", "properties": {"n": {"type": "integer", "maximum": -(2**63) - 1}}},
     ".properties.n.maximum"),
    ({"type": "object", "properties": {"n": {"const": 2**70}}}, ".properties.n.const"),
    ({"anyOf": [{"type": "string"}, {"enum": [1, 2**53 + 1]}]}, ".anyOf[1].enum[1]"),
], ids=["bound", "negative-bound", "const", "enum"])
def test_integers_llguidance_cannot_hold_exactly_are_refused_naming_the_path(grammars, schema, where):
    param = "response_format.json_schema.schema"
    with pytest.raises(GrammarError) as caught:
        plan(grammars, answer_format=AnswerFormat("json_schema", json.dumps(schema), param))
    assert caught.value.param == param + where and str(caught.value).startswith(param + where + ": ")


def test_integers_at_the_limits_are_kept(grammars):
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": -(2**63), "maximum": 2**63 - 1},
                                               "c": {"const": 2**53}, "d": {"default": 2**70}}}
    assert plan(grammars, answer_format=AnswerFormat("json_schema", json.dumps(schema))) is not None


def test_a_strict_tools_integers_are_checked_too(grammars):
    tools = [{"type": "function", "function": {"name": "f", "strict": True, "parameters": {
        "type": "object", "properties": {"n": {"type": "integer", "maximum": 2**65}}}}}]
    with pytest.raises(GrammarError) as caught:
        plan(grammars, tools=tools, tool_choice="required")
    assert caught.value.param == "tools[0].function.parameters.properties.n.maximum"


@pytest.mark.parametrize(("schema", "where"), [
    ({"type": "object", "properties": {"x": {"$ref": "#"}}, "required": ["x"]}, ".properties.x.$ref"),
    ({"$ref": "#/$defs/a", "$defs": {"a": {"type": "object", "properties": {"x": {"$ref": "#/$defs/a"}},
                                           "required": ["x"]}}}, ".$defs.a.properties.x.$ref"),
    ({"type": "array", "items": {"$ref": "#"}, "minItems": 1}, ".items.$ref"),
    ({"$ref": "#/$defs/a", "$defs": {
        "a": {"type": "object", "properties": {"b": {"$ref": "#/$defs/b"}}, "required": ["b"]},
        "b": {"allOf": [{"type": "array", "items": {"$ref": "#/$defs/a"}, "minItems": 2}]}}},
     ".$defs.b.allOf[0].items.$ref"),
], ids=["required", "defs", "items", "mutual"])
def test_a_schema_every_instance_of_which_contains_itself_is_refused(grammars, schema, where):
    param = "response_format.json_schema.schema"
    with pytest.raises(GrammarError) as caught:
        plan(grammars, answer_format=AnswerFormat("json_schema", json.dumps(schema), param))
    assert caught.value.param == param + where and "no finite JSON" in str(caught.value)


@pytest.mark.parametrize("schema", [
    {"type": "object", "properties": {"x": {"$ref": "#"}}},  # optional
    {"properties": {"x": {"$ref": "#"}}, "required": ["x"]},  # not only objects
    {"type": "array", "items": {"$ref": "#"}},  # may be empty
    {"type": "object", "properties": {"x": {"anyOf": [{"$ref": "#"}, {"type": "null"}]}}, "required": ["x"]},
], ids=["optional", "untyped", "empty-array", "branch"])
def test_recursive_schemas_with_a_way_out_are_kept(grammars, schema):
    assert plan(grammars, answer_format=AnswerFormat("json_schema", json.dumps(schema))) is not None


def test_an_answer_llguidance_gives_up_on_is_not_a_finished_answer(grammars, tokenizer):
    # No finite JSON satisfies it (through branches, which the plan's check does not follow): llguidance's matcher
    # fails after `{"` and leaves only an end-of-turn token.
    endless = {"type": "object", "properties": {"x": {"anyOf": [{"$ref": "#"}, {"$ref": "#"}]}}, "required": ["x"]}
    the_plan = plan(grammars, answer_format=AnswerFormat("json_schema", json.dumps(endless)))
    guide = grammars.guide(the_plan)
    sampler = Sampler(SamplingParams(temperature=0.0), grammars.n_vocab, mask=guide)
    rng = np.random.default_rng(0)
    out: list[int] = []
    while not out or out[-1] not in grammars.eos_ids:
        out.append(sampler.sample(rng.normal(0, 3, grammars.n_vocab).astype(np.float32), out))
        assert len(out) < 50
    error = grammars.answer_error(guide)
    assert error is not None and "constraint failed" in error


def test_a_finished_answer_is_checked_against_the_schema(grammars, tokenizer):
    the_plan = plan(grammars, answer_format=AnswerFormat("json_schema", json.dumps(SCHEMA)))
    guide = grammars.guide(the_plan)
    sampler = Sampler(SamplingParams(temperature=1.0, seed=3), grammars.n_vocab, mask=guide)
    rng = np.random.default_rng(3)
    out: list[int] = []
    while not out or out[-1] not in grammars.eos_ids:
        out.append(sampler.sample(rng.normal(0, 3, grammars.n_vocab).astype(np.float32), out))
    assert grammars.answer_error(guide) is None
    # What llguidance would let through, as when it enforces a bound only approximately: the check still sees it.
    guide.answer_ids[:] = tokenizer.encode('{"colour": "red", "count": 100, "ok": true}', special=False)
    error = grammars.answer_error(guide)
    assert error is not None and "$.count" in error


def test_compiled_grammars_are_cached(grammars):
    answer_format = AnswerFormat("json_schema", json.dumps(SCHEMA))
    first = plan(grammars, answer_format=answer_format)
    grammars.guide(first)
    cached = dict(grammars._cache)
    grammars.guide(plan(grammars, answer_format=answer_format))
    assert first.answer in cached and grammars._cache.keys() == cached.keys()


def calls_of(tokenizer, ids: list[int], names=None) -> tuple[str, list[tuple[str, dict[str, Any]]]]:
    parser = ToolCallParser(QWEN3, tool_names=names)
    events = parser.feed(tokenizer.decode(ids)) + parser.finish()
    text = "".join(e.text for e in events if isinstance(e, TextDelta))
    calls: list[tuple[str, dict[str, Any]]] = []
    for event in events:
        if isinstance(event, ToolCallStart):
            calls.append((event.name, {}))
        elif isinstance(event, ToolCallArgumentsDelta):
            name, _ = calls[event.index]
            calls[event.index] = (name, json.loads(event.text))
    return text, calls


@pytest.mark.parametrize("seed", range(3))
def test_required_calls_a_declared_tool_with_its_schema(grammars, tokenizer, seed):
    ids = run(grammars, plan(grammars, tools=TOOLS, tool_choice="required"), seed)
    text, calls = calls_of(tokenizer, ids)
    assert text == "" and calls
    for name, arguments in calls:
        tool = next(tool["function"] for tool in TOOLS if tool["function"]["name"] == name)
        jsonschema.validate(arguments, tool["parameters"])


def test_a_named_tool_is_the_one_called_once_without_parallel_calls(grammars, tokenizer):
    choice = {"type": "function", "function": {"name": "get_time"}}
    for seed in range(3):
        the_plan = plan(grammars, tools=TOOLS, tool_choice=choice, parallel_tool_calls=False)
        _, calls = calls_of(tokenizer, run(grammars, the_plan, seed))
        assert [name for name, _ in calls] == ["get_time"]
        assert calls[0][1]["zone"] in ("utc", "cet")


def test_auto_with_a_strict_tool_constrains_calls_the_model_starts(grammars, tokenizer):
    call_open = grammars.tokens.call_open
    the_plan = plan(grammars, tools=TOOLS, tool_choice="auto", parallel_tool_calls=False)
    ids = run(grammars, the_plan, 3, bias={call_open: 12.0, grammars.eos_ids[0]: 3.0})
    assert ids.count(call_open) == 1  # parallel_tool_calls false: the second call can never start
    _, calls = calls_of(tokenizer, ids)
    assert len(calls) == 1 and calls[0][0] in ("get_weather", "get_time")


def test_none_bans_the_call_tag(grammars, tokenizer):
    the_plan = plan(grammars, tools=TOOLS, tool_choice="none")
    ids = run(grammars, the_plan, 1, bias={grammars.tokens.call_open: 50.0, grammars.eos_ids[0]: 4.0})
    assert grammars.tokens.call_open not in ids


def test_nothing_to_constrain_is_no_plan(grammars):
    assert plan(grammars) is None
    assert plan(grammars, tools=[{"type": "function", "function": {"name": "f", "parameters": {}}}]) is None


def test_a_grammar_and_tools_together_are_refused(grammars):
    with pytest.raises(GrammarError) as caught:
        plan(grammars, tools=TOOLS, answer_format=AnswerFormat("grammar", 'root ::= "x"', "grammar"))
    assert caught.value.param == "grammar"


def test_calls_to_undeclared_tools_are_text(tokenizer):
    ids = tokenizer.encode('<tool_call>\n{"name": "rm", "arguments": {"path": "/"}}\n</tool_call>', special=True)
    text, calls = calls_of(tokenizer, ids, names={"get_weather"})
    assert calls == [] and '"rm"' in text
