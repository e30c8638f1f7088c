"""`strata-vision`: the image encoder process.

    strata-vision --mmproj F.gguf [--gpu [--device cuda|host]] [--threads N] [--max-tokens N]
        Load the encoder, print READY, then serve the line protocol (strata.vision.protocol) on stdin/stdout.
        --gpu runs it on the CUDA device (device_encoder.py); --device host runs that code on the host device, the
        test device, and says it holds the device as the CUDA one does.
    strata-vision encode IMAGE --mmproj F.gguf --out X.sve [--threads N] [--max-tokens N]
        Encode one picture to an SVE1 file and print a JSON summary (with the encoder's fingerprint).

The main thread reads requests while one encode thread works through the FIFO of jobs, so a CANCEL is read and
acted on while an encode runs. stdout carries protocol messages only; diagnostics go to stderr.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import os
import sys
import threading
import time
import traceback
from collections.abc import Callable
from typing import BinaryIO

import numpy as np

from strata.engine_cffi.device import Device, DeviceError
from strata.vision.device_encoder import DeviceEncoder, part_tokens
from strata.vision.encoder import EncodeCancelled, Encoder
from strata.vision.load import open_encoder
from strata.vision.mmproj import MmprojError
from strata.vision.preprocess import (
    DEFAULT_MAX_PIXELS,
    ImageError,
    Picture,
    load_image,
    most_rows,
    preprocess,
    sizing,
    token_budget,
)
from strata.vision.protocol import (
    GPU_ADVICE,
    MAX_IMAGE_BYTES,
    MAX_LINE_BYTES,
    Cancel,
    Cancelled,
    Capabilities,
    EncodeBytes,
    Encoded,
    EncodePath,
    Failed,
    ProtocolError,
    Quit,
    Ready,
    Reply,
    Result,
    encode_reply,
    encode_sve,
    job_bytes_to_skip,
    parse_request,
)

AnyEncoder = Encoder | DeviceEncoder


@dataclasses.dataclass(eq=False)
class _Job:
    request: EncodePath | EncodeBytes
    image: bytes | None  # in-band jobs: the picture's bytes
    cancel: threading.Event = dataclasses.field(default_factory=threading.Event)

    @property
    def job_id(self) -> str | None:
        return self.request.job_id if isinstance(self.request, EncodeBytes) else None


class Server:
    """Serves the protocol on two binary streams until QUIT or the end of input.

    Invariant: every job gets exactly one final reply (OK/RES, ERR or CANCELLED), except after the end of input,
    when nobody is left to read it.
    """

    def __init__(self, encoder: AnyEncoder, max_tokens: int, stdin: BinaryIO, stdout: BinaryIO,
                 max_image_bytes: int = MAX_IMAGE_BYTES, max_pixels: int = DEFAULT_MAX_PIXELS, min_tokens: int = 1):
        self.encoder = encoder
        self.max_tokens = max_tokens
        self.min_tokens = min_tokens
        self.max_image_bytes = max_image_bytes
        self.max_pixels = max_pixels
        self._stdin = stdin
        self._stdout = stdout
        self._out_lock = threading.Lock()
        self._output_closed = False
        self._cond = threading.Condition()  # guards the three fields below
        self._queue: collections.deque[_Job] = collections.deque()
        self._running: _Job | None = None
        self._closing = False

    def ready(self) -> Ready:
        rule = sizing(self.encoder.hp, self.max_tokens, self.min_tokens)
        on_device = isinstance(self.encoder, DeviceEncoder)
        caps = Capabilities(
            cuda=on_device,  # the device's context: an encode competes with the engine for the card
            threads=self.encoder.threads,
            max_tokens=most_rows(rule),  # a picture split into tiles takes more than the budget of its thumbnail
            fingerprint=self.encoder.mmproj.fingerprint,
            projector=self.encoder.hp.projector,
            max_image_bytes=self.max_image_bytes,
            sizing=rule,
            device_bytes=self.encoder.device_bytes if isinstance(self.encoder, DeviceEncoder) else None,
        )
        return Ready(self.encoder.n_embd, caps)

    def serve(self) -> None:
        """Print READY, serve until QUIT (answer the jobs received, then return) or end of input (drop them)."""
        self._send(self.ready())
        worker = threading.Thread(target=self._encode_loop, name="encode")
        worker.start()
        graceful = False
        try:
            graceful = self._read_loop()
        finally:  # also on an interrupt: stop the encode thread, or the process would never exit
            self._close(graceful)
            worker.join()

    def _close(self, graceful: bool) -> None:
        with self._cond:
            self._closing = True
            if not graceful:
                self._queue.clear()
                if self._running is not None:
                    self._running.cancel.set()
            self._cond.notify()

    # --- input

    def _read_loop(self) -> bool:
        """Read and dispatch requests; True after QUIT, False at the end of input."""
        while True:
            line = self._stdin.readline(MAX_LINE_BYTES)
            if not line:
                return False
            if len(line) == MAX_LINE_BYTES and not line.endswith(b"\n"):
                self._send(Failed("protocol", f"line longer than {MAX_LINE_BYTES} bytes"))
                if not self._discard_line():
                    return False
                continue
            try:
                request = parse_request(line, self.max_image_bytes)
            except ProtocolError as exc:
                self._send(Failed("protocol", str(exc), exc.job_id))
                if not self._discard(job_bytes_to_skip(line)):
                    return False
                continue
            match request:
                case Quit():
                    return True
                case Cancel(job_id):
                    self._cancel(job_id)
                case EncodePath():
                    self._submit(_Job(request, None))
                case EncodeBytes(_, n_bytes):
                    image = self._stdin.read(n_bytes)
                    if len(image) < n_bytes:
                        return False
                    self._submit(_Job(request, image))

    def _discard_line(self) -> bool:
        """Skip the rest of an over-long line; False at the end of input."""
        while True:
            chunk = self._stdin.readline(1 << 16)
            if not chunk:
                return False
            if chunk.endswith(b"\n"):
                return True

    def _discard(self, n_bytes: int) -> bool:
        """Skip the payload of a refused JOB, so the next line is read in step; False at the end of input."""
        while n_bytes > 0:
            chunk = self._stdin.read(min(n_bytes, 1 << 20))
            if not chunk:
                return False
            n_bytes -= len(chunk)
        return True

    def _submit(self, job: _Job) -> None:
        with self._cond:
            if job.job_id is not None and self._find(job.job_id) is not None:
                # Untagged, so the job that holds this id still gets its own single reply.
                self._send(Failed("protocol", f"job id {job.job_id} is already queued or running"))
                return
            self._queue.append(job)
            self._cond.notify()

    def _find(self, job_id: str) -> _Job | None:
        if self._running is not None and self._running.job_id == job_id:
            return self._running
        return next((job for job in self._queue if job.job_id == job_id), None)

    def _cancel(self, job_id: str) -> None:
        """Drop a queued job (answered here) or flag the running one (answered when it stops); ignore others."""
        with self._cond:
            job = self._find(job_id)
            if job is None:
                return
            if job is self._running:
                job.cancel.set()
                return
            self._queue.remove(job)
            self._send(Cancelled(job_id))

    # --- encoding

    def _encode_loop(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._closing:
                    self._cond.wait()
                if not self._queue:
                    return
                job = self._running = self._queue.popleft()
            reply, payload = self._run(job)
            with self._cond:
                self._running = None
            self._send(reply, payload)

    def _run(self, job: _Job) -> tuple[Reply, bytes]:
        start = time.perf_counter()
        request = job.request
        source = request.image if isinstance(request, EncodePath) else job.image
        assert source is not None  # an in-band job carries its bytes
        try:
            picture = preprocess(load_image(source, self.max_pixels), self.encoder.hp, self.max_tokens,
                                 self.min_tokens)
            data = encode_picture(self.encoder, picture, job.cancel.is_set)
            ms = (time.perf_counter() - start) * 1000
            if isinstance(request, EncodeBytes):
                return Result(request.job_id, picture.n_tokens, picture.nx, picture.ny, ms, len(data)), data
            write_file(request.out, data)
            return Encoded(picture.n_tokens, picture.nx, picture.ny, ms), b""
        except ImageError as exc:
            return Failed("image", str(exc), job.job_id), b""
        except EncodeCancelled:
            if job.job_id is None:  # a path-form job is only stopped at the end of input
                return Failed("cancelled", "the encoder is shutting down"), b""
            return Cancelled(job.job_id), b""
        except OSError as exc:
            out = request.out if isinstance(request, EncodePath) else "the reply"
            return Failed("output", f"cannot write '{out}': {exc}"), b""
        except Exception as exc:  # noqa: BLE001 - a bug: report it on this job and keep serving the others
            traceback.print_exc(file=sys.stderr)
            return Failed("internal", f"{type(exc).__name__}: {exc}", job.job_id), b""

    # --- output

    def _send(self, reply: Reply, payload: bytes = b"") -> None:
        with self._out_lock:
            if self._output_closed:
                return
            try:
                self._stdout.write(encode_reply(reply))
                self._stdout.write(payload)
                self._stdout.flush()
            except (BrokenPipeError, ValueError):  # the reader is gone (ValueError: stream closed)
                self._output_closed = True


def encode_picture(encoder: AnyEncoder, picture: Picture, cancelled: Callable[[], bool] = lambda: False) -> bytes:
    """SVE bytes of a picture: each part (tile or whole) is encoded on its own, as the checkpoint sees them, and
    their rows follow one another."""
    rows = np.concatenate([encoder.encode(part, cancelled) for part in picture.parts])
    grid = picture.grid
    return encode_sve(rows, grid.nx, grid.ny, (grid.cols, grid.rows, grid.tile))


def write_file(path: str, data: bytes) -> None:
    """Write `data` to `path` whole or not at all: a reader never sees a partial file."""
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except OSError:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


# --- command line


def _common_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--mmproj", required=True, help="the encoder's mmproj GGUF file")
    parser.add_argument("--threads", type=_positive, default=len(os.sched_getaffinity(0)),
                        help="threads for the encode (default: every core this process may use)")
    parser.add_argument("--max-tokens", type=_positive, default=None,
                        help="most embedding rows per picture; larger pictures are scaled down (default: the "
                             "mmproj file's budget, else 1024)")
    parser.add_argument("--min-tokens", type=_positive, default=None,
                        help="smaller pictures are scaled up to about this many rows (default: the mmproj file's "
                             "budget, else 1)")


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError("must be at least 1")
    return value


def _load(args: argparse.Namespace) -> Encoder:
    return open_encoder(args.mmproj, args.threads)


def _load_on_device(args: argparse.Namespace) -> DeviceEncoder:
    """The encoder on `args.device`, its workspace sized for the largest part of a picture under its budget.

    Raises:
        DeviceError: the device cannot be opened here (DeviceUnavailable) or cannot run this file.
        MmprojError: the file cannot be loaded.
    """
    device = Device(args.device)  # first: a machine without the device says so without loading the file
    try:
        encoder = _load(args)
    except BaseException:
        device.close()
        raise
    return DeviceEncoder(encoder, device, part_tokens(encoder.hp, args.min_tokens, args.max_tokens))


def serve_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="strata-vision", description="The image encoder process.",
                                     epilog="Also: strata-vision encode IMAGE --mmproj F --out X.sve")
    _common_arguments(parser)
    parser.add_argument("--gpu", action="store_true", help="encode on the GPU (needs the CUDA backend)")
    parser.add_argument("--device", choices=("cuda", "host"), default=None,
                        help="with --gpu: the device (default cuda; host: the test device, the same code on the CPU)")
    parser.add_argument("--max-image-bytes", type=_positive, default=MAX_IMAGE_BYTES,
                        help=f"largest picture an in-band job may carry (default {MAX_IMAGE_BYTES})")
    args = parser.parse_args(argv)
    if args.device is not None and not args.gpu:
        parser.error("--device needs --gpu")
    args.device = args.device or "cuda"
    encoder: AnyEncoder
    try:
        try:
            encoder = _load_on_device(args) if args.gpu else _load(args)
        except MmprojError as exc:
            raise _StartupError("mmproj", str(exc)) from None
        except DeviceError as exc:
            raise _StartupError("gpu", f"{exc}; {GPU_ADVICE}") from None
    except _StartupError as exc:
        # The ERR line stands where READY would, so a client sees why; stderr gets the same for a person.
        sys.stdout.buffer.write(encode_reply(Failed(exc.kind, exc.detail)))
        sys.stdout.buffer.flush()
        print(f"strata-vision: {exc.detail}", file=sys.stderr)
        return 1
    min_tokens, max_tokens = token_budget(encoder.hp, args.min_tokens, args.max_tokens)
    Server(encoder, max_tokens, sys.stdin.buffer, sys.stdout.buffer, args.max_image_bytes,
           min_tokens=min_tokens).serve()
    return 0


class _StartupError(Exception):
    def __init__(self, kind: str, detail: str):
        super().__init__(detail)
        self.kind = kind
        self.detail = detail


def encode_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="strata-vision encode",
                                     description="Encode one picture to an SVE1 file (pre-computed embeddings).")
    parser.add_argument("image", help="the picture (any format Pillow reads)")
    parser.add_argument("--out", required=True, help="the SVE1 file to write")
    _common_arguments(parser)
    args = parser.parse_args(argv)
    start = time.perf_counter()
    try:
        encoder = _load(args)
        min_tokens, max_tokens = token_budget(encoder.hp, args.min_tokens, args.max_tokens)
        picture = preprocess(load_image(args.image), encoder.hp, max_tokens, min_tokens)
        data = encode_picture(encoder, picture)
        write_file(args.out, data)
    except (MmprojError, ImageError, OSError) as exc:
        print(f"strata-vision encode: {exc}", file=sys.stderr)
        return 1
    summary = {
        "out": args.out,
        "n_tokens": picture.n_tokens,
        "nx": picture.nx,
        "ny": picture.ny,
        "tiles": [picture.grid.cols, picture.grid.rows, picture.grid.tile],  # [0, 0, 0]: not split
        "n_embd": encoder.n_embd,
        "fingerprint": encoder.mmproj.fingerprint,
        "ms": round((time.perf_counter() - start) * 1000, 1),
    }
    print(json.dumps(summary))
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "encode":
        return encode_main(argv[1:])
    return serve_main(argv)


if __name__ == "__main__":
    sys.exit(main())
