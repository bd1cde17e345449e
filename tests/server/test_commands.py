"""Every command of both frame generations against a real server on loopback."""

from __future__ import annotations

import socket
import threading
import time

import pytest
from wire import Wire

import lmserver
from lmproto import (
    NO_META,
    PLACEHOLDER_META,
    Command,
    Generation,
    ObjectMeta,
    decode_json,
    decode_key_lines,
    decode_presence,
    encode_key_list,
    encode_request,
)
from lmserver.config import ServerConfig
from lmserver.connection import LMProtocol
from lmserver.connection.staging import STAGING_SIZE
from lmserver.server import Server

GENERATIONS = [Generation.V0, Generation.V1]


@pytest.fixture(params=["uvloop", "asyncio"])
def server_thread(request: pytest.FixtureRequest, make_server_thread):
    """Every test here runs on both event loops the server supports."""
    return make_server_thread(loop=request.param)


@pytest.fixture(params=GENERATIONS, ids=["v0", "v1"])
def wire(request: pytest.FixtureRequest, server_thread):
    with Wire(server_thread.host, server_thread.port, request.param) as w:
        yield w


def test_put_is_fire_and_forget_then_get(wire: Wire) -> None:
    wire.send(Command.PUT, "model@1@0@abc@half", b"kv-bytes")
    reply, body = wire.call(Command.GET, "model@1@0@abc@half")
    assert (reply.status, body) == (200, b"kv-bytes")


def test_get_miss_is_400_with_no_body(wire: Wire) -> None:
    reply, body = wire.call(Command.GET, "absent")
    assert (reply.status, reply.length, body) == (400, 0, b"")
    if wire.generation == Generation.V1:
        assert reply.meta == PLACEHOLDER_META


def test_overwrite_replaces_and_empty_value_is_an_object(wire: Wire) -> None:
    wire.put("k", b"first version")
    wire.put("k", b"2nd")
    assert wire.get("k") == b"2nd"
    wire.put("empty", b"")
    reply, body = wire.call(Command.GET, "empty")
    assert (reply.status, reply.length, body) == (200, 0, b"")


def test_exist(wire: Wire) -> None:
    wire.put("here", b"x")
    assert wire.call(Command.EXIST, "here")[0].status == 200
    assert wire.call(Command.EXIST, "not-here")[0].status == 400


def test_list_all_and_by_prefix(wire: Wire) -> None:
    for key in ["b/2", "a/1", "b/1", "c"]:
        wire.put(key, b"v")
    reply, body = wire.call(Command.LIST, "")
    assert reply.status == 200
    assert decode_key_lines(body) == ["a/1", "b/1", "b/2", "c"]
    assert decode_key_lines(wire.call(Command.LIST, "b/")[1]) == ["b/1", "b/2"]
    assert decode_key_lines(wire.call(Command.LIST, "zzz")[1]) == []


def test_health(wire: Wire) -> None:
    reply, body = wire.call(Command.HEALTH)
    assert (reply.status, body) == (200, b"")


def test_delete(wire: Wire) -> None:
    wire.put("gone", b"soon")
    assert wire.call(Command.DELETE, "gone")[0].status == 200
    assert wire.get("gone") is None
    assert wire.call(Command.DELETE, "gone")[0].status == 404


def test_exist_many_answers_each_key_in_order(wire: Wire) -> None:
    for key in ["c0", "c1", "c3"]:
        wire.put(key, b"x")
    reply, body = wire.call(Command.EXIST_MANY, "", encode_key_list(["c0", "c1", "c2", "c3"]))
    assert reply.status == 200
    assert decode_presence(body) == [True, True, False, True]


def test_stats_reports_the_buffers_connections_hold(server_thread) -> None:
    """``connections.buffer_bytes``: staging and reply buffers, outside --memory-limit; a
    connection that closes takes its share with it."""
    with Wire(server_thread.host, server_thread.port) as asking:
        asking.put("b", bytes(4096))
        with Wire(server_thread.host, server_thread.port) as busy:
            assert busy.get("b") == bytes(4096)
            _, body = asking.call(Command.STATS)
            both = decode_json(body)["connections"]["buffer_bytes"]
            assert both >= 2 * STAGING_SIZE  # two staging buffers (and what reply buffers keep)
        deadline = time.monotonic() + 30
        while True:
            _, body = asking.call(Command.STATS)
            alone = decode_json(body)["connections"]["buffer_bytes"]
            if alone <= both - STAGING_SIZE or time.monotonic() > deadline:
                break
            time.sleep(0.05)  # the connection closes on the server's loop, soon after ours
        assert STAGING_SIZE <= alone <= both - STAGING_SIZE


def test_stats_is_json_with_counters(wire: Wire) -> None:
    wire.put("s", b"12345")
    wire.get("s")
    wire.get("missing")
    _, body = wire.call(Command.STATS)
    stats = decode_json(body)
    assert stats["server"] == "lmserver" and isinstance(stats["version"], str)
    assert stats["uptime_s"] >= 0
    assert stats["compiled"] == sorted(name for name, native in lmserver.compiled().items() if native)
    assert stats["connections"]["current"] == 1 and stats["connections"]["total"] >= 1
    [memory] = stats["tiers"]
    assert memory["name"] == "memory" and memory["objects"] == 1 and memory["bytes"] == 5
    assert memory["capacity"] > 0
    assert (stats["hits"], stats["misses"], stats["evictions"], stats["refusals"]) == (1, 1, 0, 0)
    assert stats["counters"]["puts"] == 1


def test_v1_metadata_round_trips(server_thread) -> None:
    meta = ObjectMeta(fmt=1, dtype=3, shape=(2, 32, 256, 1024), location=1)
    with Wire(server_thread.host, server_thread.port, Generation.V1) as w:
        w.put("tensor", b"\x01" * 64, meta)
        reply, body = w.call(Command.GET, "tensor")
    assert reply.meta == meta and body == b"\x01" * 64


def test_generations_share_objects(server_thread) -> None:
    with Wire(server_thread.host, server_thread.port, Generation.V0) as v0:
        v0.put("shared", b"from v0")
    with Wire(server_thread.host, server_thread.port, Generation.V1) as v1:
        reply, body = v1.call(Command.GET, "shared")
        assert body == b"from v0" and reply.meta == NO_META
        v1.put("shared", b"from v1", ObjectMeta(4, 6, (7, 0, 0, 0), 0))
    with Wire(server_thread.host, server_thread.port, Generation.V0) as v0:
        assert v0.get("shared") == b"from v1"


@pytest.mark.parametrize("size", [64, 1 << 20], ids=["copied", "pinned"])
def test_each_generation_gets_its_own_reply_header_of_one_object(server_thread, size: int) -> None:
    # An object keeps one cached reply header at a time: readers of the two generations,
    # taking turns, must each get theirs (small objects are copied out under the shard
    # lock, larger ones sent pinned: two paths to the cache).
    meta = ObjectMeta(fmt=1, dtype=3, shape=(2, 32, 256, 1024), location=1)
    value = (bytes(range(256)) * (size // 256 + 1))[:size]
    with Wire(server_thread.host, server_thread.port, Generation.V1) as v1:
        v1.put("turns", value, meta)
        with Wire(server_thread.host, server_thread.port, Generation.V0) as v0:
            for _ in range(3):
                reply, body = v0.call(Command.GET, "turns")
                assert (reply.status, reply.length, body) == (200, size, value)
                reply, body = v1.call(Command.GET, "turns")
                assert (reply.status, reply.length, reply.meta, body) == (200, size, meta, value)


def test_forced_generation(make_server_thread) -> None:
    server = make_server_thread(protocol="v0")
    with Wire(server.host, server.port, Generation.V0) as w:
        # An empty NUL-padded key on the first request would look like v1 to "auto".
        w.send_raw(b"\x05\x00\x00\x00\x00\x00\x00\x00" + b"\x00" * 150)
        assert w.reply()[0].status == 200


def test_multibyte_150_byte_key(wire: Wire) -> None:
    key = "é" * 75
    assert len(key.encode()) == 150
    wire.put(key, b"accented")
    assert wire.get(key) == b"accented"
    assert decode_key_lines(wire.call(Command.LIST, "é")[1]) == [key]


def test_nul_padded_keys_are_accepted(server_thread) -> None:
    with Wire(server_thread.host, server_thread.port, Generation.V0) as w:
        w.put("nulpad", b"v")
        frame = bytearray(w.frame(Command.GET, "nulpad"))
        frame[8 + 6 :] = b"\x00" * 144
        w.send_raw(bytes(frame))
        reply, body = w.reply()
    assert (reply.status, body) == (200, b"v")


def test_pipelined_lookups_take_the_fast_path_or_the_full_decode_as_their_key_field_says(
    wire: Wire,
) -> None:
    # EXIST and GET with a valid key are served from (command, key) alone; every other key
    # field goes through the full decode. One burst mixes both, and answers stay in order.
    wire.put("k1", b"small")
    wire.put("big", b"B" * (64 * 1024))  # above the copied-reply size: sent pinned

    def frame(command: int, field: bytes) -> bytes:
        header = wire.frame(command, "x")
        return header[:-150] + field.ljust(150, b" ")

    expected: list[tuple[int, bytes]] = []
    burst = b""
    for command, field, answer in [
        (Command.EXIST, b"k1", (200, b"")),
        (Command.GET, b"k1", (200, b"small")),
        (Command.GET, b"big", (200, b"B" * (64 * 1024))),
        (Command.EXIST, b" \tk1\t", (200, b"")),  # whitespace around the key is not the key
        (Command.GET, b"k1".ljust(150, b"\x00"), (200, b"small")),  # NUL padding
        (Command.GET, b"\xff\xfek1", (400, b"")),  # not UTF-8
        (Command.EXIST, b"", (400, b"")),  # empty key
        (Command.EXIST, b"k1\x00x", (400, b"")),  # NUL inside the key
        (Command.EXIST, b"missing", (400, b"")),
        (77, b"k1", (400, b"")),  # unknown command
        (Command.EXIST, b"k1", (200, b"")),
    ]:
        burst += frame(command, field)
        expected.append(answer)
    wire.send_raw(burst)
    for status, body in expected:
        reply, got = wire.reply()
        assert (reply.status, got) == (status, body)


def test_a_run_of_exists_ends_at_every_key_field_it_does_not_take(wire: Wire) -> None:
    """After an EXIST, a connection's EXISTs are answered a run at a time in one call (C when
    compiled). Every key field that call does not take ends the run and goes through the full
    decode, and the run goes on after it: the answers stay those of one EXIST at a time."""
    wire.put("k1", b"small")

    def frame(field: bytes) -> bytes:
        return wire.frame(Command.EXIST, "x")[:-150] + field.ljust(150, b" ")

    cases = [
        (b"k1", 200),
        (b" \tk1\t", 200),  # whitespace around the key is not the key
        (b"k1".ljust(150, b"\x00"), 200),  # NUL padding
        (b"\xff\xfek1", 400),  # not UTF-8
        (b"k1", 200),
        ("é".encode(), 400),  # UTF-8, not ASCII: the full decode's, a valid key held by no one
        (b"", 400),  # empty key
        (b"k1\x00x", 400),  # NUL inside the key
        (b"k1", 200),
        (b"missing", 400),
        (b"k1", 200),
    ]
    assert wire.call(Command.EXIST, "k1")[0].status == 200  # the runs start after an EXIST
    wire.send_raw(b"".join(frame(field) for field, _ in cases * 3))
    assert [wire.reply()[0].status for _ in cases * 3] == [status for _, status in cases * 3]
    assert wire.call(Command.EXIST, "k1")[0].status == 200


def test_pipelined_requests_are_answered_in_order(wire: Wire) -> None:
    burst = b"".join(wire.frame(Command.PUT, f"p{i}", f"value-{i}".encode()) for i in range(150))
    burst += b"".join(wire.frame(Command.GET, f"p{i}") for i in range(150))
    burst += b"".join(wire.frame(Command.EXIST, f"p{i}" if i % 2 else "nope") for i in range(150))
    wire.send_raw(burst)
    for i in range(150):
        reply, body = wire.reply()
        assert (reply.status, body) == (200, f"value-{i}".encode())
    for i in range(150):
        assert wire.reply()[0].status == (200 if i % 2 else 400)


def test_copied_and_zero_copy_replies_of_one_burst_stay_in_order(wire: Wire) -> None:
    """Small replies are copied into the connection's reply buffer; a large object's goes out
    from its own buffer (pinned). Whatever the mix, one burst is answered in request order."""
    small = {f"s{i}": bytes([i]) * (4096 + i) for i in range(8)}
    large = {f"l{i}": bytes([100 + i]) * (64 * 1024 + i) for i in range(3)}  # above small_reply
    for key, body in {**small, **large, "empty": b""}.items():
        wire.put(key, body)
    expected: list[tuple[int, bytes | None]] = []
    burst = b""
    for i in range(60):
        for command, key, answer in [
            (Command.GET, f"s{i % 8}", (200, small[f"s{i % 8}"])),
            (Command.EXIST, f"s{i % 8}", (200, b"")),
            (Command.GET, f"l{i % 3}", (200, large[f"l{i % 3}"])),
            (Command.HEALTH, "", (200, b"")),
            (Command.GET, "absent", (400, b"")),
            (Command.GET, "empty", (200, b"")),
            (Command.STATS, "", (200, None)),  # a control reply with a body of its own
            (Command.GET, f"l{(i + 1) % 3}", (200, large[f"l{(i + 1) % 3}"])),
            (Command.GET, f"l{(i + 2) % 3}", (200, large[f"l{(i + 2) % 3}"])),
        ]:
            if command == Command.STATS and wire.generation == Generation.V0:
                continue  # an extension of the newer frame
            burst += wire.frame(command, key)
            expected.append(answer)
    wire.send_raw(burst)
    for status, body in expected:
        reply, got = wire.reply()
        assert reply.status == status
        if body is None:
            assert decode_json(got)["server"] == "lmserver"
        else:
            assert got == body


def test_small_replies_to_a_late_reader_arrive_whole_and_in_order(wire: Wire) -> None:
    """Small replies go straight to the socket while the transport holds nothing unsent; a
    reader that lets the socket fill makes those sends partial, and the rest (and every reply
    after it) must go through the transport, in order, until it has sent everything."""
    objects = [bytes([i]) * 160 + f"{i:04}".encode() * 10 for i in range(64)]
    for i, body in enumerate(objects):
        wire.put(f"late{i}", body)
    wire.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 256 * 1024)  # a window that fills
    order = [(i * 7) % 64 for i in range(32_000)]  # ~7 MB of replies: more than both buffers hold
    frames = [wire.frame(Command.GET, f"late{i}") for i in range(64)]
    bursts = [b"".join(frames[i] for i in order[j : j + 1000]) for j in range(0, len(order), 1000)]
    # The server stops reading while its replies wait, so the requests are sent beside the reads.
    sender = threading.Thread(target=lambda: [wire.send_raw(burst) for burst in bursts], daemon=True)
    sender.start()
    time.sleep(0.5)  # not a wait for anything: reading late is the behaviour under test
    for i in order:
        reply, body = wire.reply()
        assert (reply.status, body) == (200, objects[i])
    sender.join(30)
    assert wire.call(Command.EXIST, "late0")[0].status == 200


class _SocketTransport:
    """The parts of a transport LMProtocol uses, over a real socket; writes are recorded."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock, self.closing, self.written = sock, False, bytearray()

    def get_extra_info(self, name: str, default: object = None) -> object:
        return {"peername": ("127.0.0.1", 1), "socket": self.sock}.get(name, default)

    def write(self, data: bytes) -> None:
        self.written += data

    def writelines(self, pieces: list[bytes]) -> None:
        for piece in pieces:
            self.write(piece)

    def is_closing(self) -> bool:
        return self.closing

    def get_write_buffer_size(self) -> int:
        return 0

    def set_write_buffer_limits(self, high: int | None = None, low: int | None = None) -> None:
        return None

    def pause_reading(self) -> None:
        return None

    def resume_reading(self) -> None:
        return None


async def test_replies_never_go_to_the_descriptor_of_a_closing_transport() -> None:
    """A closing transport has closed (or is closing) its descriptor, and the next accepted
    connection may be given the same number before connection_lost arrives: a reply finished
    meanwhile must go to the transport (which drops it), never to that descriptor."""
    server = Server(ServerConfig(host="127.0.0.1", port=0, memory_limit=1 << 26))
    await server.state.store.open()
    with socket.create_server(("127.0.0.1", 0)) as listener:
        peer = socket.create_connection(listener.getsockname())
        ours, _ = listener.accept()
    with ours, peer:
        ours.setblocking(False)
        transport = _SocketTransport(ours)
        proto = LMProtocol(server.state)
        proto.connection_made(transport)  # type: ignore[arg-type]

        def exist(key: str) -> None:
            request = encode_request(Command.EXIST, key)
            proto.get_buffer(len(request))[: len(request)] = request
            proto.buffer_updated(len(request))

        exist("a")
        assert len(peer.recv(100)) == 8  # a v0 reply, sent on the socket itself
        transport.closing = True
        exist("b")
        assert len(transport.written) == 8  # handed to the transport instead
        peer.setblocking(False)
        with pytest.raises(BlockingIOError):
            peer.recv(100)
        proto.connection_lost(None)
    await server.state.store.close()


def test_one_byte_at_a_time(server_thread) -> None:
    with Wire(server_thread.host, server_thread.port, Generation.V1) as w:
        data = w.frame(Command.PUT_ACK, "slow", b"trickled body") + w.frame(Command.GET, "slow")
        for i in range(len(data)):
            w.send_raw(data[i : i + 1])
        assert w.reply()[0].status == 200
        assert w.reply()[1] == b"trickled body"


@pytest.mark.parametrize("size", [64 * 1024, 4 * 1024**2 + 17, 32 * 1024**2])
def test_large_objects_round_trip_byte_exact(server_thread, size: int) -> None:
    payload = bytes(range(256)) * (size // 256) + b"\x07" * (size % 256)
    with Wire(server_thread.host, server_thread.port) as w:
        w.put("big", payload)
        assert w.get("big") == payload


def test_list_over_several_encoding_batches(server_thread) -> None:
    keys = sorted(f"batch/{i:05}" for i in range(2500))
    with Wire(server_thread.host, server_thread.port) as w:
        w.send_raw(b"".join(w.frame(Command.PUT, key, b"v") for key in keys))
        reply, body = w.call(Command.LIST, "batch/")
        assert reply.status == 200
        assert decode_key_lines(body) == keys


def test_counts_of_an_open_connection_are_current_when_read(server_thread, wire: Wire) -> None:
    """The hot path counts in plain ints per connection (requests, bytes, GET hits, runs by
    command); every reader sees them while the connection is still open, exactly once."""
    state = server_thread.server.state
    wire.put("c1", b"12345")
    before = server_thread.call(lambda: dict(state.current_counters()))
    commands_before = server_thread.call(state.requests_by_command)
    burst = b"".join(wire.frame(Command.EXIST, key) for key in ("c1", "c1", "nope"))
    burst += b"".join(wire.frame(Command.GET, key) for key in ("c1", "c1", "nope"))
    wire.send_raw(burst)
    for _ in range(6):
        wire.reply()
    for _ in range(2):  # reading twice adds nothing twice
        after = server_thread.call(lambda: dict(state.current_counters()))
        commands = server_thread.call(state.requests_by_command)
        assert after["requests"] - before.get("requests", 0) == 6
        assert after["bytes_received"] - before.get("bytes_received", 0) == len(burst)
        assert after["gets_served"] - before.get("gets_served", 0) == 2
        assert after["get_bytes"] - before.get("get_bytes", 0) == 10
        assert commands[Command.EXIST] - commands_before[Command.EXIST] == 3
        assert commands[Command.GET] - commands_before[Command.GET] == 3
        assert commands[0] - commands_before[0] == 2  # EXIST hits
