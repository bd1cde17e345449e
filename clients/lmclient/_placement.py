"""Where a key's commands go: which server (rendezvous hashing) and which connection.

Strategy: every command on a key is sent on one connection, the key's *lane*, chosen by a
stable hash of the key. A server serves each connection's requests in order, so the order
of a key's commands is one socket's order: a fire-and-forget PUT followed by a GET of the
same key is always served in that order, whatever other threads or tasks do meanwhile
(read-your-writes without waiting for an acknowledgement). Different keys spread over the
lanes, so unrelated requests still use every connection.

With several servers a key lives on the server with the highest rendezvous
(highest-random-weight) score ``hash(server, key)``: adding or removing a server moves
only the keys whose top score changes (about 1/N of them), and every client with the same
server list places every key the same way. Hashes are BLAKE2b, never Python's ``hash()``,
which is salted per process.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import NamedTuple


class Address(NamedTuple):
    host: str
    port: int

    def __str__(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"


def key_hash(key: str, salt: bytes = b"") -> int:
    """A stable 64-bit hash of ``key`` (the same in every process and on every machine)."""
    digest = hashlib.blake2b(key.encode("utf-8", "surrogateescape"), digest_size=8, salt=salt)
    return int.from_bytes(digest.digest(), "little")


_LANE_SALT = b"lmclient-lane"
"""Lanes hash the key with a salt of their own, so a server's keys still spread over all
of its connections (the server choice and the lane choice are independent)."""


class Placement:
    """Maps keys to (server index, lane index); pure and thread-safe."""

    __slots__ = ("_lanes", "_seeds", "servers")

    def __init__(self, servers: Sequence[Address], lanes: int) -> None:
        self.servers = tuple(servers)
        self._lanes = lanes
        # Each server's score for a key is hash(seed || key): the seed is the server's
        # address, so the ranking depends on the list's members, never on its order.
        self._seeds = [str(address).encode() + b"\0" for address in self.servers]

    def server(self, key: str) -> int:
        """Index of the server that holds ``key``."""
        if len(self._seeds) == 1:
            return 0
        data = key.encode("utf-8", "surrogateescape")
        best, best_score = 0, -1
        for index, seed in enumerate(self._seeds):
            score = int.from_bytes(hashlib.blake2b(seed + data, digest_size=8).digest(), "little")
            if score > best_score:
                best, best_score = index, score
        return best

    def lane(self, key: str) -> int:
        """Index of the connection (of its server's pool) that carries ``key``'s commands."""
        if self._lanes == 1:
            return 0
        return key_hash(key, _LANE_SALT) % self._lanes
