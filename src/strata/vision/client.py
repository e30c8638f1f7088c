"""The server's side of the image encoder: a `strata-vision` process (local, or remote through `exe`) spoken to
in the protocol's in-band form, owned by the service's long-lived nursery.

    client = VisionClient(config.vision, engine_threads=4)
    await nursery.start(client.run)           # a local encoder that cannot start raises VisionStartError here
    embedding = await client.encode(data, turn)  # in the request's task: cancellable in every phase

Invariants:
- Encodes are serialised by a fair lock (the FIFO): a request cancelled while it waits there never reaches the
  encoder; one cancelled while its picture is encoded sends `CANCEL <id>` and waits (briefly, shielded) for the
  encoder to say it stopped.
- The engine's turn is taken around an encode only when the encoder's READY said `cuda: true` (it shares the GPU
  with the engine); a CPU or remote encoder runs at the same time as generation.
- Failure is local: an encoder that is absent or crashed makes pictures fail with `VisionUnavailable` (the route
  answers 400) and is started again for the next picture; text is never affected.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager, nullcontext
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import trio

import strata
from strata.pictures.cache import EmbeddingCache, content_hash
from strata.pictures.sources import ImageInfo
from strata.vision.preprocess import picture_grid
from strata.vision.protocol import (
    GPU_ADVICE,
    MAX_LINE_BYTES,
    Cancel,
    EncodeBytes,
    Failed,
    PictureGrid,
    ProtocolError,
    Ready,
    Result,
    encode_request,
    parse_reply,
    parse_sve,
)

START_TIMEOUT = 60.0  # seconds from starting the process to its READY line (loading the mmproj included)
REMOTE_START_TIMEOUT = 15.0  # the same for a remote encoder, asked again on each picture while it is down
CANCEL_WAIT = 2.0  # seconds a cancelled job waits for CANCELLED before the encoder is deemed stuck
STOP_GRACE = 2.0  # seconds between SIGTERM and SIGKILL for the encoder's process group
_STDERR_TAIL = 2000


class VisionUnavailable(Exception):
    """The image encoder cannot be reached now; `reason` says why (shown to the client in a 400)."""

    def __init__(self, reason: str):
        super().__init__(f"the image encoder is not available: {reason}")
        self.reason = reason


class EncodeTimeout(VisionUnavailable):
    """The encoder did not finish a picture in its time: it is deemed hung, and stopped (the next picture starts
    it again)."""


class VisionStartError(RuntimeError):
    """A local encoder could not start: a broken install, so startup stops with this message."""


class PictureRefused(ValueError):
    """The encoder refused the picture (`ERR <id> image: ...`)."""


@dataclasses.dataclass(frozen=True)
class Embedding:
    """One encoded picture: `rows` (n_tokens, n_embd) float32 over an nx × ny merged-token grid, after the
    (cols, rows, side) `tiles` of a picture split into tiles (see `PictureGrid`)."""

    rows: np.ndarray
    nx: int
    ny: int
    digest: str  # content hash of the picture (or of the pre-computed embeddings)
    ms: float = 0.0
    tiles: tuple[int, int, int] = (0, 0, 0)

    @property
    def grid(self) -> PictureGrid:
        return PictureGrid(self.nx, self.ny, *self.tiles)

    @property
    def n_tokens(self) -> int:
        return self.rows.shape[0]

    @property
    def nbytes(self) -> int:
        return self.rows.nbytes


def default_threads(engine_threads: int | None, cores: int | None = None) -> int:
    """A CPU encoder's threads when the config leaves them out: a quarter of the cores, no more than the engine
    leaves free, at least one (users measured −23% decode with the encoder on every core, none with two of
    eight)."""
    cores = cores or len(os.sched_getaffinity(0))
    free = cores - (engine_threads or cores)
    return max(1, min(free, cores // 4))


def _worker_env() -> dict[str, str]:
    """The environment of the local `strata-vision`: this one, with this package importable even when it runs
    from a source tree."""
    env = dict(os.environ)
    src = str(Path(strata.__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [src, env.get("PYTHONPATH")]))
    return env


def encoder_command(config: Any, threads: int, gpu_device: str = "cuda") -> list[str]:
    """The encoder's argument list: `config.exe` verbatim when set, else the local `strata-vision` command (with
    `config.gpu`, on `gpu_device`: cuda, or host, the test device the server's `device: host` runs on too)."""
    if config.exe:
        return list(config.exe)
    argv = [sys.executable, "-m", "strata.vision.worker", "--mmproj", str(config.mmproj), "--threads", str(threads)]
    if config.max_tokens is not None:
        argv += ["--max-tokens", str(config.max_tokens)]
    if config.min_tokens is not None:
        argv += ["--min-tokens", str(config.min_tokens)]
    if config.gpu:
        argv += ["--gpu"] + (["--device", gpu_device] if gpu_device != "cuda" else [])
    return argv


async def _stop_group(process: trio.Process) -> None:
    """`deliver_cancel` for the encoder: SIGTERM to its whole process group (ssh and what it runs), SIGKILL after
    a grace period."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            return
        with trio.move_on_after(STOP_GRACE):
            await process.wait()
            return


class _Reader:
    """Lines and exact byte counts from the encoder's stdout (which arrives in arbitrary chunks)."""

    def __init__(self, stream: trio.abc.ReceiveStream):
        self._stream = stream
        self._buffer = bytearray()

    async def _fill(self) -> bool:
        chunk = await self._stream.receive_some(1 << 20)
        self._buffer += chunk
        return bool(chunk)

    async def line(self) -> bytes | None:
        """The next line (with its newline), or None at the end of the stream."""
        while True:
            end = self._buffer.find(b"\n")
            if end >= 0:
                line = bytes(self._buffer[: end + 1])
                del self._buffer[: end + 1]
                return line
            if len(self._buffer) > MAX_LINE_BYTES:
                raise ProtocolError(f"the encoder wrote a line longer than {MAX_LINE_BYTES} bytes")
            if not await self._fill():
                return None

    async def exactly(self, n: int) -> bytes | None:
        while len(self._buffer) < n:
            if not await self._fill():
                return None
        data = bytes(self._buffer[:n])
        del self._buffer[:n]
        return data


@dataclasses.dataclass(eq=False)
class _Job:
    done: trio.Event = dataclasses.field(default_factory=trio.Event)
    embedding: Embedding | None = None
    refused: str | None = None  # the encoder's reason for refusing the picture
    running: bool = False  # set when the job has been sent


class _Session:
    """One encoder process: its READY, its pending jobs, and the reasons it stopped."""

    def __init__(self, argv: list[str]):
        self.argv = argv
        self.process: trio.Process | None = None
        self.ready: Ready | None = None
        self.error: str | None = None  # why it did not start, or why it stopped
        self.alive = False
        self.jobs: dict[str, _Job] = {}
        self.scope = trio.CancelScope()
        self.stderr_tail = b""
        self.stderr_done = trio.Event()
        self._send_lock = trio.Lock()

    def ready_reply(self) -> Ready:
        """The READY of a session that started (`alive` once)."""
        assert self.ready is not None, "the encoder has not said READY"
        return self.ready

    def stderr_text(self) -> str:
        lines = self.stderr_tail.decode("utf-8", "replace").strip().splitlines()
        return " ".join(" ".join(lines[-3:]).split())[-500:]

    async def read_stderr(self) -> None:
        assert self.process is not None and self.process.stderr is not None
        try:
            while chunk := await self.process.stderr.receive_some(1 << 16):
                self.stderr_tail = (self.stderr_tail + chunk)[-_STDERR_TAIL:]
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass
        finally:
            self.stderr_done.set()

    async def send(self, data: bytes) -> None:
        assert self.process is not None and self.process.stdin is not None
        async with self._send_lock:
            await self.process.stdin.send_all(data)

    def finish(self, reason: str) -> None:
        """The process is gone or unusable: every pending job fails with `reason`."""
        self.alive = False
        self.error = self.error or reason
        for job in self.jobs.values():
            job.done.set()


class VisionClient:
    """The image encoder as the service sees it (see the module docstring).

    Args:
        config: the `vision` section of the configuration.
        engine_threads: the engine's threads, to size a CPU encoder's default thread count.
        log: where the startup line and state changes go.
        start_timeout: seconds to wait for READY (default: 15 for a remote encoder, 60 for a local one).
        gpu_device: the device a local encoder with `config.gpu` runs on ("cuda", or "host" for tests).
    """

    def __init__(self, config: Any, *, engine_threads: int | None = None, log: Callable[[str], None] = print,
                 start_timeout: float | None = None, cache: EmbeddingCache | None = None, gpu_device: str = "cuda"):
        self.config = config
        self.remote = bool(config.remote)
        self.threads = config.threads or default_threads(engine_threads)
        self.engine_threads = engine_threads
        self.argv = encoder_command(config, self.threads, gpu_device)
        self._env = None if config.exe else _worker_env()
        self.start_timeout = start_timeout or (REMOTE_START_TIMEOUT if self.remote else START_TIMEOUT)
        self.cache = cache if cache is not None else EmbeddingCache()
        self.encodes = 0
        self.queued = 0
        self.timeouts = 0  # encodes that took too long (the encoder was restarted)
        self.restarts = 0  # starts after the first
        self.last_error: str | None = None
        self.last_ready: Ready | None = None  # the most recent READY (kept while the encoder is down)
        self.job: dict[str, Any] | None = None  # the picture being encoded now: its size and start time
        self._log = log
        self._nursery: trio.Nursery | None = None
        self._session: _Session | None = None
        self._start_lock = trio.Lock()
        self._fifo = trio.Lock()  # trio's Lock is fair: waiters get it in arrival order
        self._ids = itertools.count(1)

    # --- lifetime

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Own the encoder until cancelled. Starts it now unless `lazy_load`.

        Raises (before `task_status.started`):
            VisionStartError: a local encoder that could not start (the message names the cause).
        """
        failure: VisionStartError | None = None
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            if not self.config.lazy_load:
                try:
                    await self._start()
                except VisionUnavailable as error:
                    if not self.remote:
                        failure = VisionStartError(f"the image encoder did not start: {error.reason}")
                        nursery.cancel_scope.cancel()
                    else:
                        self._log(f"vision: the remote encoder is not available yet ({error.reason}); "
                                  "serving text, pictures will ask for it again")
            if failure is None:
                self._log(self.startup_line())
                task_status.started()
                await trio.sleep_forever()
        if failure is not None:
            # Raised outside the nursery, so the caller sees the error itself rather than an exception group.
            raise failure

    @property
    def available(self) -> bool:
        return self._session is not None and self._session.alive

    @property
    def cuda(self) -> bool:
        return self.last_ready is not None and self.last_ready.capabilities.cuda

    @property
    def pid(self) -> int | None:
        """The encoder process's id while it runs (for tests and diagnostics)."""
        session = self._session
        return session.process.pid if session is not None and session.alive and session.process else None

    def mode(self) -> str:
        if self.remote:
            return "remote"
        return "gpu" if self.config.gpu else "cpu"

    def state(self) -> str:
        """"ready", "starting" (a first start or a restart in progress), "lazy" (starts on the first picture) or
        "absent" (down; `last_error` says why)."""
        if self.available:
            return "ready"
        if self._start_lock.locked():
            return "starting"
        return "lazy" if self.config.lazy_load and self.last_ready is None else "absent"

    def startup_line(self) -> str:
        state = "ready" if self.available else ("starts on the first picture" if self.config.lazy_load
                                                 else "not available")
        if self.remote:
            return f"vision: remote encoder ({' '.join(self.argv[:2])} ...), {state}"
        cores = len(os.sched_getaffinity(0))
        return (f"vision: {self.mode()} encoder, {self.threads} thread(s); engine {self.engine_threads or cores} "
                f"thread(s); {cores} cores; {state}")

    def status(self) -> dict[str, Any]:
        caps = self.last_ready.capabilities if self.last_ready else None
        return {
            "mode": self.mode(),
            "state": self.state(),
            "job": self.job,
            "available": self.available,
            "cuda": self.cuda,
            "threads": caps.threads if caps else (None if self.remote else self.threads),
            "engine_threads": self.engine_threads,
            "cores": len(os.sched_getaffinity(0)),
            "takes_turn": self.cuda,
            "device_bytes": caps.device_bytes if caps else None,
            "fingerprint": caps.fingerprint if caps else None,
            "last_error": self.last_error,
            "encodes": self.encodes,
            "queued": self.queued,
            "timeouts": self.timeouts,
            "restarts": self.restarts,
            "cache_hits": self.cache.hits,
            "cached": len(self.cache),
        }

    # --- encoding

    @staticmethod
    def grid(ready: Ready, info: ImageInfo) -> PictureGrid | None:
        """What the encoder of `ready` turns a picture with this header into (its own sizing rule applied to the
        picture's upright size); None when READY has no rule."""
        rule = ready.capabilities.sizing
        return None if rule is None else picture_grid(info.width, info.height, rule)

    @staticmethod
    def rows(ready: Ready, info: ImageInfo) -> int:
        """The rows the encoder of `ready` turns a picture with this header into (`grid`), or its `max_tokens`
        (the most a picture can take) when READY has no sizing rule."""
        grid = VisionClient.grid(ready, info)
        return ready.capabilities.max_tokens if grid is None else grid.n_tokens

    async def encode(self, data: bytes, turn: Any = None, rows: int | None = None) -> Embedding:
        """The embedding rows of the picture `data` (checked bytes), from the cache or the encoder.

        Runs in the caller's task: cancelling it drops a queued job or stops a running encode.

        Args:
            turn: the engine's `Turn`, held around the encode when the encoder holds a CUDA context.
            rows: the rows the picture takes (`rows`), which size its deadline; None: the encoder's max_tokens.

        Raises:
            VisionUnavailable: the encoder cannot be reached (or stopped during the encode).
            PictureRefused: the encoder could not read the picture.
        """
        digest = content_hash(data)
        cached = self.cache.get(digest)
        if cached is not None:
            return cached
        self.queued += 1
        try:
            await self._fifo.acquire()
        finally:
            self.queued -= 1
        try:
            session = await self.session()
            holding: AbstractAsyncContextManager[Any] = (
                turn.hold() if turn is not None and session.ready_reply().capabilities.cuda else nullcontext())
            async with holding:
                self.job = {"bytes": len(data), "started": time.time()}
                try:
                    embedding = await self._run_job(session, data, digest, rows)
                finally:
                    self.job = None
        finally:
            self._fifo.release()
        self.encodes += 1
        self.cache.put(digest, embedding)
        return embedding

    async def session(self) -> _Session:
        """The running encoder, started (again) when there is none.

        Raises:
            VisionUnavailable: it could not be started; the reason is kept in `last_error`.
        """
        async with self._start_lock:
            if not self.available:
                await self._start()
            assert self._session is not None
            return self._session

    async def _start(self) -> None:
        assert self._nursery is not None, "VisionClient.run is not running"
        if self._session is not None:
            self.restarts += 1
        session = _Session(self.argv)
        self._session = session
        await self._nursery.start(self._own_session, session)
        if not session.alive:
            self.last_error = session.error
            raise VisionUnavailable(session.error or "it stopped")
        assert session.ready is not None
        previous, self.last_ready = self.last_ready, session.ready
        if previous is not None and previous.capabilities.fingerprint != session.ready.capabilities.fingerprint:
            self.cache.clear()  # another encoder file: old rows no longer match
        self.last_error = None

    async def _own_session(self, session: _Session, *, task_status: trio.TaskStatus[None]) -> None:
        """Run one encoder process: start it, read READY, then route its replies until it ends.

        Always calls `task_status.started()` (with `session.alive` telling whether it started), so a failure
        to start is a value, not an exception through the nursery.
        """
        started = False
        try:
            with session.scope:
                async with trio.open_nursery() as nursery:
                    try:
                        session.process = await nursery.start(partial(
                            trio.run_process, session.argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, check=False, start_new_session=True, deliver_cancel=_stop_group,
                            env=self._env))
                    except OSError as error:
                        session.finish(f"cannot run {session.argv[0]!r}: {error.strerror or error}")
                        return
                    nursery.start_soon(session.read_stderr)
                    assert session.process.stdout is not None  # stdout=PIPE
                    reader = _Reader(session.process.stdout)
                    await self._handshake(session, reader)
                    task_status.started()
                    started = True
                    if session.alive:
                        await self._route_replies(session, reader)
                    nursery.cancel_scope.cancel()  # the process is gone or unusable: stop it and its readers
        finally:
            failed = session.error is not None  # None: stopped by the service's shutdown, nothing to report
            session.finish("the encoder stopped")
            if not started:
                task_status.started()
            elif failed:
                self.last_error = session.error
                self._log(f"vision: {session.error}")

    async def _handshake(self, session: _Session, reader: _Reader) -> None:
        try:
            with trio.fail_after(self.start_timeout):
                line = await reader.line()
                reply = parse_reply(line) if line is not None else None
        except trio.TooSlowError:
            session.finish(f"no READY from the encoder within {self.start_timeout:g} s")
            return
        except ProtocolError as error:
            session.finish(f"the encoder's first line is not READY: {error}")
            return
        if line is None:
            session.finish(await self._exit_reason(session))
        elif isinstance(reply, Ready):
            session.ready = reply
            session.alive = True
        elif isinstance(reply, Failed):
            session.finish(self._start_failure(reply))
        else:
            session.finish(f"the encoder's first line is not READY: {line[:80]!r}")

    def _start_failure(self, reply: Failed) -> str:
        """Why the encoder refused to start, in the user's terms: the worker names its own `--gpu`, which the
        user typed only when `vision.exe` is their own command."""
        if reply.kind == "gpu" and not self.config.exe:
            reason = reply.detail.removesuffix(f"; {GPU_ADVICE}")
            return f"{reason}; set vision.gpu to false (--vision.gpu false) to encode on the CPU"
        return reply.message

    async def _exit_reason(self, session: _Session) -> str:
        """Why a process ended without a word: its stderr's last lines and its exit status."""
        process = session.process
        assert process is not None  # only a session whose process started has output to end
        with trio.move_on_after(1.0):
            await session.stderr_done.wait()
            await process.wait()
        status = process.returncode
        tail = session.stderr_text()
        said = f": {tail}" if tail else ""
        if status is None:
            return f"the encoder closed its output{said}"
        return f"the encoder exited (status {status}){said}"

    async def _route_replies(self, session: _Session, reader: _Reader) -> None:
        """Hand each reply to its job until the encoder's output ends (a crash, or ssh losing its host)."""
        try:
            while (line := await reader.line()) is not None:
                reply = parse_reply(line)  # bounds a RES's byte count (MAX_SVE_BYTES)
                payload = await reader.exactly(reply.n_bytes) if isinstance(reply, Result) else b""
                if payload is None:
                    break
                self._deliver(session, reply, payload)
        except ProtocolError as error:
            session.finish(f"the encoder broke the protocol: {error}")
            return
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass
        session.finish(await self._exit_reason(session))

    def _deliver(self, session: _Session, reply: Any, payload: bytes) -> None:
        job_id = getattr(reply, "job_id", None)
        job = session.jobs.get(job_id) if job_id is not None else None
        if job is None:
            if isinstance(reply, Failed):
                self.last_error = reply.message  # a refused line of ours: a bug worth showing in /v1/status
            return
        if isinstance(reply, Result):
            try:
                header, rows = parse_sve(payload)
            except ProtocolError as error:
                job.refused = f"the encoder sent bad embeddings: {error}"
            else:
                job.embedding = Embedding(rows, header.nx, header.ny, "", reply.ms,
                                          (header.cols, header.rows, header.tile))
        elif isinstance(reply, Failed):
            job.refused = reply.detail if reply.kind == "image" else reply.message
        job.done.set()

    def encode_timeout(self, ready: Ready, rows: int | None = None) -> float:
        """Seconds an encode of a picture of `rows` rows (None: the most, READY's max_tokens) may take before the
        encoder is deemed hung (see the `vision.encode_timeout` key)."""
        rows = ready.capabilities.max_tokens if rows is None else rows
        return self.config.encode_timeout + rows * self.config.encode_timeout_per_row

    async def _run_job(self, session: _Session, data: bytes, digest: str, rows: int | None) -> Embedding:
        job_id = f"j{next(self._ids)}"
        job = _Job()
        session.jobs[job_id] = job
        limit = self.encode_timeout(session.ready_reply(), rows)
        try:
            # Sending is timed too: a stopped encoder stops reading, and a picture is larger than a pipe holds.
            with trio.move_on_after(limit) as timer:
                try:
                    await session.send(encode_request(EncodeBytes(job_id, len(data))) + data)
                    job.running = True
                    await job.done.wait()
                except trio.Cancelled:
                    if not timer.cancel_called:  # the request was cancelled: stop this job only
                        await self._cancel_job(session, job_id, job)
                    raise
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    session.finish(await self._exit_reason(session))
        finally:
            del session.jobs[job_id]
        if timer.cancelled_caught:
            self.timeouts += 1
            reason = f"the encoder did not finish a picture within {limit:g} s; it was stopped and starts again"
            session.finish(reason)
            session.scope.cancel()
            self.last_error = reason
            raise EncodeTimeout(reason)
        if job.embedding is not None:
            n_embd = session.ready_reply().n_embd
            if job.embedding.rows.shape[1] != n_embd:
                raise VisionUnavailable(f"the encoder sent rows {job.embedding.rows.shape[1]} wide, not {n_embd}")
            return dataclasses.replace(job.embedding, digest=digest)
        if job.refused is not None:
            raise PictureRefused(job.refused)
        raise VisionUnavailable(session.error or "the encoder stopped during the encode")

    async def _cancel_job(self, session: _Session, job_id: str, job: _Job) -> None:
        """Stop a job whose request was cancelled: `CANCEL` it and wait (shielded, briefly) until the encoder
        says it stopped, so the encoder is idle when the request's cancellation completes."""
        with trio.CancelScope(shield=True):
            if not job.running:
                # Cancelled mid-send: the pipe is out of step, so this process cannot be trusted any more.
                session.scope.cancel()
                return
            if job.done.is_set() or not session.alive:
                return
            with trio.move_on_after(CANCEL_WAIT) as waited:
                try:
                    await session.send(encode_request(Cancel(job_id)))
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    return
                await job.done.wait()
            if waited.cancelled_caught:
                session.finish(f"the encoder did not stop a cancelled encode within {CANCEL_WAIT:g} s")
                session.scope.cancel()
