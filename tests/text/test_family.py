"""The model family: which one a file is, and that the parser, the constraints and the prompts read their markers
and tool-call syntax from it (a family with other markers is parsed and forced in its own)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from strata.events import ChatRequest, ReasoningDelta, TextDelta, ToolCallArgumentsDelta, ToolCallStart
from strata.prompts import Prompts
from strata.text.constraints import SpecialTokens, plan_constraint
from strata.text.families import END_OF_TURN_TEXTS, LLAMA3, QWEN3, family_of
from strata.text.output import Output

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]


class Vocabulary:
    """A tokenizer that knows some tokens' ids."""

    def __init__(self, *tokens: str):
        self.ids = {token: i for i, token in enumerate(tokens)}

    def token_to_id(self, token: str) -> int | None:
        return self.ids.get(token)


def fn_rule(function: Mapping[str, Any], strict: bool) -> tuple[str, str | None]:
    return f'"<fn={function["name"]}>"', None


# Another syntax: reasoning in <reason>, calls in [CALL]…[/CALL] with a body of its own.
OTHER = dataclasses.replace(QWEN3, name="other", think_open="<reason>", think_close="</reason>",
                            call_open="[CALL]", call_close="[/CALL]", call_rule=fn_rule)


def test_a_qwen3_file_is_qwen3(tokenizer):
    assert family_of(tokenizer) is QWEN3
    assert tokenizer.token_to_id(QWEN3.image_pad) is not None


def test_a_llama3_vocabulary_is_llama3():
    family = family_of(Vocabulary("<|begin_of_text|>", "<|eot_id|>", "<|eom_id|>"))
    assert family is LLAMA3
    assert family.image_pad is None
    assert "<|eot_id|>" in family.end_of_turn
    # Llama 3 files keep the reasoning and tool-call markers Strata has always matched for them
    assert (family.think_open, family.call_open, family.call_close) == ("<think>", "<tool_call>", "</tool_call>")


def test_a_vocabulary_of_no_family_is_read_as_qwen3():
    assert family_of(Vocabulary("<s>", "</s>")) is QWEN3


def test_the_tokenizer_ends_on_every_familys_end_of_turn_tokens(tokenizer):
    assert set(END_OF_TURN_TEXTS) == {*QWEN3.end_of_turn, *LLAMA3.end_of_turn}
    assert tokenizer.token_to_id("<|im_end|>") in tokenizer.eos_ids


def test_the_reasoning_block_of_a_prompt():
    assert QWEN3.opens_reasoning("<|im_start|>assistant\n<think>\n")
    assert not QWEN3.opens_reasoning("<|im_start|>assistant\n")
    assert QWEN3.closes_reasoning("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert QWEN3.after_reasoning("<think>hm</think>\n\nThe answer") == "\n\nThe answer"
    assert QWEN3.after_reasoning("The answer") == "The answer"
    assert OTHER.opens_reasoning("x <reason>\n") and not OTHER.opens_reasoning("x <think>\n")


def test_the_parser_reads_the_familys_markers():
    parser = OTHER.stream_parser(tools={"get_weather": {}})
    events = parser.feed('<reason>hm</reason>Sure.[CALL]\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n'
                         "[/CALL]<tool_call>") + parser.finish()
    assert events[:2] == [ReasoningDelta("hm"), TextDelta("Sure.")]
    assert isinstance(events[2], ToolCallStart) and events[2].name == "get_weather"
    assert events[3] == ToolCallArgumentsDelta(0, '{"city": "Oslo"}')
    assert events[4:] == [TextDelta("<tool_call>")]  # another family's marker is text


def test_the_output_parses_in_the_family_it_is_given(tokenizer):
    request = ChatRequest(messages=[], tools=TOOLS)
    output = Output(tokenizer, OTHER, request, starts_in_reasoning=True)
    events = [event for token in tokenizer.encode("hm</reason>ok <think>", special=True)
              for event in output.push(token)] + output.finish()
    assert "".join(e.text for e in events if isinstance(e, ReasoningDelta)) == "hm"
    assert "".join(e.text for e in events if isinstance(e, TextDelta)) == "ok <think>"


def test_a_forced_call_is_written_in_the_familys_syntax(tokenizer):
    tokens = SpecialTokens.of(tokenizer, OTHER)
    assert (tokens.think_open, tokens.call_open) == (None, None)  # not single tokens in Qwen's vocabulary
    plan = plan_constraint(answer_format=None, tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
                           thinking=False, in_reasoning=False, tokens=tokens)
    assert plan is not None and plan.answer is not None
    assert '"[CALL]" body' in plan.answer and '"[/CALL]"' in plan.answer
    assert 'tool0: "<fn=get_weather>"' in plan.answer
    assert "<tool_call>" not in plan.answer


def test_qwen3_forced_calls_use_its_marker_tokens(tokenizer):
    tokens = SpecialTokens.of(tokenizer, QWEN3)
    assert tokens.call_open == tokenizer.token_to_id("<tool_call>")
    plan = plan_constraint(answer_format=None, tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
                           thinking=False, in_reasoning=False, tokens=tokens)
    assert plan is not None and plan.answer is not None
    assert f"<[{tokens.call_open}]> body" in plan.answer and '"name":{"const":"get_weather"}' in plan.answer


def test_the_prompts_take_the_familys_picture_placeholder(tokenizer):
    def prompts(family):
        return Prompts(tokenizer, family, "{{ messages }}", n_ctx=64, n_vocab=tokenizer.n_vocab, max_tokens=None)

    assert prompts(QWEN3).pad_id == tokenizer.token_to_id("<|image_pad|>")
    assert prompts(LLAMA3).pad_id == -1


def test_a_chat_prompt_knows_where_its_messages_start(tokenizer):
    from strata.text.prompt import render_chat

    template = tokenizer.chat_template
    prompts = Prompts(tokenizer, QWEN3, template, n_ctx=4096, n_vocab=tokenizer.n_vocab, max_tokens=None)
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"},
                {"role": "assistant", "content": "hello"}, {"role": "user", "content": "again"}]
    prepared = prompts.prepare(ChatRequest(messages=messages), [])
    opener = tokenizer.token_to_id("<|im_start|>")
    assert render_chat(template, messages).count("<|im_start|>") == 5  # four messages and the answer's turn
    assert len(prepared.turn_starts) == 5
    assert all(prepared.ids[i] == opener for i in prepared.turn_starts) and prepared.turn_starts[0] == 0
