"""Unit tests of lmproto's layouts, keys, detection, decoders and body helpers."""

from __future__ import annotations

import struct

import pytest

import lmproto
from lmproto import (
    NEED_DATA,
    Command,
    Generation,
    LocalProtocolError,
    ObjectMeta,
    RemoteProtocolError,
    ReplyDecoder,
    RequestDecoder,
    Status,
)

# ---------------------------------------------------------------------------------------
# layouts


def test_layout_sizes() -> None:
    assert struct.calcsize("ii150s") == 158
    assert struct.calcsize("iiiiiiiii150s") == 186
    assert struct.calcsize("ii") == 8
    assert struct.calcsize("iiiiiiiii") == 36
    assert lmproto.REQUEST_SIZE == {Generation.V0: 158, Generation.V1: 186}
    assert lmproto.REPLY_SIZE == {Generation.V0: 8, Generation.V1: 36}
    assert lmproto.KEY_SIZE == 150
    assert lmproto.DETECT_SIZE == 12


@pytest.mark.parametrize(
    ("native", "struct_", "values"),
    [
        ("ii150s", lmproto.V0_REQUEST, (1, 1234, b"key".ljust(150))),
        ("iiiiiiiii150s", lmproto.V1_REQUEST, (1, 16, 1, 2, 1, 2, 1, 2, 2, b"key".ljust(150))),
        ("ii", lmproto.V0_REPLY, (200, 5)),
        ("iiiiiiiii", lmproto.V1_REPLY, (200, 16, 1, 2, 2, 1, 2, 2, 1)),
    ],
)
def test_little_endian_matches_native_here(
    native: str, struct_: struct.Struct, values: tuple[object, ...]
) -> None:
    """Upstream packs with native order; on this (little-endian) machine that is our layout."""
    assert struct_.format.startswith("<")
    assert struct.pack(native, *values) == struct_.pack(*values)
    assert struct.calcsize(native) == struct_.size


def test_enumerations() -> None:
    assert [(c.name, c.value) for c in Command] == [
        ("PUT", 1),
        ("GET", 2),
        ("EXIST", 3),
        ("LIST", 4),
        ("HEALTH", 5),
        ("PUT_ACK", 101),
        ("DELETE", 102),
        ("EXIST_MANY", 103),
        ("STATS", 104),
        ("DELETE_MANY", 105),
        ("LIST_PAGE", 106),
    ]
    assert [int(s) for s in Status] == [200, 400, 404, 413, 503, 507]
    assert [int(f) for f in lmproto.MemoryFormat] == list(range(9))
    assert [int(d) for d in lmproto.DType] == list(range(9))
    assert [int(loc) for loc in lmproto.Location] == [0, 1, 2]
    assert set(Command) == lmproto.UPSTREAM_COMMANDS | lmproto.EXTENSION_COMMANDS
    assert not lmproto.UPSTREAM_COMMANDS & lmproto.EXTENSION_COMMANDS
    assert min(lmproto.EXTENSION_COMMANDS) > 100
    assert ObjectMeta(1, 2, (0, 0, 0, 0), 0) == lmproto.PLACEHOLDER_META
    assert ObjectMeta(0, 0, (0, 0, 0, 0), 0) == lmproto.NO_META


# ---------------------------------------------------------------------------------------
# keys


def test_key_padding() -> None:
    assert lmproto.encode_key("abc") == b"abc" + b" " * 147
    assert lmproto.encode_key("") == b" " * 150
    k150 = "ü" * 75
    assert lmproto.encode_key(k150) == k150.encode("utf-8")
    lmproto.validate_key(k150)


@pytest.mark.parametrize(
    "key",
    [
        "x" * 151,
        "ü" * 75 + "x",  # 151 UTF-8 bytes although only 76 characters
        "€" * 51,  # 153 bytes
        "a\x00b",
        "\x00",
        "abc\x00",
        " abc",
        "abc ",
        "\tabc",
        "abc\n",
        "abc\r",
        "\x1cabc",  # str.strip() treats the ASCII separators as whitespace
        "abc\x85",
        "\u3000abc",
        "abc\u2028",
        " ",
        "a\ud800b",  # lone surrogate: no UTF-8 form
    ],
)
def test_bad_keys_refused(key: str) -> None:
    with pytest.raises(LocalProtocolError):
        lmproto.encode_key(key)
    with pytest.raises(LocalProtocolError):
        lmproto.validate_key(key)
    with pytest.raises(LocalProtocolError):
        lmproto.encode_request(Command.GET, key)
    with pytest.raises(LocalProtocolError):
        lmproto.encode_key_list([key])


@pytest.mark.parametrize("key", [b"abc", None, 5, ["a"]])
def test_non_str_keys_refused(key: object) -> None:
    with pytest.raises(LocalProtocolError):
        lmproto.encode_key(key)  # type: ignore[arg-type]
    with pytest.raises(LocalProtocolError):
        lmproto.encode_request(Command.GET, key)  # type: ignore[arg-type]


@pytest.mark.parametrize("key", ["a b", "a\nb", "a\x00b".replace("\x00", "\x01"), "k" * 150, "日本語"])
def test_inner_whitespace_and_controls_allowed(key: str) -> None:
    header = lmproto.encode_request(Command.GET, key)
    assert lmproto.decode_request(header, Generation.V0).key == key


@pytest.mark.parametrize(
    ("field", "key"),
    [
        (b"abc".ljust(150, b" "), "abc"),
        (b"abc".ljust(150, b"\x00"), "abc"),
        (b"abc  ".ljust(150, b"\x00"), "abc"),  # spaces then NULs
        (b"\tabc\n".ljust(150, b" "), "abc"),  # whitespace around the key is stripped
        (b" " * 150, ""),
        (b"\x00" * 150, ""),
    ],
)
def test_key_field_decoding(field: bytes, key: str) -> None:
    request = lmproto.decode_request(struct.pack("<ii150s", Command.LIST, 0, field), Generation.V0)
    assert request.key == key
    assert request.problem is None


@pytest.mark.parametrize(
    "field",
    [
        b"ab\x00cd".ljust(150, b" "),
        b"abc\x00 ".ljust(150, b" "),  # NUL before the space padding is inside the key
        b"\xff".ljust(150, b" "),
        b"\xe2\x82".ljust(150, b"\x00"),  # truncated multi-byte character
    ],
)
def test_bad_key_fields_are_problems(field: bytes) -> None:
    for command in (Command.GET, Command.PUT, Command.LIST):
        request = lmproto.decode_request(struct.pack("<ii150s", command, 0, field), Generation.V0)
        assert request.problem


@pytest.mark.parametrize(
    "command", [Command.PUT, Command.GET, Command.EXIST, Command.PUT_ACK, Command.DELETE]
)
def test_empty_key_is_a_problem_for_key_commands(command: Command) -> None:
    for gen in Generation:
        request = lmproto.decode_request(lmproto.encode_request(command, "", generation=gen), gen)
        assert request.problem == "empty key"


@pytest.mark.parametrize("command", [Command.LIST, Command.HEALTH, Command.EXIST_MANY, Command.STATS])
def test_empty_key_is_fine_for_keyless_commands(command: Command) -> None:
    for gen in Generation:
        request = lmproto.decode_request(lmproto.encode_request(command, "", generation=gen), gen)
        assert request.problem is None


# ---------------------------------------------------------------------------------------
# encoder argument checks


@pytest.mark.parametrize("length", [-1, 2**31])
def test_length_out_of_int32(length: int) -> None:
    with pytest.raises(LocalProtocolError):
        lmproto.encode_request(Command.PUT, "k", length)
    with pytest.raises(LocalProtocolError):
        lmproto.encode_reply(Status.SUCCESS, length)


def test_length_limits_inclusive() -> None:
    header = lmproto.encode_request(Command.PUT, "k", 2**31 - 1)
    assert lmproto.decode_request(header, Generation.V0).length == 2**31 - 1


@pytest.mark.parametrize(
    "meta",
    [
        ObjectMeta(2**31, 0, (0, 0, 0, 0), 0),
        ObjectMeta(0, -(2**31) - 1, (0, 0, 0, 0), 0),
        ObjectMeta(0, 0, (0, 0, 0, 2**31), 0),
        ObjectMeta(0, 0, (0, 0, 0, 0), 2**40),
        ObjectMeta(0, 0, (1, 2, 3, 4, 5), 0),  # type: ignore[arg-type]
    ],
)
def test_meta_out_of_range(meta: ObjectMeta) -> None:
    with pytest.raises(LocalProtocolError):
        lmproto.encode_request(Command.PUT, "k", generation=Generation.V1, meta=meta)
    with pytest.raises(LocalProtocolError):
        lmproto.encode_reply(Status.SUCCESS, generation=Generation.V1, meta=meta)


def test_command_and_status_out_of_int32() -> None:
    with pytest.raises(LocalProtocolError):
        lmproto.encode_request(2**31, "k")
    with pytest.raises(LocalProtocolError):
        lmproto.encode_reply(-(2**31) - 1)


def test_short_shape_is_zero_padded() -> None:
    meta = ObjectMeta(1, 2, (3, 4), 1)  # type: ignore[arg-type]
    header = lmproto.encode_reply(Status.SUCCESS, 0, generation=Generation.V1, meta=meta)
    assert lmproto.decode_reply(header, Generation.V1).meta.shape == (3, 4, 0, 0)


def test_v0_ignores_meta() -> None:
    meta = ObjectMeta(1, 2, (3, 4, 5, 6), 1)
    assert lmproto.encode_reply(200, 0, meta=meta) == struct.pack("<ii", 200, 0)
    assert lmproto.decode_reply(struct.pack("<ii", 200, 0), Generation.V0).meta == lmproto.NO_META


def test_v1_reply_defaults_to_placeholder_meta() -> None:
    assert lmproto.encode_reply(400, generation=Generation.V1) == struct.pack(
        "<9i", 400, 0, 1, 2, 0, 0, 0, 0, 0
    )


def test_unknown_command_is_a_problem_not_an_error() -> None:
    request = lmproto.decode_request(lmproto.encode_request(999, "k", 3), Generation.V0)
    assert request.problem == "unknown command 999"
    assert request.known_command is None
    assert request.length == 3


# ---------------------------------------------------------------------------------------
# generation detection


def v0(key: bytes) -> bytes:
    return struct.pack("<ii150s", Command.GET, 0, key)


@pytest.mark.parametrize(
    ("data", "expected"),
    [
        (b"", None),
        (b"\x01" * 11, None),
        (v0(b"abc".ljust(150)), Generation.V0),
        (v0(b" " * 150), Generation.V0),
        (v0(b"ab".ljust(150, b"\x00")), Generation.V0),  # 2-byte NUL-padded key: still v0
        (v0(b"a".ljust(150, b"\x00")), Generation.V1),  # the documented ambiguity
        (v0(b"\x00" * 150), Generation.V1),
        (struct.pack("<iii", 1, 16, 1), Generation.V1),
        (struct.pack("<iii", 1, 16, 255), Generation.V1),
        (struct.pack("<iii", 1, 16, 256), Generation.V0),  # fmt must stay below 256
        (struct.pack("<iii", 1, 16, -1), Generation.V0),
    ],
)
def test_detect_generation_cases(data: bytes, expected: Generation | None) -> None:
    assert lmproto.detect_generation(data) == expected
    assert lmproto.detect_generation(bytearray(data)) == expected
    assert lmproto.detect_generation(memoryview(data)) == expected
    assert lmproto.detect_generation(b"junk" + data, 4) == expected


def test_detect_all_v1_formats() -> None:
    for fmt in lmproto.MemoryFormat:
        header = lmproto.encode_request(
            Command.GET, "k", generation=Generation.V1, meta=ObjectMeta(fmt, 0, (0, 0, 0, 0), 0)
        )
        assert lmproto.detect_generation(header) == Generation.V1


# ---------------------------------------------------------------------------------------
# incremental decoders


def test_decoder_detects_generation_from_first_header() -> None:
    decoder = RequestDecoder()
    assert decoder.generation is None
    header = lmproto.encode_request(Command.PUT, "k", 2, generation=Generation.V1)
    decoder.feed(header[:11])
    assert decoder.next_frame() is NEED_DATA
    assert decoder.generation is None
    decoder.feed(header[11:] + b"xy")
    request, body = decoder.next_frame()  # type: ignore[misc]
    assert decoder.generation == Generation.V1
    assert (request.key, body) == ("k", b"xy")


def test_clean_end_of_stream() -> None:
    decoder = ReplyDecoder(Generation.V0)
    decoder.feed(lmproto.encode_reply(200, 1) + b"x")
    decoder.feed(b"")
    assert decoder.next_frame() != NEED_DATA
    assert decoder.next_frame() is NEED_DATA  # nothing left: a clean close
    assert decoder.buffered == 0


def test_end_of_stream_after_header_raises() -> None:
    decoder = ReplyDecoder(Generation.V0)
    decoder.feed(lmproto.encode_reply(200, 1))
    assert decoder.next_frame() is NEED_DATA
    decoder.feed(b"")
    with pytest.raises(RemoteProtocolError):
        decoder.next_frame()


def test_feed_after_eof() -> None:
    decoder = RequestDecoder(Generation.V0)
    decoder.feed(b"")
    decoder.feed(b"")  # repeated EOF is harmless
    with pytest.raises(LocalProtocolError):
        decoder.feed(b"x")


def test_max_body() -> None:
    decoder = ReplyDecoder(Generation.V0, max_body=4)
    decoder.feed(lmproto.encode_reply(200, 4) + b"abcd" + lmproto.encode_reply(200, 5))
    assert decoder.next_frame() != NEED_DATA
    with pytest.raises(RemoteProtocolError):
        decoder.next_frame()
    for bad in (-1, 2**31):
        with pytest.raises(LocalProtocolError):
            RequestDecoder(max_body=bad)


def test_negative_length_raises() -> None:
    decoder = RequestDecoder(Generation.V0)
    decoder.feed(struct.pack("<ii150s", Command.PUT, -7, b"k".ljust(150)))
    with pytest.raises(RemoteProtocolError):
        decoder.next_frame()


def test_buffer_compaction_keeps_frames() -> None:
    frame = lmproto.encode_reply(200, 3) + b"abc"
    decoder = ReplyDecoder(Generation.V0)
    got = []
    for _ in range(50):
        decoder.feed(frame + frame[:5])
        decoder.feed(frame[5:])
        while (item := decoder.next_frame()) is not NEED_DATA:
            got.append(item)
    assert len(got) == 100
    assert all(body == b"abc" for _, body in got)


# ---------------------------------------------------------------------------------------
# errors


def test_protocol_error_is_abstract() -> None:
    with pytest.raises(TypeError):
        lmproto.ProtocolError("x")
    assert issubclass(LocalProtocolError, lmproto.ProtocolError)
    assert issubclass(RemoteProtocolError, lmproto.ProtocolError)
    assert issubclass(lmproto.MalformedBody, RemoteProtocolError)
    assert not issubclass(lmproto.ProtocolError, (ConnectionError, ValueError))


# ---------------------------------------------------------------------------------------
# bodies


@pytest.mark.parametrize(
    ("hits", "prefix"),
    [([], 0), ([True], 1), ([False], 0), ([True, True, False, True], 2), ([True] * 5, 5), ([False, True], 0)],
)
def test_hit_prefix(hits: list[bool], prefix: int) -> None:
    assert lmproto.hit_prefix(hits) == prefix
    assert lmproto.decode_presence(lmproto.encode_presence(hits)) == hits


def test_key_list_round_trip_and_limits() -> None:
    keys = ["a", "é" * 75, "k@1@0@ff"]
    assert lmproto.decode_key_list(lmproto.encode_key_list(keys)) == keys
    assert lmproto.encode_key_list([]) == b""
    with pytest.raises(LocalProtocolError):
        lmproto.encode_key_list([""])
    too_many = ["k" * 150] * (lmproto.MAX_CONTROL_BODY // 151 + 1)
    with pytest.raises(LocalProtocolError):
        lmproto.encode_key_list(too_many)


def test_key_lines() -> None:
    assert lmproto.encode_key_lines([]) == b""
    assert lmproto.decode_key_lines(b"") == []
    assert lmproto.decode_key_lines(lmproto.encode_key_lines(["a", "clé"])) == ["a", "clé"]
    with pytest.raises(lmproto.MalformedBody):
        lmproto.decode_key_lines(b"a\n\xff")


@pytest.mark.parametrize(
    "body",
    [b"", b"nope", b"[]", b"1", b'"s"', b"\xff", '{"a":1}'.encode("utf-16"), b"[" * 100_000],
)
def test_bad_json_bodies(body: bytes) -> None:
    with pytest.raises(lmproto.MalformedBody):
        lmproto.decode_json(body)


def test_json_round_trip() -> None:
    doc = {"version": "0.1.0", "hits": 3, "tiers": [{"name": "memory", "bytes": 1}]}
    assert lmproto.decode_json(lmproto.encode_json(doc)) == doc


def test_error_text_is_cut_at_a_character_boundary() -> None:
    assert lmproto.MAX_REASON_BODY == 1024
    assert lmproto.encode_error_text("short") == b"short"
    body = lmproto.encode_error_text("x" + "€" * 400)  # 1 + 1200 bytes
    assert len(body) <= lmproto.MAX_REASON_BODY
    assert body.decode("utf-8") == "x" + "€" * 341
    assert lmproto.decode_error_text(b"bad \xff") == "bad \ufffd"


def test_page_bodies_round_trip_and_refuse_what_cannot_be_sent() -> None:
    entries = [("a", 0), ("ключ", 7), ("k" * 150, lmproto.UNKNOWN_SIZE)]
    assert lmproto.decode_page(lmproto.encode_page(entries, True)) == (entries, True)
    assert lmproto.decode_page(lmproto.encode_page([], False)) == ([], False)
    assert lmproto.decode_page_request(lmproto.encode_page_request(1)) == (1, "")
    assert lmproto.decode_page_request(lmproto.encode_page_request(2**32 - 1, "é" * 75)) == (
        2**32 - 1,
        "é" * 75,
    )
    for limit in (0, 2**32):
        with pytest.raises(lmproto.LocalProtocolError):
            lmproto.encode_page_request(limit)
    with pytest.raises(lmproto.LocalProtocolError):
        lmproto.encode_page_request(5, "x" * 151)
    with pytest.raises(lmproto.LocalProtocolError):
        lmproto.encode_page([("", 1)], False)
    for bad in (b"", b"\x02", b"\x00\x01a\x00"):
        with pytest.raises(lmproto.MalformedBody):
            lmproto.decode_page(bad)
