"""The device backend's layer loop in few calls, on the host device: a launch list (`strata_dev_launch_list`,
`launch_list.LaunchList`), a pass of lists and layers' experts (`strata_dev_run_pass`, `launch_list.Pass`) and a
layer's hits (`strata_dev_launch_experts`) give the bits of the same launches made
one by one, and check every item before queuing any; the slots grouped by expert in C
(`strata_host_group_slots`) are numpy's stable sort of them.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

from strata.engine_cffi import EngineError, _check
from strata.engine_cffi.device import Device, DeviceError, interface
from strata.engine_cffi.device_check import random_weights
from strata.engine_cffi.launch_list import LaunchList, Pass, Size

N = Size("n")
E, F, ROWS = 256, 256, 8  # width, hidden width of an expert (K-quants: multiples of 256), the most tokens


@pytest.fixture
def dev():
    with Device("host", budget=1 << 26) as d:
        yield d


def buffers(dev: Device, rng: np.random.Generator, **floats: int) -> dict[str, object]:
    """Device buffers of random floats, by name and length."""
    return {name: dev.to_device(rng.standard_normal(n, dtype=np.float32)) for name, n in floats.items()}


def read(dev: Device, p: object, n: int) -> np.ndarray:
    return dev.to_host(p, (n,), np.float32)


def initial(seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {name: rng.standard_normal(n, dtype=np.float32)
            for name, n in dict(x=ROWS * E, norm=E, xb=ROWS * E, h=ROWS * 2 * F, out=ROWS * F).items()}


def test_a_launch_list_and_a_pass_give_the_bits_of_their_launches_one_by_one(dev):
    rng = np.random.default_rng(0)
    w = random_weights(Q.Q8_0, 2 * F, E, rng)
    for n_tok in (3, 5, 3):  # a list built once, run at other sizes: its Size fields follow
        outs = []
        for way in ("one by one", "list", "pass"):
            b = {name: dev.to_device(values) for name, values in initial(n_tok).items()}
            b["w"] = dev.to_device(w)
            steps = [("rms_norm", dict(n=E, n_tok=N, eps=1e-6, x=b["x"], w=b["norm"], out=b["xb"])),
                     ("matmul", dict(type=int(Q.Q8_0), n=E, rows=2 * F, n_tok=N, row_bytes=w.shape[1], w=b["w"],
                                     x=b["xb"], y=b["h"])),
                     ("memset", dict(ptr=b["out"], nbytes=4 * F * N)),
                     ("add_rows", dict(n_tok=N, k=1, n=F, y=b["h"], out=b["out"])),
                     ("swiglu", dict(n=N * F, g=b["out"], u=b["h"], out=b["out"]))]
            if way != "one by one":
                launches = LaunchList(dev)
                for name, fields in steps:
                    launches.memset(**fields) if name == "memset" else launches.launch(name, **fields)
                assert len(launches) == 4
                # the list run alone, or as a pass of one call (`strata_dev_run_pass`: its launches and memset)
                queue = launches.run if way == "list" else functools.partial(Pass(dev, [launches]).run,
                                                                             dev.ffi.NULL, n_tok, dev.ffi.NULL)
                queue(n=7)  # another size first, on the same buffers filled again: the fields follow
                for name, values in initial(n_tok).items():
                    dev.upload(b[name], values)
                queue(n=n_tok)
            else:
                for name, fields in steps:
                    sized = {k: v.factor * n_tok if isinstance(v, Size) else v for k, v in fields.items()}
                    dev.memset(sized["ptr"], 0, sized["nbytes"]) if name == "memset" else dev.launch(name, **sized)
            outs.append([read(dev, b[name], n) for name, n in (("xb", ROWS * E), ("h", ROWS * 2 * F),
                                                                ("out", ROWS * F))])
            for p in b.values():
                dev.free(p)
        for one, listed, passed in zip(*outs, strict=True):
            np.testing.assert_array_equal(one, listed)
            np.testing.assert_array_equal(one, passed)


def raw_list(dev: Device, items: list[tuple[str | None, object]]) -> tuple[object, list[object]]:
    """A strata_dev_launch_item array of (name, args) pairs (None: a NULL name or args) and what it holds."""
    ffi = dev.ffi
    array, alive = ffi.new("strata_dev_launch_item[]", len(items)), []
    for i, (name, args) in enumerate(items):
        if name is not None:
            alive.append(ffi.new("char[]", name.encode()))
            array[i].name = alive[-1]
        array[i].args = ffi.NULL if args is None else args
    return array, alive


def test_a_list_with_a_bad_item_queues_nothing_and_names_the_item(dev):
    rng = np.random.default_rng(1)
    b = buffers(dev, rng, x=4 * E, out=4 * E, logits=4 * 8)
    before = read(dev, b["out"], 4 * E)
    residual = dev.arguments("add_rows", n_tok=4, k=1, n=E, y=b["x"], out=b["out"])
    bad_topk = dev.arguments("topk", n_tok=4, n_expert=8, k=0, logits=b["logits"], ids=b["x"], weights=b["out"])
    for items, message in [([("add_rows", residual), ("topk", bad_topk)], "launch list item 1: topk: k 0"),
                           ([("add_rows", residual), ("dequantise", residual)],
                            "launch list item 1: no kernel named 'dequantise'"),
                           ([("add_rows", residual), (None, residual)], "launch list item 1: no kernel named"),
                           ([("add_rows", residual), ("add_rows", None)], "launch list item 1: no arguments")]:
        array, _ = raw_list(dev, items)
        with pytest.raises(DeviceError, match=message):
            dev.launch_list(array, len(items))
        np.testing.assert_array_equal(read(dev, b["out"], 4 * E), before)  # the good item was not queued either
    array, _ = raw_list(dev, [("add_rows", residual)])
    with pytest.raises(DeviceError, match="a launch list of -1 items"):
        dev.launch_list(array, -1)
    with pytest.raises(DeviceError, match="stream 3 does not exist"):
        dev.launch_list(array, 1, stream=3)
    dev.launch_list(dev.ffi.NULL, 0)  # nothing to queue
    dev.launch_list(array, 1)
    np.testing.assert_array_equal(read(dev, b["out"], 4 * E), before + read(dev, b["x"], 4 * E))
    with pytest.raises(DeviceError, match="no argument named bogus"):
        LaunchList(dev).launch("add_rows", bogus=N)


@pytest.mark.parametrize("types", [(Q.Q8_0, Q.Q8_0, Q.Q8_0), (Q.Q4_K, Q.Q4_K, Q.Q6_K)])
def test_a_layers_hits_give_the_bits_of_four_launches_a_hit(dev, types):
    rng = np.random.default_rng(2)
    gate, up, down = (random_weights(t, rows, n, rng) for t, rows, n in zip(types, (F, F, E), (E, E, F),
                                                                              strict=True))
    slots = [dev.to_device(np.concatenate([gate.reshape(-1), up.reshape(-1), down.reshape(-1)]))
             for _ in range(2)]
    first, count = np.array([5, 0], np.int32), np.array([3, 5], np.int32)  # two hits: rows 5..7 and 0..4
    outs = []
    for way in ("one by one", "at once"):
        b = buffers(dev, np.random.default_rng(3), x=ROWS * E, hb=ROWS * F, hb2=ROWS * F, y=ROWS * E)
        if way == "at once":
            args = dev.ffi.new("strata_dev_experts_args *", dict(
                gate_type=int(types[0]), up_type=int(types[1]), down_type=int(types[2]), n_embd=E, n_ff=F,
                x=b["x"], hb=b["hb"], hb2=b["hb2"], y=b["y"]))
            dev.launch_experts(args, slots, first, count)
        else:
            for slot, s0, c in zip(slots, first.tolist(), count.tolist(), strict=True):
                at = dev.ffi.cast("char *", slot)
                x, y = (dev.ffi.cast("float *", b[name]) + s0 * E for name in ("x", "y"))
                hb, hb2 = (dev.ffi.cast("float *", b[name]) + s0 * F for name in ("hb", "hb2"))
                dev.launch("matmul", type=int(types[0]), n=E, rows=F, n_tok=c, row_bytes=gate.shape[1], w=at, x=x,
                           y=hb)
                dev.launch("matmul", type=int(types[1]), n=E, rows=F, n_tok=c, row_bytes=up.shape[1],
                           w=at + gate.nbytes, x=x, y=hb2)
                dev.launch("swiglu", n=c * F, g=hb, u=hb2, out=hb)
                dev.launch("matmul", type=int(types[2]), n=F, rows=E, n_tok=c, row_bytes=down.shape[1],
                           w=at + gate.nbytes + up.nbytes, x=hb, y=y)
        outs.append(read(dev, b["y"], ROWS * E))
        for p in b.values():
            dev.free(p)
    np.testing.assert_array_equal(outs[0], outs[1])


def test_a_layers_hits_are_all_checked_before_any_is_queued(dev):
    rng = np.random.default_rng(4)
    w = random_weights(Q.Q8_0, 2 * F + E, E, rng)  # room for an expert's three Q8_0 matrices
    b = buffers(dev, rng, x=ROWS * E, hb=ROWS * F, hb2=ROWS * F, y=ROWS * E)
    slot = dev.to_device(w)
    before = read(dev, b["y"], ROWS * E)

    def hits(first: list[int], count: list[int], down_type: int = int(Q.Q8_0), n_ff: int = F) -> None:
        args = dev.ffi.new("strata_dev_experts_args *", dict(
            gate_type=int(Q.Q8_0), up_type=int(Q.Q8_0), down_type=down_type, n_embd=E, n_ff=n_ff, x=b["x"],
            hb=b["hb"], hb2=b["hb2"], y=b["y"]))
        dev.launch_experts(args, [slot] * len(first), np.array(first, np.int32), np.array(count, np.int32))

    with pytest.raises(DeviceError, match="hit 1: slot .*, rows 2, count 0"):
        hits([0, 2], [2, 0])
    with pytest.raises(DeviceError, match="weight types 8, 8, 99"):
        hits([0], [2], down_type=99)
    with pytest.raises(DeviceError, match="hit 0: matmul: n 48 \\(a positive multiple of 32\\)"):
        hits([0], [2], n_ff=48)
    np.testing.assert_array_equal(read(dev, b["y"], ROWS * E), before)  # nothing was queued
    hits([], [])


def group(ids: np.ndarray, x: np.ndarray, n_expert: int) -> tuple[np.ndarray, ...]:
    """strata_host_group_slots: (x_out, slot_of, experts, first, count)."""
    ffi, dev_lib = interface()  # the interface's library, without a device
    n_tok, k = ids.shape
    out = [np.full((n_tok * k, x.shape[1]), np.nan, np.float32)] + [np.full(n_tok * k, -7, np.int32)
                                                                    for _ in range(4)]
    m = ffi.new("int *")
    _check(dev_lib.strata_host_group_slots(n_tok, k, n_expert, ffi.from_buffer("int[]", ids),
                                           ffi.from_buffer("float[]", x), x.shape[1],
                                           *(ffi.from_buffer("float[]" if a.dtype == np.float32 else "int[]", a)
                                             for a in out), m))
    x_out, slot_of, experts, first, count = out
    return x_out, slot_of, experts[:m[0]], first[:m[0]], count[:m[0]]


def test_the_slots_grouped_by_expert_are_numpys_stable_sort():
    rng = np.random.default_rng(5)
    for n_tok, k, n_expert in ((1, 8, 64), (7, 4, 16), (32, 8, 128)):
        ids = np.stack([rng.choice(n_expert, k, replace=False) for _ in range(n_tok)]).astype(np.int32)
        x = rng.standard_normal((n_tok, 16), dtype=np.float32)
        x_out, slot_of, experts, first, count = group(ids, x, n_expert)
        order = np.argsort(ids.reshape(-1), kind="stable")
        want_experts, want_first, want_count = np.unique(ids.reshape(-1)[order], return_index=True,
                                                         return_counts=True)
        np.testing.assert_array_equal(x_out, x[order // k])
        np.testing.assert_array_equal(slot_of[order], np.arange(n_tok * k))
        for got, want in ((experts, want_experts), (first, want_first), (count, want_count)):
            np.testing.assert_array_equal(got, want)
    with pytest.raises(EngineError, match="slot 3 chose expert 16 of 16"):
        group(np.array([[0, 1], [2, 16]], np.int32), np.zeros((2, 4), np.float32), 16)


def test_a_layers_misses_on_a_pool_give_the_bits_of_each_expert_alone():
    ffi, lib = interface()
    rng = np.random.default_rng(6)
    types = (Q.Q4_K, Q.Q4_K, Q.Q6_K)
    experts = [[random_weights(t, rows, n, rng) for t, rows, n in zip(types, (F, F, E), (E, E, F), strict=True)]
               for _ in range(5)]
    x = rng.standard_normal((ROWS, E), dtype=np.float32)
    rows = [(0, 3), (3, 1), (4, 2), (6, 1), (7, 1)]  # each expert's (first row, rows)
    want = np.full((ROWS, E), np.nan, np.float32)
    for (gate, up, down), (s0, n) in zip(experts, rows, strict=True):
        _check(lib.strata_host_expert_ffn(int(types[0]), ffi.from_buffer(gate), int(types[1]), ffi.from_buffer(up),
                                          int(types[2]), ffi.from_buffer(down), E, F,
                                          ffi.from_buffer("float[]", x[s0:s0 + n]), n,
                                          ffi.from_buffer("float[]", want[s0:s0 + n])))
    pool = lib.strata_host_pool_create(3)
    try:
        got = np.full((ROWS, E), np.nan, np.float32)
        args = ffi.new("strata_host_expert[]", len(experts))
        alive = []
        for a, (gate, up, down), (s0, n) in zip(args, experts, rows, strict=True):
            alive += [ffi.from_buffer(w) for w in (gate, up, down)]
            a.gate_type, a.up_type, a.down_type = (int(t) for t in types)
            a.gate, a.up, a.down = alive[-3:]
            a.x, a.n_tok, a.y = ffi.from_buffer("float[]", x) + s0 * E, n, ffi.from_buffer("float[]", got) + s0 * E
        _check(lib.strata_host_experts_ffn(pool, E, F, args, len(experts)))
        np.testing.assert_array_equal(got, want)
        _check(lib.strata_host_experts_ffn(pool, E, F, args, 0))
        # the same misses named by arrays, as a layer's experts lie in a file: one after another per matrix
        stacked = [np.concatenate([expert[which] for expert in experts]) for which in range(3)]
        layer = ffi.new("strata_host_layer_experts *", dict(
            gate_type=int(types[0]), up_type=int(types[1]), down_type=int(types[2]),
            gate=ffi.from_buffer(stacked[0]), up=ffi.from_buffer(stacked[1]), down=ffi.from_buffer(stacked[2]),
            gate_bytes=experts[0][0].nbytes, up_bytes=experts[0][1].nbytes, down_bytes=experts[0][2].nbytes))
        order = [3, 0, 4, 1]  # expert 2 left out: its rows stay as they were
        named = np.full((ROWS, E), np.nan, np.float32)
        _check(lib.strata_host_layer_misses(pool, E, F, layer, len(order),
                                            ffi.from_buffer("int[]", np.array(order, np.int32)),
                                            ffi.from_buffer("int[]", np.array([rows[e][0] for e in order], np.int32)),
                                            ffi.from_buffer("int[]", np.array([rows[e][1] for e in order], np.int32)),
                                            ffi.from_buffer("float[]", x), ffi.from_buffer("float[]", named)))
        left = slice(rows[2][0], rows[2][0] + rows[2][1])
        assert np.isnan(named[left]).all()
        named[left] = want[left]
        np.testing.assert_array_equal(named, want)
        with pytest.raises(EngineError, match="misses: a layer and -2 experts"):
            _check(lib.strata_host_layer_misses(pool, E, F, layer, -2, ffi.NULL, ffi.NULL, ffi.NULL, ffi.NULL,
                                                ffi.NULL))
        args[3].down_type = 99  # no such type: that expert named, and nothing run
        got[:] = np.nan
        with pytest.raises(EngineError, match="misses: expert 3 of 5: weight types 12, 12, 99, 1 rows"):
            _check(lib.strata_host_experts_ffn(pool, E, F, args, len(experts)))
        assert np.isnan(got).all()
        with pytest.raises(EngineError, match="misses: a pool and -1 experts"):
            _check(lib.strata_host_experts_ffn(pool, E, F, args, -1))
    finally:
        lib.strata_host_pool_free(pool)


def test_runs_of_rows_upload_in_one_call(dev):
    rows = np.arange(10 * 4, dtype=np.float32).reshape(10, 4)
    p = dev.to_device(np.zeros((10, 4), np.float32))
    first, count = np.array([7, 1, 4], np.int32), np.array([2, 2, 0], np.int32)
    dev.upload_rows(p, rows, first, count)
    got = dev.to_host(p, (10, 4), np.float32)
    want = np.zeros((10, 4), np.float32)
    want[1:3], want[7:9] = rows[1:3], rows[7:9]
    np.testing.assert_array_equal(got, want)
    with pytest.raises(DeviceError, match="not inside one allocation"):  # a run past the allocation's end
        dev.upload_rows(p, np.zeros((12, 4), np.float32), np.array([9], np.int32), np.array([2], np.int32))
    with pytest.raises(DeviceError, match="upload_rows: run 0 of 1: rows -1 \\+ 1"):
        dev.upload_rows(p, rows, np.array([-1], np.int32), np.array([1], np.int32))



def test_a_pass_names_the_operation_that_failed(dev):
    """A pass stops at its first failure, whose reason names the operation: here a layer's experts on another stream
    than the pass's."""
    b = buffers(dev, np.random.default_rng(2), x=E, out=E)
    launches = LaunchList(dev)
    launches.launch("swiglu", n=E, g=b["x"], u=b["x"], out=b["out"])
    layer = dev.ffi.new("strata_moe_layer *", dict(layer=-1, n_expert=4, k=2, stream=1))
    with pytest.raises(DeviceError, match="pass operation 1: no layer, or one on another stream"):
        Pass(dev, [launches, layer]).run(dev.ffi.NULL, 1, dev.ffi.NULL)
    x = read(dev, b["x"], E).astype(np.float64)
    np.testing.assert_allclose(read(dev, b["out"], E), x / (1 + np.exp(-x)) * x, rtol=1e-5)  # the one before ran
