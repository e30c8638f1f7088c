"""Request bodies: JSON parsed without freezing the event loop, and checked for what Python's parser lets through.

`json.loads` is one C call that holds the GIL: a 60 MB body takes it for about a second, and a thread would not
help (the loop needs the same GIL). Bodies above `INLINE_BYTES` are therefore parsed in a short-lived child
process, which hands back the value pickled; unpickling is a copy, tens of milliseconds for the largest body.

Both paths apply the same checks: nesting at most `MAX_DEPTH` deep, at most `MAX_VALUES` values (unpickling a
million small objects would hold the GIL for a second), and no lone surrogate (`"\\ud800"`) in any string, since
one cannot be encoded as UTF-8 and would fail much later, deep in the tokenizer. Errors are `ApiError(400)`
naming what is wrong (and where, for a string).
"""

from __future__ import annotations

import json
import pickle
import sys
from typing import Any

import trio

from strata.api.errors import ApiError

INLINE_BYTES = 1 << 20  # bodies up to this size are parsed on the event loop (about a millisecond)
MAX_DEPTH = 64  # objects and arrays nested deeper are refused (real requests nest fewer than ten)
MAX_VALUES = 100_000  # strings, numbers, objects, ... in one body (a long agent conversation has ~10,000)
_PARSERS = trio.CapacityLimiter(2)  # child processes parsing at once


class BodyError(ValueError):
    """What is wrong with a body: the message a 400 carries."""


def parse_and_check(data: bytes) -> Any:
    """The JSON value of `data`, checked (see the module docstring).

    Raises:
        BodyError: not JSON, nested deeper than `MAX_DEPTH`, or a string with a lone surrogate.
    """
    try:
        value = json.loads(data)
    except RecursionError:
        raise BodyError(f"the request body nests more than {MAX_DEPTH} levels deep") from None
    except (ValueError, UnicodeDecodeError) as error:
        raise BodyError(f"the request body is not valid JSON: {error}") from None
    check_value(value)
    return value


def check_value(value: Any) -> None:
    """Refuse nesting deeper than `MAX_DEPTH`, more than `MAX_VALUES` values and strings that UTF-8 cannot hold
    (iteratively: no recursion)."""
    stack: list[tuple[Any, str, int]] = [(value, "", 0)]
    seen = 0
    while stack:
        item, path, depth = stack.pop()
        seen += 1
        if seen > MAX_VALUES:
            raise BodyError(f"the request body holds more than {MAX_VALUES} JSON values")
        if isinstance(item, str):
            _check_text(item, path)
        elif isinstance(item, (dict, list)):
            if depth >= MAX_DEPTH:
                raise BodyError(f"the request body nests more than {MAX_DEPTH} levels deep")
            if isinstance(item, dict):
                for key, child in item.items():
                    _check_text(key, path or "the request body")
                    stack.append((child, f"{path}.{key}" if path else key, depth + 1))
            else:
                stack.extend((child, f"{path}[{i}]", depth + 1) for i, child in enumerate(item))


def _check_text(text: str, path: str) -> None:
    if text.isascii():
        return
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        where = path or "the request body"
        raise BodyError(f"{where}: holds a lone surrogate (\\u{ord(text[error.start]):04x}), which is not text; "
                        "send a valid UTF-16 pair or the character itself") from None


async def parse_body(data: bytes) -> Any:
    """`parse_and_check(data)`, off the event loop when `data` is large.

    Raises:
        ApiError: 400 with `BodyError`'s message.
    """
    try:
        if len(data) <= INLINE_BYTES:
            return parse_and_check(data)
        return await _parse_in_child(data)
    except BodyError as error:
        raise ApiError(400, str(error)) from None


async def _parse_in_child(data: bytes) -> Any:
    async with _PARSERS:
        done = await trio.run_process([sys.executable, "-m", "strata.api.body"], stdin=data, capture_stdout=True,
                                      capture_stderr=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"the body parser exited with status {done.returncode}: {done.stderr[-500:]!r}")
    # Bounded by MAX_VALUES: about 13 ms for a 60 MB string, 0.1 s for the most values allowed.
    ok, value = pickle.loads(done.stdout)
    if not ok:
        raise BodyError(value)
    return value


def _main() -> None:
    """The child: a body on stdin, `(True, value)` or `(False, message)` pickled on stdout."""
    sys.setrecursionlimit(MAX_DEPTH + 200)  # the parser's own limit: deeper bodies fail fast
    try:
        reply: tuple[bool, Any] = (True, parse_and_check(sys.stdin.buffer.read()))
    except BodyError as error:
        reply = (False, str(error))
    sys.stdout.buffer.write(pickle.dumps(reply, protocol=pickle.HIGHEST_PROTOCOL))


if __name__ == "__main__":
    _main()
