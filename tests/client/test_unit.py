"""Pure parts of lmclient: backoff, retry policy, config, the sans-IO reply reader, the
exception tree and the package surface. No sockets, except the import check's subprocess."""

from __future__ import annotations

import builtins
import random
import subprocess
import sys
from collections.abc import Callable, Generator

import pytest

import lmclient
from lmclient import AsyncClient, Client, Retry, Timeout, compute_backoff
from lmclient._wire import Inbox, Received, advance, fresh_sink, read_reply
from lmproto import Generation, ObjectMeta, Reply, encode_reply

# ---------------------------------------------------------------------------------------
# backoff and retry


def test_backoff_is_bounded_and_grows() -> None:
    for attempt in range(200):
        low = compute_backoff(attempt, base=0.05, cap=2.0, rand=lambda: 0.0)
        high = compute_backoff(attempt, base=0.05, cap=2.0, rand=lambda: 1.0)
        assert 0.025 <= low <= high <= 2.0
    ceilings = [compute_backoff(a, rand=lambda: 1.0) for a in range(8)]
    assert ceilings == sorted(ceilings) and ceilings[0] == 0.05 and ceilings[-1] == 2.0


def test_backoff_is_jittered() -> None:
    rng = random.Random(7)
    samples = {compute_backoff(3, base=0.1, cap=10.0, rand=rng.random) for _ in range(100)}
    assert len(samples) == 100
    assert all(0.4 <= s <= 0.8 for s in samples)  # the upper half of the 0.8 s ceiling


def test_backoff_is_pure_and_validates() -> None:
    assert compute_backoff(2, rand=lambda: 0.5) == compute_backoff(2, rand=lambda: 0.5)
    with pytest.raises(ValueError):
        compute_backoff(-1)


def test_retry_policy() -> None:
    policy = Retry(retries=2)
    assert policy.delay(lmclient.ConnectError("refused"), 0) is not None
    assert policy.delay(lmclient.ReadError("eof"), 1) is not None
    assert policy.delay(lmclient.ReadError("eof"), 2) is None  # budget spent
    assert policy.delay(lmclient.ConnectTimeout("slow"), 0) is None  # timeouts: only on_timeout
    assert policy.delay(lmclient.ReadTimeout("slow"), 0) is None
    assert Retry(on_timeout=True).delay(lmclient.ConnectTimeout("slow"), 0) is not None
    assert policy.delay(lmclient.ProtocolError("garbage"), 0) is None
    assert Retry(on_timeout=True).delay(lmclient.WriteTimeout("slow"), 0) is not None
    for bad in ({"retries": -1}, {"base": 0}, {"base": 3.0, "cap": 1.0}):
        with pytest.raises(lmclient.InvalidRequest):
            Retry(**bad)  # type: ignore[arg-type]


def test_timeout_config() -> None:
    t = Timeout(10, connect=2)
    assert (t.connect, t.read, t.write, t.pool, t.total) == (2, 10, 10, 10, 10)
    assert Timeout(10, total=3).total == 3 and Timeout(10, total=3) != t
    assert Timeout(1.5) == Timeout(1.5, read=1.5) != Timeout(1.5, read=2)
    with pytest.raises(lmclient.InvalidRequest):
        Timeout(0)
    with pytest.raises(lmclient.InvalidRequest):
        Timeout(1, read=-1)
    with pytest.raises(lmclient.InvalidRequest):
        Timeout(1, total=0)


@pytest.mark.parametrize("cls", [Client, AsyncClient])
def test_client_config(cls: Callable[..., lmclient.Client]) -> None:
    client = cls.from_url("lm://cache.internal:7000", protocol="v0", timeout=3)  # type: ignore[attr-defined]
    assert (client.settings.host, client.settings.port) == ("cache.internal", 7000)
    assert client.settings.generation == Generation.V0
    assert client.settings.timeout == Timeout(3)
    assert cls.from_url("lm://h").settings.port == lmclient.DEFAULT_PORT  # type: ignore[attr-defined]
    assert "lm://cache.internal:7000 v0 open" in repr(client)
    for kwargs in ({"protocol": "v2"}, {"max_connections": 0}, {"exist_many": "sometimes"}):
        with pytest.raises(lmclient.InvalidRequest):
            cls("h", 1, **kwargs)
    for url in ("http://h:1", "lm://", "lm://h:notaport"):
        with pytest.raises(lmclient.InvalidRequest):
            cls.from_url(url)  # type: ignore[attr-defined]


# ---------------------------------------------------------------------------------------
# the sans-IO reply reader, fed one byte per receive


class Feeder:
    """A pretend socket over ``stream`` that hands out at most ``chunk`` bytes a receive."""

    def __init__(self, stream: bytes, chunk: int = 1) -> None:
        self.stream, self.chunk, self.pos = stream, chunk, 0

    def drive(self, flow: Generator[memoryview, int, Received]) -> Received:
        try:
            view = next(flow)
            while True:
                n = min(self.chunk, len(view), len(self.stream) - self.pos)
                view[:n] = self.stream[self.pos : self.pos + n]
                self.pos += n
                view = flow.send(n)
        except StopIteration as stop:
            received: Received = stop.value
            return received


def reply(status: int, body: bytes, generation: Generation, meta: ObjectMeta | None = None) -> bytes:
    kwargs = {"meta": meta} if meta is not None else {}
    return encode_reply(status, len(body), generation=generation, **kwargs) + body


@pytest.mark.parametrize("generation", list(Generation))
@pytest.mark.parametrize("chunk", [1, 7, 1 << 20])
@pytest.mark.parametrize("size", [0, 5, 40_000, 200_000])
def test_read_reply_any_fragmentation(generation: Generation, chunk: int, size: int) -> None:
    body = bytes(i % 251 for i in range(size))
    meta = ObjectMeta(1, 3, (2, 3, 0, 0), 1) if generation == Generation.V1 else None
    stream = reply(200, body, generation, meta) + reply(400, b"", generation)
    inbox, feeder = Inbox(), Feeder(stream, chunk)
    first = feeder.drive(read_reply(inbox, generation, fresh_sink, 1024))
    assert first.reply.status == 200 and bytes(first.body or b"") == body
    if meta is not None:
        assert first.reply.meta == meta
    second = feeder.drive(read_reply(inbox, generation, fresh_sink, 1024))
    assert second.reply.status == 400 and second.body is not None and len(second.body) == 0
    assert feeder.pos == len(stream) and inbox.available == 0


def test_read_reply_refusal_drains_exactly_the_body() -> None:
    gen = Generation.V0
    inbox, feeder = Inbox(), Feeder(reply(200, b"x" * 100_000, gen) + reply(200, b"next", gen), 4096)

    def refuse(r: Reply) -> memoryview | lmclient.LMClientError:
        return lmclient.BufferTooSmall(r.length, 10)

    first = feeder.drive(read_reply(inbox, gen, refuse, 1024))
    assert first.body is None and isinstance(first.refusal, lmclient.BufferTooSmall)
    second = feeder.drive(read_reply(inbox, gen, fresh_sink, 1024))
    assert bytes(second.body or b"") == b"next"


def test_read_reply_errors() -> None:
    gen = Generation.V0
    with pytest.raises(lmclient.ReadError, match="closed"):
        Feeder(reply(200, b"abc", gen)[:9]).drive(read_reply(Inbox(), gen, fresh_sink, 1024))
    negative = b"\xc8\x00\x00\x00\xff\xff\xff\xff"
    with pytest.raises(lmclient.ProtocolError, match="negative"):
        Feeder(negative).drive(read_reply(Inbox(), gen, fresh_sink, 1024))
    with pytest.raises(lmclient.ProtocolError, match="announced"):
        Feeder(reply(400, b"e" * 2000, gen)).drive(read_reply(Inbox(), gen, fresh_sink, 1024))


def test_inbox_moves_unread_bytes_to_the_front_when_short_of_room() -> None:
    inbox = Inbox(64 * 1024)
    inbox.view[-20:] = bytes(range(20))
    inbox.start, inbox.end = len(inbox.buf) - 20, len(inbox.buf)
    inbox.skip(5)
    room = inbox.space()
    assert (inbox.start, inbox.end, len(room)) == (0, 15, 64 * 1024 - 15)
    assert bytes(inbox.view[:15]) == bytes(range(5, 20))
    target = memoryview(bytearray(15))
    assert inbox.take(target) == 15 and bytes(target) == bytes(range(5, 20))


def test_advance_over_sendmsg_buffers() -> None:
    bufs = [memoryview(b"abc"), memoryview(b"defg"), memoryview(b"h")]
    assert [bytes(b) for b in advance(bufs, 0)] == [b"abc", b"defg", b"h"]
    assert [bytes(b) for b in advance(bufs, 3)] == [b"defg", b"h"]
    assert [bytes(b) for b in advance(bufs, 5)] == [b"fg", b"h"]
    assert advance(bufs, 8) == []


# ---------------------------------------------------------------------------------------
# exceptions and the package surface


def test_exception_tree() -> None:
    assert issubclass(lmclient.TransportError, lmclient.LMClientError) and issubclass(
        lmclient.ServerError, lmclient.LMClientError
    )
    for cls in (lmclient.ConnectTimeout, lmclient.ReadTimeout, lmclient.WriteTimeout, lmclient.PoolTimeout):
        assert issubclass(cls, lmclient.TimeoutException) and issubclass(cls, lmclient.TransportError)
    for cls in (lmclient.ConnectError, lmclient.ReadError, lmclient.WriteError):
        assert issubclass(cls, lmclient.NetworkError) and issubclass(cls, lmclient.TransportError)
    assert issubclass(lmclient.ProtocolError, lmclient.TransportError)
    for cls in (lmclient.InvalidRequest, lmclient.BufferTooSmall, lmclient.TensorMismatch):
        assert issubclass(cls, ValueError) and issubclass(cls, lmclient.LMClientError)
    error = lmclient.ServerError(507, "disk full", command="PUT_ACK")
    assert (error.status, error.reason) == (507, "disk full")
    assert str(error) == "PUT_ACK failed: status 507: disk full"


def test_no_exported_name_shadows_a_builtin() -> None:
    assert not [name for name in lmclient.__all__ if hasattr(builtins, name)]


def test_all_is_complete_and_importable() -> None:
    for name in lmclient.__all__:
        assert getattr(lmclient, name) is not None
    public = {n for n in vars(lmclient) if not n.startswith("_") and n[0].isupper()}
    assert public <= set(lmclient.__all__)


def test_async_methods_mirror_the_sync_ones() -> None:
    def public(cls: type) -> set[str]:
        return {n for n in dir(cls) if not n.startswith("_")}

    assert public(Client) - {"close"} == public(AsyncClient) - {"aclose"}
    assert AsyncClient.get_into.__doc__ == Client.get_into.__doc__


def test_import_pulls_in_neither_the_server_nor_torch_nor_lmcache() -> None:
    # lmclient.lmcache (the LMCache plugin) is imported by LMCache alone, never by lmclient.
    code = (
        "import sys, lmclient; "
        "bad = [m for m in ('lmserver', 'torch', 'numpy', 'structlog', 'lmcache', 'lmclient.lmcache') "
        "if m in sys.modules]; "
        "print(bad)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
