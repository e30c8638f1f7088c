"""The generated conversations: reproducible, rendered exactly as the server renders prompts, answers that are
right by an independent reading of the question, pictures that show what their labels say."""

import io
import itertools
import json
import pathlib
import random
import re
import tokenize

import pytest

from strata.modelgen.demo import data, evaluate
from strata.modelgen.writer import chat_template
from strata.models import DEMO_MODEL
from strata.text.tokenizer import Tokenizer

TEMPLATE = chat_template()


def first(n: int, seed: int = 3) -> list[data.Example]:
    return list(itertools.islice(data.examples(seed), n))


def test_the_same_seed_gives_the_same_examples() -> None:
    a, b = first(40), first(40)
    assert [(e.messages, e.tools, e.check, e.scene) for e in a] == [(e.messages, e.tools, e.check, e.scene) for e in b]
    assert [e.messages for e in first(40, seed=4)] != [e.messages for e in a]


@pytest.mark.parametrize("example", first(300), ids=lambda e: e.task)
def test_answers_follow_the_template(example: data.Example) -> None:
    prompt, answer = data.render(example, TEMPLATE)
    assert answer.endswith("<|im_end|>") and answer.count("<|im_end|>") == 1
    assert prompt.endswith("<|im_start|>assistant\n" + ("" if example.thinking else "<think>\n\n</think>\n\n"))
    if example.thinking:
        assert re.match(r"<think>\n\S.*\n</think>\n\n\S", answer, re.DOTALL), answer
    else:
        assert "<think>" not in answer and "</think>" not in answer
    assert prompt.count("<|image_pad|>") == (example.scene is not None)


@pytest.mark.parametrize("example", [e for e in first(400) if "tool" in e.check], ids=lambda e: e.task)
def test_tool_calls_are_json_with_the_asked_arguments(example: data.Example) -> None:
    _, answer = data.render(example, TEMPLATE)
    call = json.loads(re.search(r"<tool_call>\n(.*)\n</tool_call>", answer, re.DOTALL).group(1))
    assert call == {"name": example.check["tool"], "arguments": example.check["arguments"]}
    question = example.messages[-2]["content"]
    for value in call["arguments"].values():
        assert str(value) in question
    assert call["name"] in [tool["function"]["name"] for tool in example.tools]


@pytest.mark.parametrize("example", [e for e in first(400) if e.task == "arithmetic"], ids=lambda e: e.check["text"])
def test_arithmetic_answers_are_right(example: data.Example) -> None:
    question = example.messages[-2]["content"]
    a, op, b = re.search(r"(\d+) (plus|minus|times|\+|-|x) (\d+)", question).groups()
    expected = {"plus": int.__add__, "+": int.__add__, "minus": int.__sub__, "-": int.__sub__,
                "times": int.__mul__, "x": int.__mul__}[op](int(a), int(b))
    assert example.messages[-1]["content"] == f"{expected}."


@pytest.mark.parametrize("seed", range(30))
def test_a_single_shape_is_drawn_in_its_colour_and_place(seed: int) -> None:
    scene = data.single_scene(random.Random(seed))
    image = data.draw(scene)
    shape = scene.shapes[0]
    assert image.size == (scene.width, scene.height)
    centre = (int(shape.cx * scene.width), int(shape.cy * scene.height))
    assert image.getpixel(centre) == data.COLOURS[shape.colour]
    place = data.describe(shape).split(" ", 3)[3]
    third = centre[0] * 3 // scene.width
    assert place == ("on the left.", "in the middle.", "on the right.")[third]


def _renamed_by_tokens(code: str, old: str, new: str) -> str:
    """code with every NAME token `old` written `new`, by Python's own tokenizer."""
    tokens = [(t.type, new if t.type == tokenize.NAME and t.string == old else t.string)
              for t in tokenize.generate_tokens(io.StringIO(code).readline)]
    return tokenize.untokenize(tokens)


@pytest.mark.parametrize("example", [data.make_example(task, random.Random(seed))
                                     for task in ("edit", "edit_long") for seed in range(40)],
                         ids=lambda e: e.check["text"].split("(")[0] + f"-{e.check['text'].count('def ')}")
def test_edits_rename_every_use_of_the_name_and_nothing_else(example: data.Example) -> None:
    question, answer = example.messages[-2]["content"], example.messages[-1]["content"]
    old, new = re.search(r"(?:Rename|rename|Change the name) `?(\w+)`? to `?(\w+)`?", question).groups()
    code = re.search(r"```python\n(.*?)\n```", question, re.DOTALL).group(1)
    changed = re.fullmatch(r"```python\n(.*)\n```", answer, re.DOTALL).group(1)
    compile(code, "<question>", "exec")
    compile(changed, "<answer>", "exec")
    assert re.search(rf"\b{old}\b", code) and not re.search(rf"\b{new}\b", code)
    # untokenize spaces the tokens its own way: compare token by token
    expected = _renamed_by_tokens(code, old, new)
    assert [t.string for t in tokenize.generate_tokens(io.StringIO(changed).readline)] == \
        [t.string for t in tokenize.generate_tokens(io.StringIO(expected).readline)]
    assert changed.count("\n") == code.count("\n") and example.check == {"text": changed}


def test_a_long_edit_fits_the_evaluation_budget(tmp_path: pathlib.Path) -> None:
    """The held-out long edits' whole answers (thinking included) fit the tokens the evaluation generates, and
    prompt and answer the engine's context, so a wrong score there is the model's, not a cut answer."""
    tok = Tokenizer.from_gguf(DEMO_MODEL)
    assert tok.chat_template is not None
    sizes = dict.fromkeys(evaluate.SCORES, 0) | {"edit_long": 40}
    items = evaluate.held_out(0, tmp_path, sizes=sizes)
    assert len(items) == 40 and {item.example.task for item in items} == {"edit"}
    for item in items:
        prompt, answer = data.render(item.example, tok.chat_template)
        assert len(tok.encode(answer)) <= evaluate.new_tokens(item) < evaluate.N_CTX - len(tok.encode(prompt))
    assert max(item.example.check["text"].count("\ndef ") for item in items) >= 5  # several functions, long
