"""Tool results cut to fit the context, without a server: a character a token."""

from __future__ import annotations

from typing import Any

from strata.mcp_tools.fitting import fit_results, shares


def test_shares_cut_the_largest_first():
    assert shares([10, 100, 1000], 300) == [10, 100, 190]
    assert shares([10, 20], 100) == [10, 20]
    assert shares([50, 50], 10) == [5, 5]
    assert shares([50, 50], -3) == [0, 0]


def test_results_are_cut_to_the_budget():
    messages = [{"role": "user", "content": "q"}, {"role": "assistant", "content": ""},
                {"role": "tool", "content": "a" * 100}, {"role": "tool", "content": [
                    {"type": "text", "text": "b" * 300}, {"type": "image", "image": "picture"}]}]

    def count(messages: list[dict[str, Any]]) -> int:  # a character a token
        return sum(len(m["content"]) if isinstance(m["content"], str) else
                   sum(len(part.get("text", "")) for part in m["content"]) for m in messages)

    fitted = fit_results(messages, 2, 400, count, lambda text: list(text.encode()), lambda ids: bytes(ids).decode())
    assert fitted[:2] == messages[:2] and messages[2]["content"] == "a" * 100  # the input is not changed
    first, second = fitted[2]["content"], fitted[3]["content"][0]["text"]
    assert first == "a" * 100  # the smaller one is kept whole
    kept, note = second.split("\n")
    assert set(kept) == {"b"} and note == f"[cut: {len(kept)} characters of 300]"
    assert fitted[3]["content"][1] == {"type": "image", "image": "picture"}
    assert count(fitted) <= 400
    assert fit_results(messages, 2, 1000, count, lambda t: list(t.encode()), lambda i: bytes(i).decode()) == messages
