"""`strata fleet`: N replicas of `strata serve` and `vllm-router` in front of them on this machine (KV-aware
routing by default), until Ctrl-C stops them all. Flags after `--` go to every replica's `strata serve`:

    strata fleet --replicas 3 -- --model model.gguf --threads 4 --slots 4
"""

from __future__ import annotations

import argparse
import signal
import sys
import tempfile
import time
from pathlib import Path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from strata.fleet import POLICIES, FleetPlan

    plan = FleetPlan()
    parser.add_argument("--replicas", type=int, default=plan.replicas, help="replicas to start (default: 2)")
    parser.add_argument("--policy", choices=POLICIES, default=plan.policy, help="the router's policy (default: "
                        "kv_aware, on the replicas' KV events)")
    parser.add_argument("--host", default=plan.host, help="the address every process listens on (default: "
                        "127.0.0.1)")
    parser.add_argument("--port", type=int, default=plan.port, help="the router's port (default: 8080)")
    parser.add_argument("--first-port", type=int, default=plan.first_port,
                        help="replica i serves on this port + i (default: 8081)")
    parser.add_argument("--events-port", type=int, default=plan.events_port,
                        help="replica i publishes KV events on this port + 2i, replays on the next (default: 5557)")
    parser.add_argument("--router-metrics-port", type=int, default=plan.router_metrics_port,
                        help="the router's Prometheus port (default: 29000)")
    parser.add_argument("--block-size", type=int, default=plan.block_size, help="tokens per KV event block "
                        "(default: 16)")
    parser.add_argument("--router", metavar="PATH", help="the vllm-router executable (default: the one on PATH)")
    parser.add_argument("--router-arg", action="append", default=[], metavar="ARG",
                        help="one more argument for vllm-router (repeatable)")
    parser.add_argument("--log-dir", metavar="DIR", help="where each process's output goes (default: a new "
                        "temporary directory)")
    parser.add_argument("serve_args", nargs=argparse.REMAINDER, help="-- then flags for every strata serve")


def run(args: argparse.Namespace) -> int:
    from strata.fleet import Fleet, FleetError, FleetPlan

    serve_args = args.serve_args[1:] if args.serve_args[:1] == ["--"] else args.serve_args
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="strata-fleet-"))
    try:
        plan = FleetPlan(replicas=args.replicas, policy=args.policy, host=args.host, port=args.port,
                         first_port=args.first_port, events_port=args.events_port,
                         router_metrics_port=args.router_metrics_port, block_size=args.block_size,
                         serve_args=tuple(serve_args), router=args.router, router_args=tuple(args.router_arg))
    except FleetError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    # Both end the wait below, and the `finally` stops the fleet (SIGINT's handler is set again: a shell starting
    # this in the background has it ignored).
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    fleet = Fleet(plan, log_dir)
    try:
        print(f"starting {plan.replicas} replicas and vllm-router ({plan.policy}); logs in {log_dir}", flush=True)
        fleet.start()
        for i in range(plan.replicas):
            print(f"replica {i}: {plan.replica_url(i)}, KV events on {plan.events_endpoint(i)}")
        print(f"serving on http://{plan.host}:{plan.port} (Ctrl-C stops every process)", flush=True)
        while True:
            time.sleep(3600)
    except FleetError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C does not cut the stopping short
        fleet.stop()
        print("stopped", flush=True)
