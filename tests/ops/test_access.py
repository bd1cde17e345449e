"""--allow: connections from other addresses are closed at accept, counted and logged."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from serverthread import ServerThread
from wire import closed_by_server, connect_from, health

from lmproto import Status
from lmserver.access import AccessList, parse_networks
from lmserver.config import ServerConfig


def counters(thread: ServerThread) -> dict[str, int]:
    assert thread.server is not None
    state = thread.server.state
    return thread.call(lambda: dict(state.current_counters()))  # type: ignore[no-any-return]


@pytest.mark.parametrize("host", ["127.0.0.1", "0.0.0.0"])
def test_a_peer_outside_the_list_is_closed_at_accept_and_counted(
    make_server_thread: Callable[..., ServerThread], host: str
) -> None:
    thread = make_server_thread(host=host, allow=("127.0.0.1/32",))

    with connect_from("127.0.0.2", thread.port) as refused:
        assert closed_by_server(refused)  # without sending a byte: closed at accept
    with connect_from("127.0.0.1", thread.port) as allowed:
        assert health(allowed) == Status.SUCCESS

    seen = counters(thread)
    assert seen["connections_refused"] == 1
    assert seen["connections_refused_not_allowed"] == 1
    assert seen["connections_accepted"] == 1


def test_networks_and_single_addresses_mix(make_server_thread: Callable[..., ServerThread]) -> None:
    thread = make_server_thread(allow=("10.0.0.0/8, 127.0.0.3", "127.0.0.4"))
    for source, allowed in (("127.0.0.3", True), ("127.0.0.4", True), ("127.0.0.5", False)):
        with connect_from(source, thread.port) as sock:
            if allowed:
                assert health(sock) == Status.SUCCESS
            else:
                assert closed_by_server(sock)


def test_no_list_allows_everyone(make_server_thread: Callable[..., ServerThread]) -> None:
    thread = make_server_thread()
    with connect_from("127.0.0.9", thread.port) as sock:
        assert health(sock) == Status.SUCCESS


@pytest.mark.parametrize(
    ("entries", "peer", "allowed"),
    [
        (["10.0.0.0/8"], ("10.2.3.4", 1), True),
        (["10.0.0.0/8"], ("11.0.0.1", 1), False),
        (["10.1.2.3/8"], ("10.9.9.9", 1), True),  # host bits are ignored
        (["10.0.0.0/8"], ("::ffff:10.0.0.1", 1, 0, 0), True),  # dual-stack socket, IPv4 peer
        (["::ffff:127.0.0.1"], ("127.0.0.1", 1), True),  # an IPv4 network written as IPv6
        (["::ffff:10.0.0.0/104"], ("10.9.8.7", 1), True),
        (["::ffff:10.0.0.0/104"], ("::ffff:10.9.8.7", 1, 0, 0), True),
        (["::ffff:10.0.0.0/104"], ("11.0.0.1", 1), False),
        (["::1"], ("::1", 1, 0, 0), True),
        (["fd00::/8"], ("fe80::1", 1, 0, 0), False),
        (["10.0.0.0/8"], None, False),  # no address (e.g. a Unix socket)
        ([], None, True),
    ],
)
def test_access_list_decisions(entries: list[str], peer: Any, allowed: bool) -> None:
    assert AccessList(entries).allows(peer) is allowed


@pytest.mark.parametrize("bad", ["10.0.0.0/33", "example.com", "10.0.0.0/8,nope"])
def test_a_bad_entry_is_refused_with_its_name(bad: str) -> None:
    with pytest.raises(ValueError, match="is not an address or CIDR"):
        parse_networks([bad])
    with pytest.raises(ValueError, match="--allow"):
        ServerConfig(allow=(bad,))


@pytest.mark.parametrize("entries", [[""], [" , "], ["10.0.0.1", ","]])
def test_an_entry_without_an_address_is_refused(entries: list[str]) -> None:
    """``--allow ""`` let everyone in while the listening line showed ``allow: [""]``."""
    with pytest.raises(ValueError, match="holds no address"):
        parse_networks(entries)
    with pytest.raises(ValueError, match="--allow"):
        ServerConfig(allow=tuple(entries))


def test_an_ipv6_mapped_entry_admits_ipv4_peers(make_server_thread: Callable[..., ServerThread]) -> None:
    thread = make_server_thread(allow=("::ffff:127.0.0.1",))
    with connect_from("127.0.0.1", thread.port) as allowed:
        assert health(allowed) == Status.SUCCESS  # refused before
    with connect_from("127.0.0.2", thread.port) as refused:
        assert closed_by_server(refused)
