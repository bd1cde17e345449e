"""What went wrong talking to the Hub, in the few kinds the tier acts on (no Hub imports)."""

from __future__ import annotations

from typing import Literal

from ..errors import TierError

Kind = Literal["not_found", "unauthorized", "rate_limited", "server", "client", "unreachable", "error"]


class HubError(TierError):
    """A failed Hub call. ``kind`` decides what the tier does; ``retry_after`` (seconds) is
    the server's ``Retry-After`` when it sent one. The message never contains the token."""

    def __init__(
        self, kind: Kind, message: str, *, status: int | None = None, retry_after: float | None = None
    ) -> None:
        super().__init__(message)
        self.kind: Kind = kind
        self.status = status
        self.retry_after = retry_after


class BatchFailed(HubError):
    """The Hub rejected some operations of a batch (the others were applied)."""

    def __init__(self, failed: dict[str, str], message: str, *, status: int | None = None) -> None:
        super().__init__("client", message, status=status)
        self.failed = failed
