"""The encoder on "another machine" through a real `sshd` on 127.0.0.1 (generated host and user keys, a working
directory that shares nothing with the server): pictures travel in-band; killing sshd mid-encode or while idle
makes pictures fail with the encoder-unavailable error while text goes on; once sshd is back the next picture
works without a restart; a server started while the host is down starts."""

from __future__ import annotations

import contextlib
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from contextlib import aclosing
from pathlib import Path

import numpy as np
import pytest
import trio
from conftest import server_config

import strata
from strata.config import VisionConfig
from strata.events import ChatRequest, TextDelta
from strata.pictures.sources import ImageSource
from strata.request_errors import ServiceUnavailable
from strata.service import open_service
from strata.text.sampling import SamplingParams
from strata.vision.client import VisionClient, VisionUnavailable

from .conftest import noise_png

pytestmark = pytest.mark.timeout(120)

SSHD = "/usr/sbin/sshd"


def ensure_openssh_server() -> str | None:
    """Install openssh-server when missing; the reason it could not be, or None."""
    if Path(SSHD).exists() and shutil.which("ssh") and shutil.which("ssh-keygen"):
        return None
    install = ["apt-get", "install", "-y", "openssh-server", "openssh-client"]
    done = subprocess.run(install, capture_output=True, text=True, check=False)
    if done.returncode != 0:  # perhaps stale package lists: refresh them once
        subprocess.run(["apt-get", "update"], capture_output=True, check=False)
        done = subprocess.run(install, capture_output=True, text=True, check=False)
    if done.returncode != 0 or not Path(SSHD).exists():
        return f"apt-get install openssh-server failed: {done.stderr.strip()[-300:]}"
    return None


def descendants(root: int) -> list[int]:
    """Every process below `root`, from /proc."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], [root]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class SshHost:
    """sshd in `root` (keys, config, log); `command(remote_argv)` is the ssh argument list that runs it there."""

    def __init__(self, root: Path):
        self.root = root
        self.port = free_port()
        self.process: subprocess.Popen[bytes] | None = None
        root.mkdir(parents=True, exist_ok=True)
        for name in ("host_key", "user_key"):
            subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(root / name)], check=True)
        (root / "authorized_keys").write_bytes((root / "user_key.pub").read_bytes())
        (root / "sshd_config").write_text("\n".join([
            f"Port {self.port}",
            "ListenAddress 127.0.0.1",
            f"HostKey {root / 'host_key'}",
            f"AuthorizedKeysFile {root / 'authorized_keys'}",
            f"PidFile {root / 'sshd.pid'}",
            "PermitRootLogin yes",
            "PasswordAuthentication no",
            "KbdInteractiveAuthentication no",
            "UsePAM no",
            "StrictModes no",
            "",
        ]))
        Path("/run/sshd").mkdir(parents=True, exist_ok=True)  # sshd's privilege-separation directory

    def start(self) -> None:
        with open(self.root / "sshd.log", "ab") as log:
            self.process = subprocess.Popen([SSHD, "-D", "-e", "-f", str(self.root / "sshd_config")], stdout=log,
                                            stderr=log, start_new_session=True)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            with socket.socket() as sock:
                if sock.connect_ex(("127.0.0.1", self.port)) == 0:
                    return
            if self.process.poll() is not None:
                break
            time.sleep(0.02)
        raise RuntimeError(f"sshd did not start: {(self.root / 'sshd.log').read_text()[-500:]}")

    def kill(self) -> None:
        """Kill sshd and every connection it serves (its whole process group)."""
        if self.process is None:
            return
        # Each connection's sshd starts a session of its own, so the process group alone would miss them.
        for pid in [self.process.pid, *descendants(self.process.pid)]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        self.process.wait()
        self.process = None

    def command(self, remote_command: str) -> list[str]:
        return ["ssh", "-i", str(self.root / "user_key"), "-p", str(self.port), "-o", "BatchMode=yes",
                "-o", "StrictHostKeyChecking=no", "-o", f"UserKnownHostsFile={os.devnull}", "-o", "LogLevel=ERROR",
                "-o", "ConnectTimeout=5", "-o", "ServerAliveInterval=2", "-o", "ServerAliveCountMax=2",
                "root@127.0.0.1", remote_command]


@pytest.fixture(scope="module")
def ssh_host(tmp_path_factory):
    reason = ensure_openssh_server()
    if reason is not None:
        pytest.skip(reason)
    host = SshHost(tmp_path_factory.mktemp("sshd"))
    host.start()
    yield host
    host.kill()


@pytest.fixture
def host(ssh_host):
    """The module's sshd, running at the start of each test (a test may kill it)."""
    if ssh_host.process is None:
        ssh_host.start()
    return ssh_host


@pytest.fixture(scope="module")
def remote_exe(ssh_host, tmp_path_factory, slow_mmproj) -> list[str]:
    """The encoder command through ssh, run in its own directory with its own copy of the mmproj file."""
    remote_dir = tmp_path_factory.mktemp("encoder-host")
    shutil.copy(slow_mmproj, remote_dir / "encoder.gguf")
    src = Path(strata.__file__).resolve().parents[1]
    command = (f"cd {shlex.quote(str(remote_dir))} && PYTHONPATH={shlex.quote(str(src))} "
               f"exec {shlex.quote(sys.executable)} -m strata.vision.worker --mmproj encoder.gguf --threads 1 "
               f"--max-tokens 1024")
    return ssh_host.command(command)


async def start_client(nursery, exe) -> VisionClient:
    client = VisionClient(VisionConfig(exe=exe, remote=True), log=lambda line: None, start_timeout=10)
    await nursery.start(client.run)
    return client


async def test_encode_over_ssh_equals_a_local_encode(nursery, host, remote_exe, slow_mmproj):
    remote = await start_client(nursery, remote_exe)
    assert remote.available
    local = VisionClient(VisionConfig(mmproj=str(slow_mmproj), threads=1, max_tokens=1024), log=lambda line: None)
    await nursery.start(local.run)
    picture = noise_png(64, 48, seed=20)
    a, b = await remote.encode(picture), await local.encode(picture)
    np.testing.assert_allclose(a.rows, b.rows, rtol=1e-4, atol=1e-6)  # same encoder, another BLAS setup
    assert remote.status()["fingerprint"] == local.status()["fingerprint"]


async def test_host_killed_mid_encode_and_while_idle_then_back(nursery, host, remote_exe):
    client = await start_client(nursery, remote_exe)

    async def kill_soon():
        await trio.sleep(0.3)
        host.kill()

    nursery.start_soon(kill_soon)
    started = time.perf_counter()
    with pytest.raises(VisionUnavailable):
        await client.encode(noise_png(640, 480, seed=21))
    assert time.perf_counter() - started < 5
    # Down and idle: each picture asks again, and is told why.
    with pytest.raises(VisionUnavailable, match="refused|exited"):
        await client.encode(noise_png(32, 32, seed=22))
    host.start()
    embedding = await client.encode(noise_png(32, 32, seed=22))
    assert embedding.n_tokens > 0 and client.available


async def test_client_started_while_the_host_is_down(nursery, host, remote_exe):
    host.kill()
    client = await start_client(nursery, remote_exe)
    assert not client.available and client.status()["last_error"]
    host.start()
    assert (await client.encode(noise_png(32, 32, seed=23))).n_tokens > 0


# --- the whole service: text is served whatever the encoder's host does


async def answer(svc, content) -> str:
    request = ChatRequest(messages=[{"role": "user", "content": content}], sampling=SamplingParams(temperature=0))
    async with aclosing(svc.chat(request)) as events:
        return "".join([e.text async for e in events if isinstance(e, TextDelta)])


def picture_part(seed: int, width: int = 32, height: int = 32) -> list[dict]:
    return [{"type": "image", "image": ImageSource("messages[0].content[0]", data=noise_png(width, height, seed))}]


async def test_service_serves_text_while_the_host_is_down_and_recovers(nursery, host, remote_exe, scripted, tokenizer):
    host.kill()
    config = server_config(vision={"exe": remote_exe, "remote": True})
    async with open_service(config, engine=scripted("ok"), tokenizer=tokenizer, log=lambda line: None) as svc:
        assert await answer(svc, "hi") == "ok"  # started while the host was down
        with pytest.raises(ServiceUnavailable, match="^the image encoder is not available: "):
            await answer(svc, picture_part(24))
        host.start()
        assert await answer(svc, picture_part(25)) == "ok"  # back, without a restart

        failed = []

        async def big_picture():
            try:
                await answer(svc, picture_part(26, 640, 480))
            except ServiceUnavailable as error:
                failed.append(str(error))

        nursery.start_soon(big_picture)
        await trio.sleep(0.3)
        host.kill()  # mid-encode
        assert await answer(svc, "still there?") == "ok"
        with trio.fail_after(10):
            while not failed:
                await trio.sleep(0.01)
        assert failed[0].startswith("the image encoder is not available: ")
        assert await answer(svc, "hi") == "ok" and not svc.turn.busy
