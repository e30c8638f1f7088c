"""Shared test helpers: generated tiny models, scripted engines (from `fakes`), and live servers on 127.0.0.1:0."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import Any, Self

import outcome
import pytest
import trio
from fakes import ScriptedEngine

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
def qwen35_files(tmp_path_factory: pytest.TempPathFactory, qwen_tokenizer_dir: Path) -> Any:
    """(arch, full-attention interval, with an MTP block, tied embeddings) -> (the random checkpoint of 4 layers
    in transformers, its file converted to GGUF F32 by llama.cpp's converter), each made once for the session
    (`tests/engine/qwen35_checkpoints.py`)."""
    from qwen35_checkpoints import checkpoint, convert_checkpoint

    made: dict[tuple[str, int, bool, bool], tuple[Any, Path]] = {}

    def get(spec: tuple[str, int, bool, bool]) -> tuple[Any, Path]:
        if spec not in made:
            arch, interval, mtp, tied = spec
            model = checkpoint(arch, n_layer=4, interval=interval, tied=tied)
            directory = tmp_path_factory.mktemp("-".join(str(part) for part in spec))
            made[spec] = model, convert_checkpoint(model, directory, qwen_tokenizer_dir, mtp=mtp)
        return made[spec]

    return get


@pytest.fixture(scope="session")
def tokenizer(tiny_model: Path) -> Any:
    from strata.text.tokenizer import Tokenizer

    return Tokenizer.from_gguf(tiny_model)


# --- a scripted engine


@pytest.fixture
def scripted(tokenizer: Any):
    """A factory of scripted engines: `scripted("text the model writes", prompt_s=..., decode_s=...)`."""

    def make(text: str = "Hello!", **options: Any) -> ScriptedEngine:
        return ScriptedEngine(tokenizer, tokenizer.encode(text, special=True), **options)

    return make


# --- live servers


def server_config(**keys: Any) -> Config:
    """A config for tests: loopback, an ephemeral port, short shutdown, and no speculative decoding (the scripted
    engines' tests count engine calls and time tokens one step at a time; speculation's own tests turn it on)."""
    data = {"host": "127.0.0.1", "port": 0, "limits": {"graceful_timeout": 1.0}, "speculative": {"source": "off"}}
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
    "demo/test_readme.py", "demo/test_train.py", "demo/test_model.py", "demo/test_hybrid.py", "demo/test_shipped.py",
    "engine/test_llama3.py", "engine/test_qwen3vl_engine.py", "engine/test_engine_reference.py",
    "engine/test_llama_cpp_files.py", "engine/test_qwen35.py",
    "mcp_tools/test_anthropic_mcp.py", "mcp_tools/test_responses_mcp.py", "mcp_tools/test_demo_mcp.py",
    "mcp_tools/test_shutdown_mcp.py", "mcp_tools/test_mcp_limits.py",
    "modelgen/test_writer.py", "modelgen/test_qwen35_convert.py",
    "server/test_serve.py", "server/test_body_timeout.py", "server/test_fuzz.py", "server/test_hardening.py",
    "server/test_http_chat.py", "server/test_http_errors_status.py", "server/test_http_lifecycle.py",
    "server/test_http_send.py", "server/test_live_status.py", "server/test_slots.py",
    "vision/test_client.py", "vision/test_client_embeds.py", "vision/test_lfm2_vl.py",
    "vision/test_lfm2_vl_convert.py", "vision/test_lfm2_vl_tiles.py", "vision/test_qwen3vl.py",
    "vision/test_qwen3vl_serve.py", "vision/test_qwen35_vision.py", "vision/test_qwen35_serve.py",
    "vision/test_remote_ssh.py",
    "vision/test_sizing.py",
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
