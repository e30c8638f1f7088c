"""Torch definitions of the demo model that compute what the C engine and the vision encoder compute.

`TextModel` is the engine's `qwen3moe` forward pass: RMSNorm, per-head q/k RMSNorm, NEOX RoPE, grouped-query
causal attention, a router softmax whose top-k weights are renormalised, SwiGLU experts. `VisionModel` is the
`lfm2` encoder of docs/VISION.md: a pre-LN ViT with bicubic-resized position embeddings and tanh GELU, a 2x2 merge,
and a LayerNorm + two-layer MLP projector. Parameters carry the shapes of their GGUF tensors (numpy order), so
export is a rename.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from strata.modelgen.hparams import HParams
from strata.vision.mmproj import VisionHParams


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def rope_neox(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the pairs (i, i + head_dim/2) of x (..., T, head_dim) by angles with cos/sin (T, head_dim/2)."""
    half = x.shape[-1] // 2
    x0, x1 = x[..., :half], x[..., half:]
    return torch.cat([x0 * cos - x1 * sin, x0 * sin + x1 * cos], dim=-1)


def _normal(shape: tuple[int, ...], std: float, generator: torch.Generator) -> nn.Parameter:
    return nn.Parameter(torch.randn(shape, generator=generator) * std)


def _ones(n: int) -> nn.Parameter:
    return nn.Parameter(torch.ones(n))


def routed_experts(h: torch.Tensor, gate_inp: torch.Tensor, gate: torch.Tensor, up: torch.Tensor,
                   down: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The routed experts' output for h (N, n_embd) (router softmax, top k, the k weights renormalised, SwiGLU
    experts) and the load-balancing loss of the routing."""
    n_expert, n_embd = gate_inp.shape
    probs = torch.softmax(h @ gate_inp.T, dim=-1)  # (N, n_expert)
    top_p, top_e = probs.topk(k, dim=-1)
    weight = top_p / top_p.sum(-1, keepdim=True)
    # Gather the (token, choice) slots expert by expert, run each expert on its slots, scatter back.
    flat = top_e.reshape(-1)
    order = flat.argsort(stable=True)
    counts = torch.bincount(flat, minlength=n_expert).tolist()
    rows = h[order // k]
    outs = []
    for e, part in enumerate(rows.split(counts)):
        if part.shape[0]:
            hidden = F.silu(part @ gate[e].T) * (part @ up[e].T)
            outs.append(hidden @ down[e].T)
    slots = torch.empty_like(rows).index_copy(0, order, torch.cat(outs))
    out = (slots.view(-1, k, n_embd) * weight.unsqueeze(-1)).sum(1)
    share = torch.bincount(flat, minlength=n_expert).float() / flat.numel()
    balance = n_expert * (share * probs.mean(0)).sum()
    return out, balance


class TextBlock(nn.Module):
    def __init__(self, hp: HParams, generator: torch.Generator) -> None:
        super().__init__()
        e, hd, f, x = hp.n_embd, hp.head_dim, hp.n_ff_exp, hp.n_expert
        branch = 1.0 / math.sqrt(2 * hp.n_layer)  # residual branches scaled so the stream grows slowly
        self.hp = hp
        self.attn_norm, self.ffn_norm = _ones(e), _ones(e)
        self.attn_q = _normal((hp.n_head * hd, e), e**-0.5, generator)
        self.attn_k = _normal((hp.n_head_kv * hd, e), e**-0.5, generator)
        self.attn_v = _normal((hp.n_head_kv * hd, e), e**-0.5, generator)
        self.attn_output = _normal((e, hp.n_head * hd), branch * (hp.n_head * hd) ** -0.5, generator)
        self.attn_q_norm, self.attn_k_norm = _ones(hd), _ones(hd)
        self.ffn_gate_inp = _normal((x, e), 0.1 * e**-0.5, generator)
        self.ffn_gate_exps = _normal((x, f, e), e**-0.5, generator)
        self.ffn_up_exps = _normal((x, f, e), e**-0.5, generator)
        self.ffn_down_exps = _normal((x, e, f), branch * f**-0.5, generator)

    def attention(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        hp = self.hp
        b, t, _ = x.shape
        h = rms_norm(x, self.attn_norm, hp.rms_eps)
        q = (h @ self.attn_q.T).view(b, t, hp.n_head, hp.head_dim).transpose(1, 2)
        k = (h @ self.attn_k.T).view(b, t, hp.n_head_kv, hp.head_dim).transpose(1, 2)
        v = (h @ self.attn_v.T).view(b, t, hp.n_head_kv, hp.head_dim).transpose(1, 2)
        q = rope_neox(rms_norm(q, self.attn_q_norm, hp.rms_eps), cos, sin)
        k = rope_neox(rms_norm(k, self.attn_k_norm, hp.rms_eps), cos, sin)
        # query head j reads kv head j // (n_head / n_head_kv), as the engine groups them
        group = hp.n_head // hp.n_head_kv
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return att.transpose(1, 2).reshape(b, t, -1) @ self.attn_output.T

    def moe(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The expert mixture of x (N, n_embd) and the load-balancing loss of its routing."""
        h = rms_norm(x, self.ffn_norm, self.hp.rms_eps)
        return routed_experts(h, self.ffn_gate_inp, self.ffn_gate_exps, self.ffn_up_exps, self.ffn_down_exps,
                              self.hp.n_expert_used)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = x + self.attention(x, cos, sin)
        b, t, e = x.shape
        moe, balance = self.moe(x.reshape(b * t, e))
        return x + moe.view(b, t, e), balance


class TextModel(nn.Module):
    """The qwen3moe language model; `forward` gives logits for every position."""

    inv_freq: torch.Tensor  # a buffer (register_buffer)

    def __init__(self, hp: HParams, n_vocab: int, seed: int = 0) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(seed)
        self.hp = hp
        self.token_embd = _normal((n_vocab, hp.n_embd), 1.0, generator)
        self.blk = nn.ModuleList(TextBlock(hp, generator) for _ in range(hp.n_layer))
        self.output_norm = _ones(hp.n_embd)
        self.output = _normal((n_vocab, hp.n_embd), hp.n_embd**-0.5, generator)
        inv_freq = (1.0 / hp.rope_base ** (torch.arange(0, hp.head_dim // 2, dtype=torch.float64) * 2 / hp.head_dim))
        self.register_buffer("inv_freq", inv_freq.float(), persistent=False)

    def forward(self, tokens: torch.Tensor, image_rows: torch.Tensor | None = None,
                image_mask: torch.Tensor | None = None,
                select: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Logits (B, T, n_vocab) of tokens (B, T) and the mean load-balancing loss.

        image_rows (n, n_embd) replace the embeddings of the n positions where image_mask (B, T) is true, in
        row-major order. With `select` (B, T) bool, logits only of the selected positions: (n_selected, n_vocab).
        """
        x = self.token_embd[tokens]
        if image_rows is not None:
            assert image_mask is not None, "image_rows need their image_mask"
            x = x.masked_scatter(image_mask.unsqueeze(-1), image_rows.to(x.dtype))
        theta = torch.arange(tokens.shape[1], dtype=torch.float32)[:, None] * self.inv_freq[None, :]
        cos, sin = theta.cos(), theta.sin()
        balance = x.new_zeros(())
        for block in self.blk:
            x, b = block(x, cos, sin)
            balance = balance + b
        if select is not None:
            x = x[select]
        logits = rms_norm(x, self.output_norm, self.hp.rms_eps) @ self.output.T
        return logits, balance / len(self.blk)

    def gguf_tensors(self) -> dict[str, torch.Tensor]:
        """GGUF tensor name (with `.weight`) -> tensor, numpy order."""
        out: dict[str, torch.Tensor] = {"token_embd.weight": self.token_embd}
        for i, block in enumerate(self.blk):
            out |= {f"blk.{i}.{name}.weight": p for name, p in block.named_parameters()}
        return out | {"output_norm.weight": self.output_norm, "output.weight": self.output}


class VisionBlock(nn.Module):
    def __init__(self, n: int, n_ff: int, n_head: int, eps: float) -> None:
        super().__init__()
        self.n_head, self.eps = n_head, eps
        self.ln1, self.ln2 = nn.LayerNorm(n, eps=eps), nn.LayerNorm(n, eps=eps)
        self.attn_q, self.attn_k, self.attn_v = nn.Linear(n, n), nn.Linear(n, n), nn.Linear(n, n)
        self.attn_out = nn.Linear(n, n)
        self.ffn_up, self.ffn_down = nn.Linear(n, n_ff), nn.Linear(n_ff, n)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, n = x.shape
        h = self.ln1(x)
        q, k, v = (lin(h).view(b, t, self.n_head, -1).transpose(1, 2)
                   for lin in (self.attn_q, self.attn_k, self.attn_v))
        att = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, t, n)
        x = x + self.attn_out(att)
        return x + self.ffn_down(F.gelu(self.ffn_up(self.ln2(x)), approximate="tanh"))


def grid_positions(side: int, n: int) -> torch.Tensor:
    """Sine-cosine embeddings (side * side, n) of a square grid, the row in the first half of each row, the column
    in the second. The encoder starts from them rather than from small random ones: with positions it can read at
    once, it learns where a shape is in a few hundred steps instead of thousands."""
    quarter = n // 4
    freq = math.pi / 2 / side ** (torch.arange(quarter, dtype=torch.float32) / quarter)
    rows, cols = torch.meshgrid(torch.arange(side, dtype=torch.float32), torch.arange(side, dtype=torch.float32),
                                indexing="ij")

    def waves(v: torch.Tensor) -> torch.Tensor:
        angle = v.reshape(-1, 1) * freq
        return torch.cat([angle.sin(), angle.cos()], dim=1)

    return torch.cat([waves(rows), waves(cols)], dim=1)


class VisionModel(nn.Module):
    """The lfm2 encoder: pictures (B, 3, H, W) of one size -> embeddings (B, H/2p * W/2p, n_proj)."""

    def __init__(self, hp: VisionHParams, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        n, p = hp.n_embd, hp.patch_size
        self.hp = hp
        self.patch_embd = nn.Conv2d(3, n, p, stride=p)
        self.position_embd = nn.Parameter(grid_positions(hp.pos_side, n))
        self.blk = nn.ModuleList(VisionBlock(n, hp.n_ff, hp.n_head, hp.eps) for _ in range(hp.n_layer))
        self.post_ln = nn.LayerNorm(n, eps=hp.eps)
        self.input_norm = nn.LayerNorm(hp.merge**2 * n, eps=hp.eps)
        self.mm_up = nn.Linear(hp.merge**2 * n, hp.n_proj)
        self.mm_down = nn.Linear(hp.n_proj, hp.n_proj)

    def positions(self, gy: int, gx: int) -> torch.Tensor:
        """The square grid of position embeddings resized bicubically to (gy, gx): (gy * gx, n_embd)."""
        side = self.hp.pos_side
        if (gy, gx) == (side, side):
            return self.position_embd
        grid = self.position_embd.T.reshape(1, -1, side, side)
        return F.interpolate(grid, size=(gy, gx), mode="bicubic", align_corners=False).reshape(-1, gy * gx).T

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        hp = self.hp
        b, _, height, width = pixels.shape
        gy, gx = height // hp.patch_size, width // hp.patch_size
        x = self.patch_embd(pixels).flatten(2).transpose(1, 2) + self.positions(gy, gx)  # (B, gy * gx, n)
        for block in self.blk:
            x = block(x)
        x = self.post_ln(x)
        m = hp.merge
        # each m x m square of patches, concatenated in row-major order, becomes one token
        x = x.view(b, gy // m, m, gx // m, m, -1).permute(0, 1, 3, 2, 4, 5).reshape(b, (gy // m) * (gx // m), -1)
        x = F.gelu(self.mm_up(self.input_norm(x)), approximate="tanh")
        return self.mm_down(x)
