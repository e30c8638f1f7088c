"""The image encoder on a device (`strata-vision --gpu`): the forward pass of `encoder.py` (`lfm2`) and `qwen3vl.py`
(`qwen3vl_merger`, Qwen3-VL and Qwen3.5) through the device interface (`engine_cffi/device.py`).

At start every weight goes to the device once (matrices in their file's type for the device's `matmul`, biases and
norms as float32) and a workspace for the largest picture part the encoder's budget allows is allocated: together
`planned_bytes`, known from the file before the encoder starts, so a server can leave that share of the card to
it. Per picture part only the patches, the resized position embeddings and two index tables go up, and the rows
come down.

On the device: the products (`matmul`); biases and residuals (`add_rows`: a bias is row 0 of a one-row table for
every token); LayerNorm; GELU (tanh, or erf where the checkpoint uses it); attention over all the patches
(`vit_attention`); Qwen3-VL's 2-D RoPE (`rope`, the patch's row and column as two position components, each turning
a quarter of the head's NEOX pairs); the 2x2 merge (`add_rows` with an index: each merged token's four patch rows
gathered into zeroed rows). The host keeps patchify and the positions' resizing, as the CPU encoder computes them.
The cancellation check runs before each layer and the stream is synchronised after each, so a cancelled encode
stops at the next layer boundary.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Iterator
from typing import Any

import gguf
import numpy as np

from strata.engine_cffi.device import Device, DeviceError
from strata.engine_cffi.device_engine import DEVICE_TYPES
from strata.vision import encoder as vit
from strata.vision import qwen3vl
from strata.vision.encoder import EncodeCancelled, Encoder
from strata.vision.load import open_encoder
from strata.vision.mmproj import Linear, Mmproj, Norm, VisionHParams
from strata.vision.preprocess import sizing, token_budget
from strata.vision.protocol import Sizing

LFM2_VL_MERGE_EPS = 1e-5  # LFM2-VL's projector LayerNorm is a default nn.LayerNorm
MAX_PATCHES = 65535  # the card's add_rows takes a token per row of its grid (at most 65535 rows)


def largest_part(rule: Sizing) -> int:
    """The most merged tokens one encoded part (a whole picture, a tile or a thumbnail) has under `rule`."""
    side = rule.tile_size // (rule.patch_size * rule.merge) if rule.tile_size else 0
    return max(rule.max_tokens, side * side)


def part_tokens(hp: VisionHParams, min_tokens: int | None, max_tokens: int | None) -> int:
    """`largest_part` under the budget `strata-vision --min-tokens/--max-tokens` give an encoder of `hp`."""
    low, high = token_budget(hp, min_tokens, max_tokens)
    return largest_part(sizing(hp, high, low))


def encoder_share(path: str | os.PathLike[str], min_tokens: int | None, max_tokens: int | None) -> int:
    """The device bytes `strata-vision --gpu --mmproj path` with these flags takes (`planned_bytes`), read from the
    file without starting it.

    Raises:
        MmprojError: the file cannot be loaded.
    """
    mmproj = open_encoder(path, 1).mmproj
    return planned_bytes(mmproj, part_tokens(mmproj.hparams, min_tokens, max_tokens))


def _weights(node: Any) -> Iterator[Linear | Norm]:
    """Every Linear and Norm of a loaded mmproj, in field order (the reader and arrays are not walked)."""
    if isinstance(node, Linear | Norm):
        yield node
    elif dataclasses.is_dataclass(node) and not isinstance(node, type):
        for field in dataclasses.fields(node):
            if field.compare:
                yield from _weights(getattr(node, field.name))
    elif isinstance(node, tuple):
        for item in node:
            yield from _weights(item)
    elif isinstance(node, dict):
        for item in node.values():
            yield from _weights(item)


def _weight_arrays(weight: Linear | Norm) -> tuple[np.ndarray, np.ndarray]:
    if isinstance(weight, Linear):
        return weight.weight.data, weight.bias
    return weight.weight, weight.bias


def workspace(mmproj: Mmproj | qwen3vl.Qwen3VLMmproj, tokens: int) -> dict[str, int]:
    """Bytes of each device buffer the encoder keeps beside its weights, for parts of up to `tokens` merged
    tokens. Five of a patch row's width: the residual x; h, a normed copy, then the positions, the attention's
    output or a branch's; q, k, v, of which q holds the merged tokens after a layer."""
    hp = mmproj.hparams
    patches, n = tokens * hp.merge**2, hp.n_embd
    if isinstance(mmproj, qwen3vl.Qwen3VLMmproj):
        mergers = [mmproj.merger, *mmproj.deepstack.values()]
        n_out, hidden = len(mergers), max(m.fc1.weight.n_rows for m in mergers)
        extra = {"rope_pos": 12 * patches, "inv_freq": 2 * hp.head_dim, "axis": hp.head_dim // 2}
    else:
        n_out, hidden, extra = 1, mmproj.mm_up.weight.n_rows, {}
    f32 = 4 * patches
    buffers = {"patches": f32 * 3 * hp.patch_size**2, "zeros": f32, "gather": f32}
    buffers |= dict.fromkeys(("x", "h", "q", "k", "v"), f32 * n)
    buffers |= {"up": f32 * hp.n_ff, "hidden": 4 * tokens * hidden, "rows": 4 * tokens * hp.n_proj * n_out}
    return buffers | extra


def planned_bytes(mmproj: Mmproj | qwen3vl.Qwen3VLMmproj, tokens: int) -> int:
    """The device memory an encoder of `mmproj` takes for parts of up to `tokens` merged tokens: its weights and
    workspace (what `DeviceEncoder.device_bytes` then holds)."""
    weights = sum(a.nbytes for w in _weights(mmproj) for a in _weight_arrays(w))
    return weights + sum(workspace(mmproj, tokens).values())


@dataclasses.dataclass(frozen=True)
class _Matrix:
    """A Linear on the device: its rows (of `type`, row_bytes each) and its bias."""

    w: Any
    b: Any
    type: int
    n_in: int
    n_out: int
    row_bytes: int


class DeviceEncoder:
    """Runs an mmproj file's encoder on `device`; the interface of `Encoder` (encode, n_embd, hp, mmproj, threads).

    Args:
        encoder: the CPU encoder of the same file (its loaded mmproj; the device encoder owns neither).
        device: where to run; closed by `close` (or when the constructor fails).
        tokens: the most merged tokens of one picture part (`largest_part`).

    Raises:
        DeviceError: a weight type the device has no product for, heads over 256 values, parts of more than
            MAX_PATCHES patches, or a budget the weights and workspace do not fit in.
    """

    def __init__(self, encoder: Encoder, device: Device, tokens: int):
        self.mmproj, self.hp, self.threads, self.n_embd = encoder.mmproj, encoder.hp, encoder.threads, encoder.n_embd
        self.device, self.ffi = device, device.ffi
        self._pending: list[np.ndarray] = []  # host arrays queued uploads read, kept until the next sync
        try:
            self._load(tokens)
        except BaseException:
            device.close()
            raise
        self.device_bytes = device.used

    def _load(self, tokens: int) -> None:
        device = self.device
        self.max_patches = tokens * self.hp.merge**2
        if self.hp.head_dim > 256:
            raise DeviceError(f"attention heads of {self.hp.head_dim} values; the device's attention takes up to 256")
        if self.max_patches > MAX_PATCHES:
            raise DeviceError(f"pictures of up to {self.max_patches} patches; the device encoder takes up to "
                              f"{MAX_PATCHES} (lower --max-tokens)")
        weights = list(_weights(self.mmproj))
        for linear in weights:
            if isinstance(linear, Linear) and linear.weight.type not in DEVICE_TYPES:
                name = gguf.GGMLQuantizationType(linear.weight.type).name
                raise DeviceError(f"'{self.mmproj.path}': weight type {name} has no device product")
        self._qwen = isinstance(self.mmproj, qwen3vl.Qwen3VLMmproj)
        self._matrices: dict[int, _Matrix] = {}
        self._norms: dict[int, tuple[Any, Any]] = {}
        for weight in weights:
            if isinstance(weight, Linear):
                m = weight.weight
                self._matrices[id(weight)] = _Matrix(self._put(m.data), self._put(weight.bias), m.type, m.n_cols,
                                                     m.n_rows, m.data.nbytes // m.n_rows)
            else:
                self._norms[id(weight)] = (self._put(weight.weight), self._put(weight.bias))
        self._buf = {name: device.alloc(size) for name, size in workspace(self.mmproj, tokens).items()}
        device.memset(self._buf["zeros"], 0, 4 * self.max_patches)
        if self._qwen:
            d = self.hp.head_dim
            inv = qwen3vl.rope_frequencies(d).astype(np.float32)
            self._upload("inv_freq", np.concatenate([inv, inv]))  # the row's pairs, then the column's
            self._upload("axis", np.repeat(np.array([1, 2], np.uint8), d // 4))
        self.sync()

    def close(self) -> None:
        self.device.close()

    def _put(self, array: np.ndarray) -> Any:
        return self.device.to_device(np.ascontiguousarray(array))

    def _upload(self, name: str, array: np.ndarray) -> None:
        array = np.ascontiguousarray(array)
        self._pending.append(array)
        self.device.upload(self._buf[name], array)

    def sync(self) -> None:
        self.device.sync()
        self._pending.clear()

    # --- steps

    def _linear(self, x: Any, m: _Matrix, y: Any, n_tok: int) -> None:
        """y (n_tok, n_out) = x W^T + b."""
        self.device.launch("matmul", type=m.type, n=m.n_in, rows=m.n_out, n_tok=n_tok, row_bytes=m.row_bytes, w=m.w,
                           x=x, y=y)
        self.device.launch("add_rows", n_tok=n_tok, k=1, n=m.n_out, y=m.b, idx=self._buf["zeros"], out=y)

    def _rows(self, m: _Matrix, start: int, count: int) -> _Matrix:
        """Rows [start, start + count) of a matrix and its bias (a fused QKV's q, k or v)."""
        w = self.ffi.cast("char *", m.w) + start * m.row_bytes
        return dataclasses.replace(m, w=w, b=self.ffi.cast("float *", m.b) + start, n_out=count)

    def _add(self, y: Any, out: Any, n_tok: int, n: int) -> None:
        self.device.launch("add_rows", n_tok=n_tok, k=1, n=n, y=y, out=out)

    def _norm(self, x: Any, norm: Norm, out: Any, n_tok: int, n: int, eps: float) -> None:
        w, b = self._norms[id(norm)]
        self.device.launch("layer_norm", n=n, n_tok=n_tok, eps=eps, x=x, w=w, b=b, out=out)

    def _gelu(self, x: Any, n: int, erf: bool) -> None:
        self.device.launch("gelu", n=n, erf=int(erf), x=x, out=x)

    def _merge(self, x: Any, n_patch: int) -> None:
        """q, as (n_patch / 4, 4 n) merged tokens = each 2x2 square of x's patch rows, concatenated (the gather
        table is uploaded per part)."""
        b = self._buf
        self.device.memset(b["q"], 0, 4 * n_patch * self.hp.n_embd)
        self.device.launch("add_rows", n_tok=n_patch, k=1, n=self.hp.n_embd, y=x, idx=b["gather"], out=b["q"])

    def _mlp(self, merged_norm: Norm | None, eps: float, fc1: Linear, fc2: Linear, out: Any, n_tok: int,
             erf: bool) -> None:
        """out (n_tok, n_proj) = fc2(gelu(fc1(norm(merged)))): a projector, from the merged tokens in q."""
        b, width = self._buf, self.hp.merge**2 * self.hp.n_embd
        if merged_norm is not None:
            self._norm(b["q"], merged_norm, b["q"], n_tok, width, eps)
        up, down = self._matrices[id(fc1)], self._matrices[id(fc2)]
        self._linear(b["q"], up, b["hidden"], n_tok)
        self._gelu(b["hidden"], n_tok * up.n_out, erf)
        self._linear(b["hidden"], down, out, n_tok)

    def _attention(self, n_patch: int, o: Linear) -> None:
        """x += o(attention(q, k, v)): the attention's output in h (read by the projections already), o's in q."""
        b, hp = self._buf, self.hp
        self.device.launch("vit_attention", n_tok=n_patch, n_head=hp.n_head, head_dim=hp.head_dim, q=b["q"], k=b["k"],
                           v=b["v"], out=b["h"])
        self._linear(b["h"], self._matrices[id(o)], b["q"], n_patch)
        self._add(b["q"], b["x"], n_patch, hp.n_embd)

    def _ffn(self, n_patch: int, ln2: Norm, up: Linear, down: Linear) -> None:
        """x += down(gelu(up(ln2(x)))), the tanh GELU."""
        b, hp = self._buf, self.hp
        self._norm(b["x"], ln2, b["h"], n_patch, hp.n_embd, hp.eps)
        self._linear(b["h"], self._matrices[id(up)], b["up"], n_patch)
        self._gelu(b["up"], n_patch * hp.n_ff, erf=False)
        self._linear(b["up"], self._matrices[id(down)], b["h"], n_patch)
        self._add(b["h"], b["x"], n_patch, hp.n_embd)

    # --- the forward pass

    def encode(self, pixels: np.ndarray, cancelled: Callable[[], bool] = vit._never) -> np.ndarray:
        """Embeddings (n_tokens, n_embd) of normalised pixels (3, H, W), as `Encoder.encode`.

        Raises:
            EncodeCancelled: `cancelled()` returned true before a layer.
            ValueError: H or W not a multiple of patch_size * merge, or a part larger than the workspace.
        """
        hp, b = self.hp, self._buf
        _, height, width = pixels.shape
        if height % hp.unit or width % hp.unit:
            raise ValueError(f"picture {width}x{height} is not a multiple of {hp.unit} pixels per side")
        gy, gx = height // hp.patch_size, width // hp.patch_size
        n_patch, m = gy * gx, hp.merge
        if n_patch > self.max_patches:
            raise ValueError(f"a picture part of {n_patch} patches; the device encoder holds {self.max_patches}")
        tokens = n_patch // m**2
        self._upload("gather", np.arange(n_patch, dtype=np.int32).reshape(gy // m, m, gx // m, m)
                     .transpose(0, 2, 1, 3).reshape(-1))
        self._upload("patches", vit.patchify(pixels, hp.patch_size))
        self._linear(b["patches"], self._matrices[id(self.mmproj.patch)], b["x"], n_patch)
        if self._qwen:
            pos = qwen3vl.position_embeddings(self.mmproj.pos, hp.pos_side, gy, gx)
        else:
            pos = vit.position_embeddings(self.mmproj.pos, hp.pos_side, gy, gx, antialiased=hp.variant == "lfm2-vl")
        self._upload("h", pos)
        self._add(b["h"], b["x"], n_patch, hp.n_embd)
        outputs = self._qwen_layers(gy, gx, cancelled) if self._qwen else self._lfm2_layers(n_patch, cancelled)
        rows = np.empty((len(outputs), tokens, hp.n_proj), np.float32)
        self.device.download(rows, b["rows"])
        self.sync()
        return np.ascontiguousarray(rows.transpose(1, 0, 2)).reshape(tokens, -1)

    def _layer_boundary(self, cancelled: Callable[[], bool]) -> None:
        self.sync()
        if cancelled():
            raise EncodeCancelled

    def _lfm2_layers(self, n_patch: int, cancelled: Callable[[], bool]) -> list[Any]:
        """The ViT's blocks, post-layernorm, merge and projector into rows[0]; the outputs written."""
        hp, b, mm = self.hp, self._buf, self.mmproj
        assert isinstance(mm, Mmproj)
        for block in mm.blocks:
            self._layer_boundary(cancelled)
            self._norm(b["x"], block.ln1, b["h"], n_patch, hp.n_embd, hp.eps)
            for lin, out in ((block.q, "q"), (block.k, "k"), (block.v, "v")):
                self._linear(b["h"], self._matrices[id(lin)], b[out], n_patch)
            self._attention(n_patch, block.o)
            self._ffn(n_patch, block.ln2, block.up, block.down)
        self._layer_boundary(cancelled)
        self._norm(b["x"], mm.post_ln, b["h"], n_patch, hp.n_embd, hp.eps)
        self._merge(b["h"], n_patch)
        lfm2_vl = hp.variant == "lfm2-vl"
        self._mlp(mm.input_norm, LFM2_VL_MERGE_EPS if lfm2_vl else hp.eps, mm.mm_up, mm.mm_down, b["rows"],
                  n_patch // hp.merge**2, erf=lfm2_vl)
        return [b["rows"]]

    def _qwen_layers(self, gy: int, gx: int, cancelled: Callable[[], bool]) -> list[Any]:
        """Qwen3-VL's blocks (fused QKV, 2-D RoPE), each deepstack merger after its layer and the main merger at the
        end; the main merger's rows first, then the deepstack ones', in layer order."""
        hp, b, mm = self.hp, self._buf, self.mmproj
        assert isinstance(mm, qwen3vl.Qwen3VLMmproj)
        n_patch, n, tokens = gy * gx, hp.n_embd, gy * gx // hp.merge**2
        rows, block_rows = self.ffi.cast("float *", b["rows"]), tokens * hp.n_proj
        rows_y, rows_x = np.divmod(np.arange(n_patch, dtype=np.int32), gx)
        self._upload("rope_pos", np.stack([np.zeros_like(rows_y), rows_y, rows_x], axis=1))
        outputs = [rows]
        for layer, block in enumerate(mm.blocks):
            self._layer_boundary(cancelled)
            self._norm(b["x"], block.ln1, b["h"], n_patch, n, hp.eps)
            qkv = self._matrices[id(block.qkv)]
            for i, out in enumerate(("q", "k", "v")):
                self._linear(b["h"], self._rows(qkv, i * n, n), b[out], n_patch)
            for out in ("q", "k"):
                self.device.launch("rope", n_tok=n_patch, n_head=hp.n_head, head_dim=hp.head_dim, neox=1,
                                   n_rot=hp.head_dim, x=b[out], pos=b["rope_pos"], inv_freq=b["inv_freq"],
                                   axis=b["axis"])
            self._attention(n_patch, block.o)
            self._ffn(n_patch, block.ln2, block.up, block.down)
            if layer in mm.deepstack:
                merger = mm.deepstack[layer]
                self._merge(b["x"], n_patch)
                outputs.append(rows + len(outputs) * block_rows)
                self._mlp(merger.norm, hp.eps, merger.fc1, merger.fc2, outputs[-1], tokens, erf=True)
        self._layer_boundary(cancelled)
        self._norm(b["x"], mm.merger.norm, b["h"], n_patch, n, hp.eps)
        self._merge(b["h"], n_patch)
        self._mlp(None, hp.eps, mm.merger.fc1, mm.merger.fc2, rows, tokens, erf=True)
        return outputs

