"""Constrained decoding: what a request's answer must look like, as a token mask applied beside the sampler.

A request can ask for a JSON answer (a JSON schema, or any JSON object), for an answer in a grammar (GBNF or
llguidance's Lark), or for tool calls that must happen (`tool_choice` required or named) or follow their
declared schemas. `plan_constraint` turns those fields into a `Plan` (grammar texts, converted, not compiled);
`Grammars.compile` compiles a plan with llguidance into matchers, cached by grammar text; a `Guide` then runs in
the engine thread, one per generation: before each token is sampled it masks the logits to the tokens the grammar
allows, and after it follows the sampled token.

The markers and a call's syntax are the model family's (`strata.text.family.ModelFamily`; Qwen3's `<think>` and
`<tool_call>` below). Reasoning stays free: when thinking is on, the first token may open `<think>`, and the
constraint starts after `</think>`. In `auto` mode the text is free; when a declared tool is strict, each call's
body, from the model's `<tool_call>` to `</tool_call>`, is constrained to a declared tool and its schema (the
family's `call_rule`). `parallel_tool_calls` false bans `<tool_call>` once one call has started; `tool_choice`
"none" bans it always.

llguidance (not a compiler of our own): it covers most of JSON schema and says which keyword it lacks, and it
reads GBNF as llama.cpp clients send it. What it would enforce only approximately is refused instead: integers
beyond 64 bits (it clamps bounds to them, and keeps `const` and `enum` numbers as doubles), and `$ref` cycles that
every instance must follow (it gives up after a few tokens: no finite text satisfies them). Its GBNF conversion is
Python that takes time quadratic in the number of rules (a pass over every rule for each level of a chain of
rules), so a grammar's size and rules are bounded (`GrammarLimits`) before it starts; `plan_constraint` and
`Grammars.guide` are blocking work for a worker thread. An answer that ends is checked against what was asked
(`Grammars.answer_error`), so that llguidance giving up never passes for a finished answer.

A matcher's mask depends only on the tokens sampled so far, so the next one is computed in a pool thread
(llguidance drops the GIL) while the engine computes the next logits; when few tokens are allowed (most steps of
a JSON answer allow one) the sampler draws among those alone.
"""

from __future__ import annotations

import json
import os
import threading
from collections import OrderedDict
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

from strata.text.family import ModelFamily

FormatKind = Literal["json_schema", "json_object", "grammar"]

# The JSON answers' layout: compact with single spaces (`{"a": 1, "b": [2, 3]}`), no free whitespace, so that a
# model cannot fill its budget with blanks and every answer reads the same.
_JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_CACHE_SIZE = 64
# The integers llguidance enforces exactly: bounds as 64-bit integers, `const` and `enum` values as doubles.
_INT64 = (-(2**63), 2**63 - 1)
_EXACT_DOUBLE = 2**53
_BOUNDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")


class GrammarError(ValueError):
    """A schema or grammar the engine cannot enforce; `param` names the request field."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class AnswerFormat:
    """What the answer's text must be.

    Attributes:
        kind: "json_schema" (`source` is the schema as JSON text), "json_object" (any JSON object) or
            "grammar" (`source` is GBNF or llguidance Lark text).
        source: the schema or grammar text ("" for json_object).
        param: the request field it came from, named in errors (e.g. "response_format.json_schema.schema").
    """

    kind: FormatKind
    source: str = ""
    param: str = "response_format"


@dataclass(frozen=True)
class GrammarLimits:
    """How large a request's grammar may be (the `limits.max_grammar_bytes` and `limits.max_grammar_rules` config
    keys). The rules bound the GBNF conversion's quadratic time: 1,000 chained rules take about 0.6 s of a core.

    Attributes:
        max_bytes: the grammar text's size in UTF-8 bytes.
        max_rules: the rules of a GBNF grammar (its `::=`).
    """

    max_bytes: int = 64 * 1024
    max_rules: int = 1000


@dataclass(frozen=True)
class SpecialTokens:
    """A model family and the ids of its markers in a vocabulary (None: the marker is not one token there)."""

    family: ModelFamily
    think_open: int | None
    think_close: int | None
    call_open: int | None
    call_close: int | None

    @classmethod
    def of(cls, tokenizer: Any, family: ModelFamily) -> SpecialTokens:
        def one(text: str) -> int | None:
            ids = tokenizer.encode(text, special=True)
            return ids[0] if len(ids) == 1 else None

        return cls(family, one(family.think_open), one(family.think_close), one(family.call_open),
                   one(family.call_close))


@dataclass(frozen=True)
class Plan:
    """What a generation's guide enforces, as grammar texts (compiled by `Grammars.compile`).

    Attributes:
        answer: the grammar of the whole answer (after any reasoning), or None (llguidance's grammar text).
        call: in `auto` mode, the grammar of one tool call's body after `<tool_call>`, or None.
        may_think: the model may open `<think>` before the constrained answer.
        in_reasoning: the prompt already opened `<think>`.
        banned: token ids that may never be sampled.
        max_calls: in `auto` mode, how many tool calls may start (None: any number).
        parts: (grammar, param) of each schema or grammar the request sent, checked one by one so that an error
            names its field.
        prefix: text the answer already begins with (a prefilled assistant message): the answer's grammar
            applies to it and its continuation together.
        schema: the JSON schema the whole answer must satisfy (a JSON format with no tools), checked once it
            ends (`Grammars.answer_error`); None when there is none to check.
    """

    answer: str | None = None
    call: str | None = None
    may_think: bool = False
    in_reasoning: bool = False
    banned: tuple[int, ...] = ()
    max_calls: int | None = None
    parts: tuple[tuple[str, str], ...] = ()
    prefix: str = ""
    schema: Any = None


def plan_constraint(*, answer_format: AnswerFormat | None, tools: Sequence[dict[str, Any]],
                    tool_choice: str | dict[str, Any] | None, parallel_tool_calls: bool, thinking: bool,
                    in_reasoning: bool, tokens: SpecialTokens, prefix: str = "",
                    tool_fields: Mapping[str, str] | None = None,
                    limits: GrammarLimits = GrammarLimits()) -> Plan | None:
    """The plan for a request's answer format and tool choice; None when nothing is constrained. Blocking work
    (a worker thread) when the request sends a grammar or schemas: they are converted here.

    Args:
        answer_format: the answer's format, if the request set one.
        tools: the declared tools (OpenAI chat shape: `{"type": "function", "function": {name, parameters,
            strict}}`); empty when the request has none or chose "none".
        tool_choice: "none", "auto", "required", `{"type": "function", "function": {"name": ...}}` or None
            (auto).
        parallel_tool_calls: False allows at most one tool call.
        thinking: the template lets the model think (it may open `<think>` first).
        in_reasoning: the prompt ends inside an open `<think>`.
        tokens: the model family and its markers' ids in the vocabulary.
        prefix: the answer's text so far (a prefilled assistant message, past any reasoning): a format applies
            to it and what follows together.
        tool_fields: each tool's parameters field as the request named it, by tool name, for errors (default:
            the OpenAI chat shape's `tools[i].function.parameters`).
        limits: how large a grammar may be.

    Raises:
        GrammarError: a format that cannot be combined with the tools, a forced tool choice after a prefill, a
            grammar over the limits, or a schema llguidance would not hold to (`_check_schema`).
    """
    choice, forced, tools = _tool_choice(tool_choice, tools, prefix)
    format_rule = _format_rule(answer_format, limits) if answer_format is not None else None
    may_think, in_reasoning = _reasoning(thinking, in_reasoning, tokens)
    if tools and (forced or format_rule is not None):
        answer, parts = _answer_or_calls(format_rule, tools, choice, forced, tokens, parallel_tool_calls,
                                         tool_fields or {})
        return Plan(answer=answer, parts=parts, may_think=may_think, in_reasoning=in_reasoning, prefix=prefix)
    if format_rule is not None:
        # no tools here: the answer is the format's, and a call may not start
        banned = () if tokens.call_open is None else (tokens.call_open,)
        return Plan(answer=_format_answer(format_rule), banned=banned, parts=(format_rule[1],), may_think=may_think,
                    in_reasoning=in_reasoning, prefix=prefix, schema=format_rule[2])
    if not tools:
        return Plan(banned=(tokens.call_open,)) if choice == "none" and tokens.call_open is not None else None
    return _auto_calls(tools, tokens, parallel_tool_calls, tool_fields or {})


def _tool_choice(tool_choice: str | dict[str, Any] | None, tools: Sequence[dict[str, Any]], prefix: str
                 ) -> tuple[str | dict[str, Any], bool, Sequence[dict[str, Any]]]:
    """The tool choice (None is "auto"), whether it forces a call, and the tools it lets the model call (none
    when it is "none").

    Raises:
        GrammarError: a forced call after a prefill (the call would have to begin the answer).
    """
    choice = tool_choice if tool_choice is not None else "auto"
    forced = choice == "required" or isinstance(choice, dict)
    if forced and tools and prefix:
        raise GrammarError("tool_choice: a forced tool call cannot continue a prefilled assistant message (the "
                           "call would have to begin the answer); send tool_choice \"auto\" or drop the prefill",
                           "tool_choice")
    return choice, forced, [] if choice == "none" else tools


def _reasoning(thinking: bool, in_reasoning: bool, tokens: SpecialTokens) -> tuple[bool, bool]:
    """Whether the model may open `<think>` before the constrained answer, and whether the prompt left one open
    that the answer follows; both only where the vocabulary has the tags as tokens."""
    may_think = thinking and not in_reasoning and tokens.think_open is not None and tokens.think_close is not None
    return may_think, in_reasoning and tokens.think_close is not None


def _format_answer(format_rule: _FormatRule) -> str:
    """The grammar of an answer in a format (`_format_rule`) and nothing else: a JSON rule as a grammar's start,
    or the request's own grammar."""
    rule, (grammar, _), _ = format_rule
    return _lark([f"start: {rule}"]) if rule is not None else grammar


def _answer_or_calls(format_rule: _FormatRule | None, tools: Sequence[dict[str, Any]],
                     choice: str | dict[str, Any], forced: bool, tokens: SpecialTokens, parallel: bool,
                     tool_fields: Mapping[str, str]) -> tuple[str, tuple[tuple[str, str], ...]]:
    """The grammar of an answer that is tool calls (a forced choice: required, or the named tool's) or, with a
    JSON format and `auto`, either an answer in the format or calls; and the parts to check.

    Raises:
        GrammarError: the format is a grammar (it has rules of its own, and cannot be combined with calls).
    """
    rule, parts = None, []
    if format_rule is not None:
        rule, part, _ = format_rule
        parts.append(part)
        if rule is None:
            param = part[1]
            raise GrammarError(f"{param}: a grammar cannot be combined with tools; send tool_choice \"none\" or "
                               "leave the tools out", param)
    if isinstance(choice, dict):
        tools = [tool for tool in tools if tool["function"]["name"] == choice["function"]["name"]]
    calls_rule, call_parts = _calls_rules(tools, tokens, parallel, tool_fields, body_only=False)
    rules = ["start: calls" if forced else "start: answer | calls", *calls_rule]
    if rule is not None and not forced:
        rules.append(f"answer: {rule}")
    return _lark(rules), (*parts, *call_parts)


def _auto_calls(tools: Sequence[dict[str, Any]], tokens: SpecialTokens, parallel: bool,
                tool_fields: Mapping[str, str]) -> Plan | None:
    """`auto` with tools and no format: the text is free; calls are constrained when a tool is strict, and
    counted (None: nothing to enforce)."""
    if tokens.call_open is None:
        return None
    call: str | None = None
    call_parts: list[tuple[str, str]] = []
    if any(tool["function"].get("strict") for tool in tools) and tokens.call_close is not None:
        calls_rule, call_parts = _calls_rules(tools, tokens, parallel, tool_fields, body_only=True)
        call = _lark(["start: body", *calls_rule])
    elif parallel:
        return None
    return Plan(call=call, max_calls=None if parallel else 1, parts=tuple(call_parts))


def _lark(rules: list[str]) -> str:
    """A Lark grammar as llguidance reads it."""
    import llguidance

    return llguidance.LLMatcher.grammar_from_lark("\n".join(rules) + "\n")


# A format's Lark right-hand side (None for a grammar), its own grammar with its field, and its JSON schema (None
# for a grammar).
_FormatRule = tuple[str | None, tuple[str, str], Any]


def _format_rule(answer_format: AnswerFormat, limits: GrammarLimits) -> _FormatRule:
    """The Lark right-hand side for a JSON answer format (None for a grammar, which has rules of its own and is
    used alone), the format's own grammar with its field, for checking, and its JSON schema."""
    param = answer_format.param
    if answer_format.kind == "grammar":
        import llguidance

        _check_grammar_size(answer_format.source, param, limits)
        try:
            grammar = llguidance.grammar_from("gbnf", answer_format.source)
        except ValueError as error:
            raise GrammarError(f"{param}: {error}", param) from None
        return None, (grammar, param), None
    schema = json.loads(answer_format.source) if answer_format.kind == "json_schema" else {"type": "object"}
    _check_schema(schema, param)
    text = json_text(schema, lenient=False)
    return f"%json {text}", (json_grammar(text), param), schema


def _check_grammar_size(source: str, param: str, limits: GrammarLimits) -> None:
    """Refuse a grammar over the limits before any of it is converted (a conservative count of the rules: every
    `::=`, those inside literals included)."""
    size = len(source.encode("utf-8", errors="surrogatepass"))
    if size > limits.max_bytes:
        raise GrammarError(f"{param}: the grammar has {size} bytes; at most {limits.max_bytes} are allowed (the "
                           "limits.max_grammar_bytes config key)", param)
    rules = source.count("::=")
    if rules > limits.max_rules:
        raise GrammarError(f"{param}: the grammar has {rules} rules; at most {limits.max_rules} are allowed (the "
                           "limits.max_grammar_rules config key)", param)


def _check_schema(schema: Any, param: str) -> None:
    """Refuse a schema llguidance would not hold to: integers it cannot enforce exactly, or a `$ref` cycle that
    every instance must follow (no finite text satisfies it; llguidance gives up after a few tokens)."""
    _check_integers(schema, param)
    _check_finite(schema, param)


def _check_finite(schema: Any, param: str) -> None:
    """Refuse a schema whose instances must hold themselves: a chain of `$ref`s each of which an instance must
    contain (a required property of an object, an item of a non-empty array, `allOf`) that comes back to where it
    began. Branches (`anyOf`, `oneOf`, optional properties) may end a chain, so they are never followed.

    Raises:
        GrammarError: naming the `$ref` that closes the cycle.
    """
    if not isinstance(schema, dict):
        return
    forced: dict[str, list[tuple[str, str]]] = {}  # a pointer: the (pointer, path of its $ref) it forces
    stack = ["#"]
    while stack:
        pointer = stack.pop()
        if pointer in forced:
            continue
        node = _resolve(schema, pointer)
        forced[pointer] = [] if node is None else list(_forced_refs(node, param if pointer == "#" else
                                                                    f"{param}.{pointer[2:].replace('/', '.')}"))
        stack.extend(target for target, _ in forced[pointer])
    # A depth-first walk (iterative: a chain of $defs may be long): a $ref back to a pointer on the current chain
    # closes a cycle.
    on_chain, done = {"#"}, set()
    walk = [("#", iter(forced["#"]))]
    while walk:
        pointer, targets = walk[-1]
        step = next(targets, None)
        if step is None:
            walk.pop()
            on_chain.discard(pointer)
            done.add(pointer)
            continue
        target, where = step
        if target in on_chain:
            raise GrammarError(f"{where}: every instance would have to contain itself through this $ref ({target}), "
                               "so no finite JSON satisfies the schema", where)
        if target not in done:
            on_chain.add(target)
            walk.append((target, iter(forced[target])))


def _resolve(schema: dict[str, Any], pointer: str) -> Any:
    """The subschema at a local JSON pointer (`#/$defs/a`), or None."""
    node: Any = schema
    for step in pointer[2:].split("/") if pointer != "#" else ():
        step = step.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and step in node:
            node = node[step]
        elif isinstance(node, list) and step.isdigit() and int(step) < len(node):
            node = node[int(step)]
        else:
            return None
    return node


def _forced_refs(node: Any, path: str) -> Iterator[tuple[str, str]]:
    """The local `$ref`s every instance of `node` must follow, with the path of each."""
    if not isinstance(node, dict):
        return
    ref = node.get("$ref")
    if isinstance(ref, str) and ref.startswith("#"):
        yield ref, f"{path}.$ref"
    for part, where in _required_parts(node, path):
        yield from _forced_refs(part, where)


def _required_parts(node: dict[str, Any], path: str) -> Iterator[tuple[Any, str]]:
    """The subschemas every instance of `node` must satisfy too, as a whole (`allOf`) or in a part of it (a
    required property of an object, the items of a non-empty array), with their paths."""
    for i, part in enumerate(node.get("allOf") or []):
        yield part, f"{path}.allOf[{i}]"
    properties = node.get("properties")
    if node.get("type") == "object" and isinstance(properties, dict):
        for key in node.get("required") or []:
            if isinstance(key, str) and key in properties:
                yield properties[key], f"{path}.properties.{key}"
    items, min_items = node.get("items"), node.get("minItems")
    if node.get("type") == "array" and isinstance(items, dict) and isinstance(min_items, int) and min_items > 0:
        yield items, f"{path}.items"


def _check_integers(schema: Any, param: str) -> None:
    """Refuse a schema whose integers llguidance would not enforce exactly: a bound beyond 64 bits, or a `const` or
    `enum` integer beyond 2^53 (kept as a double, it would come out as another number).

    Raises:
        GrammarError: naming the keyword's path in the schema.
    """
    stack: list[tuple[Any, str, bool]] = [(schema, param, False)]
    while stack:
        value, path, in_value = stack.pop()
        if isinstance(value, dict):
            for key, item in value.items():
                where = f"{path}.{key}"
                if not in_value and key in _BOUNDS and _is_int(item) and not _INT64[0] <= item <= _INT64[1]:
                    raise GrammarError(f"{where}: {item} cannot be enforced; integer bounds must lie within 64 "
                                       f"bits ({_INT64[0]} to {_INT64[1]})", where)
                stack.append((item, where, in_value or key in ("const", "enum")))
        elif isinstance(value, list):
            stack.extend((item, f"{path}[{i}]", in_value) for i, item in enumerate(value))
        elif in_value and _is_int(value) and abs(value) > _EXACT_DOUBLE:
            raise GrammarError(f"{path}: {value} cannot be enforced; constant integers must lie within "
                               f"±2^53 ({_EXACT_DOUBLE})", path)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _calls_rules(tools: Sequence[dict[str, Any]], tokens: SpecialTokens, parallel: bool,
                 tool_fields: Mapping[str, str], *, body_only: bool
                 ) -> tuple[list[str], list[tuple[str, str]]]:
    """Lark rules for tool calls in the model family's syntax: its call markers around one call of a declared tool
    (`ModelFamily.call_rule`; Qwen3's: `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, Qwen3.5's:
    `<tool_call>\\n<function=...>\\n<parameter=...>...</function>\\n</tool_call>`), one rule per declared tool, and
    the terminals they use, with the grammars of the strict ones to check.

    Raises:
        GrammarError: a strict tool's schema that the family's syntax cannot hold a call to.
    """
    family = tokens.family
    open_tag = _tag(tokens.call_open, family.call_open)
    close_tag = _tag(tokens.call_close, family.call_close)
    rules = [f'body: "\\n" ({" | ".join(f"tool{i}" for i in range(len(tools)))}) "\\n" {close_tag}']
    if not body_only:
        rules.insert(0, 'calls: call ("\\n" call)*' if parallel else "calls: call")
        rules.insert(1, f"call: {open_tag} body")
    parts = []
    for i, tool in enumerate(tools):
        function = tool["function"]
        strict = bool(function.get("strict"))
        param = tool_fields.get(function["name"], f"tools[{i}].function.parameters")
        if strict:
            _check_schema(function.get("parameters") or {}, param)
        try:
            rule, grammar = family.call_rule(function, strict)
        except ValueError as error:  # a schema the family's syntax cannot hold a call to, naming its part
            raise GrammarError(f"{param}.{error}", param) from None
        rules.append(f"tool{i}: {rule}")
        if grammar is not None:
            parts.append((grammar, param))
    return [*rules, *family.call_terminals], parts


def _tag(token: int | None, text: str) -> str:
    return f"<[{token}]>" if token is not None else json.dumps(text)


def json_text(schema: Any, *, lenient: bool) -> str:
    """A JSON schema as llguidance's `%json` reads it, in the answers' layout (lenient: keywords llguidance lacks
    are ignored)."""
    if isinstance(schema, dict):
        options = {**schema.get("x-guidance", {}), **_JSON_LAYOUT, "lenient": lenient}
        schema = {**schema, "x-guidance": options}
    return json.dumps(schema, ensure_ascii=False, separators=(",", ":"))


def json_grammar(schema_text: str) -> str:
    """The grammar of a JSON value in a schema (`json_text`), on its own."""
    import llguidance

    return llguidance.LLMatcher.grammar_from_json_schema(schema_text)


# --- compiling


@dataclass
class _Compiled:
    answer: Any = None  # LLMatcher templates (each generation takes a deep copy)
    call: Any = None


class Grammars:
    """A model's llguidance tokenizer and its compiled grammars, cached by grammar text (thread-safe; call
    `compile` from a worker thread: the first call builds the tokenizer, ~2 s for 151k tokens).

    Args:
        tokenizer: the model's `strata.text.tokenizer.Tokenizer`.
        family: the model's family (its markers and tool-call syntax).
        n_vocab: the engine's logits length (may exceed the tokenizer's).
        overlap: the guides compute their next masks in a pool thread beside the engine's forward pass (see
            `Guide`; off only to measure the difference).
    """

    def __init__(self, tokenizer: Any, family: ModelFamily, n_vocab: int, overlap: bool = True):
        self._tokenizer = tokenizer
        self.n_vocab = n_vocab
        self.overlap = overlap
        self.tokens = SpecialTokens.of(tokenizer, family)
        self.eos_ids = tuple(sorted(tokenizer.eos_ids))
        self._lock = threading.Lock()
        self._ll_tokenizer: Any = None
        self._cache: OrderedDict[str, Any] = OrderedDict()
        self._checked: OrderedDict[tuple[str, str], str] = OrderedDict()

    def ll_tokenizer(self) -> Any:
        with self._lock:
            if self._ll_tokenizer is None:
                import llguidance

                self._ll_tokenizer = llguidance.LLTokenizer(llguidance.TokenizerWrapper(_Vocabulary(self._tokenizer)),
                                                            n_vocab=self.n_vocab, eos_token=list(self.eos_ids))
            return self._ll_tokenizer

    def guide(self, plan: Plan) -> Guide:
        """A fresh guide for one generation (compiles what is not cached yet).

        Raises:
            GrammarError: a schema or grammar llguidance refuses, naming the request field.
        """
        for grammar, param in plan.parts:
            self._check(grammar, param)
        compiled = _Compiled(self._matcher(plan.answer, "response_format") if plan.answer else None,
                             self._matcher(plan.call, "tools") if plan.call else None)
        if plan.prefix and compiled.answer is not None:
            ids = self._tokenizer.encode(plan.prefix, special=False)
            matcher = compiled.answer
            if matcher.try_consume_tokens(ids) < len(ids) or matcher.is_error():
                raise GrammarError(f"messages: the prefilled assistant text {plan.prefix[:40]!r} cannot begin an "
                                   f"answer in the requested format ({plan.parts[0][1]}); JSON answers are "
                                   'compact with single spaces, as in {"a": 1, "b": [2, 3]}', "messages")
        return Guide(plan, compiled, self.n_vocab, self.tokens, self.eos_ids, overlap=self.overlap)

    def answer_error(self, guide: Guide) -> str | None:
        """Why a constrained answer that ended with an end-of-turn token is not what its plan asked for, or None
        when it is: the grammar failed (llguidance gave up, e.g. on a schema no finite text satisfies), ended
        incomplete, or the text does not validate against the plan's schema. Blocking (a worker thread): the
        answer is parsed and validated."""
        error = guide.answer_error()
        if error is not None or guide.plan.schema is None:
            return error
        import jsonschema
        import referencing.exceptions

        text = guide.plan.prefix + self._tokenizer.decode([t for t in guide.answer_ids if t not in self.eos_ids])
        try:
            answer = json.loads(text)
        except ValueError as not_json:
            return f"the answer is not JSON ({not_json})"
        try:
            failure = jsonschema.exceptions.best_match(jsonschema.validators.validator_for(guide.plan.schema)(
                guide.plan.schema).iter_errors(answer))
        except (jsonschema.exceptions.SchemaError, referencing.exceptions.Unresolvable, RecursionError):
            return None  # a schema jsonschema cannot read: llguidance's grammar is all there is to check
        if failure is None:
            return None
        where = "".join(f"[{step}]" if isinstance(step, int) else f".{step}" for step in failure.absolute_path)
        return f"the answer does not match the schema at ${where}: {failure.message}"

    def _check(self, grammar: str, param: str) -> None:
        import llguidance

        key = (grammar, param)
        with self._lock:
            error = self._checked.get(key)
        if error is None:
            error = llguidance.LLMatcher.validate_grammar(grammar, self.ll_tokenizer())
            with self._lock:
                self._checked[key] = error
                while len(self._checked) > _CACHE_SIZE:
                    self._checked.popitem(last=False)
        if error:
            raise GrammarError(f"{param}: {error.strip()}", param)

    def _matcher(self, grammar: str, param: str) -> Any:
        import llguidance

        with self._lock:
            template = self._cache.get(grammar)
            if template is not None:
                self._cache.move_to_end(grammar)
                return template.deep_copy()
        template = llguidance.LLMatcher(self.ll_tokenizer(), grammar, log_level=0)
        if template.is_error():
            raise GrammarError(f"{param}: {template.get_error()}", param)
        with self._lock:
            self._cache[grammar] = template
            while len(self._cache) > _CACHE_SIZE:
                self._cache.popitem(last=False)
        return template.deep_copy()


class _Vocabulary:
    """Our tokenizer in the shape `llguidance.TokenizerWrapper` reads: every id's bytes, the special ids."""

    def __init__(self, tokenizer: Any):
        self.tokens = list(tokenizer.id_bytes)
        self.eos_token_id = tokenizer.eos_id
        self.bos_token_id = tokenizer.bos_id
        self.special_token_ids = sorted(tokenizer.hf.get_added_tokens_decoder())
        self._encode = tokenizer.encode

    def __call__(self, text: str) -> list[int]:
        return self._encode(text, special=False)


# --- the guide, in the engine thread

_FREE, _ANSWER, _REASONING, _CALL, _START = range(5)
# A mask with at most this many allowed (or banned) tokens is written by index, the rest through a boolean mask:
# a fill and a scatter of a few ids cost ~20 µs on 151,936 logits, a masked copy ~100 µs.
_FEW = 16384
_pool_lock = threading.Lock()
_pool: ThreadPoolExecutor | None = None


def _mask_pool() -> ThreadPoolExecutor:
    """The threads that compute the guides' next masks (llguidance drops the GIL meanwhile)."""
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(max_workers=min(4, os.cpu_count() or 1), thread_name_prefix="strata-mask")
        return _pool


@dataclass(frozen=True)
class _Mask:
    """What the next token may be, ready to write over logits: the allowed ids when they are few, else the banned
    ids when those are, else a boolean mask of the banned ones. `ended`: the call's grammar is complete (no mask:
    the text is free again)."""

    allowed: np.ndarray | None = None
    banned: np.ndarray | None = None
    banned_mask: np.ndarray | None = None
    ended: bool = False

    def write(self, logits: np.ndarray) -> None:
        if self.allowed is not None:
            kept = logits[self.allowed]
            logits.fill(-np.inf)
            logits[self.allowed] = kept
        elif self.banned is not None:
            logits[self.banned] = -np.inf
        else:
            np.copyto(logits, -np.inf, where=self.banned_mask)


@dataclass
class Guide:
    """Masks one generation's logits to what its plan allows and follows the sampled tokens (engine thread).

    `apply(logits)` is called before a token is sampled, `advance(token)` after; the sampler keeps the rest of
    its pipeline. Once the answer's grammar is complete only an end-of-turn token remains allowed.

    The mask depends only on the tokens sampled so far. With `overlap`, `advance` hands the token to a pool
    thread that consumes it and computes the next mask while the engine computes the next logits, and `apply`
    waits for it (it is usually done) and writes it; without, `advance` computes the mask itself. Overlapping
    also keeps the gap between engine calls short, within the engine threads' idle spin (bench/RESULTS.md).
    """

    plan: Plan
    compiled: _Compiled
    n_vocab: int
    tokens: SpecialTokens
    eos_ids: tuple[int, ...]
    calls: int = 0
    overlap: bool = True
    _state: int = field(init=False)
    _matcher: Any = field(init=False, default=None)
    _bits: np.ndarray = field(init=False)
    _next: Future[_Mask] | None = field(init=False, default=None)  # the next mask, being computed
    _mask: _Mask | None = field(init=False, default=None)  # the mask of this step, once computed
    answer_ids: list[int] = field(init=False, default_factory=list)  # the tokens sampled in the answer's grammar

    def __post_init__(self) -> None:
        import llguidance.numpy

        self._bits = llguidance.numpy.allocate_token_bitmask(1, self.n_vocab)
        if self.plan.in_reasoning:
            self._state = _REASONING
        elif self.compiled.answer is not None:
            self._state = _START if self.plan.may_think else _ANSWER
            self._matcher = self.compiled.answer
            self._start(None, think=self._state == _START)
        else:
            self._state = _FREE

    def apply(self, logits: np.ndarray) -> np.ndarray | None:
        """Set the logits of the tokens that may not come next to -inf (in place); return the allowed ids when they
        are few (the sampler then draws among those alone), else None."""
        if self._next is not None:
            self._mask = self._next.result()
            self._next = None
            if self._mask.ended:
                self._state, self._matcher, self._mask = _FREE, None, None
        if self._mask is not None:
            self._mask.write(logits)
            return self._mask.allowed
        banned_ids = list(self.plan.banned)
        if self.plan.max_calls is not None and self.calls >= self.plan.max_calls and self.tokens.call_open is not None:
            banned_ids.append(self.tokens.call_open)
        if self._state == _REASONING and self.compiled.answer is not None:
            banned_ids += self.eos_ids  # the constrained answer must follow the reasoning
        if banned_ids:
            logits[banned_ids] = -np.inf
        return None

    def advance(self, token: int) -> None:
        """Follow the token that was sampled."""
        if self._next is not None:  # a mask that was never applied: the matcher is the pool's until it is done
            self._next.result()
            self._next = None
        self._mask = None
        state = self._state
        if state == _START and token == self.tokens.think_open:
            self._state = _REASONING
        elif state == _REASONING:
            if token == self.tokens.think_close:
                if self.compiled.answer is not None:
                    self._state, self._matcher = _ANSWER, self.compiled.answer
                    self._start(None)
                else:
                    self._state = _FREE
        elif state in (_ANSWER, _START):
            self._state = _ANSWER
            self.answer_ids.append(token)
            self._start(token)
        elif state == _CALL:
            self._start(token, call=True)
        elif token == self.tokens.call_open and self.compiled.call is not None:
            self.calls += 1
            self._state, self._matcher = _CALL, self.compiled.call
            self._start(None, reset=self.calls > 1)
        elif token == self.tokens.call_open:
            self.calls += 1

    def answer_error(self) -> str | None:
        """Once the generation has ended: why the answer's grammar did not accept it (llguidance's error, or an
        answer that stopped incomplete), or None (accepted, or no answer grammar)."""
        if self._next is not None:
            self._next.result()  # the matcher is the pool's until it has consumed the last token
            self._next = None
        matcher = self.compiled.answer
        if matcher is None:
            return None
        if self._state != _ANSWER:
            return "the answer did not begin"
        if matcher.is_error():
            return f"the constraint failed: {matcher.get_error().splitlines()[0]}"
        if not (matcher.is_accepting() or matcher.is_stopped()):
            return "the answer ended incomplete"
        return None

    def _start(self, token: int | None, *, think: bool = False, call: bool = False, reset: bool = False) -> None:
        """Compute the next mask (in a pool thread with `overlap`): after `token` (if any) is consumed."""
        if self.overlap:
            self._next = _mask_pool().submit(self._next_mask, self._matcher, token, think, call, reset)
            return
        self._next = Future()
        self._next.set_result(self._next_mask(self._matcher, token, think, call, reset))

    def _next_mask(self, matcher: Any, token: int | None, think: bool, call: bool, reset: bool) -> _Mask:
        """(pool thread) Consume `token`, then what may come next. In a call, a complete call ends the mask. Once
        the matcher is done (or in error, which a masked sampler cannot reach) only end-of-turn tokens remain."""
        import llguidance.numpy

        if reset:
            matcher.reset()
        if token is not None:
            matcher.consume_token(token)
            if call and matcher.is_accepting():
                return _Mask(ended=True)
        if matcher.is_error() or matcher.is_stopped():
            return _Mask(allowed=np.array(self.eos_ids, dtype=np.int64))
        llguidance.numpy.fill_next_token_bitmask(matcher, self._bits, 0)
        allowed = np.unpackbits(self._bits.view(np.uint8), bitorder="little", count=self.n_vocab).view(bool)
        if think:
            allowed[self.tokens.think_open] = True
        n_allowed = int(np.count_nonzero(allowed))
        if n_allowed <= _FEW:
            return _Mask(allowed=np.flatnonzero(allowed))
        if self.n_vocab - n_allowed <= _FEW:
            return _Mask(banned=np.flatnonzero(~allowed))
        return _Mask(banned_mask=~allowed)
