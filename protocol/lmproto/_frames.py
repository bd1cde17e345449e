"""The decoded forms of request and reply headers.

Strategy: NamedTuples, because the server builds one per request on its hot path and a
tuple is the cheapest immutable record CPython can make. Bodies are never part of these:
they travel beside the header as separate buffers.
"""

from __future__ import annotations

from typing import NamedTuple

from ._constants import Command, Generation, Status


class ObjectMeta(NamedTuple):
    """v1 tensor metadata stored with an object and returned by GET.

    The integers are kept as sent (not coerced into the enums) so that a newer client's
    formats survive a round trip through an older server.
    """

    fmt: int = 0
    dtype: int = 0
    shape: tuple[int, int, int, int] = (0, 0, 0, 0)
    location: int = 0


NO_META = ObjectMeta()
"""Metadata of objects stored through v0 frames, which carry none."""

PLACEHOLDER_META = ObjectMeta(fmt=1, dtype=2, shape=(0, 0, 0, 0), location=0)
"""What upstream's v1 server puts in replies that carry no object (miss, EXIST, HEALTH)."""


class Request(NamedTuple):
    """One decoded request header.

    ``length`` bytes of body always follow the header on the wire, whatever the command:
    that rule alone keeps the stream framed even for commands the server refuses.
    ``problem`` is None for a servable request, else the reason it must be answered FAIL
    (the frame itself was fine, so the connection goes on).
    """

    command: int
    length: int
    key: str
    meta: ObjectMeta
    generation: Generation
    problem: str | None = None

    @property
    def known_command(self) -> Command | None:
        try:
            return Command(self.command)
        except ValueError:
            return None


class Reply(NamedTuple):
    """One decoded reply header; ``length`` body bytes follow it."""

    status: int
    length: int
    meta: ObjectMeta
    generation: Generation

    @property
    def ok(self) -> bool:
        return self.status == Status.SUCCESS
