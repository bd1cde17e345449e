"""Property tests: round trips, arbitrary stream splits, and random input to the decoders."""

from __future__ import annotations

import contextlib
import itertools
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import lmproto
from lmproto import Command, Generation, ObjectMeta, ReplyDecoder, RequestDecoder

# No deadline: these tests must not depend on how fast the machine is.
FAST = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])

INT32 = st.integers(-(2**31), 2**31 - 1)
GENERATIONS = st.sampled_from(list(Generation))

# Keys the wire can carry: no NUL, no surrounding whitespace, at most 150 UTF-8 bytes.
KEYS = (
    st.text(st.characters(exclude_categories=["Cs"], exclude_characters="\x00"), max_size=80)
    .map(str.strip)
    .filter(lambda k: len(k.encode("utf-8")) <= lmproto.KEY_SIZE)
)
NON_EMPTY_KEYS = KEYS.filter(bool)
METAS = st.builds(ObjectMeta, INT32, INT32, st.tuples(INT32, INT32, INT32, INT32), INT32)
BODIES = st.binary(max_size=40)
KEYLESS = [Command.LIST, Command.HEALTH, Command.EXIST_MANY, Command.STATS]


@st.composite
def requests(draw: st.DrawFn, gen: Generation, small_fmt: bool = False) -> tuple[int, str, ObjectMeta, bytes]:
    command = draw(st.sampled_from(list(Command)))
    key = draw(KEYS if command in KEYLESS else NON_EMPTY_KEYS)
    meta = draw(METAS) if gen == Generation.V1 else lmproto.NO_META
    if small_fmt and gen == Generation.V1:
        meta = meta._replace(fmt=draw(st.integers(0, 255)))
    return command, key, meta, draw(BODIES)


@st.composite
def replies(draw: st.DrawFn, gen: Generation) -> tuple[int, ObjectMeta, bytes]:
    meta = draw(METAS) if gen == Generation.V1 else lmproto.NO_META
    return draw(st.sampled_from(list(lmproto.Status)) | INT32), meta, draw(BODIES)


def request_bytes(gen: Generation, req: tuple[int, str, ObjectMeta, bytes]) -> bytes:
    command, key, meta, body = req
    return lmproto.encode_request(command, key, len(body), generation=gen, meta=meta) + body


def reply_bytes(gen: Generation, rep: tuple[int, ObjectMeta, bytes]) -> bytes:
    status, meta, body = rep
    return lmproto.encode_reply(status, len(body), generation=gen, meta=meta) + body


def feed_chunks(decoder: RequestDecoder | ReplyDecoder, chunks: list[bytes]) -> list[tuple[Any, bytes]]:
    frames: list[tuple[Any, bytes]] = []
    for chunk in [*chunks, b""]:
        decoder.feed(chunk)
        while (frame := decoder.next_frame()) is not lmproto.NEED_DATA:
            frames.append(frame)
    return frames


def split(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({min(c, len(data)) for c in cuts})
    bounds = [0, *points, len(data)]
    # No empty chunks: feeding b"" means end of stream.
    return [data[a:b] for a, b in itertools.pairwise(bounds) if b > a]


# ---------------------------------------------------------------------------------------
# round trips


@FAST
@given(st.data())
def test_request_round_trip(data: st.DataObject) -> None:
    gen = data.draw(GENERATIONS)
    command, key, meta, body = data.draw(requests(gen))
    header = lmproto.encode_request(command, key, len(body), generation=gen, meta=meta)
    assert len(header) == lmproto.REQUEST_SIZE[gen]
    request = lmproto.decode_request(header, gen)
    assert request == lmproto.Request(command, len(body), key, meta, gen, None)


@FAST
@given(st.data())
def test_reply_round_trip(data: st.DataObject) -> None:
    gen = data.draw(GENERATIONS)
    status, meta, body = data.draw(replies(gen))
    header = lmproto.encode_reply(status, len(body), generation=gen, meta=meta)
    assert len(header) == lmproto.REPLY_SIZE[gen]
    assert lmproto.decode_reply(header, gen) == lmproto.Reply(status, len(body), meta, gen)


@FAST
@given(st.lists(NON_EMPTY_KEYS, max_size=20))
def test_key_list_round_trip(keys: list[str]) -> None:
    body = lmproto.encode_key_list(keys)
    assert lmproto.decode_key_list(body) == keys
    presence = [len(k) % 2 == 0 for k in keys]
    assert lmproto.decode_presence(lmproto.encode_presence(presence)) == presence


@FAST
@given(st.lists(NON_EMPTY_KEYS.filter(lambda k: "\n" not in k), max_size=20))
def test_key_lines_round_trip(keys: list[str]) -> None:
    assert lmproto.decode_key_lines(lmproto.encode_key_lines(keys)) == keys


# ---------------------------------------------------------------------------------------
# any split of a stream yields the same frames


@FAST
@given(st.data())
def test_request_stream_splits(data: st.DataObject) -> None:
    gen = data.draw(GENERATIONS)
    reqs = data.draw(st.lists(requests(gen, small_fmt=True), min_size=1, max_size=6))
    stream = b"".join(request_bytes(gen, r) for r in reqs)
    cuts = data.draw(st.lists(st.integers(0, len(stream)), max_size=20))
    whole = feed_chunks(RequestDecoder(gen), [stream])
    assert [(h.command, h.key, h.meta, body) for h, body in whole] == [(c, k, m, b) for c, k, m, b in reqs]
    assert feed_chunks(RequestDecoder(gen), split(stream, cuts)) == whole
    # Detection from the first header (fmt kept below 256, as every real v1 client sends).
    assert feed_chunks(RequestDecoder(), split(stream, cuts)) == whole


@FAST
@given(st.data())
def test_reply_stream_splits(data: st.DataObject) -> None:
    gen = data.draw(GENERATIONS)
    reps = data.draw(st.lists(replies(gen), min_size=1, max_size=6))
    stream = b"".join(reply_bytes(gen, r) for r in reps)
    cuts = data.draw(st.lists(st.integers(0, len(stream)), max_size=20))
    whole = feed_chunks(ReplyDecoder(gen), [stream])
    assert [(h.status, h.meta, body) for h, body in whole] == list(reps)
    assert feed_chunks(ReplyDecoder(gen), split(stream, cuts)) == whole


@settings(max_examples=10, deadline=None)
@given(st.data())
def test_one_byte_at_a_time_streams(data: st.DataObject) -> None:
    gen = data.draw(GENERATIONS)
    reqs = data.draw(st.lists(requests(gen), min_size=1, max_size=4))
    stream = b"".join(request_bytes(gen, r) for r in reqs)
    singles = [stream[i : i + 1] for i in range(len(stream))]
    assert feed_chunks(RequestDecoder(gen), singles) == feed_chunks(RequestDecoder(gen), [stream])
    reps = data.draw(st.lists(replies(gen), min_size=1, max_size=4))
    stream = b"".join(reply_bytes(gen, r) for r in reps)
    singles = [stream[i : i + 1] for i in range(len(stream))]
    assert feed_chunks(ReplyDecoder(gen), singles) == feed_chunks(ReplyDecoder(gen), [stream])


# ---------------------------------------------------------------------------------------
# random input never raises anything but ProtocolError


def make_decoders() -> list[RequestDecoder | ReplyDecoder]:
    return [
        RequestDecoder(),
        RequestDecoder(Generation.V0),
        RequestDecoder(Generation.V1, max_body=64),
        ReplyDecoder(Generation.V0),
        ReplyDecoder(Generation.V1, max_body=64),
    ]


# Headers with small random lengths, so random data also reaches the body paths.
SMALL_HEADERS = st.one_of(
    st.builds(
        lambda c, n, k: lmproto.V0_REQUEST.pack(c, n, k),
        INT32,
        st.integers(-3, 40),
        st.binary(min_size=150, max_size=150),
    ),
    st.builds(
        lambda c, n, k: lmproto.V1_REQUEST.pack(c, n, 1, 2, 0, 0, 0, 0, 0, k),
        INT32,
        st.integers(-3, 40),
        st.binary(min_size=150, max_size=150),
    ),
    st.builds(lambda s, n: lmproto.V0_REPLY.pack(s, n), INT32, st.integers(-3, 40)),
)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.binary(max_size=200) | SMALL_HEADERS, max_size=5), st.lists(st.integers(0, 1200)))
def test_random_bytes_only_raise_protocol_errors(parts: list[bytes], cuts: list[int]) -> None:
    stream = b"".join(parts)
    for decoder in make_decoders():
        try:
            frames = feed_chunks(decoder, split(stream, cuts))
        except lmproto.ProtocolError:
            continue
        for header, body in frames:
            assert len(body) == header.length
            if isinstance(header, lmproto.Request):
                assert header.problem is not None or header.known_command is not None


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=300))
def test_random_bodies_only_raise_malformed_body(body: bytes) -> None:
    for decode in (lmproto.decode_key_list, lmproto.decode_key_lines, lmproto.decode_json):
        with contextlib.suppress(lmproto.MalformedBody):
            decode(body)
    lmproto.decode_presence(body)
    lmproto.decode_error_text(body)


def _upstream_key(raw: bytes) -> str | None:
    """The key rule of SPEC.md, written plainly: drop trailing NUL padding, decode UTF-8, refuse
    a NUL left inside, strip whitespace on both ends. None: the request carries a problem."""
    try:
        key = raw.rstrip(b"\x00").decode("utf-8")
    except UnicodeDecodeError:
        return None
    return None if "\x00" in key else key.strip()


# Key fields built from the pieces that matter: padding of spaces and NULs in any order,
# Unicode whitespace, stray NULs, multi-byte characters and invalid UTF-8.
KEY_PIECES = st.sampled_from(
    [b" ", b"\x00", b"\t", b"\x1c", "\u3000".encode(), "\xa0".encode(), b"k", b"\xff", "é".encode()]
)


@FAST
@given(st.lists(KEY_PIECES | st.binary(max_size=3), max_size=60), st.sampled_from([b" ", b"\x00"]))
def test_key_field_decodes_as_the_plain_rule_says(pieces: list[bytes], pad: bytes) -> None:
    raw = b"".join(pieces)[: lmproto.KEY_SIZE].ljust(lmproto.KEY_SIZE, pad)
    frame = lmproto.encode_request(Command.EXIST, "k", generation=Generation.V0)
    frame = frame[: -lmproto.KEY_SIZE] + raw
    req = lmproto.decode_request(frame, Generation.V0)
    expected = _upstream_key(raw)
    if expected is None:
        assert req.problem is not None and req.key == ""
    else:
        assert req.key == expected
        assert (req.problem is None) == bool(expected)


# The lookup fast path scans ASCII fields byte by byte (in C when compiled): every ASCII
# whitespace character str.strip() knows, and the neighbours that are not whitespace.
ASCII_EDGES = st.sampled_from(
    [b"\x08", b"\t", b"\n", b"\x0b", b"\x0c", b"\r", b"\x0e", b"\x1b", b"\x1f", b"\x7f"]
)


@FAST
@given(
    st.lists(KEY_PIECES | ASCII_EDGES | st.binary(max_size=3), max_size=60),
    st.sampled_from([b" ", b"\x00"]),
    st.sampled_from([*Command, 0, 99, -1]),
    st.sampled_from([0, 0, 1, 4096]),
    st.sampled_from(list(Generation)),
)
def test_decode_lookup_agrees_with_decode_request(
    pieces: list[bytes], pad: bytes, command: int, length: int, generation: Generation
) -> None:
    # The server's EXIST/GET fast path must see what decode_request sees, or say it cannot:
    # it answers "" for a body, a key the rule refuses or leaves empty, and a field that is not
    # all ASCII (decode_request takes those).
    raw = b"".join(pieces)[: lmproto.KEY_SIZE].ljust(lmproto.KEY_SIZE, pad)
    frame = lmproto.encode_request(Command.EXIST, "k", generation=generation)
    frame = command.to_bytes(4, "little", signed=True) + length.to_bytes(4, "little") + frame[8:]
    frame = frame[: -lmproto.KEY_SIZE] + raw
    req = lmproto.decode_request(frame, generation)
    looked_command, key = lmproto.decode_lookup(frame, generation)
    assert looked_command == command
    if length or _upstream_key(raw) is None or not raw.isascii():
        assert key == ""
    else:
        assert key == req.key
