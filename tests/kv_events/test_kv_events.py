"""KV events: the wire format, the block hashes, and the events a batcher's prefix cache sends through a real ZMQ
socket, replayed into an index and held to the slots' own view after a random workload with evictions."""

from __future__ import annotations

import random
import threading
import time

import msgpack
import pytest
import zmq
from fakes import N_VOCAB, RecurrentEngine, SuccessorEngine

from strata.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KvBlocks, KvEvent, block_hash
from strata.kv_events.publisher import Publisher
from strata.kv_events.wire import decode_batch, encode_batch
from strata.scheduling.batcher import Batcher, Job, salted
from strata.scheduling.drafts import PromptLookup, Speculation
from strata.text.sampling import Sampler, SamplingParams

BLOCK = 4
GREEDY = SamplingParams(temperature=0.0)


def job(ids: list[int], max_tokens: int, **kw) -> Job:
    return Job(ids, Sampler(GREEDY, N_VOCAB), max_tokens, set(), **kw)


class Index:
    """A consumer's view: the set of blocks a replica holds, rebuilt from its events as a router does."""

    def __init__(self) -> None:
        self.blocks: dict[int, tuple[int, ...]] = {}  # hash -> tokens
        self.parents: dict[int, int | None] = {}

    def apply(self, event: KvEvent) -> None:
        if isinstance(event, AllBlocksCleared):
            self.blocks.clear()
            self.parents.clear()
        elif isinstance(event, BlockStored):
            assert event.parent_block_hash is None or event.parent_block_hash in self.blocks, "a parent not held"
            parent = event.parent_block_hash
            for i, block in enumerate(event.block_hashes):
                assert block not in self.blocks, "a block stored twice"
                self.blocks[block] = event.token_ids[i * event.block_size:(i + 1) * event.block_size]
                self.parents[block], parent = parent, block
        else:
            for block in event.block_hashes:
                del self.blocks[block]  # a block removed that was not held fails here


def expected_blocks(batcher: Batcher, size: int) -> dict[int, tuple[int, ...]]:
    """Every whole block of plain tokens the slots hold, hashed here from the slots' own keys."""
    held = {}
    for slot in batcher.slots:
        parent = None
        for start in range(0, len(slot.keys) - size + 1, size):
            tokens = [key for key in slot.keys[start:start + size] if isinstance(key, int)]
            if len(tokens) < size:
                break
            parent = block_hash(parent, tokens)
            held[parent] = tuple(tokens)
    return held


def test_a_batch_is_vllms_layout_an_array_of_tagged_maps() -> None:
    events: list[KvEvent] = [AllBlocksCleared(), BlockStored((7, 8), None, (1, 2, 3, 4), 2), BlockRemoved((7,))]
    payload = encode_batch(1.5, events)
    raw = msgpack.unpackb(payload)
    assert raw[0] == 1.5 and raw[2] == 0
    assert raw[1][0] == {"type": "AllBlocksCleared"}
    assert raw[1][1] == {"type": "BlockStored", "block_hashes": [7, 8], "parent_block_hash": None,
                         "token_ids": [1, 2, 3, 4], "block_size": 2, "lora_id": None, "medium": "GPU",
                         "lora_name": None}
    assert raw[1][2] == {"type": "BlockRemoved", "block_hashes": [7], "medium": "GPU"}
    assert decode_batch(payload) == (1.5, events, 0)
    with pytest.raises(ValueError, match="KV event must be a tagged map"):
        decode_batch(msgpack.packb([1.0, [[0, [7], None, [1], 1]], 0]))


def test_block_hashes_chain_on_the_parent_and_the_salt() -> None:
    first = block_hash(None, [1, 2, 3, 4])
    assert 0 <= first < 2**64 and first == block_hash(None, (1, 2, 3, 4))
    assert block_hash(first, [5, 6]) != block_hash(block_hash(None, [9, 2, 3, 4]), [5, 6])
    assert block_hash(None, [1, 2, 3, 4], salt="a") not in (first, block_hash(None, [1, 2, 3, 4], salt="b"))


def test_shared_blocks_are_stored_by_the_first_slot_and_removed_with_the_last() -> None:
    sent: list[list[KvEvent]] = []
    blocks = KvBlocks(2, sent.append)
    blocks.on_blocks(0, [1, 2, 3, 4, 5], 5, 0)
    a, b = block_hash(None, [1, 2]), block_hash(block_hash(None, [1, 2]), [3, 4])
    assert sent == [[BlockStored((a, b), None, (1, 2, 3, 4), 2)]]
    blocks.on_blocks(1, [1, 2, 3, 9], 4, 0)  # shares the first block: only its second is new
    c = block_hash(a, [3, 9])
    assert sent[-1] == [BlockStored((c,), a, (3, 9), 2)]
    blocks.on_blocks(0, [7, 7], 2, 0)  # slot 0 overwritten: its second block goes, the shared first stays
    assert sent[-1] == [BlockStored((block_hash(None, [7, 7]),), None, (7, 7), 2), BlockRemoved((b,))]
    blocks.on_blocks(1, [], 0, 0)
    assert sent[-1] == [BlockRemoved((c, a))]
    assert blocks.restate() == [AllBlocksCleared(), BlockStored((block_hash(None, [7, 7]),), None, (7, 7), 2)]


def test_a_salted_prompt_announces_salted_hashes_and_pictures_end_the_announced_prefix() -> None:
    sent: list[list[KvEvent]] = []
    blocks = KvBlocks(2, sent.append)
    blocks.on_blocks(0, salted([1, 2, 3, 4], "k"), 4, 0)
    salted_first = block_hash(None, [1, 2], salt="k")
    assert sent[-1] == [BlockStored((salted_first, block_hash(salted_first, [3, 4])), None, (1, 2, 3, 4), 2)]
    blocks.on_blocks(1, [5, 6, ("digest", 0), ("digest", 1), 7, 8], 6, 0)
    assert sent[-1] == [BlockStored((block_hash(None, [5, 6]),), None, (5, 6), 2)]


def test_a_recurrent_slot_announces_only_what_it_can_resume() -> None:
    sent: list[list[KvEvent]] = []
    engine = RecurrentEngine(n_seq=1)
    batcher = Batcher(engine, snapshot_bytes=10 * engine.state_bytes)
    blocks = KvBlocks(BLOCK, sent.append)
    batcher.observer = blocks
    first = job(list(range(1, 15)), max_tokens=50, turn_starts=(8,))
    batcher.add(first)
    while len(first.tokens) < 3:
        batcher.step()
    assert len(blocks.held()) == len(batcher.slots[0].keys) // BLOCK  # live: everything it holds
    batcher.cancel(first)
    batcher.step()  # cancelled: its state is gone, the snapshots at 8 and 14 remain
    assert batcher.slots[0].live is False
    assert len(blocks.held()) == 14 // BLOCK


def collect(sub: zmq.Socket, until_seq: int, timeout: float = 5.0) -> dict[int, bytes]:
    got: dict[int, bytes] = {}
    deadline = time.monotonic() + timeout
    while until_seq not in got and time.monotonic() < deadline:
        if sub.poll(50):
            topic, seq, payload = sub.recv_multipart()
            assert topic == b"strata"
            got[int.from_bytes(seq, "big")] = payload
    return got


def replay(context: zmq.Context, endpoint: str, first: int) -> dict[int, bytes]:
    """Ask the replay socket for every batch from `first` on, as a router that joined late does."""
    dealer = context.socket(zmq.DEALER)
    dealer.connect(endpoint)
    try:
        dealer.send_multipart([b"", first.to_bytes(8, "big")])
        got: dict[int, bytes] = {}
        while True:
            assert dealer.poll(5000), "no replay answer"
            _, seq, payload = dealer.recv_multipart()
            if int.from_bytes(seq, "big", signed=True) == -1:
                return got
            got[int.from_bytes(seq, "big")] = payload
    finally:
        dealer.close(linger=0)


def test_the_events_of_a_random_workload_rebuild_the_prefix_cache_through_zmq() -> None:
    rng = random.Random(33)
    engine = SuccessorEngine(n_ctx=48, n_seq=3)
    batcher = Batcher(engine, step_tokens=8)
    publisher = Publisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*", topic="strata")
    blocks = KvBlocks(BLOCK, publisher.publish)
    publisher.restate = blocks.restate
    batcher.observer = blocks
    context = zmq.Context()
    sub = context.socket(zmq.SUB)
    try:
        sub.setsockopt(zmq.SUBSCRIBE, b"strata")
        sub.connect(publisher.endpoint)
        time.sleep(0.2)  # the subscription reaches the publisher
        systems = [[rng.randrange(1, N_VOCAB) for _ in range(10)] for _ in range(3)]
        running: list[Job] = []
        for _ in range(60):
            while batcher.free_slots and rng.random() < 0.7:
                prompt = rng.choice(systems) + [rng.randrange(1, N_VOCAB) for _ in range(rng.randrange(1, 14))]
                # every other job drafts by prompt lookup: its rolled-back positions must leave no block behind
                spec = Speculation(PromptLookup(), max_draft=4, adaptive=False) if rng.random() < 0.5 else None
                running.append(job(prompt, max_tokens=rng.randrange(1, 12), speculation=spec))
                batcher.add(running[-1])
            if running and rng.random() < 0.1:
                batcher.cancel(rng.choice(running))
            batcher.step()
            running = [j for j in running if j.finish is None]
        while running:
            batcher.step()
            running = [j for j in running if j.finish is None]
        deadline = time.monotonic() + 5
        while publisher._queue.qsize() and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.1)
        last = publisher.sent - 1
        live = collect(sub, last)
        assert last in live
        missed = replay(context, publisher.replay_endpoint or "", 0)  # what the subscription missed as it joined
        batches = {**missed, **live}
        assert sorted(batches) == list(range(last + 1))
        assert all(missed[seq] == payload for seq, payload in live.items())  # the replay is the same stream
    finally:
        sub.close(linger=0)
        context.term()
        publisher.close()
    index = Index()
    events = [event for seq in sorted(batches) for event in decode_batch(batches[seq])[1]]
    for event in events:
        index.apply(event)
    assert sum(isinstance(event, BlockRemoved) for event in events) > 5  # slots were overwritten and cut back
    assert isinstance(decode_batch(batches[0])[1][0], AllBlocksCleared)
    assert index.blocks == expected_blocks(batcher, BLOCK) and len(index.blocks) > 5
    assert publisher.dropped == 0


def test_events_dropped_on_a_full_queue_are_made_good_by_a_restatement(monkeypatch) -> None:
    release = threading.Event()
    send = Publisher._send

    def held(self: Publisher, events: list[KvEvent]) -> None:
        release.wait(5)  # the thread is stuck sending: the queue fills
        send(self, events)

    monkeypatch.setattr(Publisher, "_send", held)
    publisher = Publisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*", queue_size=2)
    blocks = KvBlocks(2, publisher.publish)
    publisher.restate = blocks.restate
    try:
        deadline = time.monotonic() + 5
        while publisher._queue.qsize() and time.monotonic() < deadline:  # the thread holds AllBlocksCleared
            time.sleep(0.01)
        for seq in range(4):  # two fit the queue, two are dropped
            blocks.on_blocks(seq, [seq, 1, 2, 3], 4, 0)
        assert publisher.dropped == 2
        release.set()
        while publisher._lost.is_set() or publisher._queue.qsize():
            assert time.monotonic() < deadline, "no restatement"
            time.sleep(0.01)
        time.sleep(0.1)
        context = zmq.Context()
        try:
            batches = replay(context, publisher.replay_endpoint or "", 0)
        finally:
            context.term()
    finally:
        release.set()
        publisher.close()
    index = Index()
    for seq in sorted(batches):
        for event in decode_batch(batches[seq])[1]:
            index.apply(event)
    assert set(index.blocks) == blocks.held() and len(index.blocks) == 8


def test_blocks_read_back_from_the_disk_tier_are_announced(tmp_path) -> None:
    from strata.kv_disk import KvTier

    rng = random.Random(5)
    prompt = [rng.randrange(1, N_VOCAB) for _ in range(40)]

    def served(first: list[int], answer: int) -> tuple[Batcher, list[KvEvent], Job]:
        engine = SuccessorEngine(n_ctx=128)
        tier = KvTier(str(tmp_path), engine.kv_identity, 10**6, engine.kv_position_bytes, 8, print)
        batcher = Batcher(engine, tier=tier)
        sent: list[KvEvent] = []
        batcher.observer = KvBlocks(BLOCK, sent.extend)
        done = job(first, max_tokens=answer)
        batcher.add(done)
        while done.finish is None:
            batcher.step()
        tier.close()
        return batcher, sent, done

    served(prompt, 3)  # saved to disk as it leaves its slot
    batcher, sent, again = served(prompt + [1, 2, 3], 1)  # a restarted server reads the prompt back
    assert again.disk_tokens == 40
    index = Index()
    for event in sent:
        index.apply(event)
    assert index.blocks == expected_blocks(batcher, BLOCK) and len(index.blocks) == 43 // BLOCK
