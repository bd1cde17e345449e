"""Numbers fixed by the wire: commands, status codes, v1 metadata enumerations, layouts.

Strategy: every struct layout is compiled once here with an explicit little-endian prefix.
Upstream LMCache packs with native order (`"ii150s"`); every platform it runs on is
little-endian, so `"<ii150s"` is byte-identical there and stays correct everywhere else.
"""

from __future__ import annotations

import enum
import struct

KEY_SIZE = 150
"""Bytes reserved for the key in every request header; keys are at most this long."""


class Generation(enum.IntEnum):
    """The two frame generations that share the port."""

    V0 = 0  # LMCache <= 0.3 `lmcache.server`: 158-byte request, 8-byte reply
    V1 = 1  # LMCache >= 0.3 `lmcache.v1.server`: 186-byte request, 36-byte reply


class Command(enum.IntEnum):
    # Upstream commands: their meaning never changes.
    PUT = 1
    GET = 2
    EXIST = 3
    LIST = 4
    HEALTH = 5
    # lmserver extensions, numbered far away from upstream's 1-5.
    PUT_ACK = 101
    DELETE = 102
    EXIST_MANY = 103
    STATS = 104
    DELETE_MANY = 105
    LIST_PAGE = 106


UPSTREAM_COMMANDS = frozenset({Command.PUT, Command.GET, Command.EXIST, Command.LIST, Command.HEALTH})
EXTENSION_COMMANDS = frozenset(set(Command) - UPSTREAM_COMMANDS)


class Status(enum.IntEnum):
    SUCCESS = 200
    FAIL = 400
    # Only extension commands use these; upstream commands see 200 or 400 alone.
    NOT_FOUND = 404
    TOO_LARGE = 413
    UNAVAILABLE = 503
    NO_SPACE = 507


class MemoryFormat(enum.IntEnum):
    UNDEFINED = 0
    KV_2LTD = 1
    KV_T2D = 2
    KV_2TD = 3
    BINARY = 4
    BINARY_BUFFER = 5
    KV_MLA_FMT = 6
    EC_TD = 7
    HS_TD = 8


class DType(enum.IntEnum):
    NONE = 0
    HALF = 1
    FLOAT16 = 2
    BFLOAT16 = 3
    FLOAT32 = 4
    FLOAT64 = 5
    UINT8 = 6
    FLOAT8_E4M3FN = 7
    FLOAT8_E5M2 = 8


class Location(enum.IntEnum):
    NONE = 0
    LOCAL_CPU = 1
    LOCAL_DISK = 2


V0_REQUEST = struct.Struct("<ii150s")  # command, length, key
V0_REPLY = struct.Struct("<ii")  # status, length
# command, length, fmt, dtype, location, shape0..3, key
V1_REQUEST = struct.Struct("<iiiiiiiii150s")
# status, length, fmt, dtype, shape0..3, location (location moves to the end in replies)
V1_REPLY = struct.Struct("<iiiiiiiii")

REQUEST_SIZE = {Generation.V0: V0_REQUEST.size, Generation.V1: V1_REQUEST.size}
REPLY_SIZE = {Generation.V0: V0_REPLY.size, Generation.V1: V1_REPLY.size}

DETECT_SIZE = 12
"""Bytes of a first request header needed to tell the generations apart (see detect_generation)."""

INT32_MAX = 2**31 - 1
