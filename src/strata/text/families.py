"""The model families Strata knows, and how a model file's is chosen (from its chat template and vocabulary).

Qwen3 (and Qwen3-VL) write reasoning in `<think>` and Hermes-style JSON tool calls in `<tool_call>`; a picture is
`<|vision_start|><|image_pad|><|vision_end|>`. Qwen3.5 and Qwen3.6 have the same markers and tokens but write their
tool calls in XML inside `<tool_call>` (`<function=NAME>` with `<parameter=ARG>` blocks; `strata.text.xml_toolcalls`).
Llama 3 files are served with Qwen3's reasoning and tool-call markers, matched as text (their vocabulary has them
as no single token, so the constraints spell them out), and end their turns with their own tokens. A file whose
vocabulary names no family is read as Qwen3.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from strata.text.family import ModelFamily
from strata.text.toolcalls import ToolCallParser, json_call_rule
from strata.text.xml_toolcalls import XML_TEXT_RULE, XmlToolCallParser, xml_call_rule

QWEN3 = ModelFamily(
    name="qwen3",
    think_open="<think>", think_close="</think>",
    call_open="<tool_call>", call_close="</tool_call>",
    end_of_turn=("<|endoftext|>", "<|im_end|>"),
    image_pad="<|image_pad|>",
    picture_prompt="<|vision_start|><|image_pad|><|vision_end|>",
    signature="<|im_end|>",
    turn_open="<|im_start|>",
    parser=ToolCallParser,
    call_rule=json_call_rule,
)

LLAMA3 = dataclasses.replace(
    QWEN3,
    name="llama3",
    end_of_turn=("<|eot_id|>", "<|eom_id|>", "<|end_of_text|>"),
    image_pad=None,
    picture_prompt="a picture placeholder token (Llama 3 files have none)",
    signature="<|eot_id|>",
    turn_open="<|start_header_id|>",
)

# Qwen3.5/3.6 are known by their chat template, which is what teaches the model its tool-call syntax: the same
# template text is in every file of the family, whatever the vocabulary or architecture. Their vocabulary has
# Qwen3's tokens, and neither the `qwen35` pre-tokenizer nor the `qwen35`/`qwen35moe` architecture would tell a
# fine-tune that ships a Hermes template, or Qwen3-Coder (a `qwen3moe` file that writes this XML syntax), apart.
QWEN35 = dataclasses.replace(
    QWEN3,
    name="qwen35",
    parser=XmlToolCallParser,
    call_rule=xml_call_rule,
    call_terminals=(XML_TEXT_RULE,),
    template_mark="<parameter=",
)

# In the order a file is matched against them (template marks first); the first is also the default.
FAMILIES = (QWEN3, LLAMA3, QWEN35)

# Every family's end-of-turn texts: the tokenizer reads them as end-of-generation tokens, before any family is
# chosen (a file may carry another family's tokens too).
END_OF_TURN_TEXTS = tuple(dict.fromkeys(text for family in FAMILIES for text in family.end_of_turn))


def family_of(tokenizer: Any, template: str | None = None) -> ModelFamily:
    """The family of a model: the first family whose template mark its chat template holds (Qwen3.5's
    `<parameter=`), else the first whose signature token its vocabulary has (Qwen3's `<|im_end|>`, Llama 3's
    `<|eot_id|>`), else Qwen3.

    Args:
        tokenizer: the model's `strata.text.tokenizer.Tokenizer` (anything with `token_to_id`; its
            `chat_template`, if it has one, is the template by default).
        template: the chat template the model is served with (one configured in place of the file's).
    """
    template = template or getattr(tokenizer, "chat_template", None) or ""
    for family in FAMILIES:
        if family.template_mark is not None and family.template_mark in template:
            return family
    for family in FAMILIES:
        if family.template_mark is None and tokenizer.token_to_id(family.signature) is not None:
            return family
    return QWEN3
