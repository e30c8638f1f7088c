"""Startup progress lines: ticks while a step runs, naming what it does; its result and its own exception."""

from __future__ import annotations

import pytest
import trio

from strata.progress import with_progress


async def test_ticks_while_the_step_runs_and_returns_its_result(autojump_clock):
    lines: list[str] = []

    async def work(stage):
        stage.now = "tokenizer"
        await trio.sleep(5.5)
        return 42

    assert await with_progress(lines.append, "loading m.gguf", work, every=2.0) == 42
    assert lines == ["loading m.gguf ... 2 s (tokenizer)", "loading m.gguf ... 4 s (tokenizer)"]


async def test_the_step_s_exception_comes_through_unwrapped():
    async def work(stage):
        raise ValueError("bad file")

    with pytest.raises(ValueError, match="bad file"):
        await with_progress(print, "loading", work)
