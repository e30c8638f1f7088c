"""A fleet on one machine: N `strata serve` replicas, each publishing its KV events, and `vllm-router` in front of
them, as processes (`strata fleet`, bench/fleet.py, the fleet test). What production runs across machines is the
same processes with other addresses (docs/SCALE_OUT.md).

Replica i (from 0) serves on `first_port + i`, publishes its KV events on `events_port + 2i` and answers replays
on `events_port + 2i + 1`; the router listens on `port` and subscribes to every replica's events.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

import httpx

POLICIES = ("kv_aware", "cache_aware", "round_robin", "random", "power_of_two", "consistent_hash")
STOP_SECONDS = 5.0  # a process gets this long to end after SIGTERM, then it is killed


class FleetError(RuntimeError):
    pass


@dataclass(frozen=True)
class FleetPlan:
    """Where each process of the fleet listens and how it is started.

    Args:
        serve_args: flags for every `strata serve` (the model, threads, slots, ...).
        router: the `vllm-router` executable (default: the one on PATH).
        router_args: more flags for the router (health checks, retries).
    """

    replicas: int = 2
    policy: str = "kv_aware"
    host: str = "127.0.0.1"
    port: int = 8080
    first_port: int = 8081
    events_port: int = 5557
    router_metrics_port: int = 29000  # the router's own Prometheus metrics
    block_size: int = 16
    serve_args: tuple[str, ...] = ()
    router: str | None = None
    router_args: tuple[str, ...] = field(default=())

    def __post_init__(self) -> None:
        if self.replicas < 1:
            raise FleetError(f"replicas must be at least 1, got {self.replicas}")
        if self.policy not in POLICIES:
            raise FleetError(f"policy must be one of {', '.join(POLICIES)}, got {self.policy!r}")

    def replica_url(self, i: int) -> str:
        return f"http://{self.host}:{self.first_port + i}"

    def events_endpoint(self, i: int) -> str:
        return f"tcp://{self.host}:{self.events_port + 2 * i}"

    def replay_endpoint(self, i: int) -> str:
        return f"tcp://{self.host}:{self.events_port + 2 * i + 1}"

    def ports(self) -> list[int]:
        """Every port the fleet listens on."""
        return [self.port, self.router_metrics_port, *(self.first_port + i for i in range(self.replicas)),
                *(self.events_port + j for j in range(2 * self.replicas))]

    def serve_command(self, i: int) -> list[str]:
        return [sys.executable, "-m", "strata.cli", "serve", "--host", self.host, "--port", str(self.first_port + i),
                "--kv-events.endpoint", self.events_endpoint(i), "--kv-events.replay-endpoint",
                self.replay_endpoint(i), "--kv-events.block-size", str(self.block_size), *self.serve_args]

    def router_command(self, model: str) -> list[str]:
        router = self.router or shutil.which("vllm-router")
        if router is None:
            raise FleetError("vllm-router is not installed (pip install vllm-router)")
        workers = [self.replica_url(i) for i in range(self.replicas)]
        command = [router, "--host", self.host, "--port", str(self.port), "--policy", self.policy,
                   "--prometheus-host", self.host, "--prometheus-port", str(self.router_metrics_port),
                   "--worker-urls", *workers]
        if self.policy == "kv_aware":
            command += ["--kv-event-model", model, "--kv-event-block-size", str(self.block_size)]
            for i, worker in enumerate(workers):
                command += ["--kv-event-source", f"{worker}={self.events_endpoint(i)}",
                            "--kv-event-replay-source", f"{worker}={self.replay_endpoint(i)}"]
        return [*command, *self.router_args]


class Fleet:
    """The processes of a `FleetPlan`, started by `start` (or `with`), each one's output in `log_dir`, stopped
    all together by `stop`.

    Raises (start):
        FleetError: a process that ended or did not become healthy within `timeout` seconds (its log named).
    """

    def __init__(self, plan: FleetPlan, log_dir: Path, timeout: float = 120.0):
        self.plan, self.log_dir, self.timeout = plan, log_dir, timeout
        self.replicas: list[subprocess.Popen[bytes] | None] = [None] * plan.replicas
        self.router: subprocess.Popen[bytes] | None = None
        self._logs: list[IO[bytes]] = []

    def __enter__(self) -> Fleet:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> None:
        taken = [port for port in self.plan.ports() if not _free(self.plan.host, port)]
        if taken:  # another server there would answer the health checks in our replicas' place
            raise FleetError(f"port {taken[0]} on {self.plan.host} is in use")
        self.log_dir.mkdir(parents=True, exist_ok=True)
        for i in range(self.plan.replicas):
            self.start_replica(i, wait=False)
        for i in range(self.plan.replicas):
            self.wait_replica(i)
        with httpx.Client(timeout=10) as client:
            model = client.get(f"{self.plan.replica_url(0)}/v1/models").json()["data"][0]["id"]
        self.router = self._spawn(self.plan.router_command(model), "router")
        self._wait_healthy(self.router, f"http://{self.plan.host}:{self.plan.port}/health", "router")

    def start_replica(self, i: int, wait: bool = True) -> None:
        """Start replica `i` (again, after `kill_replica`)."""
        port = self.plan.first_port + i
        if wait and not _free(self.plan.host, port):
            raise FleetError(f"port {port} on {self.plan.host} is in use")
        self.replicas[i] = self._spawn(self.plan.serve_command(i), f"replica{i}")
        if wait:
            self.wait_replica(i)

    def wait_replica(self, i: int) -> None:
        process = self.replicas[i]
        assert process is not None
        self._wait_healthy(process, f"{self.plan.replica_url(i)}/health", f"replica{i}")

    def kill_replica(self, i: int) -> None:
        """Kill replica `i` at once (SIGKILL: what a crash looks like to the router)."""
        process = self.replicas[i]
        if process is not None:
            process.kill()
            process.wait()
            self.replicas[i] = None

    def stop(self) -> None:
        """Stop the router, then the replicas: SIGTERM, then SIGKILL after `STOP_SECONDS`."""
        processes = [p for p in [self.router, *self.replicas] if p is not None]
        for process in processes:
            if process.poll() is None:
                process.terminate()
        deadline = time.monotonic() + STOP_SECONDS
        for process in processes:
            try:
                process.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        self.router = None
        self.replicas = [None] * self.plan.replicas
        for log in self._logs:
            log.close()
        self._logs = []

    def _spawn(self, command: list[str], name: str) -> subprocess.Popen[bytes]:
        log = open(self.log_dir / f"{name}.log", "ab")  # noqa: SIM115 - closed by stop()
        self._logs.append(log)
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        return subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env)

    def _wait_healthy(self, process: subprocess.Popen[bytes], url: str, name: str) -> None:
        deadline = time.monotonic() + self.timeout
        with httpx.Client(timeout=2) as client:
            while time.monotonic() < deadline:
                if process.poll() is not None:
                    raise FleetError(f"{name} ended with status {process.returncode}: see "
                                     f"{self.log_dir / (name + '.log')}")
                try:
                    if client.get(url).status_code == 200:
                        return
                except httpx.TransportError:
                    pass
                time.sleep(0.1)
        raise FleetError(f"{name} was not healthy after {self.timeout:g} s: see {self.log_dir / (name + '.log')}")


def _free(host: str, port: int) -> bool:
    """Whether nothing listens on (host, port) now."""
    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError:
            return False
    return True
