"""The connection's parts without sockets: Staging (where received bytes go) fed a byte at a
time and in every split, and Phase (what a connection may do) read off its parts."""

from __future__ import annotations

import pytest

from lmserver.connection.phase import (
    CLOSED,
    DISCARDING,
    READING_HEADERS,
    RECEIVING_BODY,
    WAITING,
    Phase,
)
from lmserver.connection.replies import MAX_ACKS_IN_FLIGHT, Replies
from lmserver.connection.staging import EMPTY, HEADER_ROOM, STAGING_SIZE, Staging


def feed(staging: Staging, data: bytes) -> None:
    """What the transport does: read into get_buffer's view, then say how much came."""
    view = staging.get_buffer()
    view[: len(data)] = data
    staging.received(len(data))


def staged(staging: Staging) -> bytes:
    return bytes(staging.view[staging.start : staging.end])


@pytest.mark.parametrize("piece", [1, 2, 7, 158, 4096])
def test_bytes_fed_in_any_pieces_are_staged_in_order(piece: int) -> None:
    staging = Staging()
    data = bytes(range(256)) * 8
    for i in range(0, len(data), piece):
        feed(staging, data[i : i + piece])
    assert staged(staging) == data
    assert staging.staged == len(data)


def test_consume_takes_from_the_front_and_an_empty_buffer_starts_over() -> None:
    staging = Staging()
    feed(staging, b"abcdef")
    staging.consume(2)
    assert staged(staging) == b"cdef"
    staging.consume(4)
    assert (staging.start, staging.end) == (0, 0)  # nothing left: the next read starts at 0
    assert staging.get_buffer().obj is staging.view.obj and len(staging.get_buffer()) == STAGING_SIZE


def test_a_partial_header_near_the_end_moves_to_the_front() -> None:
    staging = Staging()
    feed(staging, b"x" * (STAGING_SIZE - HEADER_ROOM + 10))
    staging.consume(STAGING_SIZE - HEADER_ROOM)  # all but a 10-byte partial header
    view = staging.get_buffer()
    assert (staging.start, staging.end) == (0, 10)
    assert len(view) == STAGING_SIZE - 10
    feed(staging, b"y" * 5)
    assert staged(staging) == b"x" * 10 + b"y" * 5


def test_discard_drops_what_is_staged_then_what_arrives() -> None:
    staging = Staging()
    feed(staging, b"HEAD" + b"b" * 6)
    staging.consume(4)
    staging.discard(10)  # a refused 10-byte body: 6 staged, 4 to come
    assert staging.discard_left == 4 and staging.staged == 0
    for byte in b"bbb":
        feed(staging, bytes([byte]))
    assert staging.discard_left == 1 and staging.staged == 0
    feed(staging, b"bNEXT")  # the body's last byte, then the next request
    assert staging.discard_left == 0
    assert staged(staging) == b"NEXT"


def test_a_body_takes_what_is_staged_then_the_socket_fills_it_in_place() -> None:
    staging = Staging()
    feed(staging, b"HEAD" + b"12")
    staging.consume(4)
    target = memoryview(bytearray(5))
    assert staging.begin_body(target) == 2  # two bytes were staged: copied
    assert staging.body is target and staging.staged == 0
    view = staging.get_buffer()
    assert view.obj is target.obj and len(view) == 3  # the rest goes straight into the target
    view[:3] = b"345"
    staging.body_pos += 3
    staging.end_body()
    assert bytes(target) == b"12345"
    assert staging.body is None


def test_a_body_wholly_staged_is_complete_at_once() -> None:
    staging = Staging()
    feed(staging, b"12345NEXT")
    target = memoryview(bytearray(5))
    assert staging.begin_body(target) == 5
    assert staging.body is None
    assert bytes(target) == b"12345" and staged(staging) == b"NEXT"


def test_an_idle_staging_buffer_goes_back_to_the_free_list() -> None:
    staging = Staging()
    feed(staging, b"abc")
    staging.give()  # something is staged: kept
    assert staging.holding == STAGING_SIZE
    staging.consume(3)
    staging.give()
    assert staging.holding == 0 and staging.view is EMPTY
    feed(staging, b"again")  # taken again when bytes come
    assert staged(staging) == b"again"


def phase() -> Phase:
    staging = Staging()
    return Phase(staging, Replies(lambda entry: None))


def test_a_fresh_connection_reads_headers_and_may_parse() -> None:
    p = phase()
    assert p.current == READING_HEADERS and p.name == "reading headers"
    assert p.may_parse() and not p.should_pause_reading() and not p.in_request()
    assert not p.may_close()
    p.closing = True
    assert p.may_close() and p.should_pause_reading()


@pytest.mark.parametrize(
    ("setup", "current"),
    [
        (lambda p: setattr(p, "busy", True), WAITING),
        (lambda p: setattr(p.staging, "body", memoryview(bytearray(1))), RECEIVING_BODY),
        (lambda p: setattr(p.staging, "discard_left", 1), DISCARDING),
        (lambda p: setattr(p, "closed", True), CLOSED),
    ],
)
def test_every_phase_but_reading_headers_stops_parsing(setup, current) -> None:  # type: ignore[no-untyped-def]
    p = phase()
    setup(p)
    assert p.current == current
    assert not p.may_parse()
    assert p.in_request()
    p.closing = True
    assert not p.may_close()  # nothing closes in the middle of a request


def test_unread_replies_and_too_many_acks_stop_parsing_in_any_phase() -> None:
    p = phase()
    p.replies.write_paused = True
    assert p.current == READING_HEADERS
    assert not p.may_parse() and p.should_pause_reading() and p.in_request()
    p.replies.write_paused = False
    p.replies.acks_in_flight = MAX_ACKS_IN_FLIGHT
    assert not p.may_parse() and p.should_pause_reading()
    assert not p.waiting_for_server()  # acks in flight are not held replies
    p.replies.acks_in_flight = 0
    assert p.may_parse()


def test_a_partial_header_is_a_request_in_progress() -> None:
    p = phase()
    feed(p.staging, b"half a header")
    assert p.current == READING_HEADERS
    assert p.in_request() and p.may_parse()
