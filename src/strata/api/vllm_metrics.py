"""The Prometheus metrics the routers and endpoint pickers read, under vLLM's names, beside Strata's own.

What reads them: llm-d's endpoint picker and the Gateway API Inference Extension's model-server protocol
(`vllm:num_requests_waiting` for the queue, `vllm:kv_cache_usage_perc` for the KV cache; older pickers read
`vllm:gpu_cache_usage_perc`), `vllm-router`'s load signals (`vllm:num_requests_running`, `..._waiting`), and
`vllm:cache_config_info` for the block size and block count. Every series has vLLM's `model_name` label. Computed
from the service at scrape time, like the rest of `/metrics`.

What they mean here: a request is running while it holds a slot, waiting while it queues for one; the KV cache is
the slots' positions (`slots` x `context`), cut into blocks of `kv_events.block_size` positions, and its usage is
the positions the running requests hold (an idle slot's cached prefix can be overwritten at once, like vLLM's
cached free blocks); the prefix cache's queries and hits are the prompt tokens of finished requests and those of
them found in the cache.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric


class VllmMetrics:
    """A collector over one `strata.service.Service`."""

    def __init__(self, service: Any):
        self._service = service

    def collect(self) -> Iterator[Metric]:
        service = self._service
        label = [service.model_name]

        def gauge(name: str, text: str, value: float) -> GaugeMetricFamily:
            family = GaugeMetricFamily(name, text, labels=["model_name"])
            family.add_metric(label, value)
            return family

        def counter(name: str, text: str, value: float) -> CounterMetricFamily:
            family = CounterMetricFamily(name, text, labels=["model_name"])
            family.add_metric(label, value)
            return family

        batcher = service.loop.batcher if service.loop is not None else None
        running = [slot for slot in batcher.slots if slot.job is not None] if batcher is not None else []
        positions = batcher.engine.n_seq * batcher.engine.n_ctx if batcher is not None else 0
        usage = sum(len(slot.keys) for slot in running) / positions if positions else 0.0
        yield gauge("vllm:num_requests_running", "Requests holding a slot.", len(running))
        yield gauge("vllm:num_requests_waiting", "Requests waiting for a slot.", service.turn.queued)
        yield gauge("vllm:kv_cache_usage_perc", "Fraction of the KV cache the running requests hold (0 to 1).", usage)
        yield gauge("vllm:gpu_cache_usage_perc", "The same as vllm:kv_cache_usage_perc (its older name).", usage)
        block_size = service.config.kv_events.block_size
        info = GaugeMetricFamily("vllm:cache_config_info", "The KV cache's configuration.",
                                 labels=["model_name", "block_size", "num_gpu_blocks"])
        info.add_metric([*label, str(block_size), str(positions // block_size)], 1)
        yield info
        totals = service.history.totals
        yield counter("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", totals.prompt_tokens)
        yield counter("vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache.", totals.reused_tokens)
