"""`Engine`: a GGUF model and a context of several sequences in the C engine.

The GGUF file is memory-mapped (`strata.gguf_file`); the C model keeps pointers into that mapping, so the mapping
lives as long as the engine. Every C call releases the GIL (cffi API mode), so `abort()` works from another thread
while `eval` runs.
"""

from __future__ import annotations

import os
import pathlib
from collections.abc import Sequence
from typing import Any, Self

import numpy as np

from strata.engine_cffi._engine import ffi, lib
from strata.experts.trace import RoutingRecorder, TraceInfo
from strata.gguf_file import GGUFError, GGUFFile
from strata.pictures.rows import PictureRows

__all__ = ["BatchItem", "Engine", "EngineAborted", "EngineError", "PictureRows", "crc32c", "get_rows"]

# The architectures the C forward pass runs (its own table, ARCHS in archs.c, has their traits and layers).
SUPPORTED_ARCHITECTURES = ("qwen3moe", "qwen3", "llama", "qwen3vl", "qwen3vlmoe", "qwen35", "qwen35moe")
# Hybrid architectures (Gated DeltaNet layers with a recurrent state between attention ones), and every
# `{arch}.` key the engine reads or knows to leave the maths alone: any other is refused, naming it.
_HYBRID = ("qwen35", "qwen35moe")
_HYBRID_KEYS = frozenset({
    "block_count", "context_length", "embedding_length", "feed_forward_length", "attention.head_count",
    "attention.head_count_kv", "attention.key_length", "attention.value_length", "attention.layer_norm_rms_epsilon",
    "rope.freq_base", "rope.dimension_count", "rope.dimension_sections", "expert_count", "expert_used_count",
    "expert_feed_forward_length", "expert_shared_feed_forward_length", "ssm.conv_kernel", "ssm.state_size",
    "ssm.group_count", "ssm.time_step_rank", "ssm.inner_size", "attention.recurrent_layers",
    "full_attention_interval", "nextn_predict_layers", "vocab_size"})
_KV_TYPES = {"f32": lib.STRATA_KV_F32, "f16": lib.STRATA_KV_F16, "int8": lib.STRATA_KV_INT8}
_INT32 = np.iinfo(np.int32)
KV_LAYOUT = 1  # the layout of exported positions (kv_rows.c): a change makes every stored block another's


class EngineError(Exception):
    """The engine refused a file or a call; the message is the C engine's (or names the file)."""


class EngineAborted(EngineError):
    """`Engine.abort()` stopped the call in flight; the positions it had not finished were dropped.

    Attributes:
        dropped: the sequences the call dropped (for `eval_batch`: the others' work is complete).
        results: for `eval_batch`, what it would have returned, None for each item of a dropped sequence.
    """

    def __init__(self, message: str, dropped: frozenset[int] = frozenset(),
                 results: list[np.ndarray | None] | None = None):
        super().__init__(message)
        self.dropped, self.results = dropped, results or []


# (index in the tokens, rows): rows replacing the embeddings of tokens[index : index + len(rows)]
Embeds = Sequence[tuple[int, "np.ndarray | PictureRows"]]


class BatchItem:
    """One sequence's part of an `Engine.eval_batch` call: tokens appended after what the sequence holds.

    Args:
        seq: the sequence.
        tokens: its new tokens.
        embeds: (index in `tokens`, float32 (n_rows, picture_width) or `PictureRows`) rows replacing token
            embeddings.
        logits: "last" (the last token's logits), "all" or "none".
    """

    __slots__ = ("embeds", "logits", "seq", "tokens")

    def __init__(self, seq: int, tokens: Sequence[int], embeds: Embeds | None = None, logits: str = "last"):
        if logits not in ("last", "all", "none"):
            raise ValueError(f"logits must be 'last', 'all' or 'none', not {logits!r}")
        self.seq, self.tokens, self.embeds, self.logits = int(seq), tokens, embeds, logits


def _check(status: int) -> None:
    """Raise the exception for a C status (no-op for STRATA_OK)."""
    if status == lib.STRATA_OK:
        return
    message = ffi.string(lib.strata_last_error()).decode("utf-8", "replace")
    if status == lib.STRATA_ABORTED:
        raise EngineAborted(message)
    raise EngineError(message or ffi.string(lib.strata_status_string(status)).decode())


def _open_gguf(path: str | os.PathLike[str]) -> GGUFFile:
    if not pathlib.Path(path).is_file():
        raise EngineError(f"model file not found: {path}")
    try:
        return GGUFFile(path)
    except GGUFError as exc:
        raise EngineError(str(exc)) from None


def _item_logits(items: Sequence[BatchItem], logits: np.ndarray, dropped: frozenset[int]) -> list[np.ndarray | None]:
    """Each item's rows of a batch's logits (views), None for an item of a dropped sequence."""
    results: list[np.ndarray | None] = []
    at = 0
    for item in items:
        n = {"all": len(item.tokens), "last": 1, "none": 0}[item.logits]
        results.append(None if item.seq in dropped else logits[at : at + n])
        at += n
    return results


class _TensorTable:
    """The C tensor table for a file's tensors; holds the cffi objects the table points into."""

    def __init__(self, file: GGUFFile) -> None:
        self._keep: list[Any] = []
        self.count = len(file.tensors)
        self.array = ffi.new("strata_tensor_info[]", max(self.count, 1))
        for info, tensor in zip(self.array, file.tensors, strict=False):  # the array has at least one entry
            name = ffi.new("char[]", tensor.name.encode())
            data = ffi.from_buffer(file.data(tensor))  # a view of the mapping: weights are never copied
            self._keep += [name, data]
            info.name, info.type, info.n_dims = name, tensor.type, len(tensor.shape)
            for d in range(4):
                info.ne[d] = tensor.shape[d] if d < len(tensor.shape) else 1
            info.data, info.n_bytes = data, tensor.n_bytes


def _model_params(file: GGUFFile, table: _TensorTable, keep: list[Any]) -> Any:
    """strata_model_params from the GGUF metadata (llama.cpp key names); the C side validates the values."""
    arch = file.metadata.get("general.architecture")
    if not isinstance(arch, str):
        raise EngineError("the file has no general.architecture")
    # Before any hyper-parameter is read: other architectures' keys may not even have our types (LFM2 stores
    # head_count_kv per layer, as an array).
    if arch not in SUPPORTED_ARCHITECTURES:
        raise EngineError(f"unsupported architecture '{arch}' (this engine runs {', '.join(SUPPORTED_ARCHITECTURES)})")

    def key(name: str, default: float = 0) -> Any:
        return file.metadata.get(f"{arch}.{name}", default)

    arch_c = ffi.new("char[]", arch.encode())
    keep.append(arch_c)
    p = ffi.new("strata_model_params *")
    p.arch = arch_c
    embd = file.tensor("token_embd")
    if embd is None:
        raise EngineError("missing tensor token_embd")
    embd_shape = list(embd.shape)
    if len(embd_shape) != 2:
        raise EngineError(f"token_embd has shape {embd_shape}, expected [n_embd, n_vocab]")
    p.n_vocab = embd_shape[1]
    try:
        _set_hparams(p, arch, key)
    except (TypeError, ValueError, OverflowError) as exc:  # a key of the wrong type or range
        raise EngineError(f"bad hyper-parameter in the GGUF metadata: {exc}") from exc
    if arch in _HYBRID:
        _set_hybrid_hparams(p, arch, file.metadata, key, keep)
    p.tensors, p.n_tensors = table.array, table.count
    return p


def _set_hybrid_hparams(p: Any, arch: str, metadata: dict[str, Any], key: Any, keep: list[Any]) -> None:
    """Qwen3.5's keys: the Gated DeltaNet's sizes, which layers are recurrent, the shared expert, the MTP blocks
    (counted in block_count, after the layers the forward pass runs). A key the engine does not know is refused."""
    unknown = sorted(k for k in metadata if k.startswith(f"{arch}.") and k[len(arch) + 1:] not in _HYBRID_KEYS)
    if unknown:
        raise EngineError(f"unknown key {unknown[0]} in a {arch} file (refused: it may change the model's maths)")
    if key("attention.value_length", p.head_dim) != p.head_dim:
        raise EngineError(f"attention.value_length {key('attention.value_length')} differs from key_length "
                          f"{p.head_dim}")
    p.n_nextn = key("nextn_predict_layers")
    n_all = p.n_layer
    p.n_layer = n_all - p.n_nextn
    if p.n_layer <= 0:
        raise EngineError(f"block_count {n_all} leaves no layer besides {p.n_nextn} MTP blocks")
    flags = key("attention.recurrent_layers", None)
    if flags is None:
        interval = key("full_attention_interval", 4)
        if interval <= 0:
            raise EngineError(f"full_attention_interval {interval} must be positive")
        recurrent = [(il + 1) % interval != 0 for il in range(p.n_layer)]
    else:
        recurrent = [bool(f) for f in flags]
        if len(recurrent) != n_all or any(recurrent[p.n_layer:]):
            raise EngineError(f"attention.recurrent_layers has {len(recurrent)} entries, expected block_count "
                              f"{n_all} with the MTP blocks not recurrent")
    layers = ffi.new("int[]", [int(r) for r in recurrent[: p.n_layer]])
    keep.append(layers)
    p.recurrent_layers = layers
    p.ssm_d_conv, p.ssm_d_state = key("ssm.conv_kernel"), key("ssm.state_size")
    p.ssm_n_group, p.ssm_dt_rank = key("ssm.group_count"), key("ssm.time_step_rank")
    p.ssm_d_inner = key("ssm.inner_size")
    p.n_ff_shexp = key("expert_shared_feed_forward_length")


def _set_hparams(p: Any, arch: str, key: Any) -> None:
    """Fill the hyper-parameters of `p`; key(name, default) reads `{arch}.name`."""
    p.n_ctx_train, p.n_embd, p.n_layer = key("context_length"), key("embedding_length"), key("block_count")
    p.n_head, p.n_head_kv = key("attention.head_count"), key("attention.head_count_kv", key("attention.head_count"))
    p.head_dim = key("attention.key_length", (p.n_embd // p.n_head) if p.n_head else 0)
    p.n_ff, p.n_expert, p.n_expert_used = key("feed_forward_length"), key("expert_count"), key("expert_used_count")
    p.n_ff_exp = key("expert_feed_forward_length")
    p.rope_base, p.rms_eps = key("rope.freq_base", 10000.0), key("attention.layer_norm_rms_epsilon", 1e-6)
    sections = [int(n) for n in key("rope.dimension_sections", [])]
    if len(sections) > 4:
        raise EngineError(f"rope.dimension_sections has {len(sections)} values, expected at most 4")
    p.rope_sections = sections + [0] * (4 - len(sections))
    p.n_deepstack = key("n_deepstack_layers")
    p.n_rot = key("rope.dimension_count", p.head_dim)  # the leading dimensions of a head RoPE turns
    if p.n_rot != p.head_dim and arch not in _HYBRID:
        raise EngineError(f"rope.dimension_count {p.n_rot} differs from the head size {p.head_dim} (partial RoPE is "
                          f"not supported for {arch})")
    scaling = key("rope.scaling.type", "none")
    if scaling != "none":  # Llama 3's "llama3" scaling writes no type: its factors are the rope_freqs tensor
        raise EngineError(f"unsupported rope.scaling.type {scaling!r} (the engine runs unscaled RoPE and Llama 3's "
                          "rope_freqs)")


def crc32c(data: Any, crc: int = 0) -> int:
    """CRC-32C of a buffer (bytes, memoryview, numpy array), continued from `crc`: the engine's own, 6.7 GB/s with
    SSE4.2 against zlib's crc32 at 0.6-3.7 GB/s here, on the disk tier's read path. Releases the GIL."""
    view = memoryview(data).cast("B")
    return int(lib.strata_crc32c(ffi.from_buffer(view), len(view), crc))


def get_rows(qtype: int, data: Any, n_rows: int, n_cols: int, ids: np.ndarray) -> np.ndarray:
    """Rows `ids` of a table of `n_rows` rows of `n_cols` values of GGML type `qtype` (its bytes `data`, e.g. a
    mapped GGUF tensor), float32 (len(ids), n_cols): the engine's dequantisers, as its forward pass looks the token
    embeddings up (`strata_get_rows`; the same bits as the gguf package's). Releases the GIL.

    Raises:
        EngineError: a type the engine does not read, a shape that does not fit it, or an id outside the table.
    """
    table = ffi.from_buffer(data)
    if len(table) < n_rows * lib.strata_row_bytes(int(qtype), n_cols):
        raise EngineError(f"get_rows: {len(table)} bytes hold no {n_rows} rows of {n_cols} values of type {qtype}")
    ids32 = np.ascontiguousarray(ids, np.int32)
    out = np.empty((len(ids32), n_cols), np.float32)
    _check(lib.strata_get_rows(int(qtype), table, n_rows, n_cols, ffi.from_buffer("int[]", ids32), len(ids32),
                               ffi.from_buffer("float[]", out)))
    return out


def kv_cache_bytes(n_layer: int, n_head_kv: int, head_dim: int, n_ctx: int, n_seq: int, kv: str) -> int:
    """The bytes of the KV cache the engine allocates (`strata_kv_bytes`): K and V rows of `head_dim` values per
    layer, KV head, position and sequence; an int8 row carries a float32 scale."""
    rows = n_seq * n_layer * n_head_kv * n_ctx
    return 2 * rows * (head_dim * {"f32": 4, "f16": 2, "int8": 1}[kv] + (4 if kv == "int8" else 0))


def attention_layers(params: Any) -> int:
    """The layers with KV rows: every layer but a hybrid model's recurrent ones."""
    if params.recurrent_layers == ffi.NULL:
        return int(params.n_layer)
    return sum(1 for il in range(params.n_layer) if not params.recurrent_layers[il])


def recurrent_state_bytes(params: Any) -> int:
    """One sequence's recurrent state (`strata_state_bytes`): per recurrent layer, (conv_kernel - 1) rows of the
    convolution's channels and the delta rule's (v heads, head size, head size), float32."""
    n_rec = int(params.n_layer) - attention_layers(params)
    if n_rec == 0:
        return 0
    conv_dim = 2 * params.ssm_n_group * params.ssm_d_state + params.ssm_d_inner
    return 4 * n_rec * ((params.ssm_d_conv - 1) * conv_dim + params.ssm_dt_rank * params.ssm_d_state ** 2)


def _check_kv_budget(params: Any, n_ctx: int, n_seq: int, kv: str, budget: int, mtp: bool) -> None:
    """Refuse, before allocating anything, a KV cache (with a hybrid model's recurrent state per slot, and the MTP
    block's rows with `mtp`) larger than `budget` bytes, naming what would fit."""
    shape = (attention_layers(params) + int(mtp), params.n_head_kv, params.head_dim)
    state = recurrent_state_bytes(params)
    need = kv_cache_bytes(*shape, n_ctx, n_seq, kv) + n_seq * state
    if need <= budget:
        return
    per_slot = kv_cache_bytes(*shape, n_ctx, 1, kv) + state
    slots = budget // per_slot
    positions = max(0, budget - n_seq * state) // max(1, kv_cache_bytes(*shape, 1, n_seq, kv))
    with_state = f" with {state / 2**20:,.1f} MiB of recurrent state per slot" if state else ""
    raise EngineError(f"the KV cache of {n_seq} slots x {n_ctx} positions ({kv}){with_state} needs "
                      f"{need / 2**20:,.1f} MiB, over the KV budget of {budget / 2**20:,.1f} MiB: {slots} slots of "
                      f"{n_ctx} positions fit, or {n_seq} slots of {positions} positions")


class Engine:
    """A model and a context of `n_seq` sequences. Use `Engine.load`; close it (or use `with`) to free its memory.

    The single-sequence calls (`eval`, `keep`, `n_past`, `abort`, ...) take `seq=0` by default, so a context of
    one sequence reads like one.
    """

    _ctx: Any = None  # the C context; None once closed, and in an engine whose construction failed (`__del__`)

    def __init__(self, file: GGUFFile, params: Any, model: Any, ctx: Any, keep: list[Any], n_ctx: int,
                 threads: int, n_batch: int, kv_type: int, mtp: bool = False) -> None:
        self._file, self._model, self._ctx, self._keep = file, model, ctx, keep
        self.arch: str = ffi.string(params.arch).decode()
        self.n_vocab: int = params.n_vocab
        self.n_embd: int = params.n_embd
        # (MoE layers, experts a layer, experts a token uses), None without routed experts: what a step's
        # draft tokens may add to the experts it reads (`strata.scheduling.drafts.VerifyCost`)
        self.expert_routing: tuple[int, int, int] | None = (
            (params.n_layer, params.n_expert, params.n_expert_used) if params.n_expert > 0 else None)
        # the width of a picture's rows: the embedding, then Qwen3-VL's deepstack slices
        self.picture_width: int = params.n_embd * (1 + params.n_deepstack)
        self.n_ctx, self.threads, self.backend = n_ctx, threads, "cpu"
        self.n_seq: int = lib.strata_n_seq(ctx)
        self.n_batch: int = n_batch
        self.kv_bytes: int = lib.strata_kv_bytes(ctx)  # the KV cache of every sequence, allocated once
        # one sequence's recurrent state (every recurrent layer's conv rows and delta-rule state; 0 without), and
        # whether the model has one: its sequences cannot be cut back to an arbitrary prefix
        self.state_bytes: int = lib.strata_state_bytes(ctx)
        self.recurrent: bool = self.state_bytes > 0
        # weights laid out again at load (the output weight's bands) and copied (mapped_weights off): memory
        # beyond the mapped file
        self.prepared_bytes: int = lib.strata_model_prepared_bytes(model)
        self.copied_bytes: int = lib.strata_model_copied_bytes(model)
        self._dropped = ffi.new("int[]", self.n_seq)
        self._routing: RoutingRecorder | None = None
        self.kv_type: str = next(name for name, value in _KV_TYPES.items() if value == kv_type)
        # what names the bits of the cached rows: the model file, the KV type and the rows' layout
        self.kv_identity: str = f"{file.fingerprint()}:{self.kv_type}:layout{KV_LAYOUT}"
        self.kv_position_bytes: int = lib.strata_kv_position_bytes(ctx)
        self.has_mtp: bool = params.n_nextn > 0  # the file has an MTP block
        # which layers are recurrent (a hybrid model's Gated DeltaNet ones; none elsewhere)
        self.recurrent_layers: tuple[bool, ...] = (
            () if params.recurrent_layers == ffi.NULL
            else tuple(bool(params.recurrent_layers[il]) for il in range(params.n_layer)))
        self.mtp: bool = bool(mtp)  # the context runs it: `mtp_draft`
        self.mtp_window = 0  # its window (`load`'s `mtp_window`)

    @classmethod
    def load(cls, path: str | os.PathLike[str], n_ctx: int = 4096, threads: int | None = None, kv: str = "f16",
             n_batch: int = 256, n_seq: int = 1, kv_budget: int | None = None,
             mapped_weights: bool = False, record_routing: str | os.PathLike[str] | None = None,
             mtp: bool | None = False, mtp_window: int = 0, host_cache: bool = True) -> Self:
        """Map a GGUF model and create its context: `n_seq` sequences of `n_ctx` positions each.

        Args:
            kv_budget: the most bytes the KV cache of all sequences may take; None: what they need.
            mapped_weights: read every weight where the file is mapped (4 KiB pages), instead of a copy of the
                matrices that decode reads whole, in huge pages and Q8_0 ones in bands (faster decode and
                prompts, the same logits; the copy is memory the kernel cannot drop, as it can the file's pages).
            record_routing: a file to write the routing trace of every eval to (`strata.experts.trace`): each
                MoE layer's chosen experts per token of each step.
            mtp: run the model's MTP block for `mtp_draft` (speculative decoding's drafts): a layer more of KV
                rows per slot, and about a layer's work more per token the block fills (lazily: the pairs a
                draft needs, in one batched pass; see `mtp_fills`); None: where the file has one.
            mtp_window: with `mtp`, 0: the block attends over each sequence's whole history (an eval fills the
                pairs its kept hidden states would lose); N (at most 128, `STRATA_MTP_HISTORY`): over what it
                filled since its drafts last started, the last N pairs at least: evals fill nothing, pairs not
                drafted from lapse, and a draft fills the last N waiting at most (a backed-off sequence's guess
                costs N pairs, not its whole prompt; drafts from the recent history only, verified as any).
            host_cache: allocate the context's KV cache, recurrent states and a batch's buffers for `n_seq`,
                `n_ctx` and `n_batch`; False for a subclass whose forward pass keeps them elsewhere (the GPU
                backend's device): the C context then holds one sequence of one position, one token and no MTP
                block (the subclass keeps the `n_seq` slots and runs the block where `mtp` says), and `kv_bytes`
                is 0 until the subclass says (the checks of `n_ctx` and `kv_budget`, the block's rows and the
                recurrent states included, are made all the same).

        Raises:
            EngineError: missing, truncated or non-GGUF file; unsupported architecture or tensor type; a context
                larger than the model's training context; a KV cache over `kv_budget`; bad arguments.
        """
        if kv not in _KV_TYPES:
            raise EngineError(f"kv must be one of {sorted(_KV_TYPES)}, not {kv!r}")
        threads = threads or len(os.sched_getaffinity(0))
        file = _open_gguf(path)
        try:
            table = _TensorTable(file)
            keep: list[Any] = [table]
            params = _model_params(file, table, keep)
            params.copy_weights, params.load_threads = not mapped_weights, threads
            keep.append(params)
            mtp = params.n_nextn > 0 if mtp is None else mtp
            if kv_budget is not None:
                _check_kv_budget(params, n_ctx, n_seq, kv, kv_budget, mtp)
            if not host_cache and n_ctx > params.n_ctx_train:  # the C context's own check sees one position
                raise EngineError(f"context of {n_ctx} positions is larger than the model's {params.n_ctx_train}")
            model_out = ffi.new("strata_model **")
            _check(lib.strata_model_create(params, model_out))
        except BaseException:
            keep = []
            file.close()
            raise
        on_host = (n_ctx, n_seq, n_batch) if host_cache else (1, 1, 1)
        cparams = ffi.new("strata_context_params *", {"n_ctx": on_host[0], "n_seq": on_host[1], "n_batch": on_host[2],
                                                      "n_threads": threads, "kv_type": _KV_TYPES[kv],
                                                      "mtp": int(mtp and host_cache),
                                                      "mtp_window": mtp_window if mtp and host_cache else 0})
        ctx_out = ffi.new("strata_context **")
        status = lib.strata_context_create(model_out[0], cparams, ctx_out)
        if status != lib.STRATA_OK:
            lib.strata_model_free(model_out[0])
            keep = []
            file.close()
            _check(status)
        if not mapped_weights:  # the model has its own copy of every tensor but the embeddings it looks up
            embeddings = file.tensor("token_embd")
            file.release(t for t in file.tensors if t is not embeddings)
        engine = cls(file, params, model_out[0], ctx_out[0], keep, n_ctx, threads, min(n_batch, n_ctx), _KV_TYPES[kv],
                     mtp)
        engine.mtp_window = mtp_window if mtp and host_cache else 0
        if not host_cache:
            engine.kv_bytes, engine.n_seq = 0, n_seq
        if record_routing is not None:
            try:
                engine._record_routing(record_routing, params)
            except BaseException:
                engine.close()
                raise
        return engine

    def _record_routing(self, path: str | os.PathLike[str], params: Any) -> None:
        """Start writing the routing trace to `path`."""
        if params.n_expert <= 0:
            raise EngineError(f"record_routing: the {self.arch} model has no experts to record")
        name = self.metadata.get("general.name")
        info = TraceInfo(name if isinstance(name, str) else os.path.basename(self._file.path), self.arch,
                         params.n_layer, params.n_expert, params.n_expert_used)
        try:
            self._routing = RoutingRecorder(path, info)
        except OSError as exc:
            raise EngineError(f"record_routing: cannot write {path}: {exc.strerror}") from None

    # --- state

    def _live_ctx(self) -> Any:
        if self._ctx is None:
            raise EngineError("the engine is closed")
        return self._ctx

    @property
    def n_past(self) -> int:
        """Positions sequence 0 holds."""
        return self.seq_n_past(0)

    def seq_n_past(self, seq: int) -> int:
        """Positions sequence `seq` holds."""
        n = lib.strata_n_past(self._live_ctx(), int(seq))
        if n < 0:
            raise EngineError(f"sequence {seq} outside [0, {self.n_seq})")
        return n

    @property
    def metadata(self) -> dict[str, Any]:
        """GGUF key -> value (strings, numbers, lists of strings, numpy arrays of numbers)."""
        return self._file.metadata

    @property
    def timings(self) -> dict[str, float]:
        """Timings of the last eval: a call of one token counts as decode, a longer one as prompt processing."""
        t = ffi.new("strata_timings *")
        lib.strata_get_timings(self._live_ctx(), t)
        decode = t.n_tokens == 1
        return {"n_tokens": t.n_tokens, "n_chunks": t.n_chunks, "ms": t.total_ms, "output_ms": t.output_ms,
                "prompt_ms": 0.0 if decode else t.total_ms, "decode_ms": t.total_ms if decode else 0.0,
                "tokens_per_s": t.n_tokens * 1e3 / t.total_ms if t.total_ms > 0 else 0.0}

    # --- calls

    def eval(self, tokens: Sequence[int], embeds: Embeds | None = None, all_logits: bool = False,
             seq: int = 0) -> np.ndarray:
        """Append `tokens` after the positions sequence `seq` holds and return float32 logits: (n_vocab,) for the
        last position, or (len(tokens), n_vocab) with all_logits.

        Args:
            embeds: (index_in_tokens, float32 (n_rows, picture_width) or `PictureRows`) pairs; the rows replace the
                token embeddings of tokens[index : index + n_rows].
        Raises:
            EngineAborted: abort() stopped the call.
            EngineError: empty or out-of-range tokens, bad embedding rows, context full.
        """
        item = BatchItem(seq, tokens, embeds, "all" if all_logits else "last")
        (logits,) = self.eval_batch([item])
        return logits if all_logits else logits[0]

    def eval_batch(self, items: Sequence[BatchItem], notify_fd: int = -1) -> list[np.ndarray]:
        """Evaluate the tokens of several sequences in one call: every weight is read once for all of them.

        Returns, per item, its logits rows: (1, n_vocab) for "last", (len(tokens), n_vocab) for "all", (0, n_vocab)
        for "none" (views into one array). `notify_fd`: an eventfd the call adds 1 to as it starts, without the GIL
        (-1: none).
        Raises:
            EngineAborted: abort(seq) dropped some sequences (`dropped`); the others' work is complete, but the
                logits are not returned: evaluate nothing more for the dropped ones and look at `seq_n_past`.
            EngineError: a sequence twice or out of range, empty or out-of-range tokens, bad embedding rows, a
                sequence's context full.
        """
        ctx = self._live_ctx()
        if not items:
            raise EngineError("eval needs at least one token")
        ids32, seq32, pos32, out32, rows, index, grid = self._batch_arrays(ctx, items)
        logits = np.empty((len(out32), self.n_vocab), dtype=np.float32)
        batch = ffi.new("strata_batch *")
        keep = [ffi.from_buffer("int[]", ids32), ffi.from_buffer("int[]", seq32), ffi.from_buffer("int[]", pos32),
                ffi.from_buffer("float[]", rows), ffi.from_buffer("int[]", index), ffi.from_buffer("int[]", out32),
                ffi.from_buffer("float[]", logits), ffi.from_buffer("int[]", np.ascontiguousarray(grid))]
        batch.n_tokens, batch.tokens, batch.seq, batch.pos = len(ids32), keep[0], keep[1], keep[2]
        batch.embd_rows, batch.embd_index, batch.n_embd_rows = keep[3], keep[4], len(index)
        batch.embd_grid = keep[7] if (grid >= 0).any() else ffi.NULL
        batch.out_index, batch.n_out, batch.logits = keep[5], len(out32), keep[6]
        batch.seq_dropped = self._dropped
        batch.notify_fd = notify_fd
        if self._routing is None:
            status = lib.strata_eval_batch(ctx, batch)
        else:
            status = self._eval_recorded(ctx, batch)
        dropped = frozenset(s for s in range(self.n_seq) if self._dropped[s]) if status == lib.STRATA_ABORTED \
            else frozenset()
        if status != lib.STRATA_ABORTED:
            _check(status)
        results = _item_logits(items, logits, dropped)
        if dropped:
            raise EngineAborted(ffi.string(lib.strata_last_error()).decode("utf-8", "replace"), dropped, results)
        return results  # type: ignore[return-value]  # no None without a dropped sequence

    def mtp_draft(self, seqs: Sequence[int], pos: Sequence[int], tokens: Sequence[int], n_draft: int,
                  logits: bool = False) -> tuple[np.ndarray, np.ndarray | None]:
        """Greedy drafts of the model's MTP block (an engine loaded with `mtp`): for each sequence `seqs[i]`, whose
        history ends with `tokens[i]` at position `pos[i]` (not evaluated yet; position `pos[i] - 1` evaluated
        by a recent eval), `n_draft` tokens likely to follow it, chained (see `strata_mtp_draft`).

        Returns (drafts int32 (n, n_draft), -1s for a sequence whose hidden state is not held; with `logits`,
        each draft's logits float32 (n, n_draft, n_vocab), else None).
        Raises:
            EngineError: no MTP block run, a sequence twice or out of range, drafts past the context.
        """
        ctx = self._live_ctx()
        arrays = [np.ascontiguousarray(a, dtype=np.int32) for a in (seqs, pos, tokens)]
        drafts = np.full((len(arrays[0]), max(n_draft, 0)), -1, np.int32)
        rows = np.zeros((len(arrays[0]), n_draft, self.n_vocab), np.float32) if logits else None
        if drafts.size == 0:
            return drafts, rows
        _check(lib.strata_mtp_draft(ctx, len(drafts), *(ffi.from_buffer("int[]", a) for a in arrays), int(n_draft),
                                    ffi.from_buffer("int[]", drafts),
                                    ffi.from_buffer("float[]", rows) if rows is not None else ffi.NULL))
        return drafts, rows

    def mtp_fills(self) -> tuple[int, int]:
        """(passes of the MTP block over evaluated pairs, the pairs they filled) since the engine was loaded. Evals
        fill the block's rows lazily: a draft first fills what waits, in one pass (see `strata_mtp_counts`)."""
        counts = ffi.new("strata_mtp_counts *")
        lib.strata_mtp_get_counts(self._live_ctx(), counts)
        return int(counts.fill_runs), int(counts.pairs)

    def _eval_recorded(self, ctx: Any, batch: Any) -> int:
        """strata_eval_batch with the routing record on, its records appended to the trace."""
        assert self._routing is not None
        n_chunks = -(-batch.n_tokens // self.n_batch)
        buffer = self._routing.buffer(batch.n_tokens, n_chunks)
        _check(lib.strata_record_routing(ctx, ffi.from_buffer("int[]", buffer), buffer.size))
        try:
            status = lib.strata_eval_batch(ctx, batch)
        finally:
            used = lib.strata_routing_used(ctx)
            lib.strata_record_routing(ctx, ffi.NULL, 0)
        assert used >= 0, "the routing record's buffer is sized for every record of the call"
        t = ffi.new("strata_timings *")
        lib.strata_get_timings(ctx, t)
        self._routing.write(used, t.n_chunks)
        return int(status)

    def _batch_arrays(self, ctx: Any, items: Sequence[BatchItem]) -> tuple[np.ndarray, ...]:
        """The C batch's arrays for `items`: token ids, sequences and positions (int32, one per token), the
        tokens whose logits are wanted, and the embedding rows with their token indices and grid places (a
        placeholder row and grid when there are none: an empty buffer has no address to give).

        Raises:
            EngineError: a sequence twice or out of range, empty or out-of-range tokens, bad embedding rows.
        """
        seen: set[int] = set()
        ids: list[int] = []
        seqs: list[int] = []
        pos: list[int] = []
        outs: list[int] = []
        row_blocks, row_index, grid_blocks = [], [], []
        for item in items:
            if item.seq in seen or not 0 <= item.seq < self.n_seq:
                raise EngineError(f"sequence {item.seq}: twice in one call or outside [0, {self.n_seq})")
            seen.add(item.seq)
            start, n = len(ids), len(item.tokens)
            if n == 0:
                raise EngineError(f"sequence {item.seq}: no tokens")
            ids.extend(item.tokens)
            past = self.seq_n_past(item.seq)
            seqs.extend([item.seq] * n)
            pos.extend(range(past, past + n))
            if item.logits == "all":
                outs.extend(range(start, start + n))
            elif item.logits == "last":
                outs.append(start + n - 1)
            if item.embeds:
                rows, index, grid = self._embedding_rows(item.embeds, n)
                row_blocks.append(rows)
                row_index.append(index + start)
                grid_blocks.append(grid)
        ids64 = np.asarray(ids, dtype=np.int64)
        if ids64.min() < _INT32.min or ids64.max() > _INT32.max:
            raise EngineError(f"token id out of range [0, {self.n_vocab})")
        if row_blocks:
            rows, index = np.concatenate(row_blocks), np.concatenate(row_index).astype(np.int32)
            grid = np.concatenate(grid_blocks)
        else:
            rows, index = np.zeros((1, self.picture_width), np.float32), np.zeros(0, np.int32)
            grid = np.full((1, 2), -1, np.int32)  # not read: an empty buffer has no address to give
        return (ids64.astype(np.int32), np.asarray(seqs, dtype=np.int32), np.asarray(pos, dtype=np.int32),
                np.asarray(outs, dtype=np.int32), rows, index, grid)

    def _embedding_rows(self, embeds: Embeds, n_tokens: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The embedding rows as one (n_rows, picture_width) array, the token index of each row, and each row's
        (row, column) in its picture's grid ((-1, -1): plain rows, placed as text)."""
        rows, index, grid = [], [], []
        for start, array in embeds:
            block = np.ascontiguousarray(array, dtype=np.float32)
            if block.ndim != 2 or block.shape[1] != self.picture_width:
                raise EngineError(f"embedding rows at {start} have shape {block.shape}, expected "
                                  f"(n, {self.picture_width})")
            rows.append(block)
            index.append(int(start) + np.arange(len(block), dtype=np.int64))
            grid.append(array.grid() if isinstance(array, PictureRows) else np.full((len(block), 2), -1, np.int32))
        if not rows:
            return np.zeros((0, self.picture_width), np.float32), np.zeros(0, np.int64), np.zeros((0, 2), np.int32)
        at = np.concatenate(index)
        if at.min() < 0 or at.max() >= n_tokens:  # the C check sees call indices, which would name another sequence
            raise EngineError(f"embedding rows at indices outside the {n_tokens} tokens")
        return np.concatenate(rows), at, np.concatenate(grid)

    def keep(self, n: int, seq: int = 0) -> None:
        """Truncate sequence `seq` to its first n positions; keep(0) clears it. A recurrent model's state cannot be
        cut back: n below what the sequence holds leaves it invalid, and an eval of the sequence fails until
        `load_state` or keep(0)."""
        _check(lib.strata_keep(self._live_ctx(), int(seq), int(n)))

    def copy_prefix(self, src: int, dst: int, n: int) -> None:
        """Sequence `dst` = the first n positions of sequence `src` (copied KV rows: no forward pass). A recurrent
        model's state goes with them when n is all `src` holds; a shorter n leaves `dst`'s state invalid (as
        `keep` does)."""
        _check(lib.strata_copy_prefix(self._live_ctx(), int(src), int(dst), int(n)))

    def save_state(self, seq: int = 0) -> bytes:
        """Sequence `seq`'s recurrent state as it is at its n_past (`state_bytes` bytes; empty for a model
        without recurrent layers)."""
        buf = bytearray(self.state_bytes)
        _check(lib.strata_state_save(self._live_ctx(), int(seq), ffi.from_buffer(buf)))
        return bytes(buf)

    def checkpoint_state(self, seq: int = 0) -> None:
        """Keep sequence `seq`'s recurrent state as it is now, at its n_past, for `restore_state` (the next eval
        with its tokens copies each layer's state before changing it: `strata_state_checkpoint`)."""
        _check(lib.strata_state_checkpoint(self._live_ctx(), int(seq)))

    def restore_state(self, seq: int = 0) -> None:
        """Sequence `seq`'s recurrent state = its checkpoint's, valid, after `keep` back to the position it was
        taken at (no copy: `strata_state_restore`)."""
        _check(lib.strata_state_restore(self._live_ctx(), int(seq)))

    def load_state(self, seq: int, data: bytes) -> None:
        """Set sequence `seq`'s recurrent state to `data` (from `save_state`), which must belong at its current
        n_past (after `keep` or `copy_prefix` to that n); the state is valid again."""
        if len(data) != self.state_bytes:
            raise EngineError(f"a state of {len(data)} bytes; this model's is {self.state_bytes}")
        _check(lib.strata_state_load(self._live_ctx(), int(seq), ffi.from_buffer(data or b"\0")))

    def export_kv(self, seq: int, first: int, n: int) -> np.ndarray:
        """Positions [first, first + n) of sequence `seq` as bytes (uint8, n x `kv_position_bytes`): their K and V
        rows of every layer, int8 scales, RoPE components (`strata_kv_export`'s layout, which depends on n)."""
        buf = np.empty(n * self.kv_position_bytes, np.uint8)
        _check(lib.strata_kv_export(self._live_ctx(), int(seq), int(first), int(n), ffi.from_buffer(buf)))
        return buf

    def import_kv(self, seq: int, first: int, data: Any) -> None:
        """Append positions exported by `export_kv` from position `first` (bytes, or a buffer of them) to sequence
        `seq`, which holds exactly `first` positions: its cache continues as if they had been evaluated (a recurrent
        model's state is invalid then until `load_state`)."""
        view = memoryview(data).cast("B")
        n, rest = divmod(len(view), self.kv_position_bytes)
        if rest:
            raise EngineError(f"{len(view)} bytes are not whole positions of {self.kv_position_bytes} bytes")
        _check(lib.strata_kv_import(self._live_ctx(), int(seq), int(first), n, ffi.from_buffer(view)))

    def abort(self, seq: int = 0) -> None:
        """Stop sequence `seq`'s work in the eval in flight (from any thread) within one layer of a chunk; the call's
        other sequences go on. If no call is in flight, the next call with tokens of `seq` stops it at once (so a
        decode loop ends even when the abort falls between two steps); `clear_abort()` drops such a flag when it
        is no longer wanted."""
        _check(lib.strata_abort(self._live_ctx(), int(seq)))

    def expert_counts(self) -> dict[str, int] | None:
        """None: the CPU engine has no expert cache (`DeviceEngine` has)."""
        return None

    def cpu_seconds(self) -> float:
        """CPU seconds this context's threads have run: the calling thread's (call it from the thread that
        evaluates) and the pool workers'. A step's work, without the process's other threads."""
        return float(lib.strata_cpu_seconds(self._live_ctx()))

    def sample_rows(self, rows: Sequence[np.ndarray], settings: Sequence[Any], u: Sequence[float]) -> list[int]:
        """A token drawn from each row of logits (n_vocab float32 each), as `strata.text.sampling.draw` draws it (row i
        under settings[i], a `SamplingParams`, with u[i]; numpy's arg-max where settings[i] is greedy), the rows
        shared out among the engine's threads. Call it between evals, from the thread that evaluates."""
        if not rows:
            return []
        n = self.n_vocab
        keep = [np.ascontiguousarray(row, dtype=np.float32) for row in rows]
        if any(row.shape != (n,) for row in keep):
            raise EngineError(f"draws need rows of {n} logits")
        pointers = ffi.new("float *[]", [ffi.from_buffer("float[]", row) for row in keep])
        draws = ffi.new("strata_sampling[]", [{"temperature": 0.0 if p.greedy else p.temperature, "top_k": p.top_k,
                                               "top_p": p.top_p, "min_p": p.min_p} for p in settings])
        tokens = ffi.new("int[]", len(keep))
        _check(lib.strata_sample_rows(self._live_ctx(), len(keep), pointers, n, draws, ffi.new("double[]", u),
                                      tokens))
        if any(tokens[i] < 0 for i in range(len(keep))):
            raise MemoryError("no memory for the top-k candidates")
        return list(tokens)

    def clear_abort(self, seq: int = 0) -> None:
        """Lower an abort flag that no call has consumed, e.g. before starting a new request's work."""
        _check(lib.strata_clear_abort(self._live_ctx(), int(seq)))

    def close(self) -> None:
        """Free the context and the model, then drop the file mapping. Idempotent."""
        if self._ctx is not None:
            lib.strata_context_free(self._ctx)
            lib.strata_model_free(self._model)
            self._ctx = self._model = None
            self._keep.clear()
            self._file.close()
            if self._routing is not None:
                self._routing.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __del__(self) -> None:
        self.close()
