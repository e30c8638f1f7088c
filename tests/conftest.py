"""Shared test helpers: generated tiny models, a scripted engine, and live servers on 127.0.0.1:0."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import Any, Self

import numpy as np
import outcome
import pytest
import trio

from strata.config import Config, config_from_dict

# --- models


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random qwen3moe model (f32, byte vocabulary) with the Qwen3 chat template."""
    from strata.modelgen import write_random_model

    return write_random_model(tmp_path_factory.mktemp("models") / "tiny.gguf", arch="qwen3moe", size="tiny",
                              dtype="f32", vocab="bytes", seed=0)


@pytest.fixture(scope="session")
def qwen_tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Qwen's real tokenizer saved as a Hugging Face tokenizer (`llama_cpp_convert.qwen_tokenizer`: tens of seconds,
    made once for every converted Qwen checkpoint); skips without llama.cpp's converter, which is what reads it."""
    from llama_cpp_convert import qwen_tokenizer, require_converter

    require_converter()
    directory = tmp_path_factory.mktemp("qwen-tokenizer")
    qwen_tokenizer(directory)
    return directory


@pytest.fixture(scope="session")
def tokenizer(tiny_model: Path) -> Any:
    from strata.text.tokenizer import Tokenizer

    return Tokenizer.from_gguf(tiny_model)


# --- a scripted engine


class ScriptedEngine:
    """The `Engine` API with a "model" that writes `script` (token ids) after each assistant prompt, then stops.

    Timing and aborts behave like the C engine's: a prompt token costs `prompt_s` and a decode step `decode_s`
    seconds of blocking work (a batch costs the sum of its items'); each sequence's abort flag is checked between
    tokens — `LAYERS` times per token —, drops that sequence from the call in flight (or the next one that has its
    tokens) with `EngineAborted`, is lowered by doing so, and the positions not reached are dropped.

    Args:
        tokenizer: the tokenizer whose ids the script uses (for the vocabulary size and end-of-turn id).
        script: the ids the model writes after `<|im_start|>assistant\\n`; the end-of-turn id follows.
        n_seq: sequences (slots).
    """

    LAYERS = 4  # abort checks per token

    def __init__(self, tokenizer: Any, script: Sequence[int] = (), *, n_ctx: int = 4096, prompt_s: float = 0.0,
                 decode_s: float = 0.0, n_embd: int = 48, n_seq: int = 1):
        self.n_embd = self.picture_width = n_embd  # the vision tests' encoders write rows this wide
        self.n_vocab = tokenizer.n_vocab
        self.n_ctx, self.n_seq = n_ctx, n_seq
        self.arch, self.backend, self.threads = "scripted", "scripted", 1
        self.script = list(script)
        self.prompt_s, self.decode_s = prompt_s, decode_s
        self.kvs: list[list[int]] = [[] for _ in range(n_seq)]
        self.calls: list[list[int]] = []  # the tokens of every item of every eval call, in order
        self.embeds: list[list[Any]] = []  # the embeds of every item: (index, rows) pairs
        self.call_times: list[float] = []  # time.perf_counter() at the start of each item
        self.aborts = 0  # items stopped by an abort flag
        self.running = threading.Event()  # set while an eval call runs
        self._abort: set[int] = set()
        self._lock = threading.Lock()
        self._turn_open = tokenizer.encode("<|im_start|>assistant\n", special=True)
        self._no_thinking = tokenizer.encode("<think>\n\n</think>\n\n", special=True)
        self._end = tokenizer.token_to_id("<|im_end|>")

    @property
    def kv(self) -> list[int]:
        return self.kvs[0]

    @property
    def n_past(self) -> int:
        return len(self.kvs[0])

    def seq_n_past(self, seq: int) -> int:
        return len(self.kvs[seq])

    def eval_batch(self, items: Sequence[Any], notify_fd: int = -1) -> list[np.ndarray | None]:
        from strata.engine_cffi import EngineAborted, EngineError

        if notify_fd >= 0:  # as the engine does as a call starts
            os.eventfd_write(notify_fd, 1)
        results: list[np.ndarray | None] = []
        dropped: set[int] = set()
        self.running.set()
        try:
            for item in items:
                self.call_times.append(time.perf_counter())
                self.calls.append(list(item.tokens))
                self.embeds.append(list(item.embeds or []))
                kv = self.kvs[item.seq]
                if len(kv) + len(item.tokens) > self.n_ctx:
                    raise EngineError("context full")
                step = self.prompt_s if len(item.tokens) > 1 else self.decode_s
                results.append(self._run(item, kv, step, dropped))
        finally:
            self.running.clear()
        if dropped:
            raise EngineAborted("aborted", frozenset(dropped), results)
        return results

    def _run(self, item: Any, kv: list[int], step: float, dropped: set[int]) -> np.ndarray | None:
        for token in item.tokens:
            for _ in range(self.LAYERS):
                with self._lock:
                    stop = item.seq in self._abort
                    self._abort.discard(item.seq)
                if stop:
                    self.aborts += 1
                    dropped.add(item.seq)
                    return None
                if step:
                    time.sleep(step / self.LAYERS)
            kv.append(token)
        # A margin no temperature below ~10 can overturn: the script is followed at any sampling setting.
        logits = np.full((1, self.n_vocab), -100.0, dtype=np.float32)
        logits[0, self._next_token(kv)] = 100.0
        return logits if item.logits == "last" else logits[:0]

    def eval(self, tokens: Sequence[int], embeds: Any = None, all_logits: bool = False) -> np.ndarray:
        from strata.engine_cffi import BatchItem

        (logits,) = self.eval_batch([BatchItem(0, tokens, embeds)])
        assert logits is not None
        return logits[0]

    def _next_token(self, kv: list[int]) -> int:
        """The script's token after what follows the last assistant prompt (and its empty thinking block, when
        the template disabled thinking) in the cache."""
        n = len(self._turn_open)
        for start in range(len(kv) - n, -1, -1):
            if kv[start:start + n] == self._turn_open:
                start += n
                if kv[start:start + len(self._no_thinking)] == self._no_thinking:
                    start += len(self._no_thinking)
                written = len(kv) - start
                return self.script[written] if 0 <= written < len(self.script) else self._end
        return self._end

    def keep(self, n: int, seq: int = 0) -> None:
        del self.kvs[seq][n:]

    def copy_prefix(self, src: int, dst: int, n: int) -> None:
        self.kvs[dst] = self.kvs[src][:n]

    def abort(self, seq: int = 0) -> None:
        with self._lock:
            self._abort.add(seq)

    def clear_abort(self, seq: int = 0) -> None:
        with self._lock:
            self._abort.discard(seq)

    def close(self) -> None:
        pass


@pytest.fixture
def scripted(tokenizer: Any):
    """A factory of scripted engines: `scripted("text the model writes", prompt_s=..., decode_s=...)`."""

    def make(text: str = "Hello!", **options: Any) -> ScriptedEngine:
        return ScriptedEngine(tokenizer, tokenizer.encode(text, special=True), **options)

    return make


# --- live servers


def server_config(**keys: Any) -> Config:
    """A config for tests: loopback, an ephemeral port, short shutdown."""
    data = {"host": "127.0.0.1", "port": 0, "limits": {"graceful_timeout": 1.0}}
    for key, value in keys.items():
        if isinstance(value, dict):
            data.setdefault(key, {}).update(value)
        else:
            data[key] = value
    return config_from_dict(data)


class LiveServer:
    """A Strata server (hypercorn, trio worker) in a thread of its own, for sync and async clients alike.

    Attributes:
        url: the base URL, e.g. "http://127.0.0.1:41234".
        service: the server's `Service` (read it from tests; it lives in the server thread).
    """

    def __init__(self, config: Config, engine: Any = None, tokenizer: Any = None):
        self._config, self._engine, self._tokenizer = config, engine, tokenizer
        self.url = ""
        self.service: Any = None
        self._ready = threading.Event()
        self._token: trio.lowlevel.TrioToken | None = None
        self._stop: trio.Event | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="strata-test-server", daemon=True)

    def __enter__(self) -> Self:
        self._thread.start()
        if not self._ready.wait(60):
            raise RuntimeError("the test server did not start")
        if self._error is not None:
            raise self._error
        return self

    def __exit__(self, *exc_info: object) -> None:
        if self._token is not None and self._stop is not None:
            self._token.run_sync_soon(self._stop.set)
        self._thread.join(30)
        assert not self._thread.is_alive(), "the test server did not stop"
        if self._error is not None:
            raise self._error

    def call(self, fn: Any, *args: Any) -> Any:
        """Run a sync function in the server's trio thread (to read its state consistently); works from any
        thread, a trio test's included (it blocks that thread briefly)."""
        done = threading.Event()
        result: list[Any] = []

        def run() -> None:
            try:
                result.append(outcome.capture(fn, *args))
            finally:
                done.set()

        self._token.run_sync_soon(run)
        if not done.wait(10):
            raise RuntimeError("the test server did not answer")
        return result[0].unwrap()

    def _run(self) -> None:
        try:
            trio.run(self._main)
        except BaseException as error:  # noqa: BLE001 - handed to the test thread
            self._error = error
            self._ready.set()

    async def _main(self) -> None:
        import hypercorn
        import hypercorn.trio

        from strata.api import create_app
        from strata.service import open_service

        self._token = trio.lowlevel.current_trio_token()
        self._stop = trio.Event()
        async with open_service(self._config, engine=self._engine, tokenizer=self._tokenizer,
                                log=lambda line: None) as service:
            self.service = service
            hyper = hypercorn.Config()
            hyper.bind = ["127.0.0.1:0"]
            hyper.graceful_timeout = self._config.limits.graceful_timeout
            hyper.accesslog = None
            hyper.errorlog = None
            async with trio.open_nursery() as nursery:
                binds = await nursery.start(partial(hypercorn.trio.serve, create_app(service=service), hyper,
                                                    shutdown_trigger=self._stop.wait))
                self.url = binds[0]
                self._ready.set()


@contextmanager
def live_server(config: Config | None = None, engine: Any = None, tokenizer: Any = None) -> Iterator[LiveServer]:
    with LiveServer(config or server_config(), engine, tokenizer) as server:
        yield server


async def wait_until(predicate: Any, timeout: float = 5.0, interval: float = 0.002) -> None:
    """Poll `predicate()` from a trio test until it is true."""
    with trio.fail_after(timeout):
        while not predicate():
            await trio.sleep(interval)


@pytest.fixture
def serve_script(tokenizer):
    """Start a live server whose model writes `text`; returns the server (a context manager)."""

    def start(text: str, **options: Any):
        engine = ScriptedEngine(tokenizer, tokenizer.encode(text, special=True), **options)
        return live_server(server_config(), engine, tokenizer)

    return start


# --- tiers: `./scripts/test.sh --fast` (pytest -m "not slow") runs the unit tests in well under a minute; the
# whole suite is the gate. Slow are the modules that start servers, processes or a browser, or build models with
# torch or llama.cpp; every `*_e2e.py` module is slow too.
SLOW_MODULES = frozenset({
    "demo/test_readme.py", "demo/test_train.py", "demo/test_model.py", "demo/test_shipped.py",
    "engine/test_llama3.py", "engine/test_qwen3vl_engine.py", "engine/test_engine_reference.py",
    "engine/test_llama_cpp_files.py",
    "mcp_tools/test_anthropic_mcp.py", "mcp_tools/test_responses_mcp.py", "mcp_tools/test_demo_mcp.py",
    "mcp_tools/test_mcp_limits.py",
    "modelgen/test_writer.py",
    "server/test_serve.py", "server/test_body_timeout.py", "server/test_fuzz.py", "server/test_hardening.py",
    "server/test_http_chat.py", "server/test_http_errors_status.py", "server/test_http_lifecycle.py",
    "server/test_http_send.py", "server/test_live_status.py", "server/test_slots.py",
    "vision/test_client.py", "vision/test_client_embeds.py", "vision/test_lfm2_vl.py",
    "vision/test_lfm2_vl_convert.py", "vision/test_lfm2_vl_tiles.py", "vision/test_qwen3vl.py",
    "vision/test_qwen3vl_serve.py", "vision/test_remote_ssh.py", "vision/test_sizing.py",
    "vision/test_vision_service.py", "vision/test_worker.py",
    "web/test_pages_e2e.py", "web/test_web_routes.py",
})


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "slow: not in the fast tier (./scripts/test.sh --fast)")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    tests = Path(__file__).parent
    for item in items:
        module = item.path.relative_to(tests).as_posix()
        if module in SLOW_MODULES or module.endswith("_e2e.py"):
            item.add_marker(pytest.mark.slow)
