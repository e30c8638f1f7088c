"""`strata.fleet`'s plan of a fleet: the commands it starts, and the refusals before it starts anything."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from strata.fleet import Fleet, FleetError, FleetPlan


def test_the_router_subscribes_to_each_replicas_events_and_replays() -> None:
    plan = FleetPlan(replicas=2, port=9000, first_port=9001, events_port=9100, router="/bin/router",
                     serve_args=("--threads", "1"))
    assert plan.serve_command(1)[-8:] == ["--kv-events.endpoint", "tcp://127.0.0.1:9102",
                                          "--kv-events.replay-endpoint", "tcp://127.0.0.1:9103",
                                          "--kv-events.block-size", "16", "--threads", "1"]
    command = plan.router_command("demo")
    assert command[:5] == ["/bin/router", "--host", "127.0.0.1", "--port", "9000"]
    joined = " ".join(command)
    assert "--worker-urls http://127.0.0.1:9001 http://127.0.0.1:9002" in joined
    assert "--kv-event-model demo --kv-event-block-size 16" in joined
    assert "--kv-event-source http://127.0.0.1:9002=tcp://127.0.0.1:9102" in joined
    assert "--kv-event-replay-source http://127.0.0.1:9002=tcp://127.0.0.1:9103" in joined
    assert "--kv-event" not in " ".join(FleetPlan(policy="round_robin", router="r").router_command("demo"))


def test_a_bad_plan_and_a_port_in_use_are_refused_before_anything_starts(tmp_path: Path) -> None:
    with pytest.raises(FleetError, match="policy must be one of"):
        FleetPlan(policy="fastest")
    with pytest.raises(FleetError, match="replicas must be at least 1"):
        FleetPlan(replicas=0)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        fleet = Fleet(FleetPlan(first_port=port, port=port + 100, events_port=port + 200,
                                router_metrics_port=port + 300), tmp_path)
        with pytest.raises(FleetError, match=f"port {port} on 127.0.0.1 is in use"):
            fleet.start()
    assert fleet.replicas == [None, None] and not list(tmp_path.iterdir())
