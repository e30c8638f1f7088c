"""What a router or a Kubernetes probe sees of a replica that is still loading its model: alive, not ready, no
prompts rendered, and vLLM's metrics already there (zeros)."""

from __future__ import annotations

from conftest import server_config
from prometheus_client.parser import text_string_to_metric_families

from strata.api import create_app
from strata.service import Service


async def test_a_loading_replica_is_alive_but_not_ready_and_renders_nothing():
    service = Service(server_config())  # never loaded: as during a slow startup
    client = create_app(service=service).test_client()
    live, ready = await client.get("/health/live"), await client.get("/health")
    assert (live.status_code, await live.get_json()) == (200, {"status": "alive"})
    assert ready.status_code == 503
    render = await client.post("/v1/chat/completions/render", json={"messages": [{"role": "user", "content": "hi"}]})
    assert render.status_code == 503
    text = await (await client.get("/metrics")).get_data(as_text=True)
    samples = {(sample.name, tuple(sorted(sample.labels.items()))): sample.value
               for family in text_string_to_metric_families(text) for sample in family.samples}
    model = (("model_name", service.model_name),)
    assert samples[("vllm:num_requests_waiting", model)] == 0
    assert samples[("vllm:kv_cache_usage_perc", model)] == 0
    assert samples[("vllm:prefix_cache_hits_total", model)] == 0
