"""The line protocol without a process: every message's wire form, round trips, and every refusal."""

from __future__ import annotations

import dataclasses
import json
import re
import struct

import numpy as np
import pytest

from strata.vision.protocol import (
    MAX_LINE_BYTES,
    MAX_MESSAGE_CHARS,
    PROTOCOL_VERSION,
    Cancel,
    Cancelled,
    Capabilities,
    EncodeBytes,
    Encoded,
    EncodePath,
    Failed,
    PictureGrid,
    ProtocolError,
    Quit,
    Ready,
    Result,
    Sizing,
    encode_reply,
    encode_request,
    encode_sve,
    job_bytes_to_skip,
    parse_reply,
    parse_request,
    parse_sve,
    parse_sve_header,
    split_words,
)

CAPS = Capabilities(cuda=False, threads=2, max_tokens=1024, fingerprint="sha256:" + "ab" * 32, projector="lfm2")

# The wire form of each message, written out by hand from the grammar in docs/VISION.md.
REQUESTS = [
    (EncodePath("/pics/a.png", "/tmp/a.sve"), b"ENC /pics/a.png /tmp/a.sve\n"),
    (EncodePath("/my pics/\"b\".png", "out.sve"), b'ENC "/my pics/\\"b\\".png" out.sve\n'),
    (EncodePath("/bilder/\u00e4.png", "x"), "ENC /bilder/\u00e4.png x\n".encode()),
    (EncodeBytes("job-1.a_B", 1234), b"JOB job-1.a_B 1234\n"),
    (Cancel("7"), b"CANCEL 7\n"),
    (Quit(), b"QUIT\n"),
]
REPLIES = [
    (Encoded(1000, 40, 25, 812.25), b"OK 1000 40 25 812.2\n"),
    (Result("7", 6, 3, 2, 5.0, 1172), b"RES 7 6 3 2 5.0 1172\n"),
    (Cancelled("7"), b"CANCELLED 7\n"),
    (Failed("image", "cannot identify image file"), b"ERR image: cannot identify image file\n"),
    (Failed("image", "truncated", "7"), b"ERR 7 image: truncated\n"),
]


@pytest.mark.parametrize(("request_", "wire"), REQUESTS)
def test_request_wire_form_and_round_trip(request_, wire):
    assert encode_request(request_) == wire
    assert parse_request(wire) == request_


@pytest.mark.parametrize(("reply", "wire"), REPLIES)
def test_reply_wire_form_and_round_trip(reply, wire):
    assert encode_reply(reply) == wire
    parsed = parse_reply(wire)
    assert type(parsed) is type(reply)
    if isinstance(reply, (Encoded, Result)):  # milliseconds travel with one decimal
        assert parsed.ms == pytest.approx(reply.ms, abs=0.05)
    else:
        assert parsed == reply


def test_ready_line_is_json_with_every_capability():
    line = encode_reply(Ready(2048, CAPS))
    verb, n_embd, text = line.rstrip(b"\n").split(b" ", 2)
    assert (verb, n_embd) == (b"READY", b"2048")
    assert json.loads(text) == {
        "cuda": False, "threads": 2, "max_tokens": 1024, "fingerprint": CAPS.fingerprint, "projector": "lfm2",
        "max_image_bytes": 64 * 1024 * 1024, "protocol": PROTOCOL_VERSION,
    }
    assert parse_reply(line) == Ready(2048, CAPS)


def test_ready_carries_the_sizing_rule_and_an_older_encoder_may_leave_it_out():
    caps = dataclasses.replace(CAPS, sizing=Sizing("smart", 16, 2, 64, 256))
    line = encode_reply(Ready(8, caps))
    fields = json.loads(line.split(b" ", 2)[2])
    assert fields["sizing"] == {"grid": "smart", "patch_size": 16, "merge": 2, "min_tokens": 64, "max_tokens": 256,
                                "tile_size": 0, "min_tiles": 0, "max_tiles": 0}
    assert parse_reply(line) == Ready(8, caps)
    # the tiling fields are optional: an encoder that does not split pictures may leave them out
    untiled = {k: v for k, v in fields.items() if k != "sizing"} | {"sizing": {
        k: v for k, v in fields["sizing"].items() if not k.endswith(("tile_size", "tiles"))}}
    assert parse_reply(b"READY 8 " + json.dumps(untiled).encode() + b"\n") == Ready(8, caps)
    assert "sizing" not in json.loads(encode_reply(Ready(8, CAPS)).split(b" ", 2)[2])
    assert parse_reply(encode_reply(Ready(8, CAPS))).capabilities.sizing is None
    for bad, message in [
        ([1], "'sizing' is not a JSON object"),
        (fields["sizing"] | {"grid": "other"}, "'grid' is not one of token, smart"),
        (fields["sizing"] | {"merge": 0}, "'merge' is not an integer"),
        ({k: v for k, v in fields["sizing"].items() if k != "patch_size"}, "'patch_size' is not an integer"),
        (fields["sizing"] | {"max_tiles": -1}, "'max_tiles' is not an integer from 0"),
    ]:
        with pytest.raises(ProtocolError, match=message):
            parse_reply(b"READY 8 " + json.dumps(fields | {"sizing": bad}).encode())


def test_a_gpu_encoder_reports_its_device_memory_and_others_leave_it_out():
    caps = dataclasses.replace(CAPS, cuda=True, device_bytes=123 << 20)
    line = encode_reply(Ready(8, caps))
    fields = json.loads(line.split(b" ", 2)[2])
    assert fields["device_bytes"] == 123 << 20 and parse_reply(line) == Ready(8, caps)
    assert "device_bytes" not in json.loads(encode_reply(Ready(8, CAPS)).split(b" ", 2)[2])
    for bad in (-1, 1.5, True, "1"):
        with pytest.raises(ProtocolError, match="'device_bytes' is not a non-negative integer"):
            parse_reply(b"READY 8 " + json.dumps(fields | {"device_bytes": bad}).encode())


def test_ready_ignores_unknown_capabilities_and_checks_known_ones():
    fields = json.loads(encode_reply(Ready(8, CAPS)).split(b" ", 2)[2])
    assert parse_reply(b"READY 8 " + json.dumps(fields | {"future": [1]}).encode()) == Ready(8, CAPS)
    for bad, message in [
        ({k: v for k, v in fields.items() if k != "cuda"}, "lack 'cuda'"),
        (fields | {"threads": True}, "'threads' is not a int"),
        (fields | {"cuda": "false"}, "'cuda' is not a bool"),
        ([1, 2], "not a JSON object"),
    ]:
        with pytest.raises(ProtocolError, match=message):
            parse_reply(b"READY 8 " + json.dumps(bad).encode())
    with pytest.raises(ProtocolError, match="not JSON"):
        parse_reply(b"READY 8 {")


def test_an_error_names_its_job_only_when_it_answers_one():
    untagged = parse_reply(b"ERR protocol: unknown verb 'X'\n")
    assert untagged == Failed("protocol", "unknown verb 'X'", None)
    assert parse_reply(b"ERR job7 image: bad").job_id == "job7"
    assert parse_reply(b"ERR job7 image: bad").message == "image: bad"
    with pytest.raises(ProtocolError, match="bad job id"):  # an id cannot hold ':', so it never reads as a kind
        encode_reply(Failed("image", "x", "a:b"))
    with pytest.raises(ProtocolError, match="kind"):
        parse_reply(b"ERR 7 no kind here")


def test_error_messages_are_one_bounded_line():
    line = encode_reply(Failed("internal", "first\nsecond\r\n\tthird " + "x" * 5000))
    assert line.count(b"\n") == 1
    assert line.startswith(b"ERR internal: first second third xx")
    assert len(line) <= len("ERR internal: ") + MAX_MESSAGE_CHARS + 1
    assert encode_reply(Failed("image", "")) == b"ERR image: (no detail)\n"


@pytest.mark.parametrize(
    ("line", "message", "job_id"),
    [
        (b"\n", "empty line", None),
        (b"FOO bar\n", "unknown verb 'FOO'", None),
        (b"enc a b\n", "unknown verb 'enc'", None),
        (b"ENC onlyone\n", "expected 'ENC <image> <out>', got 1", None),
        (b"ENC a b c\n", "got 3", None),
        (b'ENC "" out\n', "empty path", None),
        (b'ENC "unterminated out\n', "bad quoted word", None),
        (b'ENC "a"b c\n', "no space after", None),
        (b'ENC a"b c\n', "no space after", None),
        (b"ENC a\x01 b\n", "control character", None),
        (b"ENC \xff\xfe b\n", "not valid UTF-8", None),
        (b"JOB\n", "expected 'JOB <id> <n_bytes>'", None),
        (b"JOB 7\n", "expected 'JOB <id> <n_bytes>'", "7"),
        (b"JOB 7 -1\n", "bad byte count", "7"),
        (b"JOB 7 1e3\n", "bad byte count", "7"),
        (b"JOB 7 1001\n", "bad byte count '1001' (an integer from 0 to 1000)", "7"),
        (b"JOB a:b 10\n", "bad job id", None),
        (b"JOB " + b"x" * 65 + b" 10\n", "bad job id", None),
        (b"CANCEL\n", "expected 'CANCEL <id>'", None),
        (b"CANCEL a/b\n", "bad job id", None),
        (b"QUIT now\n", "expected 'QUIT'", None),
        (b"ENC a b\nENC c d\n", "more than one line", None),
        (b"ENC " + b"a" * MAX_LINE_BYTES + b" b\n", "line longer than", None),
    ],
)
def test_malformed_requests_are_refused(line, message, job_id):
    with pytest.raises(ProtocolError, match=re.escape(message)) as info:
        parse_request(line, max_image_bytes=1000)
    assert info.value.job_id == job_id


def test_crlf_and_blank_separators_are_accepted():
    assert parse_request(b"CANCEL  7 \r\n") == Cancel("7")
    assert parse_request(b"ENC\ta\tb") == EncodePath("a", "b")


def test_a_refused_job_says_how_many_bytes_to_skip():
    assert job_bytes_to_skip(b"JOB 7 5000\n") == 5000
    assert job_bytes_to_skip(b"JOB a:b 12\n") == 12
    assert job_bytes_to_skip(b"JOB 7 abc\n") == 0
    assert job_bytes_to_skip(b"FOO 7 12\n") == 0


def test_split_words_decodes_json_strings():
    assert split_words('a "b c" "\\u00e4\\n" d') == ["a", "b c", "\u00e4\n", "d"]


def test_encoding_refuses_what_cannot_be_parsed():
    with pytest.raises(ProtocolError, match="line longer"):
        encode_request(EncodePath("a" * MAX_LINE_BYTES, "b"))
    with pytest.raises(ProtocolError, match="bad job id"):
        encode_request(Cancel("has space"))


@pytest.mark.parametrize(
    "line",
    [b"OK 1 1 1\n", b"OK 1 1 1 -3\n", b"OK 1 1 1 nan\n", b"RES 7 1 1 1 2.0\n", b"CANCELLED\n", b"HELLO\n",
     b"OK a b c d\n"],
)
def test_malformed_replies_are_refused(line):
    with pytest.raises(ProtocolError):
        parse_reply(line)


# --- SVE1


def test_sve_layout():
    rows = np.arange(6 * 4, dtype=np.float32).reshape(6, 4) / 7
    data = encode_sve(rows, nx=3, ny=2)
    assert data[:4] == b"SVE1"
    assert struct.unpack_from("<5i", data) == (0x31455653, 6, 3, 2, 4)
    np.testing.assert_array_equal(np.frombuffer(data[20:], dtype="<f4").reshape(6, 4), rows)
    header, parsed = parse_sve(data)
    assert (header.n_tokens, header.nx, header.ny, header.n_embd) == (6, 3, 2, 4)
    np.testing.assert_array_equal(parsed, rows)
    assert parse_sve_header(data[:20]) == header


def test_a_tiled_picture_is_sve2_with_its_tiles():
    # two tiles of 2x2 tokens, then a 3x1 thumbnail: 11 rows
    rows = np.arange(11 * 4, dtype=np.float32).reshape(11, 4) / 7
    data = encode_sve(rows, 3, 1, (2, 1, 2))
    assert data[:4] == b"SVE2"
    assert struct.unpack_from("<8i", data) == (0x32455653, 11, 3, 1, 4, 2, 1, 2)
    header, parsed = parse_sve(data)
    assert header.grid == PictureGrid(3, 1, 2, 1, 2) and header.size == 32
    np.testing.assert_array_equal(parsed, rows)
    assert parse_sve_header(data[:32]) == header
    with pytest.raises(ProtocolError, match="for a 3x1 grid after 2x1 tiles of 2x2"):
        parse_sve(struct.pack("<8i", 0x32455653, 12, 3, 1, 4, 2, 1, 2) + np.zeros(48, "<f4").tobytes())
    with pytest.raises(ProtocolError, match="out of range"):
        parse_sve(struct.pack("<8i", 0x32455653, 3, 3, 1, 4, 0, 1, 2) + np.zeros(12, "<f4").tobytes())
    with pytest.raises(ProtocolError, match="shorter than its 32-byte header"):
        parse_sve(data[:24])
    with pytest.raises(ValueError, match="10 rows for a 3x1 grid after"):
        encode_sve(rows[:10], 3, 1, (2, 1, 2))


def test_a_grids_segments_are_lfm2_vls_layout():
    assert PictureGrid(4, 3).segments() == [("", 4, 3)]
    assert PictureGrid(4, 3, cols=2, rows=2, tile=16).segments() == [
        ("<|img_row_1_col_1|>", 16, 16), ("<|img_row_1_col_2|>", 16, 16), ("<|img_row_2_col_1|>", 16, 16),
        ("<|img_row_2_col_2|>", 16, 16), ("<|img_thumbnail|>", 4, 3)]
    assert PictureGrid(4, 3, cols=2, rows=2, tile=16).n_tokens == 4 * 256 + 12


@pytest.mark.parametrize(
    ("header", "extra", "message"),
    [
        ((0x31455654, 6, 3, 2, 4), 0, "not SVE1"),
        ((0x31455653, 6, 3, 3, 4), 0, "for a 3x3 grid"),
        ((0x31455653, -6, -3, 2, 4), 0, "out of range"),
        ((0x31455653, 6, 3, 2, 0), 0, "out of range"),
        ((0x31455653, 6, 3, 2, 4), 4, "needs 116"),
        ((0x31455653, 6, 3, 2, 4), -4, "needs 116"),
    ],
)
def test_bad_sve_data_is_refused(header, extra, message):
    body = np.zeros(6 * 4 + extra // 4, dtype="<f4").tobytes()
    with pytest.raises(ProtocolError, match=message):
        parse_sve(struct.pack("<5i", *header) + body)


def test_sve_refuses_short_and_non_finite_data():
    with pytest.raises(ProtocolError, match="shorter"):
        parse_sve(b"SVE1")
    rows = np.ones((2, 3), dtype=np.float32)
    rows[1, 2] = np.inf
    with pytest.raises(ProtocolError, match="not finite"):
        parse_sve(encode_sve(rows, 2, 1))
    with pytest.raises(ValueError, match="6 rows for a 2x2 grid"):
        encode_sve(np.zeros((6, 3), np.float32), 2, 2)
