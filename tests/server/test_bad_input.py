"""Every kind of bad input gets the answer protocol/SPEC.md defines, and nobody else notices."""

from __future__ import annotations

import socket
import struct
import time

import pytest
from wire import Wire, raw_v0, stats, wait_until

from lmproto import MAX_CONTROL_BODY, Command, Generation, decode_error_text


def test_negative_length_closes_only_that_connection(server_thread) -> None:
    with (
        Wire(server_thread.host, server_thread.port) as good,
        Wire(server_thread.host, server_thread.port) as bad,
    ):
        good.put("k", b"v")
        bad.send_raw(raw_v0(Command.PUT, -5, b"k"))
        assert bad.is_closed()
        assert good.get("k") == b"v"
    assert stats(server_thread)["protocol_errors"] == 1


def test_oversized_put_is_refused_without_allocating(make_server_thread) -> None:
    server = make_server_thread(max_object_size=1024 * 1024)
    with Wire(server.host, server.port) as w:
        # Announce 2 GiB - 1 but send only the first 3 MiB: nothing may be reserved for it.
        w.send_raw(raw_v0(Command.PUT, 2**31 - 1, b"huge"))
        w.send_raw(b"\0" * (3 * 1024 * 1024))
        assert stats(server)["reserved_bytes"] == 0
        assert w.is_closed(0.2) is False  # still connected, still draining
    with Wire(server.host, server.port) as w:
        body = b"y" * (1024 * 1024 + 1)
        w.send(Command.PUT, "toolarge", body)  # fire-and-forget: no reply
        reply, text = w.call(Command.PUT_ACK, "toolarge", body)
        assert reply.status == 413 and "exceeds" in decode_error_text(text)
        assert w.get("toolarge") is None  # the stream stayed framed after both bodies
        w.put("fits", b"z" * 1024 * 1024)
        assert w.get("fits") == b"z" * 1024 * 1024
    assert stats(server)["refused_too_large"] == 3


def test_unknown_command_gets_fail_and_connection_goes_on(server_thread) -> None:
    for generation in (Generation.V0, Generation.V1):
        with Wire(server_thread.host, server_thread.port, generation) as w:
            reply, body = w.call(77, "key", b"a body that is dropped")
            assert (reply.status, body) == (400, b"")
            w.put("after", b"ok")
            assert w.get("after") == b"ok"


def test_non_utf8_key(server_thread) -> None:
    with Wire(server_thread.host, server_thread.port) as w:
        w.send_raw(raw_v0(Command.GET, 0, b"\xff\xfe bad"))
        assert w.reply()[0].status == 400
        # A PUT with such a key: no reply (fire-and-forget), body dropped, nothing stored.
        w.send_raw(raw_v0(Command.PUT, 4, b"\xff\xfe bad") + b"body")
        w.send_raw(raw_v0(Command.PUT_ACK, 4, b"\xc3") + b"body")
        reply, text = w.reply()
        assert reply.status == 400 and "UTF-8" in decode_error_text(text)
        reply, body = w.call(Command.LIST)
        assert body == b""
    assert stats(server_thread)["bad_requests"] == 3


def test_nul_inside_key_and_empty_key(server_thread) -> None:
    with Wire(server_thread.host, server_thread.port) as w:
        w.send_raw(raw_v0(Command.EXIST, 0, b"a\0b"))
        assert w.reply()[0].status == 400
        w.send_raw(raw_v0(Command.GET, 0, b""))
        assert w.reply()[0].status == 400
        assert w.call(Command.HEALTH)[0].status == 200


def test_body_on_a_bodyless_command_is_read_and_ignored(server_thread) -> None:
    with Wire(server_thread.host, server_thread.port) as w:
        w.put("k", b"v")
        assert w.call(Command.GET, "k", b"ignored body")[1] == b"v"
        assert w.call(Command.EXIST, "k")[0].status == 200


def test_oversized_control_body(server_thread) -> None:
    with Wire(server_thread.host, server_thread.port) as w:
        reply, _ = w.call(Command.EXIST_MANY, "", b"\x01a" * (MAX_CONTROL_BODY // 2 + 1))
        assert reply.status == 413
        reply, body = w.call(Command.EXIST, "x", b"\0" * (MAX_CONTROL_BODY + 1))
        assert (reply.status, body) == (400, b"")  # upstream command: 400, length 0
        assert w.call(Command.HEALTH)[0].status == 200


def test_malformed_exist_many_body(server_thread) -> None:
    with Wire(server_thread.host, server_thread.port) as w:
        reply, _ = w.call(Command.EXIST_MANY, "", b"\x09short")
        assert reply.status == 400
        assert w.call(Command.HEALTH)[0].status == 200


def test_put_cut_short_is_never_visible(server_thread) -> None:
    with Wire(server_thread.host, server_thread.port) as w:
        w.put("victim", b"old value")
        w.send_raw(raw_v0(Command.PUT, 1000, b"victim") + b"partial")
    with Wire(server_thread.host, server_thread.port) as w:
        wait_until(lambda: stats(server_thread)["bodies_cut_short"] == 1)
        assert w.get("victim") == b"old value"
        w.send_raw(raw_v0(Command.PUT, 1000, b"fresh") + b"x" * 999)
    wait_until(lambda: stats(server_thread)["bodies_cut_short"] == 2)
    with Wire(server_thread.host, server_thread.port) as w:
        assert w.get("fresh") is None
    # The reservations went back: only the one stored object's buffer is in use.
    assert stats(server_thread)["reserved_bytes"] == 4096


def test_truncated_header_at_eof(server_thread) -> None:
    with Wire(server_thread.host, server_thread.port) as w:
        w.send_raw(raw_v0(Command.PUT, 3, b"t")[:100])
        w.sock.shutdown(socket.SHUT_WR)
        assert w.is_closed()
    with Wire(server_thread.host, server_thread.port) as w:
        assert w.call(Command.LIST)[1] == b""


def test_stalled_client_mid_body_does_not_stall_others(server_thread) -> None:
    with Wire(server_thread.host, server_thread.port) as stalled:
        stalled.send_raw(raw_v0(Command.PUT, 10_000_000, b"stall") + b"x" * 5000)
        with Wire(server_thread.host, server_thread.port) as other:
            for i in range(20):
                other.put(f"o{i}", b"data")
            assert other.get("o7") == b"data"


def test_max_connections(make_server_thread) -> None:
    """At the limit a newcomer displaces an idle connection, and is refused when every one is
    in the middle of a request (tests/ops/test_admission.py: which one, and why)."""
    server = make_server_thread(max_connections=2)
    with Wire(server.host, server.port) as a, Wire(server.host, server.port) as b:
        assert a.call(Command.HEALTH)[0].status == 200
        with Wire(server.host, server.port) as c:
            assert c.call(Command.HEALTH)[0].status == 200
        assert stats(server)["connections_displaced"] == 1
    connections = server.server.state.connections
    wait_until(lambda: server.call(lambda: len(connections)) == 0)  # the server saw them close
    with Wire(server.host, server.port) as a, Wire(server.host, server.port) as b:
        for w in (a, b):
            w.send_raw(raw_v0(Command.GET, 0, b"k")[:20])  # a header begun: busy
        wait_until(lambda: server.call(lambda: [c.received for c in connections]) == [20, 20])
        with Wire(server.host, server.port) as c:
            assert c.is_closed()
    assert stats(server)["connections_refused"] == 1


def test_put_waits_for_pinned_memory_then_is_refused(make_server_thread) -> None:
    """Admission control: memory pinned by a reader that stopped reading cannot be evicted;
    a PUT that needs it waits the configured time, then gets 507."""
    server = make_server_thread(memory_limit=32 * 1024**2, memory_wait=0.3)
    with Wire(server.host, server.port) as writer:
        writer.put("pinned", b"p" * (24 * 1024**2))
    with Wire(server.host, server.port) as reader:
        reader.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        reader.send(Command.GET, "pinned")  # and never read the reply
        time.sleep(0.2)
        with Wire(server.host, server.port) as w:
            reply, _ = w.call(Command.PUT_ACK, "new", b"n" * (16 * 1024**2))
            assert reply.status == 507
            w.put("small", b"s" * 1024)  # what fits is still served
            assert w.get("small") == b"s" * 1024
    assert stats(server)["refused_no_space"] == 1


@pytest.mark.parametrize("command", [Command.GET, Command.EXIST])
def test_v1_fail_replies_carry_no_body(server_thread, command: int) -> None:
    with Wire(server_thread.host, server_thread.port, Generation.V1) as w:
        w.send_raw(struct.pack("<iiiiiiiii150s", command, 0, 1, 2, 0, 0, 0, 0, 0, b"\xff"))
        reply, _ = w.reply()
        assert (reply.status, reply.length) == (400, 0)
