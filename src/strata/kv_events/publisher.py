"""The thread that sends a replica's KV events: a ZMQ PUB socket for the stream, a ROUTER socket for replays.

The engine thread never waits for it: `publish` puts one step's events on a bounded queue without blocking, and
this thread encodes them, sends each batch (PUB drops messages to a subscriber past its high-water mark rather
than block) and keeps the last `buffer_batches` for replay. Sending from the engine thread itself was the other
way (zmq's non-blocking send), but encoding and the replay requests would then take the engine thread's time, and
the ROUTER socket needs a thread to answer on anyway. Should the queue ever be full (this thread starved of the
GIL for as long as `queue_size` steps), the step's events are dropped, and this thread restates the whole state
(`AllBlocksCleared`, then every block held) as soon as it runs, so a consumer's index is never left wrong.

The first batch, sequence number 0, is `AllBlocksCleared`: a restarted replica's stale blocks leave the routers'
indexes when it comes back.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import zmq

from strata.config import KvEventsConfig
from strata.kv_events.blocks import KvBlocks
from strata.kv_events.wire import END_OF_REPLAY, AllBlocksCleared, KvEvent, encode_batch, sequence_frame
from strata.scheduling.batcher import Batcher

BATCH_EVENTS = 256  # events per batch at most (vllm-router caps a batch's events and bytes)
POLL_SECONDS = 0.05  # how long the thread waits for events before it looks at the replay socket again

Restate = Callable[[Callable[[], object]], list[KvEvent]]


class Publisher:
    """Binds its sockets at once (`endpoint` like `tcp://*:5557`; port `*` picks a free one, then `endpoint` says
    which) and sends `AllBlocksCleared` first.

    Args:
        endpoint: the PUB socket's address; routers connect to it.
        replay_endpoint: the ROUTER socket's address, or None for no replays.
        topic: the first frame of every message (subscribers filter on it; "" matches every subscription).
        restate: the whole state as events, after running its argument where no event can be published
            (`KvBlocks.restate`); None until set, then used when the queue overflowed.

    Raises:
        zmq.ZMQError: an address that cannot be bound (in use, malformed).
    """

    def __init__(self, endpoint: str, replay_endpoint: str | None = None, topic: str = "", *,
                 buffer_batches: int = 10_000, queue_size: int = 10_000, hwm: int = 100_000,
                 restate: Restate | None = None):
        self._context = zmq.Context()
        self._pub = self._context.socket(zmq.PUB)
        self._replay: zmq.Socket[bytes] | None = None
        try:
            self._pub.setsockopt(zmq.SNDHWM, hwm)
            self._pub.setsockopt(zmq.LINGER, 0)
            self._pub.bind(endpoint)
            if replay_endpoint is not None:
                self._replay = self._context.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.LINGER, 0)
                self._replay.bind(replay_endpoint)
        except zmq.ZMQError:
            self._close_sockets()
            raise
        self.endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self.replay_endpoint = None if self._replay is None else self._replay.getsockopt_string(zmq.LAST_ENDPOINT)
        self.restate = restate
        self._topic = topic.encode()
        self._queue: queue.Queue[list[KvEvent]] = queue.Queue(queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_batches)
        self._next_seq = 0
        self._lost = threading.Event()  # events were dropped: restate before sending more
        self._stop = threading.Event()
        self.sent = self.dropped = 0  # batches sent; steps whose events were dropped
        self.blocks: KvBlocks | None = None  # the blocks it publishes, for the status (publish_cache_events)
        self._queue.put([AllBlocksCleared()])
        self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)
        self._thread.start()

    def publish(self, events: list[KvEvent]) -> bool:
        """Queue one step's events (any thread, never blocks); False when the queue was full and they were
        dropped (the thread restates everything instead)."""
        try:
            self._queue.put_nowait(events)
            return True
        except queue.Full:
            self.dropped += 1
            self._lost.set()
            return False

    def status(self) -> dict[str, Any]:
        """What `/v1/status` shows of the events: where they go, how many batches went, the blocks held now."""
        return {"endpoint": self.endpoint, "replay_endpoint": self.replay_endpoint, "batches": self.sent,
                "dropped_steps": self.dropped, "blocks": None if self.blocks is None else len(self.blocks.held())}

    def close(self) -> None:
        """Send what is queued, then stop the thread and close the sockets."""
        self._stop.set()
        self._thread.join(timeout=5)
        self._close_sockets()

    def _close_sockets(self) -> None:
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)
        self._context.term()

    # in the publisher's thread

    def _run(self) -> None:
        while not (self._stop.is_set() and self._queue.empty()):
            if self._lost.is_set() and self.restate is not None:
                self._send(self.restate(self._forget_queued))
            events = self._take()
            if events:
                self._send(events)
            self._answer_replays()

    def _take(self) -> list[KvEvent]:
        """The queued events, up to a batch's worth, waiting a moment for the first."""
        try:
            events = list(self._queue.get(timeout=POLL_SECONDS))
        except queue.Empty:
            return []
        while len(events) < BATCH_EVENTS:
            try:
                events += self._queue.get_nowait()
            except queue.Empty:
                break
        return events

    def _forget_queued(self) -> None:
        """Drop what is queued: the restatement that follows covers it (runs while no slot can change)."""
        while True:
            try:
                self._queue.get_nowait()
            except queue.Empty:
                break
        self._lost.clear()

    def _send(self, events: list[KvEvent]) -> None:
        for start in range(0, len(events), BATCH_EVENTS):
            payload = encode_batch(time.time(), events[start:start + BATCH_EVENTS])
            seq = self._next_seq
            self._next_seq += 1
            self._pub.send_multipart([self._topic, sequence_frame(seq), payload])
            self._buffer.append((seq, payload))
            self.sent += 1

    def _answer_replays(self) -> None:
        """Answer each waiting replay request `[identity, b"", first sequence]`: every batch held from that one on,
        then the end marker."""
        replay = self._replay
        if replay is None:
            return
        while replay.poll(0):
            frames = replay.recv_multipart()
            if len(frames) != 3 or len(frames[2]) != 8:
                continue  # not a replay request
            identity, first = frames[0], int.from_bytes(frames[2], "big")
            for seq, payload in list(self._buffer):
                if seq >= first:
                    replay.send_multipart([identity, b"", sequence_frame(seq), payload])
            replay.send_multipart([identity, b"", END_OF_REPLAY, b""])


def publish_cache_events(config: KvEventsConfig, batcher: Batcher) -> Publisher | None:
    """Publish the events of `batcher`'s prefix cache as `config` says (None: not configured); the caller closes
    the publisher after the engine thread has ended.

    Raises:
        zmq.ZMQError: an endpoint that cannot be bound.
    """
    if config.endpoint is None:
        return None
    publisher = Publisher(config.endpoint, config.replay_endpoint, config.topic)
    blocks = KvBlocks(config.block_size, publisher.publish)
    publisher.restate = blocks.restate
    publisher.blocks = blocks
    batcher.observer = blocks
    return publisher
