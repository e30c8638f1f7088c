"""Generated training and evaluation data: pictures of shapes drawn with Pillow, short text tasks with checkable
answers, tool use and thinking, as chat conversations rendered by the project's chat template.

Every example ends in the one assistant turn the model learns (or is scored on); the turns before it are its
prompt. `render` turns an example into the exact prompt text the server renders and the text the model must
write after it. The same seed always gives the same examples.
"""

from __future__ import annotations

import dataclasses
import json
import math
import random
import re
from collections.abc import Callable, Iterator
from typing import Any

from PIL import Image, ImageDraw

from strata.text.prompt import render_chat

COLOURS = {
    "red": (220, 30, 30), "green": (30, 160, 60), "blue": (40, 80, 225), "yellow": (240, 210, 20),
    "orange": (245, 135, 20), "purple": (140, 50, 185), "black": (15, 15, 15),
}
SHAPES = ("circle", "square", "triangle", "star")
NUMBER_WORDS = ("zero", "one", "two", "three", "four", "five", "six")
PLACES = ("on the left", "in the middle", "on the right")

CAPITALS = {
    "France": "Paris", "Germany": "Berlin", "Italy": "Rome", "Spain": "Madrid", "Portugal": "Lisbon",
    "Japan": "Tokyo", "China": "Beijing", "Egypt": "Cairo", "Canada": "Ottawa", "Brazil": "Brasilia",
    "Russia": "Moscow", "Greece": "Athens", "Ireland": "Dublin", "Norway": "Oslo", "Sweden": "Stockholm",
    "Poland": "Warsaw", "Austria": "Vienna", "Kenya": "Nairobi", "Peru": "Lima", "Australia": "Canberra",
}
CITIES = tuple(CAPITALS.values()) + ("London", "New York", "Sydney", "Toronto", "Munich", "Osaka", "Chicago")
WORDS = (
    "cat", "dog", "sun", "moon", "star", "tree", "book", "fish", "bird", "lamp", "road", "rain", "snow", "wind",
    "apple", "house", "water", "green", "table", "chair", "bread", "music", "river", "light", "cloud", "stone",
    "plant", "train", "horse", "mouse", "paper", "phone", "glass", "happy", "smile", "ocean", "robot", "tiger",
    "lemon", "piano",
)
CONDITIONS = ("sunny", "cloudy", "rainy", "snowy", "windy", "foggy")

# The generator's default mix of tasks, on which the vocabulary is trained.
TASK_WEIGHTS = {
    "picture": 0.19, "count": 0.15, "arithmetic": 0.15, "capital": 0.06, "spelling": 0.06, "greeting": 0.05,
    "weather_call": 0.08, "weather_answer": 0.07, "add_call": 0.06, "add_answer": 0.05, "time_call": 0.02,
    "no_tool": 0.04, "edit": 0.08,
}
SYSTEM_PROMPTS = ("You are a helpful assistant.", "You are a friendly assistant. Answer briefly.",
                  "You are Strata's demo model.")


@dataclasses.dataclass(frozen=True)
class Shape:
    kind: str
    colour: str
    cx: float  # centre, in fractions of the picture's width and height
    cy: float
    size: float  # side of the bounding square, in fractions of the picture's shorter side


@dataclasses.dataclass(frozen=True)
class Scene:
    width: int
    height: int
    background: tuple[int, int, int]
    shapes: tuple[Shape, ...]
    noise_seed: int  # speckles drawn over the background; 0: none


@dataclasses.dataclass
class Example:
    """One conversation whose last message is the assistant turn to learn or score.

    `check` names what the evaluation looks for in the answer: {"text": ...} a phrase, {"tool": name,
    "arguments": {...}} a tool call; `scene` is the picture shown in the user turns holding an image part.
    """

    task: str
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    thinking: bool
    check: dict[str, Any]
    scene: Scene | None = None


# --- pictures


def _background(rng: random.Random) -> tuple[int, int, int]:
    """A plain, light or dark background that never matches a shape colour."""
    kind = rng.random()
    if kind < 0.45:
        v = rng.randint(225, 255)
        return (v, v, v)
    if kind < 0.8:  # pastel
        return tuple(rng.randint(190, 255) for _ in range(3))  # type: ignore[return-value]
    v = rng.randint(60, 110)  # dark grey: black shapes are not drawn on it
    return (v, v, v)


def _colours_for(background: tuple[int, int, int]) -> list[str]:
    return [c for c in COLOURS if not (c == "black" and max(background) < 128)]


def _picture_size(rng: random.Random) -> tuple[int, int]:
    side = math.exp(rng.uniform(math.log(48), math.log(720)))
    aspect = math.exp(rng.uniform(math.log(0.5), math.log(2.0)))
    return max(16, round(side * math.sqrt(aspect))), max(16, round(side / math.sqrt(aspect)))


def single_scene(rng: random.Random) -> Scene:
    width, height = _picture_size(rng)
    background = _background(rng)
    place = rng.randrange(3)
    short = min(width, height)
    size = min(rng.uniform(0.3, 0.5) * short, 0.26 * width) / short
    cx = (place + 0.5) / 3 + rng.uniform(-0.04, 0.04)
    cy = rng.uniform(0.35, 0.65)
    shape = Shape(rng.choice(SHAPES), rng.choice(_colours_for(background)), cx, cy, size)
    return Scene(width, height, background, (shape,), rng.randrange(1, 1 << 30) if rng.random() < 0.3 else 0)


def count_scene(rng: random.Random, kind: str, n: int, n_other: int) -> Scene:
    """n shapes of `kind` and n_other of other kinds, apart from each other, in random colours."""
    width, height = _picture_size(rng)
    background = _background(rng)
    colours = _colours_for(background)
    kinds = [kind] * n + [rng.choice([k for k in SHAPES if k != kind]) for _ in range(n_other)]
    short = min(width, height)
    size = rng.uniform(0.16, 0.22)
    while True:  # rejection sampling of centres; shrinks the shapes until they fit
        placed: list[tuple[float, float]] = []
        for _ in range(200):
            if len(placed) == len(kinds):
                break
            x, y = rng.uniform(0.12, 0.88) * width, rng.uniform(0.12, 0.88) * height
            half = size * short / 2
            if x - half < 0 or x + half > width or y - half < 0 or y + half > height:
                continue
            if all(math.hypot(x - px, y - py) > 1.25 * size * short for px, py in placed):
                placed.append((x, y))
        if len(placed) == len(kinds):
            break
        size *= 0.9
    shapes = tuple(Shape(k, rng.choice(colours), x / width, y / height, size)
                   for k, (x, y) in zip(kinds, placed, strict=True))
    return Scene(width, height, background, shapes, rng.randrange(1, 1 << 30) if rng.random() < 0.3 else 0)


def draw(scene: Scene) -> Image.Image:
    """The scene as an RGB picture."""
    image = Image.new("RGB", (scene.width, scene.height), scene.background)
    pen = ImageDraw.Draw(image)
    if scene.noise_seed:
        noise = random.Random(scene.noise_seed)
        for _ in range(scene.width * scene.height // 60):
            x, y = noise.randrange(scene.width), noise.randrange(scene.height)
            shade = tuple(min(255, max(0, c + noise.randint(-40, 40))) for c in scene.background)
            pen.point((x, y), fill=shade)
    short = min(scene.width, scene.height)
    for shape in scene.shapes:
        _draw_shape(pen, shape, shape.cx * scene.width, shape.cy * scene.height, shape.size * short / 2)
    return image


def _draw_shape(pen: ImageDraw.ImageDraw, shape: Shape, x: float, y: float, r: float) -> None:
    fill = COLOURS[shape.colour]
    if shape.kind == "circle":
        pen.ellipse((x - r, y - r, x + r, y + r), fill=fill)
    elif shape.kind == "square":
        s = r * 0.85
        pen.rectangle((x - s, y - s, x + s, y + s), fill=fill)
    elif shape.kind == "triangle":
        pen.polygon([(x, y - r), (x + r * 0.95, y + r * 0.8), (x - r * 0.95, y + r * 0.8)], fill=fill)
    else:  # a five-pointed star
        points = [(x + (r if i % 2 == 0 else r * 0.45) * math.sin(i * math.pi / 5),
                   y - (r if i % 2 == 0 else r * 0.45) * math.cos(i * math.pi / 5)) for i in range(10)]
        pen.polygon(points, fill=fill)


def article(word: str) -> str:
    return "An" if word[0] in "aeiou" else "A"


def describe(shape: Shape) -> str:
    return f"{article(shape.colour)} {shape.colour} {shape.kind} {PLACES[min(2, int(shape.cx * 3))]}."


def plural(kind: str) -> str:
    return kind + "s"


# --- conversations


def _user(text: str, picture: bool = False, rng: random.Random | None = None) -> dict[str, Any]:
    if not picture:
        return {"role": "user", "content": text}
    parts: list[dict[str, Any]] = [{"type": "text", "text": text}, {"type": "image_url", "image_url": {"url": ""}}]
    if rng is not None and rng.random() < 0.4:
        parts.reverse()
    return {"role": "user", "content": parts}


def _reply(content: str, reasoning: str, thinking: bool, tool_calls: list | None = None) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if thinking:
        message["reasoning_content"] = reasoning
    if tool_calls:
        message["tool_calls"] = tool_calls
    return message


def _picture(rng: random.Random, thinking: bool) -> Example:
    scene = single_scene(rng)
    shape = scene.shapes[0]
    ask = rng.random()
    if ask < 0.7:
        question = rng.choice(("What is in the picture?", "What do you see?", "Describe the picture.",
                               "What is in this image?", "What is this?", "Describe the image."))
        answer, check = describe(shape), {"text": f"{shape.colour} {shape.kind}"}
    elif ask < 0.85:
        question = rng.choice(("What colour is the shape?", "Which colour is it?"))
        answer, check = f"{shape.colour.capitalize()}.", {"text": shape.colour}
    else:
        question = rng.choice(("What shape is it?", "Which shape is this?"))
        answer, check = f"A {shape.kind}.", {"text": shape.kind}
    reasoning = f"The picture shows one {shape.colour} {shape.kind}."
    return Example("picture", [_user(question, True, rng), _reply(answer, reasoning, thinking)], None, thinking,
                   check, scene)


def counting_scene(rng: random.Random) -> tuple[str, int, int, Scene]:
    """A picture to count in: (the kind asked about, how many of it, how many others, the scene)."""
    kind = rng.choice(SHAPES)
    n, n_other = rng.randint(1, 4), rng.choice((0, 0, 1, 2))
    return kind, n, n_other, count_scene(rng, kind, n, n_other)


def picture_scene(rng: random.Random) -> Scene:
    """A scene of either picture task, a quarter of them one shape (learnt sooner), three quarters shapes to count:
    what the encoder is taught on its own."""
    return single_scene(rng) if rng.random() < 1 / 4 else counting_scene(rng)[3]


def _count(rng: random.Random, thinking: bool) -> Example:
    kind, n, n_other, scene = counting_scene(rng)
    if rng.random() < 0.8:
        question = rng.choice((f"How many {plural(kind)} are there?", f"How many {plural(kind)}?",
                               f"Count the {plural(kind)}.", f"How many {plural(kind)} are in the picture?"))
        total, what = n, plural(kind) if n > 1 else kind
    else:
        question = rng.choice(("How many shapes are there?", "How many shapes are in the picture?"))
        total, what = n + n_other, "shapes" if n + n_other > 1 else "shape"
    word = NUMBER_WORDS[total]
    reasoning = f"I count {word} {what}."
    return Example("count", [_user(question, True, rng), _reply(f"{word.capitalize()}.", reasoning, thinking)],
                   None, thinking, {"text": word}, scene)


def arithmetic_problem(rng: random.Random) -> tuple[str, str, int]:
    """(question, reasoning, result) of a sum, difference or product in the trained range."""
    op = rng.choices(("+", "-", "*"), (0.45, 0.3, 0.25))[0]
    if op == "*":
        a, b = rng.randint(0, 5), rng.randint(0, 5)
        result, words = a * b, "times"
    else:
        a, b = rng.randint(0, 10), rng.randint(0, 10)
        if op == "-":
            a, b = max(a, b), min(a, b)
        result, words = (a + b, "plus") if op == "+" else (a - b, "minus")
    sign = "x" if op == "*" else op
    question = rng.choice((f"What is {a} {words} {b}?", f"What is {a} {sign} {b}?", f"{a} {sign} {b} =",
                           f"Calculate {a} {sign} {b}.", f"How much is {a} {words} {b}?"))
    return question, f"{a} {words} {b} is {result}.", result


def _arithmetic(rng: random.Random, thinking: bool) -> Example:
    question, reasoning, result = arithmetic_problem(rng)
    return Example("arithmetic", [_user(question), _reply(f"{result}.", reasoning, thinking)], None, thinking,
                   {"text": str(result)})


def _capital(rng: random.Random, thinking: bool) -> Example:
    country = rng.choice(list(CAPITALS))
    city = CAPITALS[country]
    question = rng.choice((f"What is the capital of {country}?", f"Capital of {country}?",
                           f"Which city is the capital of {country}?"))
    answer = f"The capital of {country} is {city}."
    return Example("capital", [_user(question), _reply(answer, f"The user asks about {country}.", thinking)],
                   None, thinking, {"text": city})


def _spelling(rng: random.Random, thinking: bool) -> Example:
    word = rng.choice(WORDS)
    if rng.random() < 0.5:
        question = rng.choice((f"Spell the word {word}.", f"How do you spell {word}?", f"Spell {word}."))
        answer = "-".join(word.upper()) + "."
        reasoning = f"The word {word} has {NUMBER_WORDS[len(word)] if len(word) < 7 else len(word)} letters."
    else:
        question = rng.choice((f"Reverse the word {word}.", f"Write {word} backwards."))
        answer = word[::-1] + "."
        reasoning = f"I read {word} from the end."
    return Example("spelling", [_user(question), _reply(answer, reasoning, thinking)], None, thinking,
                   {"text": answer[:-1]})


_GREETINGS = (
    (("Hello!", "Hello", "Hi!", "Hi", "Hey there!"), "Hello! How can I help you today?", "The user greets me."),
    (("Good morning!", "Good morning"), "Good morning! How can I help you?", "The user says good morning."),
    (("Thank you!", "Thanks!", "Thanks a lot."), "You are welcome!", "The user thanks me."),
    (("Who are you?", "What are you?", "What can you do?"),
     ("I am the Strata demo model. I can name shapes and colours in pictures, count shapes, do small sums, "
      "spell words and call tools."), "The user asks who I am."),
    (("Goodbye!", "Bye!"), "Goodbye! Have a nice day.", "The user says goodbye."),
)


def _greeting(rng: random.Random, thinking: bool) -> Example:
    questions, answer, reasoning = rng.choice(_GREETINGS)
    return Example("greeting", [_user(rng.choice(questions)), _reply(answer, reasoning, thinking)], None, thinking,
                   {"text": answer.split()[0]})


# --- tools

_WEATHER_DESCRIPTIONS = ("Get the current weather in a city.", "Get the current weather for a given city.",
                         "Returns the weather for a location.", "Look up today's weather.")
_CITY_DESCRIPTIONS = ("The city name.", "City, e.g. Paris.", "The name of the city.", None)


def tool_definition(name: str, rng: random.Random) -> dict[str, Any]:
    """An OpenAI tool definition of `get_weather(city)`, `add(a, b)` or `get_time(city)`, worded at random."""
    def prop(kind: str, descriptions: tuple[str | None, ...]) -> dict[str, Any]:
        description = rng.choice(descriptions)
        return {"type": kind} | ({"description": description} if description else {})

    if name == "get_weather":
        description = rng.choice(_WEATHER_DESCRIPTIONS)
        properties = {"city": prop("string", _CITY_DESCRIPTIONS)}
        required = ["city"]
    elif name == "add":
        description = rng.choice(("Add two numbers.", "Return the sum of a and b.", "Adds a and b."))
        kind = rng.choice(("number", "integer"))
        properties = {"a": prop(kind, ("The first number.", None)), "b": prop(kind, ("The second number.", None))}
        required = ["a", "b"]
    else:
        description = rng.choice(("Get the local time in a city.", "Returns the current time for a city."))
        properties = {"city": prop("string", _CITY_DESCRIPTIONS)}
        required = ["city"]
    parameters = {"type": "object", "properties": properties, "required": required}
    return {"type": "function", "function": {"name": name, "description": description, "parameters": parameters}}


def _tools(rng: random.Random, needed: str | None) -> list[dict[str, Any]]:
    names = [n for n in ("get_weather", "add", "get_time") if n == needed or rng.random() < 0.4]
    if not names:
        names = [rng.choice(("get_weather", "add", "get_time"))]
    rng.shuffle(names)
    return [tool_definition(n, rng) for n in names]


def _call(name: str, arguments: dict[str, Any], rng: random.Random) -> dict[str, Any]:
    call_id = "call_" + "".join(rng.choice("abcdefghijklmnopqrstuvwxyz0123456789") for _ in range(8))
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": json.dumps(arguments)}}


def weather_question(city: str, rng: random.Random) -> str:
    return rng.choice((f"What is the weather in {city}?", f"What's the weather like in {city}?",
                       f"How is the weather in {city} today?", f"Weather in {city}?",
                       f"Tell me the weather in {city}.", f"Is it sunny in {city}?"))


def weather_result(city: str, rng: random.Random) -> tuple[str, int, str]:
    """A get_weather result as a JSON string, its temperature and its condition."""
    temperature, condition = rng.randint(-5, 35), rng.choice(CONDITIONS)
    result: dict[str, Any] = {"temperature": temperature, "condition": condition}
    if rng.random() < 0.4:
        result = {"city": city} | result
    if rng.random() < 0.3:
        result["unit"] = "celsius"
    return json.dumps(result), temperature, condition


def _weather(rng: random.Random, thinking: bool, answer_turn: bool) -> Example:
    city = rng.choice(CITIES)
    tools = _tools(rng, "get_weather")
    call = _call("get_weather", {"city": city}, rng)
    call_reasoning = f"The user asks about the weather in {city}, so I call get_weather."
    messages = [_user(weather_question(city, rng))]
    if not answer_turn:
        messages.append(_reply("", call_reasoning, thinking, [call]))
        return Example("weather_call", messages, tools, thinking,
                       {"tool": "get_weather", "arguments": {"city": city}})
    result, temperature, condition = weather_result(city, rng)
    messages.append(_reply("", call_reasoning, thinking and rng.random() < 0.5, [call]))
    messages.append({"role": "tool", "tool_call_id": call["id"], "content": result})
    answer = f"It is {condition} and {temperature} degrees in {city}."
    reasoning = f"The tool says {condition} and {temperature} degrees."
    messages.append(_reply(answer, reasoning, thinking))
    return Example("weather_answer", messages, tools, thinking, {"text": f"{condition} and {temperature} degrees"})


def _add(rng: random.Random, thinking: bool, answer_turn: bool) -> Example:
    a, b = rng.randint(0, 99), rng.randint(0, 99)
    tools = _tools(rng, "add")
    call = _call("add", {"a": a, "b": b}, rng)
    question = rng.choice((f"What is {a} plus {b}?", f"Add {a} and {b}.", f"What is the sum of {a} and {b}?",
                           f"What is {a} + {b}?"))
    call_reasoning = f"I will use add with {a} and {b}."
    messages = [_user(question)]
    if not answer_turn:
        messages.append(_reply("", call_reasoning, thinking, [call]))
        return Example("add_call", messages, tools, thinking, {"tool": "add", "arguments": {"a": a, "b": b}})
    result = rng.choice((str(a + b), json.dumps({"result": a + b})))
    messages.append(_reply("", call_reasoning, thinking and rng.random() < 0.5, [call]))
    messages.append({"role": "tool", "tool_call_id": call["id"], "content": result})
    messages.append(_reply(f"{a} + {b} = {a + b}.", f"The tool returned {a + b}.", thinking))
    return Example("add_answer", messages, tools, thinking, {"text": str(a + b)})


def _time(rng: random.Random, thinking: bool) -> Example:
    city = rng.choice(CITIES)
    tools = _tools(rng, "get_time")
    question = rng.choice((f"What time is it in {city}?", f"What is the time in {city}?"))
    call = _call("get_time", {"city": city}, rng)
    messages = [_user(question), _reply("", f"I call get_time for {city}.", thinking, [call])]
    return Example("time_call", messages, tools, thinking, {"tool": "get_time", "arguments": {"city": city}})


def _no_tool(rng: random.Random, thinking: bool) -> Example:
    """A question no tool answers, asked with tools declared: the model answers it directly."""
    inner = rng.choice((_capital, _greeting, _spelling))(rng, thinking)
    inner.tools, inner.task = _tools(rng, None), "no_tool"
    return inner


# --- edits: a piece of code given back with one name changed

IDENTIFIERS = ("count", "total", "items", "value", "result", "index", "name", "data", "size", "width", "height",
               "price", "score", "limit", "step", "start", "offset", "label", "text", "line", "word", "key", "node",
               "path", "user", "colour", "speed", "rate", "level", "amount", "first", "last", "delta", "factor")
FUNCTIONS = ("compute", "update", "scale", "check", "clamp", "merge", "measure", "collect", "apply", "shift",
             "average", "bound", "combine", "adjust", "summarise", "weigh")


def code_snippet(rng: random.Random) -> str:
    """A short Python function over a few names: arithmetic, a test or a loop, a return."""
    names = rng.sample(IDENTIFIERS, 5)
    params, local = names[:rng.randint(1, 3)], names[3]
    lines = [f"def {rng.choice(FUNCTIONS)}({', '.join(params)}):"]
    known = list(params)
    for _ in range(rng.randint(2, 4)):
        a, b = rng.choice(known), rng.choice([*known, str(rng.randint(1, 9))])
        form = rng.random()
        if form < 0.45:
            lines.append(f"    {local} = {a} {rng.choice('+-*')} {b}")
            known.append(local)
        elif form < 0.75:
            limit = rng.randint(1, 99)
            lines += [f"    if {a} > {limit}:", f"        {a} = {limit}"]
        else:
            lines += [f"    for {names[4]} in range({a}):", f"        {a} = {a} + {names[4]}"]
    lines.append(f"    return {rng.choice(known)}")
    return "\n".join(lines)


def rename(code: str, old: str, new: str) -> str:
    """code with every whole name `old` written `new`."""
    return re.sub(rf"\b{re.escape(old)}\b", new, code)


def _edit(rng: random.Random, thinking: bool, functions: int = 1) -> Example:
    """Rename a name in `functions` functions (a module of them, two blank lines apart)."""
    code = "\n\n\n".join(code_snippet(rng) for _ in range(functions))
    names = sorted(set(re.findall(r"[a-z_]+", code)) - {"def", "if", "for", "in", "range", "return"})
    old = rng.choice(names)
    new = rng.choice([n for n in (*IDENTIFIERS, *FUNCTIONS) if n not in names])
    block = f"```python\n{code}\n```"
    question = rng.choice((f"Rename {old} to {new} in this code:\n\n{block}",
                           f"In the code below, rename `{old}` to `{new}`.\n\n{block}",
                           f"{block}\n\nRename {old} to {new}.",
                           f"Change the name {old} to {new}:\n{block}"))
    changed = rename(code, old, new)
    reasoning = f"I write the code again with every {old} renamed to {new}."
    return Example("edit", [_user(question), _reply(f"```python\n{changed}\n```", reasoning, thinking)], None,
                   thinking, {"text": changed})


_MAKERS: dict[str, Callable[[random.Random, bool], Example]] = {
    "picture": _picture, "count": _count, "arithmetic": _arithmetic, "capital": _capital, "spelling": _spelling,
    "greeting": _greeting,
    "weather_call": lambda rng, thinking: _weather(rng, thinking, False),
    "weather_answer": lambda rng, thinking: _weather(rng, thinking, True),
    "add_call": lambda rng, thinking: _add(rng, thinking, False),
    "add_answer": lambda rng, thinking: _add(rng, thinking, True),
    "time_call": _time, "no_tool": _no_tool, "edit": _edit,
    # a module of several functions: a long copy, with the name renamed only where it occurs
    "edit_long": lambda rng, thinking: _edit(rng, thinking, rng.randint(3, 9)),
}
_HISTORY_TASKS = ("arithmetic", "capital", "greeting", "spelling")


def make_example(task: str, rng: random.Random) -> Example:
    """One example of `task`: half with thinking, some after a system prompt or earlier turns."""
    thinking = rng.random() < 0.5
    example = _MAKERS[task](rng, thinking)
    if example.scene is not None and rng.random() < 0.2:
        _ask_again(example, rng)
    elif example.scene is None and rng.random() < 0.2:
        earlier = _MAKERS[rng.choice(_HISTORY_TASKS)](rng, False)
        example.messages[:0] = earlier.messages
    if rng.random() < 0.25:
        example.messages.insert(0, {"role": "system", "content": rng.choice(SYSTEM_PROMPTS)})
    return example


def _ask_again(example: Example, rng: random.Random) -> None:
    """Move the picture to an earlier turn (with an answer) and ask the example's question as a follow-up."""
    question = example.messages[0]["content"]
    text = next(p["text"] for p in question if p["type"] == "text")
    first = _user("What is in the picture?" if example.task == "count" else "What do you see?", True, rng)
    assert example.scene is not None  # only examples with a picture are moved
    answer = describe(example.scene.shapes[0]) if example.task == "picture" else "Some shapes."
    example.messages[:1] = [first, _reply(answer, "", False), _user(text)]


def examples(seed: int, weights: dict[str, float] | None = None) -> Iterator[Example]:
    """An endless stream of examples drawn with the task weights; the same seed gives the same stream."""
    rng = random.Random(seed)
    weights = weights or TASK_WEIGHTS
    tasks, probs = list(weights), list(weights.values())
    while True:
        yield make_example(rng.choices(tasks, probs)[0], rng)


# --- rendering


def render(example: Example, template: str) -> tuple[str, str]:
    """(prompt, answer): the text the server renders for the conversation before the last turn, and what the model
    writes after it, up to and including `<|im_end|>`."""
    prompt = render_chat(template, example.messages[:-1], tools=example.tools, add_generation_prompt=True,
                         enable_thinking=example.thinking)
    full = render_chat(template, example.messages, tools=example.tools, add_generation_prompt=False,
                       enable_thinking=example.thinking)
    if not full.startswith(prompt):
        raise ValueError(f"the template renders the {example.task} answer turn differently from its prompt")
    answer = full[len(prompt):]
    return prompt, answer[:answer.rindex("<|im_end|>") + len("<|im_end|>")]
