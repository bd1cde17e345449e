"""lmproto: the sans-IO codec of the LMCache ``lm://`` wire protocol and lmserver's extensions.

Standard library only, no I/O. The contract is ``protocol/SPEC.md``; ``protocol/vectors.json``
holds golden frames that tests replay against this package.
"""

# First: with LMSERVER_PURE=1 it makes the imports below load sources, not compiled modules.
from . import _native  # noqa: F401
from ._bodies import (
    MAX_CONTROL_BODY,
    MAX_REASON_BODY,
    MalformedBody,
    decode_error_text,
    decode_json,
    decode_key_lines,
    decode_key_list,
    decode_presence,
    encode_error_text,
    encode_json,
    encode_key_lines,
    encode_key_list,
    encode_presence,
    hit_prefix,
)
from ._codec import encode_key, encode_reply, encode_request, validate_key
from ._constants import (
    DETECT_SIZE,
    EXTENSION_COMMANDS,
    KEY_SIZE,
    REPLY_SIZE,
    REQUEST_SIZE,
    UPSTREAM_COMMANDS,
    V0_REPLY,
    V0_REQUEST,
    V1_REPLY,
    V1_REQUEST,
    Command,
    DType,
    Generation,
    Location,
    MemoryFormat,
    Status,
)
from ._decode import decode_reply, decode_request, detect_generation
from ._decoder import NEED_DATA, ReplyDecoder, RequestDecoder
from ._errors import LocalProtocolError, ProtocolError, RemoteProtocolError
from ._frames import NO_META, PLACEHOLDER_META, ObjectMeta, Reply, Request
from ._lookup import decode_lookup, decode_lookups, decode_lookups_into

__all__ = [
    "DETECT_SIZE",
    "EXTENSION_COMMANDS",
    "KEY_SIZE",
    "MAX_CONTROL_BODY",
    "MAX_REASON_BODY",
    "NEED_DATA",
    "NO_META",
    "PLACEHOLDER_META",
    "REPLY_SIZE",
    "REQUEST_SIZE",
    "UPSTREAM_COMMANDS",
    "V0_REPLY",
    "V0_REQUEST",
    "V1_REPLY",
    "V1_REQUEST",
    "Command",
    "DType",
    "Generation",
    "LocalProtocolError",
    "Location",
    "MalformedBody",
    "MemoryFormat",
    "ObjectMeta",
    "ProtocolError",
    "RemoteProtocolError",
    "Reply",
    "ReplyDecoder",
    "Request",
    "RequestDecoder",
    "Status",
    "decode_error_text",
    "decode_json",
    "decode_key_lines",
    "decode_key_list",
    "decode_presence",
    "decode_reply",
    "decode_lookup",
    "decode_lookups",
    "decode_lookups_into",
    "decode_request",
    "detect_generation",
    "encode_error_text",
    "encode_json",
    "encode_key",
    "encode_key_lines",
    "encode_key_list",
    "encode_presence",
    "encode_reply",
    "encode_request",
    "hit_prefix",
    "validate_key",
]
