"""``--allow``: which peer addresses may connect.

LMCache's connectors cannot authenticate, so the only control that works with them is by
address. The check runs when a connection is accepted (admission.py), before anything is
read from the peer or a TLS handshake begins.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable
from typing import Any

Network = ipaddress.IPv4Network | ipaddress.IPv6Network


def parse_networks(entries: Iterable[str]) -> list[Network]:
    """CIDRs (``10.0.0.0/8``) or single addresses, each entry possibly a comma- or
    space-separated list (as ``LMSERVER_ALLOW`` is given). Host bits may be set. An entry with
    no address in it is an error: read as "no restriction", it would let everyone in."""
    networks: list[Network] = []
    for entry in entries:
        items = entry.replace(",", " ").split()
        if not items:
            raise ValueError(f"--allow: {entry!r} holds no address (to allow everyone, leave --allow out)")
        for item in items:
            try:
                networks.append(_unmapped(ipaddress.ip_network(item, strict=False)))
            except ValueError:
                raise ValueError(f"--allow: {item!r} is not an address or CIDR (e.g. 10.0.0.0/8)") from None
    return networks


def _unmapped(network: Network) -> Network:
    """``::ffff:10.0.0.0/104`` is ``10.0.0.0/8``: peers are matched by their IPv4 address
    (``allows`` unmaps a dual-stack socket's ``::ffff:a.b.c.d``), so the list must hold it so."""
    if isinstance(network, ipaddress.IPv6Network) and network.prefixlen >= 96:
        mapped = network.network_address.ipv4_mapped
        if mapped is not None:
            return ipaddress.IPv4Network((mapped, network.prefixlen - 96))
    return network


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
