"""The shipped demo model answers, greedily through the C engine and the `strata-vision` process: pictures, sums,
tool calls and thinking. The expected answers are facts about the questions, not outputs recorded from the model."""

import importlib.resources
import json
import pathlib

import pytest
from PIL import Image, ImageDraw

from strata.modelgen.demo import data, evaluate

SHIPPED = pathlib.Path(str(importlib.resources.files("strata.models")))
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Get the weather in a city.",
                                            "parameters": {"type": "object", "properties": {
                                                "city": {"type": "string"}}, "required": ["city"]}}}


def item(content: object, thinking: bool = False, tools: list | None = None,
         picture: pathlib.Path | None = None) -> evaluate.Item:
    example = data.Example("test", [{"role": "user", "content": content}, {"role": "assistant", "content": ""}],
                           tools, thinking, {})
    return evaluate.Item("test", example, picture)


@pytest.fixture(scope="module")
def red_circle(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    path = tmp_path_factory.mktemp("pictures") / "red-circle.png"
    image = Image.new("RGB", (320, 240), "white")
    ImageDraw.Draw(image).ellipse((30, 80, 110, 160), fill=(230, 20, 20))
    image.save(path)
    return path


@pytest.fixture(scope="module")
def answers(red_circle: pathlib.Path) -> list[str]:
    picture = [{"type": "text", "text": "What is in the picture?"}, {"type": "image_url", "image_url": {"url": ""}}]
    items = [
        item(picture, picture=red_circle),
        item("What is 3 plus 4?"),
        item("What is the weather in Paris?", tools=[WEATHER]),
        item("What is the capital of Italy?", thinking=True),
    ]
    results = evaluate.evaluate(SHIPPED / "demo.gguf", SHIPPED / "demo-mmproj.gguf", items, with_torch=False)
    return [r.engine for r in results]


def test_a_picture_colour_is_named(answers: list[str]) -> None:
    assert answers[0].lower().startswith("a red ")


def test_a_picture_shape_and_place_are_named(answers: list[str]) -> None:
    assert "red circle on the left" in answers[0].lower()


def test_a_sum_is_right(answers: list[str]) -> None:
    assert "7" in answers[1] and "<think>" not in answers[1]


def test_a_weather_question_becomes_a_tool_call(answers: list[str]) -> None:
    call = evaluate.tool_call_of(answers[2])
    assert call == {"name": "get_weather", "arguments": {"city": "Paris"}}, answers[2]
    assert json.loads(answers[2].split("\n")[1])["arguments"]["city"] == "Paris"


def test_thinking_comes_first_when_enabled(answers: list[str]) -> None:
    reasoning, answer = evaluate.split_thinking(answers[3])
    assert reasoning and "Rome" in answer
