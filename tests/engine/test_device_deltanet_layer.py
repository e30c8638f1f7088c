"""A Qwen3.5 model's first layer, a Gated DeltaNet, through the device's kernels on the host device, its state in
the CPU engine's layout (a sequence's conv state, then its delta-rule state): after a prompt (the chunked form)
and after a decode step (the recurrent form), the layer's state is the CPU engine's (`save_state`) within the
check driver's tolerance for the rule. The products, norms and gates before the convolution feed both parts of
that state, so this checks that the kernels compose into the layer as `blocks_deltanet.c` runs it, with the
arguments a device forward pass would give them. The state does not depend on q (nor the output on anything after
the rule), so q's norm and the gated RMS norm are the unit tests' (test_device_deltanet.py). Not bit for bit: the
host device's `rms_norm` is the reference kernel's port (sums in double), the CPU engine's sums in float
(measured: about 5e-7 of values of order 1).
"""

from __future__ import annotations

import pathlib
from typing import Any

import numpy as np
import pytest
from gguf import GGUFReader
from qwen35_checkpoints import checkpoint, convert_checkpoint
from strata.engine_cffi._engine import lib

from strata.engine_cffi import Engine, device_check
from strata.engine_cffi.device import Device

pytestmark = pytest.mark.slow  # a checkpoint converted and a layer run through each kernel: 15 s

PROMPT = 70  # tokens: a 64-token chunk and a part of one


@pytest.fixture(scope="module")
def model_file(tmp_path_factory: pytest.TempPathFactory, qwen_tokenizer_dir: pathlib.Path) -> pathlib.Path:
    """Two layers: 0 a Gated DeltaNet, 1 full attention."""
    model = checkpoint("qwen35moe", n_layer=2, interval=2)
    return convert_checkpoint(model, tmp_path_factory.mktemp("qwen35moe-deltanet"), qwen_tokenizer_dir)


class Layer0:
    """Layer 0's DeltaNet on a device, one sequence, its state in slot 0 (conv state, then the rule's)."""

    def __init__(self, dev: Device, path: pathlib.Path) -> None:
        reader = GGUFReader(path)
        t = {tensor.name: np.ascontiguousarray(tensor.data) for tensor in reader.tensors}
        self.dev, self.embd = dev, t["token_embd.weight"]
        self.E = self.embd.shape[1]
        self.conv_w = t["blk.0.ssm_conv1d.weight"]
        self.C, self.K = self.conv_w.shape
        self.hv = t["blk.0.ssm_a"].shape[0]
        self.d = t["blk.0.ssm_norm.weight"].shape[0]
        self.hk = (self.C - self.hv * self.d) // (2 * self.d)
        self.conv_floats = self.C * (self.K - 1)
        self.stride = self.conv_floats + self.hv * self.d * self.d
        self.w = {name: dev.to_device(t[f"blk.0.{name}"]) for name in (
            "attn_norm.weight", "attn_qkv.weight", "ssm_alpha.weight", "ssm_beta.weight",
            "ssm_conv1d.weight", "ssm_a", "ssm_dt.bias")}
        self.rows = {name: t[f"blk.0.{name}.weight"].shape[0] for name in ("attn_qkv", "ssm_alpha", "ssm_beta")}
        self.state = dev.to_device(np.zeros(self.stride, np.float32))

    def run(self, tokens: list[int]) -> None:
        dev, n, E, w = self.dev, len(tokens), self.E, self.w
        ffi = dev.ffi
        buf = {name: dev.alloc(4 * n * width) for name, width in (
            ("xb", E), ("attn_qkv", self.C), ("ssm_alpha", self.hv),
            ("ssm_beta", self.hv), ("conv", self.C), ("o", self.hv * self.d))}
        x = dev.to_device(self.embd[tokens])
        seqs = {"seq": dev.to_device(np.zeros(1, np.int32)), "seq_first": dev.to_device(np.array([0, n], np.int32))}
        dev.launch("rms_norm", n=E, n_tok=n, eps=1e-6, x=x, w=w["attn_norm.weight"], out=buf["xb"])
        for name, rows in self.rows.items():
            dev.launch("matmul", type=0, n=E, rows=rows, n_tok=n, row_bytes=4 * E, w=w[f"{name}.weight"],
                       x=buf["xb"], y=buf[name])
        dev.launch("dn_conv", n_seq=1, d_conv=self.K, channels=self.C, state_stride=self.stride, x=buf["attn_qkv"],
                   w=w["ssm_conv1d.weight"], state=self.state, out=buf["conv"], **seqs)

        def at(p: Any, floats: int) -> Any:
            return ffi.cast("float *", p) + floats

        hk, d = self.hk, self.d
        dev.launch("l2_norm", n_tok=n, n_head=hk, head_dim=d, row_stride=self.C, scale=1 / np.sqrt(d), x=buf["conv"])
        dev.launch("l2_norm", n_tok=n, n_head=hk, head_dim=d, row_stride=self.C, scale=1.0,
                   x=at(buf["conv"], hk * d))
        dev.launch("dn_gates", n_tok=n, n_head=self.hv, alpha=buf["ssm_alpha"], beta=buf["ssm_beta"],
                   a=w["ssm_a"], dt_bias=w["ssm_dt.bias"])
        rule = "delta_rule_chunked" if lib.strata_deltanet_chunked(n) else "delta_rule"  # the CPU engine's choice
        dev.launch(rule, n_seq=1, n_k_heads=hk, n_v_heads=self.hv, head_dim=d, row_stride=self.C,
                   state_stride=self.stride, q=buf["conv"], k=at(buf["conv"], hk * d), v=at(buf["conv"], 2 * hk * d),
                   g=buf["ssm_alpha"], beta=buf["ssm_beta"], state=at(self.state, self.conv_floats), out=buf["o"],
                   **seqs)
        dev.sync()
        for p in [*buf.values(), x, *seqs.values()]:
            dev.free(p)

    def state_floats(self) -> np.ndarray:
        return self.dev.to_host(self.state, (self.stride,), np.float32)


def test_the_kernels_give_layer_0s_state_as_the_cpu_engine(model_file: pathlib.Path) -> None:
    tokens = [int(t) for t in np.random.default_rng(0).integers(0, 151000, PROMPT + 1)]
    with Engine.load(model_file, n_ctx=256, threads=2, kv="f32", n_batch=256) as engine, Device("host") as dev:
        layer = Layer0(dev, model_file)
        for part in (tokens[:PROMPT], tokens[PROMPT:]):  # the chunked form, then the recurrent one
            engine.eval(part)
            layer.run(part)
            want = np.frombuffer(engine.save_state(0), np.float32)[:layer.stride]
            got = layer.state_floats()
            assert np.abs(got).max() > 0
            conv, rule = slice(0, layer.conv_floats), slice(layer.conv_floats, layer.stride)
            for part_of in (conv, rule):
                err = np.abs(got[part_of] - want[part_of]).max()
                print(f"{len(part)} tokens: max |device - CPU| {err:.2e} of {np.abs(want[part_of]).max():.2f}")
                assert err <= device_check.RULE_RTOL * max(1.0, np.abs(want[part_of]).max())
