"""What a model family writes around its answer: the reasoning and tool-call markers, the picture placeholder,
the end-of-turn tokens, the parser of its streamed tool calls and the grammar of a forced call.

A `ModelFamily` is data plus two functions; the families Strata knows, and how a file's is chosen, are in
`strata.text.families`. The parser and the constraints take the family they are given, so a family with another
tool-call syntax is a new object there, not edits across the text side.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

# (family, starts_in_reasoning, parse_tool_calls, tools) -> a parser for one generation, with `feed`, `finish`,
# `n_tool_calls` and `in_reasoning` (`strata.text.output.StreamParser`); `tools` maps the declared tools' names to
# their parameters' schemas (None: any name)
ParserFactory = Callable[["ModelFamily", bool, bool, "Mapping[str, Any] | None"], Any]
# (a declared tool's `function` object, strict) -> the Lark right-hand side of one call of it between the
# family's call markers, and (strict tools only) a grammar of that call alone, checked before use
CallRule = Callable[[Mapping[str, Any], bool], tuple[str, str | None]]


@dataclass(frozen=True)
class ModelFamily:
    """A family's text format.

    Attributes:
        name: the family's name ("qwen3", "llama3").
        think_open, think_close: the markers around reasoning.
        call_open, call_close: the markers around one tool call.
        end_of_turn: the texts of the tokens that end an answer (end-of-generation tokens where the vocabulary
            types them CONTROL).
        image_pad: the token a chat template renders once per picture (expanded to the picture's rows), or None.
        picture_prompt: how the chat template must render one picture (named when a prompt's pads do not match).
        signature: a vocabulary token that marks a file of this family (`strata.text.families.family_of`).
        turn_open: the token the chat template opens each message with: where a hybrid model's prompt is
            snapshotted (`strata.scheduling.snapshots`).
        parser: makes the streamed tool-call parser of one generation.
        call_rule: the grammar piece of one tool's call, which forced and strict calls are built from.
        call_terminals: Lark definitions the call rules refer to, added to any grammar of calls.
        template_mark: text whose presence in the chat template marks a file of this family, before any
            vocabulary signature is looked at (None: the family is known by its vocabulary).
    """

    name: str
    think_open: str
    think_close: str
    call_open: str
    call_close: str
    end_of_turn: tuple[str, ...]
    image_pad: str | None
    picture_prompt: str
    signature: str
    turn_open: str
    parser: ParserFactory
    call_rule: CallRule
    call_terminals: tuple[str, ...] = ()
    template_mark: str | None = None

    def stream_parser(self, starts_in_reasoning: bool = False, parse_tool_calls: bool = True,
                      tools: Mapping[str, Any] | None = None) -> Any:
        """A parser for one generation's text.

        Args:
            starts_in_reasoning: the prompt already opened `think_open`.
            parse_tool_calls: False treats `call_open` as ordinary text (a request without tools).
            tools: the declared tools' parameters' schemas by name (a syntax whose values are text reads them by
                their types); None accepts any name.
        """
        return self.parser(self, starts_in_reasoning, parse_tool_calls, tools)

    def opens_reasoning(self, prompt: str) -> bool:
        """Whether a rendered prompt ends inside an open reasoning block (generation starts in it)."""
        return prompt.rstrip("\n").endswith(self.think_open)

    def closes_reasoning(self, prompt: str) -> bool:
        """Whether a rendered prompt ends with a closed (empty) reasoning block: the template turned thinking off."""
        return prompt.rstrip().endswith(self.think_close)

    def after_reasoning(self, text: str) -> str:
        """An assistant message's text past its reasoning block (all of it when it has none)."""
        return text.rpartition(self.think_close)[2]
