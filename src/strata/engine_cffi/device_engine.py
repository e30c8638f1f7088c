"""The device backend: a `qwen3moe` or `qwen35moe` model's forward pass through the device interface
(`cuda/device.h`), with the routed experts split between the device's expert cache (hits) and the CPU (misses).

What lives on the device: every layer's attention (or Gated DeltaNet) and norm weights, the router and the shared
expert, the output norm and projection, the sequences' KV cache (the CPU engine's layout: attention layers only),
a hybrid model's recurrent state (`device_state`) and the step's activations. What stays in RAM: the mapped file,
from which the token embeddings are looked up and the misses computed; the experts the policy keeps are copied
into the device's slots (`expert_slots`).

A chunk of tokens (at most `n_batch`, the sequences' tokens in call order, so each sequence's are adjacent) goes
through each layer as:

    attention layer: xb = rmsnorm(x); q, k, v = xb Wq, Wk, Wv (qwen35moe: q with each head's gate beside it,
    gathered out by add_rows); q, k = rope(rmsnorm(q), rmsnorm(k)) per head (the first n_rot values of a head);
    cache k, v; att = attention over each token's positions (qwen35moe: times the sigmoid of its gate); x += att Wo
    Gated DeltaNet layer (qwen35moe): xb = rmsnorm(x); qkv, z, alpha, beta = xb Wqkv, Wz, Walpha, Wbeta;
    q, k, v = dn_conv(qkv) from each sequence's conv state; L2-normed q, k; the gates; o = the delta rule per
    (sequence, v head) on its state (a run of more than 16 tokens by the chunked form, `delta_rule_chunked`, the
    rest token by token: the CPU engine's rule, strata_deltanet_chunked); o = gated_rms_norm(o, z); x += o Wout
    xb = rmsnorm(x); router logits = xb Wr; top-k per token -> the host (ids, weights) with xb
    each distinct expert: a hit runs gate, up, SwiGLU, down on the device over its tokens' rows (queued first); a
    miss runs the same on the CPU's threads meanwhile (strata_host_layer_misses, from the mapped file, the layer's
    misses in one call) and the misses' rows are uploaded in one more (strata_dev_upload_rows)
    x += the router's weights times the experts' rows (add_rows, on the device); qwen35moe: x += the shared
    expert's SwiGLU of xb times the sigmoid of xb . its gate (on the device)

then the output norm and head for the tokens that want logits. The layer loop runs here, in Python, in a few calls
a layer: each layer's launches up to the top-k are a `LaunchList` built at load (its pointers never change; the
fields that follow the chunk's size are patched when it changes) and queued by one call, the slots are grouped by
expert in C (`strata_host_group_slots`), the hits queued by one call (`strata_dev_launch_experts`), the mix by one
more list; the policy (a Python class) is called once per layer, between the top-k's read-back and the hits.

Where the cache holds every routed expert (all uploaded at load: no miss, no upload can happen), a step is
resident: its whole pass up to the output is one list, queued by one call (split only by memsets), each layer's
experts grouped on the device (`moe_group`) and computed by one product launch per matrix over all of them
(`moe_matmul`, the slots' pointers in a device table), and nothing comes back to the host before the step's end.
Each layer's top-k ids have their own rows on the device; they come back once, with the logits, and the step's
hits (each layer's distinct experts) and routing records are taken from them then. The policy is not stepped. The
results are the per-layer path's bits on the host device (the same products over the same grouped rows).

The rest of the engine's interface (sampling, the checks of a call's items) is the CPU engine's, whose context
this class extends; the positions each sequence holds (and with multi-axis RoPE each position's RoPE components)
are kept here, as the KV cache and the recurrent state are the device's (`copy_prefix`, `export_kv`,
`import_kv`, `save_state` and `load_state` move them through the host, in the CPU engine's layouts).

With `mtp`, the model's MTP block (layer n_layer: `mtp_draft`, as the CPU engine's) runs with the same kernels:
each chunk's hidden states (output_norm(x)) come back to the host, where each sequence's last 128 are held
(`device_mtp`); the pairs the chunk completes (the hidden state at p, the token at p + 1) then go through the
block at once: x = eh_proj([enorm(embedding), hnorm(hidden)]), its gated attention on its own KV rows, its
router and shared expert on the device and its routed experts all on the CPU's threads (the expert cache holds
the trunk's). A draft chains steps of the block and its head from the held hidden states. Without a window the
fill is eager, not lazy as the CPU engine's: a pass is about one layer of a step here, and the block's rows then
follow the trunk's (`keep`, `copy_prefix`, `import_kv` as the CPU engine's for the block's history). With one
(`mtp_window`, the server's `speculative.mtp_window`), as the CPU engine's: no eval fills but one bringing a
picture's rows (its last N pairs), a draft fills the last N waiting pairs first, and the block's attention starts
at each sequence's history's start (the kernel's `first`); `keep`, `copy_prefix` and `import_kv` move that start
as mtp.c does. Not built yet: other architectures (Qwen3-VL's deepstack rows, dense models).
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType as Q
from gguf import quants

from strata.engine_cffi import _KV_TYPES, BatchItem, Engine, EngineAborted, EngineError, _item_logits, get_rows
from strata.engine_cffi._engine import lib
from strata.engine_cffi.device import Device, DeviceError
from strata.engine_cffi.device_check import MATMUL_TYPES
from strata.engine_cffi.device_mtp import MTP_HISTORY, HiddenHistory
from strata.engine_cffi.device_state import RecurrentState
from strata.engine_cffi.expert_slots import UPLOADS_PER_STEP, ExpertSlots
from strata.engine_cffi.launch_list import LaunchList, Pass, Size
from strata.experts.simulate import Key, most_frequent
from strata.experts.trace import RoutingTrace
from strata.gguf_file import TensorInfo

ARCHITECTURES = ("qwen3moe", "qwen35moe")
# Qwen3.5: Gated DeltaNet layers between gated attention ones, partial multi-axis RoPE, a gated shared expert
HYBRID = ("qwen35moe",)
DEVICE_TYPES = frozenset(MATMUL_TYPES)  # the weight types the device's products take
KV_ELEM = {"f32": 4, "f16": 2, "int8": 1}  # bytes of a cached value
RESERVE = 1 << 30  # of a card's free memory, left to the driver and other users when no budget is given
LINK_PROBE_BYTES = 8 << 20  # the upload timed to measure the link: long enough that a launch's latency is small
# the sizes the launches follow: a chunk's tokens, its runs of a sequence's tokens, the rows that want logits
N, RUNS, ROWS = Size("n"), Size("runs"), Size("m")
# the runs each form of the delta rule is launched over: every run where some run takes that form, else none (no
# launch: a decode step's runs are all the recurrent form's, a long prompt's all the chunked form's)
RECURRENT_RUNS, CHUNKED_RUNS = Size("recurrent_runs"), Size("chunked_runs")


def device_budget(free: int, gpu_memory: int | None, encoder_bytes: int) -> int:
    """The backend's budget in bytes: `gpu_memory` when given, else the card's `free` memory less `RESERVE`; either
    way less `encoder_bytes`, the share of a local GPU image encoder on the same card (at least 1: a budget the
    dense part does not fit in is refused when the model is put on the device)."""
    total = gpu_memory if gpu_memory is not None else free - RESERVE
    return max(total - encoder_bytes, 1)


def open_device(kind: str, budget: int | None, encoder_bytes: int = 0) -> Device:
    """Open device `kind` with `budget` bytes (None: a card's free memory less `RESERVE`, unlimited on the host),
    less a local GPU image encoder's `encoder_bytes` (`device_budget`).

    Raises:
        DeviceUnavailable: cuda, and no CUDA library was built or no GPU is there (one line says which).
    """
    if budget is None and kind != "cuda":
        return Device(kind, 0)
    free = 0
    if budget is None:
        with Device(kind) as probe:
            free = probe.budget
    return Device(kind, device_budget(free, budget, encoder_bytes))


@dataclass(frozen=True)
class Matrix:
    """A weight on the device: its type, shape and row size."""

    ptr: Any
    type: int
    n_in: int
    n_out: int
    row_bytes: int


class DeviceEngine(Engine):
    """A CPU engine whose forward pass runs on `device` (see the module's docstring). Make one with `open`."""

    device: Device
    slots: ExpertSlots
    mtp_experts_held: bool  # the MTP block's routed experts on the device (beside a resident trunk's)

    @classmethod
    def open(cls, path: str | os.PathLike[str], device: Device, n_ctx: int = 4096, threads: int | None = None,
             kv: str = "f16", n_batch: int = 256, n_seq: int = 1, kv_budget: int | None = None,
             record_routing: str | os.PathLike[str] | None = None, capacity: int | None = None,
             uploads_per_step: float | None = UPLOADS_PER_STEP, prior: RoutingTrace | None = None,
             paced: bool = True, mtp: bool | None = False, mtp_window: int = 0,
             resident: bool | None = None) -> DeviceEngine:
        """Load the model as `Engine.load` does (the weights read where the file is mapped), then put its dense
        part and the KV cache on `device` (which the engine closes with itself) and give what its budget leaves
        to the expert cache.

        Args:
            capacity: the most experts the cache holds (None: as many as the device's budget leaves room for).
            uploads_per_step: the policy's bound on the uploads a step starts (None: no bound); when `paced`, the
                bound until a step has had misses.
            prior: a routing trace recorded earlier on this model: the cache starts holding its most frequent
                experts (uploaded here).
            paced: each step's upload bound follows the time the last step's misses took and the link's rate,
                measured here (see `expert_slots`).
            mtp: run the model's MTP block on the device for `mtp_draft` (its own KV rows on the device, filled at
                each eval); None: where the file has one.
            mtp_window: `Engine.load`'s: 0, the block's rows filled at each eval for every pair; N (at most
                `MTP_HISTORY`), none filled at an eval, a draft filling the last N waiting pairs and the block
                attending from the start of what it filled (the CPU engine's `mtp_window`, the same drafts).
            resident: where the cache holds every routed expert (all uploaded here), queue a step's whole forward
                pass at once, the experts grouped and computed on the device (None: so; False: layer by layer, as
                a cache that holds some of them, each layer's routing read back).
        Raises:
            EngineError: what `Engine.load` raises; an architecture other than qwen3moe and qwen35moe, a weight type
                the device has no product for, a device budget the dense part, the KV cache and the recurrent state
                do not fit in, a prior recorded on a model of another shape, `mtp` on a file without the block, or
                `resident` where the cache cannot hold every expert.
        """
        try:
            engine = cls.load(path, n_ctx=n_ctx, threads=threads, kv=kv, n_batch=n_batch, n_seq=n_seq,
                              kv_budget=kv_budget, mapped_weights=True, record_routing=record_routing, mtp=mtp,
                              host_cache=False)
        except BaseException:
            device.close()
            raise
        if not 0 <= mtp_window <= MTP_HISTORY:
            engine.close()
            raise EngineError(f"mtp_window {mtp_window} outside [0, {MTP_HISTORY}]")
        engine.mtp_window = mtp_window if engine.mtp else 0
        try:
            engine._attach(device, capacity, uploads_per_step, prior, paced, resident)
        except DeviceError as exc:
            engine.close()
            raise EngineError(f"the {device.kind} device: {exc}") from None
        except BaseException:
            engine.close()
            raise
        return engine

    # --- set-up

    def _attach(self, device: Device, capacity: int | None, uploads_per_step: float | None,
                prior: RoutingTrace | None, paced: bool, resident: bool | None) -> None:
        self.device, self.backend = device, device.kind  # closed with the engine from here on
        # the cached rows' bits are the device's kernels': another backend's rows are not these
        self.kv_identity = f"{self.kv_identity}:{device.kind}"
        if self.arch not in ARCHITECTURES:
            raise EngineError(f"the {device.kind} device runs {', '.join(ARCHITECTURES)} models, not {self.arch}")
        self._n_past = [0] * self.n_seq
        # a sequence's checkpoint (`checkpoint_state`): its position, and its state's bytes where the device had no
        # room for the spares (None: in its spare)
        self._checkpoints: dict[int, tuple[int, bytes | None]] = {}
        self._in_flight: list[np.ndarray] = []  # host buffers queued copies read: kept until a synchronisation
        self._aborted: set[int] = set()
        self.hybrid = self.arch in HYBRID
        meta = self.metadata

        def key(name: str, default: Any = 0) -> Any:
            return meta.get(f"{self.arch}.{name}", default)

        self.n_layer = int(key("block_count")) - int(key("nextn_predict_layers"))  # the MTP block is layer n_layer
        if self.mtp and not self.has_mtp:  # `load` resolved None; the C context runs no block here
            raise EngineError(f"mtp: the {self.arch} model has no MTP block")
        self._mtp_counts = [0, 0]  # the MTP block's passes over evaluated pairs, the pairs
        # with a window: each sequence's block history, rows [from, filled) filled, the pairs from filled waiting
        # (mtp.c's mtp_from and mtp_filled); without one, from stays 0 and every pair is filled at its eval
        self._mtp_from = np.zeros(self.n_seq, np.int32)
        self._mtp_filled = np.zeros(self.n_seq, np.int32)
        self.n_head = int(key("attention.head_count"))
        self.n_head_kv = int(key("attention.head_count_kv", self.n_head))
        self.head_dim = int(key("attention.key_length", self.n_embd // self.n_head))
        self.n_expert, self.n_used = int(key("expert_count")), int(key("expert_used_count"))
        self.n_ff = int(key("expert_feed_forward_length"))
        self.n_ff_shexp = int(key("expert_shared_feed_forward_length"))
        self.eps = float(key("attention.layer_norm_rms_epsilon", 1e-6))
        self._recurrent = self.recurrent_layers or (False,) * self.n_layer
        # each attention layer's place in the KV cache, each recurrent layer's in a sequence's state
        self._kv_layer = np.cumsum([not r for r in self._recurrent]) - 1
        self._rec_layer = np.cumsum(self._recurrent) - 1
        self.n_kv_layer = self.n_layer - sum(self._recurrent)
        self._rope_tables(key)
        if self.hybrid:
            self._deltanet_sizes(key)
        self._layers = [self._layer_weights(il) for il in range(self.n_layer + self.mtp)]
        self._output_norm = self._put(self._vector("output_norm"))
        self._output = self._matrix("output" if self._file.tensor("output") else "token_embd")  # tied: the embeddings
        if self.mtp:
            self._mtp_weights()
        self._alloc_kv()
        self._state = RecurrentState(device, self.n_seq, self.state_bytes // 4)
        self._alloc_activations()
        # every layer's experts where the file is mapped, the MTP block's (layer n_layer) too
        self._experts = [(self._tensor(f"blk.{il}.ffn_gate_exps"), self._tensor(f"blk.{il}.ffn_up_exps"),
                          self._tensor(f"blk.{il}.ffn_down_exps")) for il in range(self.n_layer + self.mtp)]
        expert_bytes = [(g.n_bytes // self.n_expert, u.n_bytes // self.n_expert, d.n_bytes // self.n_expert)
                        for g, u, d in self._experts[:self.n_layer]]
        # each layer's experts where the file is mapped (a matrix's base, an expert's bytes): the misses and the
        # uploads read them
        self._layer_experts: list[Any] = []
        self._mapped_alive: list[Any] = []  # the structs point into these views of the file: kept with them
        for gate, up, down in self._experts:
            mapped = {name: device.ffi.from_buffer(self._file.data(t))
                      for name, t in (("gate", gate), ("up", up), ("down", down))}
            self._mapped_alive.extend(mapped.values())
            self._layer_experts.append(device.ffi.new("strata_host_layer_experts *", dict(
                gate_type=gate.type, up_type=up.type, down_type=down.type, **mapped,
                gate_bytes=gate.n_bytes // self.n_expert, up_bytes=up.n_bytes // self.n_expert,
                down_bytes=down.n_bytes // self.n_expert)))
        every = self.n_layer * self.n_expert
        free = device.budget - device.used - 8 * every  # less a resident step's table of the slots' pointers
        slot = max(sum(sizes) for sizes in expert_bytes)
        fits = max(0, min(every, free // slot))
        capacity = fits if capacity is None else min(capacity, fits)
        if resident and capacity < every:
            raise EngineError(f"resident: the expert cache holds {capacity} of the model's {every} routed experts")
        self.resident = capacity == every and resident is not False
        # the MTP block's routed experts (layer n_layer): held beside a resident trunk's where they fit too, else
        # the CPU's (the policy and the routing traces are the trunk's)
        mtp_slot = sum(t.n_bytes // self.n_expert for t in self._experts[-1]) if self.mtp else 0
        room = free - every * slot - 8 * self.n_expert
        self.mtp_experts_held = self.resident and self.mtp and room >= self.n_expert * mtp_slot
        held = self._prior(prior, capacity)
        if capacity == every:  # every expert held from the start: none is ever a miss
            held = [(il, e) for il in range(self.n_layer) for e in range(self.n_expert)]
        self._upload_stream = device.stream()
        link_rate = self._link_rate(slot) if paced and capacity else None
        self.slots = ExpertSlots(device, self.n_layer, self.n_expert, capacity, expert_bytes,
                                 self._layer_experts[:self.n_layer], self._upload_stream, uploads_per_step, held,
                                 link_rate)
        self._pool = device.lib.strata_host_pool_create(self.threads)  # the misses' threads, the caller's included
        if self._pool == device.ffi.NULL:
            raise EngineError(f"could not start {self.threads} threads for the expert cache's misses")
        self._build_launches()
        if self.resident:
            self._build_resident_step(self._hold_mtp_experts(mtp_slot) if self.mtp_experts_held else None)
            device.sync(self._upload_stream)  # the experts are on the device before a step reads them

    def _prior(self, trace: RoutingTrace | None, capacity: int) -> list[Key]:
        """The `capacity` experts the trace's steps used most; none without a trace."""
        if trace is None:
            return []
        info = trace.info
        if (info.arch, info.n_layer, info.n_expert) != (self.arch, self.n_layer, self.n_expert):
            raise EngineError(f"the expert prior was recorded on a {info.arch} model of {info.n_layer} layers of "
                              f"{info.n_expert} experts, not this {self.arch} of {self.n_layer} x {self.n_expert}")
        return most_frequent(trace, capacity)

    def _link_rate(self, slot: int) -> float:
        """Bytes a second the upload stream moves from host memory: a probe of a few slots' size, timed by two
        events (a server records no others: a device keeps a bounded number)."""
        nbytes = min(max(slot, LINK_PROBE_BYTES), self.device.budget - self.device.used)
        probe, scratch = np.zeros(nbytes, np.uint8), self.device.alloc(nbytes)
        try:
            start = self.device.record(self._upload_stream)
            self.device.upload(scratch, probe, self._upload_stream)
            end = self.device.record(self._upload_stream)
            self.device.event_sync(end)
            return nbytes / max(self.device.elapsed_ms(start, end) / 1e3, 1e-9)
        finally:
            self.device.free(scratch)

    def _rope_tables(self, key: Any) -> None:
        """inv_freq of the first n_rot values of a head, and each pair's position axis (multi-axis RoPE: Qwen3-VL's
        interleaving of the sections, as model_load.c's build_mrope); with multi-axis RoPE, each sequence's
        positions' t components and the next text position after each, as the CPU engine keeps them."""
        self.n_rot = int(key("rope.dimension_count", self.head_dim))
        base = float(key("rope.freq_base", 10000.0))
        half = np.arange(self.n_rot // 2, dtype=np.float64)
        inv_freq = (1.0 / base ** (2.0 * half / self.n_rot)).astype(np.float32)  # as the engine's build_rope
        sections = [int(n) for n in key("rope.dimension_sections", [])] + [0, 0, 0]
        i = np.arange(self.n_rot // 2)
        axis = np.where((i % 3 == 1) & (i < 3 * sections[1]), 1, np.where((i % 3 == 2) & (i < 3 * sections[2]), 2, 0))
        self._inv_freq, self._axis = self._put(inv_freq), self._put(axis.astype(np.uint8))
        self._mrope = self.hybrid  # the architectures' table (archs.c): Qwen3.5's RoPE has three axes
        self._rope_t = np.zeros((self.n_seq, self.n_ctx), np.int32)
        self._rope_next = np.zeros((self.n_seq, self.n_ctx), np.int32)

    def _deltanet_sizes(self, key: Any) -> None:
        self.d_conv, self.d_state = int(key("ssm.conv_kernel")), int(key("ssm.state_size"))
        self.n_k_heads, self.n_v_heads = int(key("ssm.group_count")), int(key("ssm.time_step_rank"))
        self.d_inner = int(key("ssm.inner_size"))
        self.conv_dim = 2 * self.n_k_heads * self.d_state + self.d_inner
        self.conv_floats = (self.d_conv - 1) * self.conv_dim
        self.layer_state_floats = self.conv_floats + self.n_v_heads * self.d_state ** 2

    def _put(self, array: np.ndarray) -> Any:
        return self.device.to_device(np.ascontiguousarray(array))

    def _alloc(self, nbytes: int) -> Any:
        return self.device.alloc(max(nbytes, 1))

    def _tensor(self, name: str) -> TensorInfo:
        t = self._file.tensor(name)
        if t is None:
            raise EngineError(f"missing tensor {name}")
        return t

    def _vector(self, name: str) -> np.ndarray:
        t = self._tensor(name)
        data = self._file.data(t)
        if t.type == Q.F32:
            return data.view(np.float32)
        return np.asarray(quants.dequantize(data, Q(t.type)), np.float32).reshape(-1)

    def _matrix(self, name: str) -> Matrix:
        t = self._tensor(name)
        if t.type not in DEVICE_TYPES:
            raise EngineError(f"tensor {name}: the device has no product for type {Q(t.type).name}")
        return Matrix(self._put(self._file.data(t)), t.type, t.shape[0], t.shape[1], t.n_bytes // t.shape[1])

    def _layer_weights(self, il: int) -> dict[str, Any]:
        """Layer il's weights on the device by their file names, and its norm before the feed-forward as
        "ffn_norm" (Qwen3.5's post_attention_norm)."""
        ffn_norm = "post_attention_norm" if self.hybrid else "ffn_norm"
        vectors = ["attn_norm"]
        matrices = ["ffn_gate_inp"]
        if il < self.n_layer and self._recurrent[il]:
            vectors += ["ssm_conv1d", "ssm_a", "ssm_dt.bias", "ssm_norm"]
            matrices += ["attn_qkv", "attn_gate", "ssm_alpha", "ssm_beta", "ssm_out"]
        else:
            vectors += ["attn_q_norm", "attn_k_norm"]
            matrices += ["attn_q", "attn_k", "attn_v", "attn_output"]
        if self.hybrid:
            matrices += ["ffn_gate_shexp", "ffn_up_shexp", "ffn_down_shexp"]
        weights = {n: self._put(self._vector(f"blk.{il}.{n}")) for n in vectors}
        weights |= {n: self._matrix(f"blk.{il}.{n}") for n in matrices}
        weights["ffn_norm"] = self._put(self._vector(f"blk.{il}.{ffn_norm}"))
        if self.hybrid:  # the shared expert's gate: a product with one row
            gate = self._vector(f"blk.{il}.ffn_gate_inp_shexp")
            weights["ffn_gate_inp_shexp"] = Matrix(self._put(gate), Q.F32, self.n_embd, 1, 4 * self.n_embd)
        for w in ("gate", "up", "down"):
            t = self._tensor(f"blk.{il}.ffn_{w}_exps")
            if t.type not in DEVICE_TYPES:
                raise EngineError(f"tensor {t.name}: the device has no product for type {Q(t.type).name}")
        return weights

    def _mtp_weights(self) -> None:
        """The MTP block's own tensors (its attention and feed-forward are layer n_layer's, in `_layers`): eh_proj,
        the norms of its two inputs, its head's norm and matrix (else the model's) and the table its tokens are
        looked up in (else the model's embeddings); the hidden states its pairs and drafts read."""
        blk = f"blk.{self.n_layer}.nextn"

        def has(name: str) -> bool:
            return self._file.tensor(f"{blk}.{name}") is not None

        self._eh_proj = self._matrix(f"{blk}.eh_proj")
        self._enorm, self._hnorm = (self._put(self._vector(f"{blk}.{name}")) for name in ("enorm", "hnorm"))
        self._head_norm = (self._put(self._vector(f"{blk}.shared_head_norm")) if has("shared_head_norm")
                           else self._output_norm)
        self._head = self._matrix(f"{blk}.shared_head_head") if has("shared_head_head") else self._output
        self._mtp_table = f"{blk}.embed_tokens" if has("embed_tokens") else "token_embd"
        self._history = HiddenHistory(self.n_seq, self.n_embd)

    def _alloc_kv(self) -> None:
        """The trunk's KV cache (its attention layers), and with `mtp` the MTP block's (one layer) beside it,
        zeroed: an import's positions are not filled there (as on the CPU engine, whose rows there stay as they
        were) and drafts attend to them, so no NaN from an allocation's leftovers."""
        self._kv_rows = self.n_seq * self.n_kv_layer * self.n_head_kv * self.n_ctx
        self._k, self._v, self._k_scale, self._v_scale = self._kv_cache(self._kv_rows)
        block_rows = self.n_seq * self.n_head_kv * self.n_ctx if self.mtp else 0
        if self.mtp:
            self._mtp_cache = self._kv_cache(block_rows, zeroed=True)
        row = self.head_dim * KV_ELEM[self.kv_type] + (4 if self.kv_type == "int8" else 0)
        self.kv_bytes = 2 * (self._kv_rows + block_rows) * row

    def _kv_cache(self, rows: int, zeroed: bool = False) -> tuple[Any, Any, Any, Any]:
        """K and V caches of `rows` rows of head_dim values, and with int8 their scales."""
        sizes = [rows * self.head_dim * KV_ELEM[self.kv_type]] * 2 + [4 * rows if self.kv_type == "int8" else 0] * 2
        k, v, k_scale, v_scale = (self._alloc(size) if size else self.device.ffi.NULL for size in sizes)
        for ptr, size in zip((k, v, k_scale, v_scale), sizes, strict=True):
            if zeroed and size:
                self.device.memset(ptr, 0, size)
        return k, v, k_scale, v_scale

    def _alloc_activations(self) -> None:
        B, E, k = self.n_batch, self.n_embd, self.n_used
        q_dim, kv_dim = self.n_head * self.head_dim, self.n_head_kv * self.head_dim
        sizes = dict(x=B * E, xb=B * E, q=B * q_dim, k=B * kv_dim, v=B * kv_dim, att=B * q_dim,
                     router=B * self.n_expert, weights=B * k, moe_out=B * k * E, slot_x=B * k * E,
                     hb=B * k * self.n_ff, hb2=B * k * self.n_ff, logits=B * self.n_vocab)
        # each layer's top-k ids apart (a resident step reads them back once, after its last layer)
        ints = dict(ids=(self.n_layer + self.mtp) * B * k, slot_of=B * k, seq=B, pos=B, n_pos=B, rope=3 * B, rows=B,
                    moe_first=self.n_expert, moe_count=self.n_expert)
        if self.hybrid:  # gated attention's q and gates; the DeltaNet's rows; the shared expert's
            VD, hv, F = self.d_inner, self.n_v_heads, self.n_ff_shexp
            sizes |= dict(qg=2 * B * q_dim, dn_qkv=B * self.conv_dim, dn_conv=B * self.conv_dim, dn_z=B * VD,
                          dn_alpha=B * hv, dn_beta=B * hv, dn_out=B * VD, sh_gate=B, sh_hb=B * F, sh_hb2=B * F,
                          sh_out=B * E)
            ints |= dict(q_rows=B * self.n_head, run_seq=B, run_first=B + 1, recurrent_seq=B, chunked_seq=B)
        if self.mtp:  # the hidden states; the block's inputs: B embedding rows then B hidden ones, interleaved
            sizes |= dict(mtp_h=B * E, mtp_raw=2 * B * E, mtp_pair=2 * B * E)
            ints |= dict(mtp_idx=2 * B, mtp_first=B)
        self._a = {name: self._alloc(4 * n) for name, n in (sizes | ints).items()}
        if self.hybrid:  # q head h of token t: row 2 (t n_head + h) of qg's head_dim-wide rows
            self.device.upload(self._a["q_rows"], 2 * np.arange(B * self.n_head, dtype=np.int32))
        if self.mtp:  # pair t's row of mtp_pair: [mtp_raw row t, mtp_raw row B + t]
            self.device.upload(self._a["mtp_idx"], np.stack([np.arange(B), B + np.arange(B)], 1).astype(np.int32))
        self.device.sync()

    # --- the positions each sequence holds and its recurrent state (the KV cache and the state are the device's)

    def seq_n_past(self, seq: int) -> int:
        if not 0 <= seq < self.n_seq:
            raise EngineError(f"sequence {seq} outside [0, {self.n_seq})")
        return self._n_past[seq]

    def keep(self, n: int, seq: int = 0) -> None:
        if not 0 <= n <= self.seq_n_past(seq):
            raise EngineError(f"keep {n} of sequence {seq}, which holds {self._n_past[seq]} positions")
        if n == 0:
            self._state.clear(seq)
            self._checkpoints.pop(seq, None)
        elif n < self._n_past[seq]:
            self._state.cut(seq)  # the state cannot be cut back
        self._n_past[seq] = n
        if self.mtp_window:
            self._mtp_keep(seq, n)

    def copy_prefix(self, src: int, dst: int, n: int) -> None:
        """Sequence `dst` = the first n positions of `src`: their rows copied on the device, a run per layer, KV
        head and cache (with multi-axis RoPE, their positions' components too); a recurrent state goes with them
        when n is all `src` holds, and a shorter n leaves `dst`'s state invalid (as `keep` does)."""
        if not 0 <= n <= self.seq_n_past(src):
            raise EngineError(f"copy of {n} positions of sequence {src}, which holds {self._n_past[src]}")
        self.seq_n_past(dst)
        if src == dst:
            self.keep(n, dst)
            return
        for block in (False, True) if self.mtp else (False,):  # the MTP block's rows too: its history
            for (from_, size), (to, _) in zip(self._runs(src, 0, n, block), self._runs(dst, 0, n, block), strict=True):
                self.device.copy(to, from_, size)
        self._checkpoints.pop(dst, None)  # its checkpoint was of another history
        if self.mtp:
            self._history.copy_prefix(src, dst, n)
            self._set_history(dst, int(self._mtp_from[src]), int(self._mtp_filled[src]))
        self._rope_t[dst, :n], self._rope_next[dst, :n] = self._rope_t[src, :n], self._rope_next[src, :n]
        if n == 0:
            self._state.clear(dst)
        elif n == self._n_past[src]:  # the state at n is src's own
            self._state.copy(src, dst)
        else:
            self._state.cut(dst)
        self._n_past[dst] = n

    def save_state(self, seq: int = 0) -> bytes:
        self.seq_n_past(seq)
        return self._state.save(seq)

    def load_state(self, seq: int, data: bytes) -> None:
        self.seq_n_past(seq)
        self._state.load(seq, data)
        self._checkpoints.pop(seq, None)

    def checkpoint_state(self, seq: int = 0) -> None:
        """`Engine.checkpoint_state`: a copy of the sequence's state into its spare on the device (where the device
        has no room for the spares, its bytes through the host)."""
        n = self.seq_n_past(seq)
        if not self._state.valid[seq]:
            raise EngineError(f"sequence {seq}: its recurrent state was cut back; no checkpoint")
        try:
            self._state.checkpoint(seq)
            self._checkpoints[seq] = (n, None)
        except DeviceError:
            self._checkpoints[seq] = (n, self._state.save(seq))

    def restore_state(self, seq: int = 0) -> None:
        at, data = self._checkpoints.pop(seq, (-1, None))
        if at != self.seq_n_past(seq):
            raise EngineError(f"sequence {seq} holds {self._n_past[seq]} positions: no checkpoint of its state there")
        if data is None:
            self._state.restore(seq)
        else:
            self._state.load(seq, data)

    def _runs(self, seq: int, first: int, n: int, block: bool = False) -> list[tuple[Any, int]]:
        """The device's bytes of positions [first, first + n) of `seq` in `export_kv`'s order (kv_rows.c's layout:
        per attention layer and KV head its K then V rows, then with int8 its K then V scales): (pointer, bytes)
        pairs; with `block`, those of the MTP block's cache (which no export carries, as the CPU engine's)."""
        ffi, row = self.device.ffi, self.head_dim * KV_ELEM[self.kv_type]
        k, v, k_scale, v_scale = self._mtp_cache if block else (self._k, self._v, self._k_scale, self._v_scale)
        n_layer = 1 if block else self.n_kv_layer
        heads = [((seq * n_layer + il) * self.n_head_kv + h) * self.n_ctx + first
                 for il in range(n_layer) for h in range(self.n_head_kv)]
        runs = [(ffi.cast("char *", cache) + base * row, n * row) for base in heads for cache in (k, v)]
        if self.kv_type == "int8":
            runs += [(ffi.cast("char *", cache) + base * 4, n * 4) for base in heads for cache in (k_scale, v_scale)]
        return runs

    def export_kv(self, seq: int, first: int, n: int) -> np.ndarray:
        if first < 0 or n < 0 or first + n > self.seq_n_past(seq):
            raise EngineError(f"export of positions [{first}, {first + n}): sequence {seq} holds "
                              f"{self._n_past[seq]}")
        buf = np.empty(n * self.kv_position_bytes, np.uint8)
        at = 0
        for ptr, size in self._runs(seq, first, n) if n else []:
            self.device.download(buf[at:at + size], ptr)
            at += size
        if self._mrope:  # then the positions' RoPE t components and their next text positions
            ints = buf[at:].view(np.int32)
            ints[:n], ints[n:] = self._rope_t[seq, first:first + n], self._rope_next[seq, first:first + n]
        self.device.sync()
        return buf

    def import_kv(self, seq: int, first: int, data: Any) -> None:
        view = np.frombuffer(memoryview(data).cast("B"), np.uint8)
        n, rest = divmod(len(view), self.kv_position_bytes)
        if rest or first != self.seq_n_past(seq) or first + n > self.n_ctx:
            raise EngineError(f"import of {len(view)} bytes at position {first}: sequence {seq} continues at "
                              f"{self._n_past[seq]} of {self.n_ctx}, positions of {self.kv_position_bytes} bytes")
        at = 0
        for ptr, size in self._runs(seq, first, n) if n else []:
            self.device.upload(ptr, view[at:at + size])
            at += size
        if self._mrope:
            ints = view[at:].view(np.int32)
            self._rope_t[seq, first:first + n], self._rope_next[seq, first:first + n] = ints[:n], ints[n:]
        self.device.sync()  # the caller's buffer is read by now
        if n:
            self._state.cut(seq)  # the rows came without a state: load_state
            self._checkpoints.pop(seq, None)
        self._n_past[seq] = first + n
        if self.mtp_window and n:  # imported rows are not the window's history: it starts after them
            self._set_history(seq, first + n, first + n)

    def abort(self, seq: int = 0) -> None:
        self.seq_n_past(seq)
        self._aborted.add(seq)

    def clear_abort(self, seq: int = 0) -> None:
        self._aborted.discard(seq)

    def cpu_seconds(self) -> float:
        """The clock the batcher times steps by: wall time here, as a step waits on the device and the misses'
        threads, which the CPU engine's own clock does not see."""
        return time.perf_counter()

    def expert_counts(self) -> dict[str, int]:
        """The expert cache's capacity (experts and bytes) and its counts since the engine started (hits,
        misses, uploads; the trunk's), and the MTP block's experts held beside them (`mtp`)."""
        c, slots = self.slots.counts, self.slots
        return {"capacity": slots.capacity, "bytes": slots.capacity * slots.slot_bytes, "hits": c.hits,
                "misses": c.misses, "uploads": c.uploads, "preloaded": c.preloaded,
                "mtp": self.n_expert * self.mtp_experts_held}

    # --- a call

    def eval_batch(self, items: Sequence[BatchItem], notify_fd: int = -1) -> list[np.ndarray]:
        if notify_fd >= 0:
            os.eventfd_write(notify_fd, 1)
        if not items:
            raise EngineError("eval needs at least one token")
        ids, seqs, pos, outs, rows, index, grid = self._batch_arrays(self._live_ctx(), items)
        if ids.min() < 0 or ids.max() >= self.n_vocab:
            raise EngineError(f"token id out of range [0, {self.n_vocab})")
        for s in set(seqs.tolist()):
            if self._n_past[s] + int((seqs == s).sum()) > self.n_ctx:
                raise EngineError(f"sequence {s}: context full ({self.n_ctx} positions)")
            self._state.check(s)
        embd_of = np.full(len(ids), -1, np.int64)
        embd_of[index] = np.arange(len(index))
        rope = self._rope_positions(seqs, pos, embd_of, grid)
        logits = np.empty((len(outs), self.n_vocab), np.float32)
        want = np.full(len(ids), -1, np.int64)
        want[outs] = np.arange(len(outs))
        dropped: set[int] = set()
        records: list[np.ndarray] = []  # the routing record's, when on
        n_chunks = 0
        for start in range(0, len(ids), self.n_batch):
            dropped |= {s for s in self._aborted if s in set(seqs.tolist())}
            take = np.arange(start, min(start + self.n_batch, len(ids)))
            take = take[~np.isin(seqs[take], list(dropped))]
            if len(take):
                chunk_logits = self._chunk(ids[take], seqs[take], pos[take], rope[take], rows, embd_of[take],
                                           want[take] >= 0, records, n_chunks)
                n_chunks += 1
                logits[want[take][want[take] >= 0]] = chunk_logits
                for s in set(seqs[take].tolist()):
                    self._n_past[s] = int(pos[take][seqs[take] == s].max()) + 1
        if self._routing is not None:
            self._write_routing(records, n_chunks)
        self._aborted -= dropped
        results = _item_logits(items, logits, frozenset(dropped))
        if dropped:
            raise EngineAborted("aborted", frozenset(dropped), results)
        return results  # type: ignore[return-value]  # no None without a dropped sequence

    def _rope_positions(self, seqs: np.ndarray, pos: np.ndarray, embd_of: np.ndarray, grid: np.ndarray) -> np.ndarray:
        """Each token's RoPE position (t, h, w), as the CPU engine's rope_positions gives them: its position on
        every axis, or with multi-axis RoPE the next text position after the sequence's last (a picture's rows at
        their grid place from where the picture starts), each kept with its position (scratch past n_past until a
        chunk takes it in)."""
        if not self._mrope:
            return np.repeat(pos.astype(np.int32)[:, None], 3, axis=1)
        rope = np.empty((len(pos), 3), np.int32)
        for t, (s, p, r) in enumerate(zip(seqs.tolist(), pos.tolist(), embd_of.tolist(), strict=True)):
            text = int(self._rope_next[s, p - 1]) if p > 0 else 0
            if r >= 0 and grid[r, 0] >= 0:
                row, col = int(grid[r, 0]), int(grid[r, 1])
                start = text if (row == 0 and col == 0) or p == 0 else int(self._rope_t[s, p - 1])
                rope[t] = (start, start + row, start + col)
            else:
                rope[t] = text
            self._rope_t[s, p], self._rope_next[s, p] = rope[t, 0], 1 + rope[t].max()
        return rope

    def _write_routing(self, records: list[np.ndarray], n_chunks: int) -> None:
        """Append the call's records ([layer, chunk, n_tok, ids], as the CPU engine writes them) to the trace."""
        assert self._routing is not None
        buffer = self._routing.buffer(sum(int(r[2]) for r in records if r[0] == 0), n_chunks)  # the call's tokens
        flat = np.concatenate(records) if records else np.zeros(0, np.int32)
        buffer[:len(flat)] = flat
        self._routing.write(len(flat), n_chunks)

    def _chunk(self, ids: np.ndarray, seqs: np.ndarray, pos: np.ndarray, rope: np.ndarray, rows: np.ndarray,
               embd_of: np.ndarray, wants: np.ndarray, records: list[np.ndarray], chunk: int) -> np.ndarray:
        """One forward pass over a chunk's tokens; the logits rows of those that want them."""
        n, a, dev = len(ids), self._a, self.device
        if not self.resident:
            self.slots.begin_step()
        pos32 = pos.astype(np.int32)
        # the runs of each sequence's tokens (adjacent: a call has one item a sequence), for the recurrent layers
        starts = np.flatnonzero(np.r_[True, seqs[1:] != seqs[:-1]])
        sizes = dict(n=n, runs=len(starts), recurrent_runs=0, chunked_runs=0)
        staged = {"x": self._embeddings(ids, rows, embd_of), "seq": seqs.astype(np.int32), "pos": pos32,
                  "n_pos": pos32 + 1, "rope": np.ascontiguousarray(rope, np.int32)}
        if self.hybrid:  # the delta rule's form per run, the CPU engine's choice: the other form's slot is -1 (skipped)
            run_seq, run_first = seqs[starts].astype(np.int32), np.r_[starts, n].astype(np.int32)
            chunked = np.array([lib.strata_deltanet_chunked(int(m)) for m in np.diff(run_first)], bool)
            staged |= {"run_seq": run_seq, "run_first": run_first,
                       "recurrent_seq": np.where(chunked, -1, run_seq).astype(np.int32),
                       "chunked_seq": np.where(chunked, run_seq, -1).astype(np.int32)}
            sizes.update(recurrent_runs=len(starts) * int(not chunked.all()),
                         chunked_runs=len(starts) * int(chunked.any()))
        for name, array in staged.items():
            dev.upload(a[name], array)
        self._in_flight = list(staged.values())  # host buffers the stream reads, kept until a synchronisation
        if self.resident:  # the whole pass queued at once; its routing read after the step's synchronisation
            self._step.run(**sizes)
        else:
            self._trunk_pass(sizes, records, chunk)
        hidden = None
        if self.mtp:  # the hidden states: output_norm(x), as the output head reads them
            self._hidden_launches.run(n=n)
            hidden = dev.to_host(a["mtp_h"], (n, self.n_embd), np.float32)
        # logits = rmsnorm(x rows that want them) @ Woutput
        rows_wanted = np.flatnonzero(wants).astype(np.int32)
        m = len(rows_wanted)
        logits = np.empty((m, self.n_vocab), np.float32)
        if m:
            dev.upload(a["rows"], rows_wanted)
            self._output_launches.run(m=m)
            dev.download(logits, a["logits"])
        if self.resident:
            dev.download(self._step_ids, a["ids"])
        dev.sync()  # the step's one synchronisation where it is resident
        self._in_flight = []
        if self.resident:
            self._count_resident(n, records, chunk)
        if hidden is not None:
            self._mtp_fill(ids, seqs, pos, rope, rows, embd_of, hidden)
        return logits

    def _count_resident(self, n: int, records: list[np.ndarray], chunk: int) -> None:
        """A resident step's routing, read back: each layer's distinct experts counted as hits, and with a routing
        record its records as `_moe` writes them."""
        ids = self._step_ids[:, :n].reshape(self.n_layer, n * self.n_used)
        chosen = np.sort(ids, axis=1)
        self.slots.count_held(self.n_layer + int(np.count_nonzero(chosen[:, 1:] != chosen[:, :-1])))
        if self._routing is not None:
            head = np.column_stack([np.arange(self.n_layer), np.full((self.n_layer, 2), (chunk, n))])
            records.extend(np.concatenate([head.astype(np.int32), ids], axis=1))

    def _embeddings(self, ids: np.ndarray, rows: np.ndarray, embd_of: np.ndarray,
                    table: str = "token_embd") -> np.ndarray:
        """x rows: the token embeddings looked up in the mapped file (`table`) by the engine's dequantisers (the
        CPU engine's rows), or the caller's rows."""
        t = self._tensor(table)
        own = embd_of < 0
        looked = get_rows(t.type, self._file.data(t), t.shape[1], t.shape[0], ids[own])
        if own.all():
            return looked
        x = np.empty((len(ids), self.n_embd), np.float32)
        x[own], x[~own] = looked, rows[embd_of[~own], :self.n_embd]
        return x

    # --- the MTP block: its rows filled at each eval, drafts chained from the held hidden states

    def _mtp_fill(self, ids: np.ndarray, seqs: np.ndarray, pos: np.ndarray, rope: np.ndarray, rows: np.ndarray,
                  embd_of: np.ndarray, hidden: np.ndarray) -> None:
        """Without a window, the block over the pairs a chunk completes, then the chunk's hidden states held. A
        token at p > 0 completes the pair of p - 1: the hidden state at p - 1 (the chunk's, else a held one: zeros
        where none is, after an import) and that token (its embedding, or the caller's row). Eager, unlike the CPU
        engine's lazy fill: a pass is about a layer's work on the device, and the rows then follow the trunk's
        (`keep` and `copy_prefix` as the CPU engine's, an import's pairs not filled, as its own). With a window,
        `_mtp_window_eval` first."""
        if self.mtp_window:
            self._mtp_window_eval(ids, seqs, pos, rope, rows, embd_of, hidden)
            self._history.keep(seqs, pos, hidden, rope, np.where(embd_of >= 0, -1, ids))
            return
        take = np.flatnonzero(pos > 0)
        if len(take):
            first = np.r_[True, seqs[1:] != seqs[:-1]]
            h = np.zeros((len(take), self.n_embd), np.float32)
            pair_rope = np.repeat((pos[take] - 1)[:, None], 3, axis=1).astype(np.int32)
            inner = ~first[take]
            h[inner], pair_rope[inner] = hidden[take[inner] - 1], rope[take[inner] - 1]
            for j in np.flatnonzero(~inner).tolist():
                s, p = int(seqs[take[j]]), int(pos[take[j]]) - 1
                at = self._history.held(s, p)
                if at is not None:
                    h[j], pair_rope[j] = self._history.hidden[s, at], self._history.rope[s, at]
            embd = self._embeddings(ids[take], rows, embd_of[take], self._mtp_table)
            self._mtp_run(embd, h, seqs[take], pos[take] - 1, pair_rope)
            self._mtp_counts[0] += 1
            self._mtp_counts[1] += len(take)
        self._history.keep(seqs, pos, hidden, rope, np.where(embd_of >= 0, -1, ids))

    def _mtp_window_eval(self, ids: np.ndarray, seqs: np.ndarray, pos: np.ndarray, rope: np.ndarray,
                         rows: np.ndarray, embd_of: np.ndarray, hidden: np.ndarray) -> None:
        """With a window, a chunk fills no pair, as mtp.c's plan_chunk: a sequence's waiting pairs whose hidden
        states the held history would lose lapse (its history starts after them), and one whose chunk brings
        embedding rows (whose tokens the held history cannot give later) fills its last `mtp_window` pairs now."""
        at = {(int(s), int(p)): t for t, (s, p) in enumerate(zip(seqs.tolist(), pos.tolist(), strict=True))}
        pairs = []
        for s in np.unique(seqs).tolist():
            mine = seqs == s
            last, filled = int(pos[mine].max()), int(self._mtp_filled[s])
            if not (embd_of[mine] >= 0).any():
                if filled <= last - MTP_HISTORY:
                    self._set_history(s, last - MTP_HISTORY + 1, last - MTP_HISTORY + 1)
                continue
            if last - filled > self.mtp_window:
                self._set_history(s, last - self.mtp_window, last - self.mtp_window)
            pairs += [(s, p) for p in range(int(self._mtp_filled[s]), last)]
            self._mtp_filled[s] = max(last, int(self._mtp_filled[s]))
        if pairs:
            self._fill_pairs(pairs, (at, ids, rope, rows, embd_of, hidden))

    def _fill_pairs(self, pairs: list[tuple[int, int]], chunk: tuple[Any, ...] | None = None) -> None:
        """The block over `pairs` (sequence, position p: the hidden state at p, the token at p + 1), each from the
        chunk (at, ids, rope, rows, embd_of, hidden: `at` maps a position to its index there) where it has that
        position, else from the held history (zeros and p's RoPE position for a hidden state not held, after an
        import), n_batch at a time."""
        at, ids, rope, rows, embd_of, hidden = chunk or ({}, None, None, np.empty((0, self.n_embd), np.float32),
                                                         None, None)
        n = len(pairs)
        h = np.zeros((n, self.n_embd), np.float32)
        pair_rope = np.repeat(np.array([p for _, p in pairs], np.int32)[:, None], 3, axis=1)
        tokens, token_rows = np.zeros(n, np.int32), np.full(n, -1, np.int64)
        for j, (s, p) in enumerate(pairs):
            t = at.get((s, p))
            row = self._history.held(s, p) if t is None else None
            if t is not None:
                h[j], pair_rope[j] = hidden[t], rope[t]
            elif row is not None:
                h[j], pair_rope[j] = self._history.hidden[s, row], self._history.rope[s, row]
            t = at.get((s, p + 1))
            if t is not None:
                tokens[j], token_rows[j] = ids[t], embd_of[t]
            else:
                row = self._history.held(s, p + 1)
                assert row is not None and self._history.token[s, row] >= 0, "a waiting pair's token is held"
                tokens[j] = self._history.token[s, row]
        embd = self._embeddings(tokens, rows, token_rows, self._mtp_table)
        seqs = np.array([s for s, _ in pairs], np.int64)
        pos = np.array([p for _, p in pairs], np.int64)
        for lo in range(0, n, self.n_batch):
            hi = min(lo + self.n_batch, n)
            self._mtp_run(embd[lo:hi], h[lo:hi], seqs[lo:hi], pos[lo:hi], pair_rope[lo:hi])
            self._mtp_counts[0] += 1
            self._mtp_counts[1] += hi - lo

    def _set_history(self, seq: int, first: int, filled: int) -> None:
        self._mtp_from[seq], self._mtp_filled[seq] = first, filled

    def _mtp_keep(self, seq: int, n: int) -> None:
        """With a window, the block's history of a sequence cut back to n positions, as mtp.c's mtp_keep: cut before
        its start, it starts again at the last `mtp_window` pairs the held history has."""
        last = max(n - 1, 0)
        self._mtp_filled[seq] = min(int(self._mtp_filled[seq]), last)
        if self._mtp_from[seq] <= self._mtp_filled[seq]:
            return
        first = last
        while first > 0 and last - first < self.mtp_window and self._pair_held(seq, first - 1):
            first -= 1
        self._set_history(seq, first, first)

    def _pair_held(self, seq: int, p: int) -> bool:
        row = self._history.held(seq, p + 1)
        return self._history.held(seq, p) is not None and row is not None and self._history.token[seq, row] >= 0

    def _mtp_run(self, embd: np.ndarray, hidden: np.ndarray, seqs: np.ndarray, pos: np.ndarray,
                 rope: np.ndarray) -> None:
        """x rows = the block over the pairs (embedding row, hidden state) of sequences `seqs` at positions `pos`
        (their K and V rows into the block's cache there)."""
        n, a, dev, E = len(embd), self._a, self.device, self.n_embd
        pos32 = pos.astype(np.int32)
        staged = {"seq": seqs.astype(np.int32), "pos": pos32, "n_pos": pos32 + 1,
                  "rope": np.ascontiguousarray(rope, np.int32), "mtp_first": self._mtp_from[seqs]}
        for name, array in staged.items():
            dev.upload(a[name], array)
        embd, hidden = np.ascontiguousarray(embd, np.float32), np.ascontiguousarray(hidden, np.float32)
        dev.upload(a["mtp_raw"], embd)
        dev.upload(self._floats("mtp_raw", self.n_batch * E), hidden)
        self._in_flight = [embd, hidden, *staged.values()]
        self._block_launches.run(n=n)
        if self.mtp_experts_held:
            self._mtp_resident.run(n=n)
        else:
            self._mtp_experts(n)

    def mtp_draft(self, seqs: Sequence[int], pos: Sequence[int], tokens: Sequence[int], n_draft: int,
                  logits: bool = False) -> tuple[np.ndarray, np.ndarray | None]:
        """`Engine.mtp_draft`, the block run on the device: per step, the pairs of the sequences whose hidden state
        at `pos[i] - 1` is held (the held one and `tokens[i]` first, then the last step's g and draft), each
        draft the argmax of the block's head."""
        seq, at, token = (np.asarray(x, np.int32).reshape(-1) for x in (seqs, pos, tokens))
        n = len(seq)
        drafts = np.full((n, max(n_draft, 0)), -1, np.int32)
        rows = np.zeros((n, n_draft, self.n_vocab), np.float32) if logits else None
        if drafts.size == 0:
            return drafts, rows
        self._check_draft(seq, at, token, n_draft)
        if self.mtp_window:  # the waiting pairs the drafts attend over, the last mtp_window of each sequence's
            pairs = []
            for s, p in zip(seq.tolist(), at.tolist(), strict=True):
                upto = min(p - 1, self._n_past[s] - 1)
                if upto - self.mtp_window > self._mtp_filled[s]:
                    self._set_history(s, upto - self.mtp_window, upto - self.mtp_window)
                pairs += [(s, q) for q in range(int(self._mtp_filled[s]), upto)]
                self._mtp_filled[s] = max(upto, int(self._mtp_filled[s]))
            if pairs:
                self._fill_pairs(pairs)
        held = [(i, self._history.held(int(seq[i]), int(at[i]) - 1)) for i in range(n)]
        live = np.array([i for i, row in held if row is not None], np.int64)
        if not len(live):
            return drafts, rows
        rows_at = np.array([row for _, row in held if row is not None], np.int64)
        h = self._history.hidden[seq[live], rows_at]
        rope = self._history.rope[seq[live], rows_at]
        base = 1 + rope.max(axis=1)  # text after the held position goes on from there
        step_tokens = token[live]
        none = np.full(len(live), -1, np.int64)
        for k in range(n_draft):
            if k:
                rope = np.repeat((base + k - 1)[:, None], 3, axis=1)
            embd = self._embeddings(step_tokens, np.empty((0, self.n_embd), np.float32), none, self._mtp_table)
            self._mtp_run(embd, h, seq[live], at[live] - 1 + k, rope)
            self._head_launches.run(n=len(live))
            step_logits = self.device.to_host(self._a["logits"], (len(live), self.n_vocab), np.float32)
            h = self.device.to_host(self._a["mtp_h"], (len(live), self.n_embd), np.float32)
            self._in_flight = []
            step_tokens = step_logits.argmax(axis=1).astype(np.int32)
            drafts[live, k] = step_tokens
            if rows is not None:
                rows[live, k] = step_logits
        return drafts, rows

    def _check_draft(self, seqs: np.ndarray, pos: np.ndarray, tokens: np.ndarray, n_draft: int) -> None:
        """strata_mtp_draft's checks of a call's arguments."""
        if not self.mtp:
            raise EngineError("mtp_draft: the context runs no MTP block")
        if len(seqs) > self.n_batch or n_draft < 0:
            raise EngineError(f"mtp_draft: {len(seqs)} sequences (at most n_batch, {self.n_batch}), {n_draft} drafts "
                              "each")
        for i, (s, p, t) in enumerate(zip(seqs.tolist(), pos.tolist(), tokens.tolist(), strict=True)):
            if not 0 <= s < self.n_seq:
                raise EngineError(f"mtp_draft: sequence {s} outside [0, {self.n_seq})")
            if p < 1 or p + n_draft > self.n_ctx + 1:
                raise EngineError(f"mtp_draft: {n_draft} drafts after position {p} exceed the context of {self.n_ctx}")
            if not 0 <= t < self.n_vocab:
                raise EngineError(f"token id {t} out of range [0, {self.n_vocab})")
            if s in seqs[:i]:
                raise EngineError(f"mtp_draft: sequence {s} twice")

    def mtp_fills(self) -> tuple[int, int]:
        """(passes of the MTP block over evaluated pairs, the pairs they filled): without a window one pass a chunk
        that completes pairs, as the fill is eager here; with one, a pass (of n_batch pairs at most) a draft with
        pairs waiting."""
        return self._mtp_counts[0], self._mtp_counts[1]

    # --- the launches, built once: per layer up to the router's top-k, the experts' mix, the output

    def _build_launches(self) -> None:
        """Each layer's launches up to its router's top-k, the mix of a layer's experts into the residual (the same
        for every layer), the output's, and each layer's hits' arguments (`strata_dev_launch_experts`)."""
        a, E, ffi = self._a, self.n_embd, self.device.ffi
        self._layers_launches = []
        for il in range(self.n_layer):
            out = LaunchList(self.device)
            if self._recurrent[il]:
                self._deltanet(out, il)
            else:
                self._attention(out, il)
            self._router(out, il)
            self._layers_launches.append(out)
        self._mix = LaunchList(self.device)
        self._mix_launches(self._mix)
        # the rows that want logits gathered, normed, through the output projection
        self._output_launches = out = LaunchList(self.device)
        out.memset(a["slot_x"], 4 * E * ROWS)
        out.launch("add_rows", n_tok=ROWS, k=1, n=E, y=a["x"], idx=a["rows"], out=a["slot_x"])
        out.launch("rms_norm", n=E, n_tok=ROWS, eps=self.eps, x=a["slot_x"], w=self._output_norm, out=a["xb"])
        self._matmul(out, self._output, a["xb"], ROWS, a["logits"])
        if self.mtp:
            self._mtp_launches()
        self._hit_args = [ffi.new("strata_dev_experts_args *", dict(
            gate_type=g.type, up_type=u.type, down_type=d.type, n_embd=E, n_ff=self.n_ff, x=a["slot_x"],
            hb=a["hb"], hb2=a["hb2"], y=a["moe_out"])) for g, u, d in self._experts]
        # the host's side of a layer: the top-k's ids and the normed rows, and the slots grouped by expert
        B, k = self.n_batch, self.n_used
        self._host = dict(ids=np.empty((B, k), np.int32), xb=np.empty((B, E), np.float32),
                          slot_x=np.empty((B * k, E), np.float32), slot_of=np.empty(B * k, np.int32),
                          experts=np.empty(B * k, np.int32), first=np.empty(B * k, np.int32),
                          count=np.empty(B * k, np.int32), miss_y=np.empty((B * k, E), np.float32))
        host = {f"host_{name}": ffi.from_buffer("int[]" if array.dtype == np.int32 else "float[]", array)
                for name, array in self._host.items()}
        # each layer's experts' host side, one call a layer (`strata_dev_moe_layer`); the MTP block's (layer
        # n_layer) none cached
        self._moe_layers = [ffi.new("strata_moe_layer *", dict(
            layer=il if il < self.n_layer else -1, n_expert=self.n_expert, k=k, stream=0, n_embd=E, n_ff=self.n_ff,
            ids=self._ids(il), xb=a["xb"], slot_x=a["slot_x"], moe_out=a["moe_out"], slot_of=a["slot_of"],
            hits=self._hit_args[il], experts=self._layer_experts[il], pool=self._pool, **host))
            for il in range(self.n_layer + self.mtp)]
        # a step's trunk where the cache holds some experts: each layer's launches, its experts and its mix, one call
        self._pass = Pass(self.device, [part for il in range(self.n_layer)
                                        for part in (self._layers_launches[il], self._moe_layers[il], self._mix)])
        self._records = np.empty((self.n_layer, B * k), np.int32)  # each layer's routing, when recorded

    def _mix_launches(self, out: LaunchList) -> None:
        """x += sum over the token's choices of weight * its expert's row (and the shared expert's gated rows)."""
        a, E = self._a, self.n_embd
        out.launch("add_rows", n_tok=N, k=self.n_used, n=E, y=a["moe_out"], idx=a["slot_of"], weight=a["weights"],
                   out=a["x"])
        if self.hybrid:
            out.launch("add_rows", n_tok=N, k=1, n=E, y=a["sh_out"], out=a["x"])

    def _hold_mtp_experts(self, slot: int) -> np.ndarray:
        """The MTP block's routed experts uploaded into one allocation (on the upload stream, which the resident
        step's build waits for): their slots' addresses."""
        dev, layer = self.device, self._layer_experts[self.n_layer]
        block = dev.ffi.cast("char *", dev.alloc(self.n_expert * slot))
        for e in range(self.n_expert):
            dev.check(dev.lib.strata_dev_upload_expert(dev.handle, self._upload_stream, block + e * slot, layer, e))
        return int(dev.ffi.cast("uintptr_t", block)) + slot * np.arange(self.n_expert, dtype=np.uint64)

    def _build_resident_step(self, mtp_slots: np.ndarray | None) -> None:
        """A step's whole forward pass up to the output as one list (split only by memsets): per layer its
        launches up to the top-k, its experts (`_resident_experts`) and the mix; a table of every expert's slot on
        the device, which the products read (with `mtp_slots`, the MTP block's experts' after the trunk's, and
        their list: the block's experts and mix); and the host buffer the step's routing comes back to."""
        B, k = self.n_batch, self.n_used
        table = self.slots.table if mtp_slots is None else np.concatenate([self.slots.table, mtp_slots])
        self._slot_table = self._put(table)  # every expert held: no 0 in it
        if mtp_slots is not None:
            self._mtp_resident = LaunchList(self.device)
            self._resident_experts(self._mtp_resident, self.n_layer)
            self._mix_launches(self._mtp_resident)
        self._step = out = LaunchList(self.device)
        for il in range(self.n_layer):
            if self._recurrent[il]:
                self._deltanet(out, il)
            else:
                self._attention(out, il)
            self._router(out, il)
            self._resident_experts(out, il)
            self._mix_launches(out)
        self._step_ids = np.empty((self.n_layer, B, k), np.int32)

    def _resident_experts(self, out: LaunchList, il: int) -> None:
        """Layer il's routed experts on the device, every one held: the slots grouped by expert (slot_x, slot_of,
        each expert's run), then gate and up over every expert's run at once, SwiGLU, down into moe_out."""
        a, E, F, k, ffi = self._a, self.n_embd, self.n_ff, self.n_used, self.device.ffi
        out.launch("moe_group", n_tok=N, k=k, n_expert=self.n_expert, n=E, ids=self._ids(il), x=a["xb"],
                   x_out=a["slot_x"], slot_of=a["slot_of"], first=a["moe_first"], count=a["moe_count"])
        slots = ffi.cast("void **", self._slot_table) + il * self.n_expert
        offset = 0
        for tensor, n, rows, x, y in zip(self._experts[il], (E, E, F), (F, F, E), ("slot_x", "slot_x", "hb"),
                                         ("hb", "hb2", "moe_out"), strict=True):
            out.launch("moe_matmul", type=int(tensor.type), n_expert=self.n_expert, n=n, rows=rows, max_rows=N,
                       n_slots=N * k, row_bytes=tensor.n_bytes // self.n_expert // rows, offset=offset,
                       slots=slots, first=a["moe_first"], count=a["moe_count"], x=a[x], y=a[y])
            offset += tensor.n_bytes // self.n_expert
            if y == "hb2":
                out.launch("swiglu", n=N * k * F, g=a["hb"], u=a["hb2"], out=a["hb"])

    def _mtp_launches(self) -> None:
        """The MTP block's: the chunk's hidden states; the block over a set of pairs up to its router's top-k
        (x = eh_proj([enorm(embedding), hnorm(hidden)]), then layer n_layer's attention on its own cache); its
        head (g = head_norm(x) in mtp_h; logits = g Whead)."""
        a, E, B, eps = self._a, self.n_embd, self.n_batch, self.eps
        self._hidden_launches = out = LaunchList(self.device)
        out.launch("rms_norm", n=E, n_tok=N, eps=eps, x=a["x"], w=self._output_norm, out=a["mtp_h"])
        self._block_launches = out = LaunchList(self.device)
        hidden = self._floats("mtp_raw", B * E)
        out.launch("rms_norm", n=E, n_tok=N, eps=eps, x=a["mtp_raw"], w=self._enorm, out=a["mtp_raw"])
        out.launch("rms_norm", n=E, n_tok=N, eps=eps, x=hidden, w=self._hnorm, out=hidden)
        out.memset(a["mtp_pair"], 8 * E * N)
        out.launch("add_rows", n_tok=2 * N, k=1, n=E, y=a["mtp_raw"], idx=a["mtp_idx"], out=a["mtp_pair"])
        self._matmul(out, self._eh_proj, a["mtp_pair"], N, a["x"])
        self._attention(out, self.n_layer)
        self._router(out, self.n_layer)
        self._head_launches = out = LaunchList(self.device)
        out.launch("rms_norm", n=E, n_tok=N, eps=eps, x=a["x"], w=self._head_norm, out=a["mtp_h"])
        self._matmul(out, self._head, a["mtp_h"], N, a["logits"])

    def _matmul(self, out: LaunchList, w: Matrix, x: Any, n_tok: Size, y: Any) -> None:
        out.launch("matmul", type=int(w.type), n=w.n_in, rows=w.n_out, n_tok=n_tok, row_bytes=w.row_bytes, w=w.ptr,
                   x=x, y=y)

    def _floats(self, name: str, offset: int) -> Any:
        """Activation buffer `name` from float `offset` on."""
        return self.device.ffi.cast("float *", self._a[name]) + offset

    def _attention(self, out: LaunchList, il: int) -> None:
        L, a, E, hd, nh, n = self._layers[il], self._a, self.n_embd, self.head_dim, self.n_head, N
        # xb = rmsnorm(x); q, k, v = xb Wq, Wk, Wv; gated attention's q rows gathered from its (query, gate) heads
        out.launch("rms_norm", n=E, n_tok=n, eps=self.eps, x=a["x"], w=L["attn_norm"], out=a["xb"])
        self._matmul(out, L["attn_q"], a["xb"], n, a["qg" if self.hybrid else "q"])
        if self.hybrid:
            out.memset(a["q"], 4 * n * nh * hd)
            out.launch("add_rows", n_tok=n * nh, k=1, n=hd, y=a["qg"], idx=a["q_rows"], out=a["q"])
        for name, rows in (("attn_k", "k"), ("attn_v", "v")):
            self._matmul(out, L[name], a["xb"], n, a[rows])
        # q, k heads = rope(rmsnorm(head)) on their first n_rot values; k, v rows into the cache at the tokens'
        # positions
        for name, heads in (("q", nh), ("k", self.n_head_kv)):
            out.launch("rms_norm", n=hd, n_tok=n * heads, eps=self.eps, x=a[name], w=L[f"attn_{name}_norm"],
                       out=a[name])
            out.launch("rope", n_tok=n, n_head=heads, head_dim=hd, neox=1, n_rot=self.n_rot, x=a[name],
                       pos=a["rope"], inv_freq=self._inv_freq, axis=self._axis)
        # the trunk's cache, or the MTP block's (layer n_layer) own
        k, v, k_scale, v_scale = ((self._k, self._v, self._k_scale, self._v_scale) if il < self.n_layer
                                  else self._mtp_cache)
        kv = dict(n_head_kv=self.n_head_kv, head_dim=hd, kv_type=_KV_TYPES[self.kv_type],
                  n_layer=self.n_kv_layer if il < self.n_layer else 1,
                  il=int(self._kv_layer[il]) if il < self.n_layer else 0, n_ctx=self.n_ctx, k=k, v=v, k_scale=k_scale,
                  v_scale=v_scale, seq=a["seq"])
        out.launch("kv_store", n_tok=n, k_in=a["k"], v_in=a["v"], pos=a["pos"], **kv)
        # att = softmax(q K^T / sqrt(hd)) V over each token's positions (times the sigmoid of each head's gate);
        # x += att Wo
        first = {} if il < self.n_layer else {"first": a["mtp_first"]}  # the block's from its history's start
        out.launch("attention", n_tok=n, n_head=nh, q=a["q"], n_pos=a["n_pos"], out=a["att"], **kv, **first)
        if self.hybrid:
            out.launch("sigmoid_gate", n=hd, n_rows=n * nh, gate_stride=2 * hd, per_value=1,
                       gate=self._floats("qg", hd), x=a["att"])
        self._matmul(out, L["attn_output"], a["att"], n, a["xb"])
        out.launch("add_rows", n_tok=n, k=1, n=E, y=a["xb"], out=a["x"])

    def _deltanet(self, out: LaunchList, il: int) -> None:
        """A Gated DeltaNet layer (blocks_deltanet.c's maths) on each run's sequence's state."""
        L, a, E, d, n = self._layers[il], self._a, self.n_embd, self.d_state, N
        hk, hv, C = self.n_k_heads, self.n_v_heads, self.conv_dim
        # xb = rmsnorm(x); qkv, z, alpha, beta = xb Wqkv, Wz, Walpha, Wbeta
        out.launch("rms_norm", n=E, n_tok=n, eps=self.eps, x=a["x"], w=L["attn_norm"], out=a["xb"])
        for name, rows in (("attn_qkv", "dn_qkv"), ("attn_gate", "dn_z"), ("ssm_alpha", "dn_alpha"),
                           ("ssm_beta", "dn_beta")):
            self._matmul(out, L[name], a["xb"], n, a[rows])
        # q, k, v = silu(conv(qkv)) from each sequence's conv state; L2-normed q (by 1/sqrt(d) too) and k heads;
        # g and beta per v head
        runs = dict(n_seq=RUNS, seq=a["run_seq"], seq_first=a["run_first"], state_stride=self._state.floats)
        layer = int(self._rec_layer[il]) * self.layer_state_floats
        out.launch("dn_conv", d_conv=self.d_conv, channels=C, x=a["dn_qkv"], w=L["ssm_conv1d"],
                   state=self._state.at(0, layer), out=a["dn_conv"], **runs)
        q_scale = float(np.float32(1.0) / np.sqrt(np.float32(d)))  # as the CPU engine's, in float
        for offset, scale in ((0, q_scale), (hk * d, 1.0)):
            out.launch("l2_norm", n_tok=n, n_head=hk, head_dim=d, row_stride=C, scale=scale,
                       x=self._floats("dn_conv", offset))
        out.launch("dn_gates", n_tok=n, n_head=hv, alpha=a["dn_alpha"], beta=a["dn_beta"], a=L["ssm_a"],
                   dt_bias=L["ssm_dt.bias"])
        # o = the gated delta rule per (sequence, v head), each run by the recurrent form (decode, short runs) or
        # the chunked one (a prompt's), as the CPU engine chooses; o = rmsnorm(o) w silu(z); x += o Wout
        rule = dict(n_k_heads=hk, n_v_heads=hv, head_dim=d, row_stride=C, q=a["dn_conv"],
                    k=self._floats("dn_conv", hk * d), v=self._floats("dn_conv", 2 * hk * d), g=a["dn_alpha"],
                    beta=a["dn_beta"], state=self._state.at(0, layer + self.conv_floats), out=a["dn_out"],
                    **(runs | dict(n_seq=RECURRENT_RUNS, seq=a["recurrent_seq"])))
        out.launch("delta_rule", **rule)
        out.launch("delta_rule_chunked", **(rule | dict(n_seq=CHUNKED_RUNS, seq=a["chunked_seq"])))
        out.launch("gated_rms_norm", n=d, n_rows=n * hv, eps=self.eps, x=a["dn_out"], z=a["dn_z"], w=L["ssm_norm"],
                   out=a["dn_out"])
        self._matmul(out, L["ssm_out"], a["dn_out"], n, a["xb"])
        out.launch("add_rows", n_tok=n, k=1, n=E, y=a["xb"], out=a["x"])

    def _router(self, out: LaunchList, il: int) -> None:
        """xb = rmsnorm(x); the shared expert's rows where the model has one; each token's top-k experts and their
        weights (which the host reads back with xb)."""
        L, a, n = self._layers[il], self._a, N
        out.launch("rms_norm", n=self.n_embd, n_tok=n, eps=self.eps, x=a["x"], w=L["ffn_norm"], out=a["xb"])
        if self.hybrid:
            self._shared_expert(out, il)
        self._matmul(out, L["ffn_gate_inp"], a["xb"], n, a["router"])
        out.launch("topk", n_tok=n, n_expert=self.n_expert, k=self.n_used, logits=a["router"], ids=self._ids(il),
                   weights=a["weights"])

    def _ids(self, il: int) -> Any:
        """Layer il's top-k ids on the device: (n_batch, k)."""
        return self.device.ffi.cast("int *", self._a["ids"]) + il * self.n_batch * self.n_used

    def _shared_expert(self, out: LaunchList, il: int) -> None:
        """sh_out = SwiGLU(xb) through the shared expert, times the sigmoid of xb . its gate."""
        L, a, n = self._layers[il], self._a, N
        self._matmul(out, L["ffn_gate_inp_shexp"], a["xb"], n, a["sh_gate"])
        self._matmul(out, L["ffn_gate_shexp"], a["xb"], n, a["sh_hb"])
        self._matmul(out, L["ffn_up_shexp"], a["xb"], n, a["sh_hb2"])
        out.launch("swiglu", n=n * self.n_ff_shexp, g=a["sh_hb"], u=a["sh_hb2"], out=a["sh_hb"])
        self._matmul(out, L["ffn_down_shexp"], a["sh_hb"], n, a["sh_out"])
        out.launch("sigmoid_gate", n=self.n_embd, n_rows=n, gate_stride=1, per_value=0, gate=a["sh_gate"],
                   x=a["sh_out"])

    # --- a layer's experts

    def _trunk_pass(self, sizes: dict[str, int], records: list[np.ndarray], chunk: int) -> None:
        """Every layer of the trunk where the cache holds some experts, in one call (`strata_dev_run_pass`): per
        layer its launches up to the top-k, its experts (the top-k read back with xb, the slots grouped by expert,
        the hits on the device, the misses on the CPU's threads), the mix into the residual."""
        dev = self.device
        recorded = self._routing is not None
        n = sizes["n"]
        self._pass.run(self.slots.handle, n, dev.ffi.from_buffer("int[]", self._records) if recorded else dev.ffi.NULL,
                       **sizes)
        self._in_flight = []  # what the host gave the stream is read by now (each layer synchronises once)
        if recorded:
            used = self._records.reshape(-1)[:self.n_layer * n * self.n_used].reshape(self.n_layer, -1)
            head = np.column_stack([np.arange(self.n_layer), np.full((self.n_layer, 2), (chunk, n))])
            records.extend(np.concatenate([head.astype(np.int32), used], axis=1))

    def _mtp_experts(self, n: int) -> None:
        """The MTP block's routed experts (`strata_dev_moe_layer`, every one a miss: the cache holds the trunk's),
        then their mix into the residual."""
        dev = self.device
        dev.check(dev.lib.strata_dev_moe_layer(dev.handle, self.slots.handle, self._moe_layers[self.n_layer], n,
                                               dev.ffi.NULL))
        self._in_flight = []
        self._mix.run(n=n)

    def close(self) -> None:
        """Close the CPU engine and the device (which frees every allocation on it). Idempotent."""
        pool = self.__dict__.pop("_pool", None)
        if pool is not None:
            self.device.lib.strata_host_pool_free(pool)
        device = self.__dict__.pop("device", None)
        if device is not None:
            device.close()
        super().close()
