"""Torch definitions of the demo's `qwen35moe` text model: what the C engine computes for Qwen3.5's hybrid
(`engine_cffi/arch_qwen35.c`, `blocks_deltanet.c`) and for its MTP block (`engine_cffi/mtp.c`).

Layers alternate Gated DeltaNet (linear attention with a recurrent state) and gated full attention (each head's
output times the sigmoid of a gate the q projection also yields; RMS-normed q and k; NEOX RoPE on the first n_rot
values of a head, multi-axis over pictures). Every layer's feed-forward is the routed experts plus a shared expert
behind a sigmoid gate. The MTP block reads, for each position p, the trunk's hidden state h_p (after the output
norm) and the embedding of the token after p, and predicts the token after that:
    u = eh_proj([enorm(embed(x_{p+1})), hnorm(h_p)]);  u = one more attention + expert layer over the pairs;
    logits = shared_head_norm(u) @ output
sharing the model's embedding and output matrix, as Qwen3.5's checkpoints do.

Training computes DeltaNet in chunks of 64 tokens (the chunked form of the delta rule: within a chunk the updates
are solved at once by one unit lower-triangular solve, the state is read and written once per chunk);
`delta_rule_recurrent` is the token-by-token form the tests compare it with.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from strata.modelgen.demo.model import _normal, _ones, rms_norm, rope_neox, routed_experts
from strata.modelgen.hparams import HParams

CHUNK = 64  # tokens per block of the chunked delta rule


# --- positions


def rope_positions(n: int, pictures: Sequence[tuple[int, int, int]]) -> torch.Tensor:
    """Each token's RoPE position (t, h, w), as the engine gives them (`engine.c`, rope_positions): (n, 3) long.

    pictures: (index of the first row, rows ny, columns nx) of each picture's run of rows. Text goes on one past
    the largest component before it; a picture's row at (r, c) of its grid is at (s, s + r, s + c), s where the
    text would have been."""
    out = torch.empty(n, 3, dtype=torch.long)
    starts = {first: (ny, nx) for first, ny, nx in pictures}
    at = nxt = 0
    while at < n:
        if at in starts:
            ny, nx = starts[at]
            r = torch.arange(ny * nx)
            out[at:at + ny * nx] = torch.stack([torch.full_like(r, nxt), nxt + r // nx, nxt + r % nx], 1)
            at, nxt = at + ny * nx, nxt + max(ny, nx)
        else:
            out[at] = nxt
            at, nxt = at + 1, nxt + 1
    return out


def _text_positions(shape: torch.Size) -> torch.Tensor:
    """(B, T, 3) positions 0, 1, ... on every axis."""
    return torch.arange(shape[1]).view(1, -1, 1).expand(shape[0], shape[1], 3)


# --- the delta rule


def delta_rule_recurrent(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                         beta: torch.Tensor) -> torch.Tensor:
    """The gated delta rule token by token from a zero state: q, k (B, H, T, dk) (normalised, q scaled), v (B, H,
    T, dv), g (the decay's log) and beta (B, H, T) -> o (B, H, T, dv). Per token: S = exp(g) S;
    S += k (beta (v - S^T k))^T; o = S^T q."""
    S = q.new_zeros(*q.shape[:2], q.shape[-1], v.shape[-1])
    outs = []
    for t in range(q.shape[2]):
        S = S * g[:, :, t, None, None].exp()
        delta = beta[:, :, t, None] * (v[:, :, t] - (S * k[:, :, t, :, None]).sum(2))
        S = S + k[:, :, t, :, None] * delta[:, :, None, :]
        outs.append((S * q[:, :, t, :, None]).sum(2))
    return torch.stack(outs, 2)


def delta_rule_chunked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                       beta: torch.Tensor) -> torch.Tensor:
    """`delta_rule_recurrent` in chunks of CHUNK tokens (the engine's chunk_step, Hugging Face's
    torch_chunk_gated_delta_rule): within a chunk, with gc the running sum of g and A[i][j] = beta_i (k_i . k_j)
    exp(gc_i - gc_j) for j < i, (I + A) U = beta V and (I + A) W = beta exp(gc) K are solved at once; then per chunk
    v_new = U - W S, o_i = exp(gc_i) q_i S + sum_{j <= i} (q_i . k_j) exp(gc_i - gc_j) v_new_j and
    S = exp(gc_last) S + sum_j exp(gc_last - gc_j) k_j v_new_j^T."""
    b, h, t, dk = k.shape
    dv = v.shape[-1]
    pad = -t % CHUNK  # padded tokens (k = v = beta = g = 0) come after every real one: they change nothing
    q, k, v = (F.pad(x, (0, 0, 0, pad)).view(b, h, -1, CHUNK, x.shape[-1]) for x in (q, k, v))
    gc = F.pad(g, (0, pad)).view(b, h, -1, CHUNK).cumsum(-1)
    beta = F.pad(beta, (0, pad)).view(b, h, -1, CHUNK)
    lower = torch.ones(CHUNK, CHUNK, dtype=torch.bool).tril()
    decay = (gc[..., :, None] - gc[..., None, :]).masked_fill(~lower, 0.0).exp().masked_fill(~lower, 0.0)
    a = (beta[..., None] * (k @ k.transpose(-1, -2)) * decay).tril(-1) + torch.eye(CHUNK)
    rhs = torch.cat([v * beta[..., None], k * (beta * gc.exp())[..., None]], -1)
    u, w = torch.linalg.solve_triangular(a, rhs, upper=False, unitriangular=True).split([dv, dk], -1)
    qk = (q @ k.transpose(-1, -2)) * decay
    S = q.new_zeros(b, h, dk, dv)
    outs = []
    for c in range(q.shape[2]):
        v_new = u[:, :, c] - w[:, :, c] @ S
        outs.append((q[:, :, c] * gc[:, :, c, :, None].exp()) @ S + qk[:, :, c] @ v_new)
        last = gc[:, :, c, -1]
        S = S * last.exp()[..., None, None] + (
            k[:, :, c] * (last[..., None] - gc[:, :, c]).exp()[..., None]).transpose(-1, -2) @ v_new
    return torch.stack(outs, 2).reshape(b, h, -1, dv)[:, :, :t]


def l2_norm(x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """x * scale / sqrt(sum(x^2) + 1e-6) over the last axis (Hugging Face's l2norm, the engine's)."""
    return x * (scale * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + 1e-6))


# --- the layers


class DeltaNet(nn.Module):
    """The Gated DeltaNet token mixer: q, k, v = silu(causal conv(x Wqkv)); q and k heads L2-normed; per value head
    g = a softplus(alpha + dt_bias) and beta = sigmoid(b); the delta rule; a gated RMS norm; the output."""

    def __init__(self, hp: HParams, generator: torch.Generator) -> None:
        super().__init__()
        e, hv, vd = hp.n_embd, hp.ssm_time_step_rank, hp.ssm_inner_size
        conv_dim = 2 * hp.ssm_group_count * hp.ssm_state_size + vd
        self.hp = hp
        self.attn_qkv = _normal((conv_dim, e), e**-0.5, generator)
        self.attn_gate = _normal((vd, e), e**-0.5, generator)
        self.ssm_alpha = _normal((hv, e), e**-0.5, generator)
        self.ssm_beta = _normal((hv, e), e**-0.5, generator)
        self.ssm_conv1d = _normal((conv_dim, hp.ssm_conv_kernel), hp.ssm_conv_kernel**-0.5, generator)
        self.ssm_dt_bias = _ones(hv)
        # a = -exp(a_log), decay rates from 1 to 16 per unit of softplus, as Qwen initialises them: the file stores a
        self.ssm_a_log = nn.Parameter(torch.log(1 + 15 * torch.rand(hv, generator=generator)))
        self.ssm_norm = _ones(vd // hv)
        self.ssm_out = _normal((e, vd), (2 * hp.n_layer) ** -0.5 * vd**-0.5, generator)

    def forward(self, h: torch.Tensor, chunked: bool = True) -> torch.Tensor:
        hp = self.hp
        b, t, _ = h.shape
        hk, hv, dk = hp.ssm_group_count, hp.ssm_time_step_rank, hp.ssm_state_size
        qkv = F.pad((h @ self.attn_qkv.T).transpose(1, 2), (hp.ssm_conv_kernel - 1, 0))
        qkv = F.silu(F.conv1d(qkv, self.ssm_conv1d.unsqueeze(1), groups=qkv.shape[1])).transpose(1, 2)
        q, k, v = qkv.split([hk * dk, hk * dk, hv * dk], -1)
        # value head j reads q/k head j % hk (the converter tiles value heads over key heads)
        q = l2_norm(q.view(b, t, hk, dk), dk**-0.5).transpose(1, 2).repeat(1, hv // hk, 1, 1)
        k = l2_norm(k.view(b, t, hk, dk)).transpose(1, 2).repeat(1, hv // hk, 1, 1)
        v = v.view(b, t, hv, dk).transpose(1, 2)
        g = (-self.ssm_a_log.exp() * F.softplus(h @ self.ssm_alpha.T + self.ssm_dt_bias)).transpose(1, 2)
        beta = torch.sigmoid(h @ self.ssm_beta.T).transpose(1, 2)
        o = (delta_rule_chunked if chunked else delta_rule_recurrent)(q, k, v, g, beta).transpose(1, 2)
        z = (h @ self.attn_gate.T).view(b, t, hv, dk)
        o = rms_norm(o, self.ssm_norm, hp.rms_eps) * F.silu(z)
        return o.reshape(b, t, -1) @ self.ssm_out.T

    def gguf_tensors(self) -> dict[str, torch.Tensor]:
        out = {f"{name}.weight": p for name, p in self.named_parameters() if not name.startswith("ssm_a_log")}
        del out["ssm_dt_bias.weight"]
        return out | {"ssm_dt.bias": self.ssm_dt_bias, "ssm_a": -self.ssm_a_log.exp()}

    def load_gguf(self, tensors: dict[str, torch.Tensor]) -> None:
        """Take the weights of `gguf_tensors`' names (a = -exp(a_log) back to a_log)."""
        for name, p in self.named_parameters():
            if name == "ssm_a_log":
                p.copy_(torch.log(-tensors["ssm_a"]))
            elif name == "ssm_dt_bias":
                p.copy_(tensors["ssm_dt.bias"])
            else:
                p.copy_(tensors[f"{name}.weight"])


class GatedAttention(nn.Module):
    """Full attention whose q projection also yields each head's output gate (per head: query rows, then gate
    rows); RMS-normed q and k heads; NEOX RoPE on each head's first n_rot values."""

    def __init__(self, hp: HParams, generator: torch.Generator, branch: float) -> None:
        super().__init__()
        e, hd = hp.n_embd, hp.head_dim
        self.hp = hp
        self.attn_q = _normal((2 * hp.n_head * hd, e), e**-0.5, generator)
        self.attn_k = _normal((hp.n_head_kv * hd, e), e**-0.5, generator)
        self.attn_v = _normal((hp.n_head_kv * hd, e), e**-0.5, generator)
        self.attn_output = _normal((e, hp.n_head * hd), branch * (hp.n_head * hd) ** -0.5, generator)
        self.attn_q_norm, self.attn_k_norm = _ones(hd), _ones(hd)

    def forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """h (B, T, n_embd) normed; cos, sin (B, 1, T, n_rot / 2)."""
        hp = self.hp
        b, t, _ = h.shape
        n_rot = hp.rope_dims
        qg = (h @ self.attn_q.T).view(b, t, hp.n_head, 2, hp.head_dim)
        q, gate = qg[..., 0, :].transpose(1, 2), qg[..., 1, :]
        k = (h @ self.attn_k.T).view(b, t, hp.n_head_kv, hp.head_dim).transpose(1, 2)
        v = (h @ self.attn_v.T).view(b, t, hp.n_head_kv, hp.head_dim).transpose(1, 2)

        def rope(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
            x = rms_norm(x, weight, hp.rms_eps)
            return torch.cat([rope_neox(x[..., :n_rot], cos, sin), x[..., n_rot:]], -1)

        q, k = rope(q, self.attn_q_norm), rope(k, self.attn_k_norm)
        group = hp.n_head // hp.n_head_kv
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2) * torch.sigmoid(gate)
        return att.reshape(b, t, -1) @ self.attn_output.T


class HybridBlock(nn.Module):
    """One layer: x += mixer(rmsnorm(x)) (DeltaNet or gated attention); x += experts(rmsnorm(x)), the routed
    experts plus the shared expert behind its sigmoid gate."""

    def __init__(self, hp: HParams, recurrent: bool, generator: torch.Generator) -> None:
        super().__init__()
        e, f, x = hp.n_embd, hp.n_ff_exp, hp.n_expert
        branch = 1.0 / math.sqrt(2 * hp.n_layer)  # residual branches scaled so the stream grows slowly
        self.hp = hp
        self.attn_norm, self.post_attention_norm = _ones(e), _ones(e)
        self.mixer: nn.Module = DeltaNet(hp, generator) if recurrent else GatedAttention(hp, generator, branch)
        self.ffn_gate_inp = _normal((x, e), 0.1 * e**-0.5, generator)
        self.ffn_gate_exps = _normal((x, f, e), e**-0.5, generator)
        self.ffn_up_exps = _normal((x, f, e), e**-0.5, generator)
        self.ffn_down_exps = _normal((x, e, f), branch * f**-0.5, generator)
        s = hp.n_ff_shexp
        self.ffn_gate_inp_shexp = _normal((1, e), e**-0.5, generator)
        self.ffn_gate_shexp = _normal((s, e), e**-0.5, generator)
        self.ffn_up_shexp = _normal((s, e), e**-0.5, generator)
        self.ffn_down_shexp = _normal((e, s), branch * s**-0.5, generator)

    def experts(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The feed-forward of x (N, n_embd) and the load-balancing loss of its routing."""
        h = rms_norm(x, self.post_attention_norm, self.hp.rms_eps)
        out, balance = routed_experts(h, self.ffn_gate_inp, self.ffn_gate_exps, self.ffn_up_exps,
                                      self.ffn_down_exps, self.hp.n_expert_used)
        shared = (F.silu(h @ self.ffn_gate_shexp.T) * (h @ self.ffn_up_shexp.T)) @ self.ffn_down_shexp.T
        return out + torch.sigmoid(h @ self.ffn_gate_inp_shexp.T) * shared, balance

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                chunked: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        h = rms_norm(x, self.attn_norm, self.hp.rms_eps)
        x = x + (self.mixer(h, chunked) if isinstance(self.mixer, DeltaNet) else self.mixer(h, cos, sin))
        b, t, e = x.shape
        out, balance = self.experts(x.reshape(b * t, e))
        return x + out.view(b, t, e), balance

    def gguf_tensors(self) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {f"{name}.weight": p for name, p in self.named_parameters(recurse=False)}
        if isinstance(self.mixer, DeltaNet):
            return out | self.mixer.gguf_tensors()
        return out | {f"{name}.weight": p for name, p in self.mixer.named_parameters()}

    def load_gguf(self, tensors: dict[str, torch.Tensor]) -> None:
        for name, p in self.named_parameters(recurse=False):
            p.copy_(tensors[f"{name}.weight"])
        if isinstance(self.mixer, DeltaNet):
            self.mixer.load_gguf(tensors)
        else:
            for name, p in self.mixer.named_parameters():
                p.copy_(tensors[f"{name}.weight"])


class Mtp(nn.Module):
    """The MTP block (the file's `nextn` layer): its projection of [enorm(embedding), hnorm(hidden)], one gated
    attention and expert layer, and the norm before the shared output head."""

    def __init__(self, hp: HParams, generator: torch.Generator) -> None:
        super().__init__()
        e = hp.n_embd
        self.hp = hp
        self.eh_proj = _normal((e, 2 * e), (2 * e) ** -0.5, generator)
        self.enorm, self.hnorm, self.shared_head_norm = _ones(e), _ones(e), _ones(e)
        self.block = HybridBlock(hp, False, generator)

    def forward(self, hidden: torch.Tensor, embedded: torch.Tensor, cos: torch.Tensor,
                sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden (B, T, n_embd): the trunk's states after the output norm at positions p; embedded: the
        embeddings of the tokens after them; cos, sin of positions p. -> (the block's states after its head norm,
        the load-balancing loss)."""
        eps = self.hp.rms_eps
        u = torch.cat([rms_norm(embedded, self.enorm, eps), rms_norm(hidden, self.hnorm, eps)], -1) @ self.eh_proj.T
        u, balance = self.block(u, cos, sin)
        return rms_norm(u, self.shared_head_norm, eps), balance

    def gguf_tensors(self) -> dict[str, torch.Tensor]:
        own = {f"nextn.{name}.weight": p for name, p in self.named_parameters(recurse=False)}
        return own | self.block.gguf_tensors()

    def load_gguf(self, tensors: dict[str, torch.Tensor]) -> None:
        for name, p in self.named_parameters(recurse=False):
            p.copy_(tensors[f"nextn.{name}.weight"])
        self.block.load_gguf(tensors)


class HybridTextModel(nn.Module):
    """The qwen35moe language model with its MTP block; `forward` gives logits as `model.TextModel` does."""

    inv_freq: torch.Tensor  # a buffer (register_buffer)
    rope_axis: torch.Tensor  # the position component (t, h, w) each frequency pair turns by

    def __init__(self, hp: HParams, n_vocab: int, seed: int = 0) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(seed)
        self.hp = hp
        self.token_embd = _normal((n_vocab, hp.n_embd), 1.0, generator)
        self.blk = nn.ModuleList(HybridBlock(hp, recurrent, generator) for recurrent in hp.recurrent_layers())
        self.output_norm = _ones(hp.n_embd)
        self.output = _normal((n_vocab, hp.n_embd), hp.n_embd**-0.5, generator)
        self.mtp = Mtp(hp, generator)
        n = hp.rope_dims // 2
        inv_freq = 1.0 / hp.rope_base ** (torch.arange(0, n, dtype=torch.float64) * 2 / hp.rope_dims)
        self.register_buffer("inv_freq", inv_freq.float(), persistent=False)
        # Qwen3-VL's interleaving, as the engine's build_mrope: h on pairs 1, 4, ... below 3 sections[1], w on
        # 2, 5, ... below 3 sections[2], t on the rest
        sec = hp.rope_sections
        axis = [1 if i % 3 == 1 and i < 3 * sec[1] else 2 if i % 3 == 2 and i < 3 * sec[2] else 0 for i in range(n)]
        self.register_buffer("rope_axis", torch.tensor(axis), persistent=False)

    def angles(self, rope: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin (B, 1, T, n_rot / 2) of positions rope (B, T, 3)."""
        theta = rope[..., self.rope_axis].float() * self.inv_freq
        return theta.cos().unsqueeze(1), theta.sin().unsqueeze(1)

    def embed(self, tokens: torch.Tensor, image_rows: torch.Tensor | None = None,
              image_mask: torch.Tensor | None = None) -> torch.Tensor:
        """The trunk's input (B, T, n_embd): token embeddings, image_rows (n, n_embd) in place of the n positions
        where image_mask (B, T) is true, in row-major order."""
        x = self.token_embd[tokens]
        if image_rows is None:
            return x
        assert image_mask is not None, "image_rows need their image_mask"
        return x.masked_scatter(image_mask.unsqueeze(-1), image_rows.to(x.dtype))

    def trunk(self, x: torch.Tensor, rope: torch.Tensor | None = None,
              chunked: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        """The hidden states (B, T, n_embd) after the output norm of the input x (`embed`) and the mean
        load-balancing loss; rope (B, T, 3) positions (default: text positions 0, 1, ...)."""
        cos, sin = self.angles(_text_positions(x.shape[:2]) if rope is None else rope)
        balance = x.new_zeros(())
        for block in self.blk:
            x, b = block(x, cos, sin, chunked)
            balance = balance + b
        return rms_norm(x, self.output_norm, self.hp.rms_eps), balance / len(self.blk)

    def forward(self, tokens: torch.Tensor, image_rows: torch.Tensor | None = None,
                image_mask: torch.Tensor | None = None, select: torch.Tensor | None = None,
                rope: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Logits (B, T, n_vocab), or (n_selected, n_vocab) of the positions `select` (B, T) marks, and the mean
        load-balancing loss."""
        hidden, balance = self.trunk(self.embed(tokens, image_rows, image_mask), rope)
        return (hidden if select is None else hidden[select]) @ self.output.T, balance

    def draft_logits(self, hidden: torch.Tensor, x: torch.Tensor, rope: torch.Tensor | None = None,
                     select: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The MTP block's logits for each position p < T - 1 (B, T - 1, n_vocab), or those `select` (B, T - 1)
        marks, and its load-balancing loss: from the trunk's hidden states (B, T, n_embd) and input x (`embed`),
        each predicts the token at p + 2. The trunk's states, embeddings and output matrix are read, not trained
        through the block's loss."""
        cos, sin = self.angles((_text_positions(x.shape[:2]) if rope is None else rope)[:, :-1])
        g, balance = self.mtp(hidden[:, :-1].detach(), x[:, 1:].detach(), cos, sin)
        return (g if select is None else g[select]) @ self.output.detach().T, balance

    def gguf_tensors(self) -> dict[str, torch.Tensor]:
        """GGUF tensor name -> tensor, numpy order; the MTP block is layer n_layer."""
        out: dict[str, torch.Tensor] = {"token_embd.weight": self.token_embd}
        for i, block in enumerate([*self.blk, self.mtp]):
            out |= {f"blk.{i}.{name}": p for name, p in block.gguf_tensors().items()}
        return out | {"output_norm.weight": self.output_norm, "output.weight": self.output}

    def load_gguf(self, tensors: dict[str, torch.Tensor]) -> None:
        """Take the weights a demo file stores (`gguf_tensors`' names)."""
        with torch.no_grad():
            for name in ("token_embd", "output_norm", "output"):
                getattr(self, name).copy_(tensors[f"{name}.weight"])
            for i, block in enumerate([*self.blk, self.mtp]):
                prefix = f"blk.{i}."
                block.load_gguf({k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)})
