"""The model families Strata knows, and how a model file's is chosen (from its vocabulary).

Qwen3 (and Qwen3-VL) write reasoning in `<think>` and Hermes-style JSON tool calls in `<tool_call>`; a picture is
`<|vision_start|><|image_pad|><|vision_end|>`. Llama 3 files are served with the same reasoning and tool-call
markers, matched as text (their vocabulary has them as no single token, so the constraints spell them out), and
end their turns with their own tokens. A file whose vocabulary names no family is read as Qwen3.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from strata.text.family import ModelFamily
from strata.text.toolcalls import ToolCallParser, json_call_rule

QWEN3 = ModelFamily(
    name="qwen3",
    think_open="<think>", think_close="</think>",
    call_open="<tool_call>", call_close="</tool_call>",
    end_of_turn=("<|endoftext|>", "<|im_end|>"),
    image_pad="<|image_pad|>",
    picture_prompt="<|vision_start|><|image_pad|><|vision_end|>",
    signature="<|im_end|>",
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
)

# In the order a file is matched against them; the first is also the default.
FAMILIES = (QWEN3, LLAMA3)

# Every family's end-of-turn texts: the tokenizer reads them as end-of-generation tokens, before any family is
# chosen (a file may carry another family's tokens too).
END_OF_TURN_TEXTS = tuple(dict.fromkeys(text for family in FAMILIES for text in family.end_of_turn))


def family_of(tokenizer: Any) -> ModelFamily:
    """The family of a model, by its vocabulary: the first family whose signature token it has (Qwen3's
    `<|im_end|>`, Llama 3's `<|eot_id|>`), else Qwen3.

    Args:
        tokenizer: the model's `strata.text.tokenizer.Tokenizer` (anything with `token_to_id`).
    """
    for family in FAMILIES:
        if tokenizer.token_to_id(family.signature) is not None:
            return family
    return QWEN3
