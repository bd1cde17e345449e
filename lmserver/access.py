"""``--allow``: which peer addresses may connect.

LMCache's connectors cannot authenticate, so the only control that works with them is by
address. The check runs in ``connection_made``, before anything is read from the peer.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable
from typing import Any

Network = ipaddress.IPv4Network | ipaddress.IPv6Network


def parse_networks(entries: Iterable[str]) -> list[Network]:
    """CIDRs (``10.0.0.0/8``) or single addresses, each entry possibly a comma- or
    space-separated list (as ``LMSERVER_ALLOW`` is given). Host bits may be set."""
    networks: list[Network] = []
    for entry in entries:
        for item in entry.replace(",", " ").split():
            try:
                networks.append(ipaddress.ip_network(item, strict=False))
            except ValueError:
                raise ValueError(f"--allow: {item!r} is not an address or CIDR (e.g. 10.0.0.0/8)") from None
    return networks


class AccessList:
    """Decides per peer address; an empty list allows everyone."""

    def __init__(self, entries: Iterable[str]) -> None:
        self.networks = parse_networks(entries)

    def __bool__(self) -> bool:
        return bool(self.networks)

    def allows(self, peername: Any) -> bool:
        """``peername`` as ``get_extra_info("peername")`` gives it: ``(host, port, ...)`` for
        TCP. Anything else (no address, a Unix socket) is refused when a list is set."""
        if not self.networks:
            return True
        try:
            address = ipaddress.ip_address(peername[0])
        except (TypeError, IndexError, ValueError):
            return False
        if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
            address = address.ipv4_mapped  # a dual-stack socket reports IPv4 peers as ::ffff:a.b.c.d
        return any(address in network for network in self.networks)
