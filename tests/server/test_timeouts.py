"""Slow, stalled and idle peers: what they may hold, and for how long (docs/operating.md "Limits
and timeouts"). Waits here are generous deadlines that only detect hangs."""

from __future__ import annotations

import socket
import time

import psutil
from wire import Wire, raw_v0, stats, wait_until

from lmproto import Command
from lmserver.connection.replies import SMALL_REPLY

MiB = 1024 * 1024


def test_bodiless_put_header_neither_flushes_the_cache_nor_blocks_puts(make_server_thread) -> None:
    server = make_server_thread(memory_limit=32 * MiB, body_timeout=1.0, memory_wait=0.5)
    with Wire(server.host, server.port) as w:
        for i in range(4):
            w.put(f"kept{i}", bytes([i]) * (4 * MiB))
    with Wire(server.host, server.port) as stalled:
        # Announces all of memory and sends nothing more.
        stalled.send_raw(raw_v0(Command.PUT_ACK, 32 * MiB, b"flood"))
        wait_until(lambda: stats(server)["requests"] >= 5)
        with Wire(server.host, server.port) as w:
            for i in range(4):
                assert w.get(f"kept{i}") == bytes([i]) * (4 * MiB)  # nothing was evicted
            w.put("other", b"o" * (8 * MiB))  # and other PUTs are answered 200
        assert stats(server)["evictions"] == 0
        # The stalled body is cut off after --body-timeout: its reservation goes back.
        assert stalled.is_closed(30)
    wait_until(lambda: stats(server)["body_timeouts"] == 1)
    counters = stats(server)
    assert counters["bodies_cut_short"] == 1
    assert counters["reserved_bytes"] == 4 * (4 * MiB) + 8 * MiB


def test_large_put_charged_as_it_arrives_still_stores_and_reuses(make_server_thread) -> None:
    server = make_server_thread(memory_limit=64 * MiB)
    body = bytes(range(256)) * (40 * 4096 + 3)  # ~40 MiB: many charge steps
    with Wire(server.host, server.port) as w:
        w.put("big", body)
        assert w.get("big") == body
        w.send(Command.DELETE, "big")
        assert w.reply()[0].status == 200
        w.put("big2", body)  # the fully charged buffer was kept and is reused
        assert w.get("big2") == body
    counters = stats(server)
    assert counters["pool_reuses"] >= 1 and counters["reserved_bytes"] <= 64 * MiB


def test_put_refused_mid_body_when_memory_stays_pinned(make_server_thread) -> None:
    """A body whose next charge finds memory full of objects in use waits --memory-wait,
    then gets 507; the rest of it is read and dropped, and the stream stays framed."""
    server = make_server_thread(memory_limit=32 * MiB, memory_wait=0.3)
    with Wire(server.host, server.port) as w:
        w.put("pinned", b"p" * (24 * MiB))
    with Wire(server.host, server.port) as reader:
        reader.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        reader.send(Command.GET, "pinned")  # never read: the object stays pinned
        time.sleep(0.2)
        with Wire(server.host, server.port) as w:
            reply, _ = w.call(Command.PUT_ACK, "new", b"n" * (16 * MiB))
            assert reply.status == 507
            w.put("small", b"s" * 1024)
            assert w.get("small") == b"s" * 1024
            assert w.get("new") is None
    assert stats(server)["refused_no_space"] == 1


def test_incomplete_header_times_out(make_server_thread) -> None:
    server = make_server_thread(header_timeout=0.5)
    with Wire(server.host, server.port) as partial, Wire(server.host, server.port) as good:
        partial.send_raw(raw_v0(Command.GET, 0, b"k")[:20])
        assert partial.is_closed(30)
        assert good.call(Command.HEALTH)[0].status == 200
    assert stats(server)["header_timeouts"] == 1


def test_slowloris_header_times_out_although_bytes_trickle_in(make_server_thread) -> None:
    server = make_server_thread(header_timeout=0.5)
    header = raw_v0(Command.GET, 0, b"k")
    with Wire(server.host, server.port) as drip:
        deadline = time.monotonic() + 30
        for byte in header[:-1]:  # one byte per 100 ms: progress, but never a whole header
            try:
                drip.send_raw(bytes([byte]))
            except OSError:
                break
            time.sleep(0.1)
            assert time.monotonic() < deadline
        assert drip.is_closed(30)
    assert stats(server)["header_timeouts"] == 1


def test_idle_connections_make_room_when_the_server_is_short_of_them(make_server_thread) -> None:
    server = make_server_thread(max_connections=8, idle_timeout=0.5)
    idle = [Wire(server.host, server.port) for _ in range(7)]  # over 3/4 of 8
    try:
        for w in idle:
            assert w.call(Command.HEALTH)[0].status == 200
        assert all(w.is_closed(30) for w in idle)  # closed cleanly: EOF, not a reset
        assert stats(server)["idle_closed"] == 7
        with Wire(server.host, server.port) as w:
            assert w.call(Command.HEALTH)[0].status == 200
    finally:
        for w in idle:
            w.close()


def test_idle_connections_stay_while_there_is_room(make_server_thread) -> None:
    server = make_server_thread(max_connections=100, idle_timeout=0.2)
    with Wire(server.host, server.port) as w:
        assert w.call(Command.HEALTH)[0].status == 200
        assert not w.is_closed(1.0)
        assert w.call(Command.HEALTH)[0].status == 200
    assert stats(server)["idle_closed"] == 0


def test_connections_per_address_are_capped(make_server_thread) -> None:
    server = make_server_thread(max_connections_per_address=2)
    per_address = server.server.state.connections_per_address
    with Wire(server.host, server.port) as a, Wire(server.host, server.port) as b:
        assert a.call(Command.HEALTH)[0].status == 200
        with Wire(server.host, server.port) as c:
            assert c.is_closed()
        assert b.call(Command.HEALTH)[0].status == 200
        assert per_address["127.0.0.1"] == 2
    # The closed ones no longer count, once the server has seen them close: a connection made
    # before then is refused as the third, rightly (it failed CI once on the pure build).
    wait_until(lambda: per_address["127.0.0.1"] == 0, timeout=30)
    with Wire(server.host, server.port) as d:
        assert d.call(Command.HEALTH)[0].status == 200
    counters = stats(server)
    assert counters["connections_refused_per_address"] == 1 and counters["connections_refused"] == 1


def test_unread_replies_that_never_drain_time_out(make_server_thread) -> None:
    server = make_server_thread(memory_limit=64 * MiB, body_timeout=0.5)
    with Wire(server.host, server.port) as w:
        w.put("big", b"b" * (16 * MiB))
    with Wire(server.host, server.port) as reader:
        reader.send(Command.GET, "big")  # and never read
        wait_until(lambda: stats(server)["send_timeouts"] == 1, timeout=30)
    wait_until(lambda: stats(server)["reserved_bytes"] == 16 * MiB)  # the pin was dropped


def test_idle_connection_holds_no_staging_buffer(spawn_server) -> None:
    """RSS per idle connection: each used its 64 KiB staging buffer and its reply buffer once
    (a GET of a 16 KiB object, the largest copied into it), then went idle."""
    server = spawn_server("--memory-limit", "64MiB")
    assert server.proc is not None
    proc = psutil.Process(server.proc.pid)
    warm = [Wire(server.host, server.port) for _ in range(20)]  # imports and first allocations
    warm[0].put("small", b"s" * SMALL_REPLY)
    for w in warm:
        w.call(Command.GET, "small")
    before = proc.memory_info().rss
    conns = [Wire(server.host, server.port) for _ in range(500)]
    try:
        for w in conns:
            reply, body = w.call(Command.GET, "small")
            assert reply.status == 200 and body == b"s" * SMALL_REPLY

        def per_connection() -> float:
            return (proc.memory_info().rss - before) / len(conns)

        # Idle buffers are given back by the next sweeps: ~6 KiB is left (69 KiB when the staging
        # buffer was kept, ~23 KiB if the reply buffer were).
        wait_until(lambda: per_connection() < 16 * 1024, timeout=30)
    finally:
        for w in conns + warm:
            w.close()
