"""Where a service's replicas are: target strings, their resolvers, rendezvous hashing.

Grpc-free, so configuration objects can check a target when they are built. A target is
"host:port" (one replica), "h1:p1,h2:p2,..." (a static list) or "dns:///name:port" (every
address of the name, re-resolved by the client: a Kubernetes headless Service answers with one
record per ready pod).
"""

from __future__ import annotations

import hashlib
import socket
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

DNS_SCHEME = "dns:///"


def address(host: str, port: int) -> str:
    """host:port, with an IPv6 host in brackets."""
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"


class Resolver(Protocol):
    def resolve(self) -> list[str]:
        """The replicas' "host:port" targets now (raises OSError when resolution fails)."""
        ...


@dataclass(frozen=True)
class StaticResolver:
    targets: tuple[str, ...]

    def resolve(self) -> list[str]:
        return list(self.targets)


@dataclass(frozen=True)
class DnsResolver:
    """Every address of `host`: a headless Service answers with one A record per ready pod."""

    host: str
    port: int

    def resolve(self) -> list[str]:
        infos = socket.getaddrinfo(self.host, self.port, type=socket.SOCK_STREAM)
        return sorted({address(info[4][0], self.port) for info in infos})


def parse_targets(spec: str) -> Resolver:
    """The resolver of a drafter target (see the module docstring); ValueError if malformed."""
    spec = spec.strip()
    if spec.startswith(DNS_SCHEME):
        host, sep, port = spec[len(DNS_SCHEME):].rpartition(":")
        if not sep or not host or not port.isdigit():
            raise ValueError(f"drafter target {spec!r}: expected dns:///NAME:PORT")
        return DnsResolver(host, int(port))
    targets = tuple(t.strip() for t in spec.split(","))
    for target in targets:
        host, sep, port = target.rpartition(":")
        if not sep or not host or not port.isdigit():
            raise ValueError(f"drafter target {target!r} in {spec!r}: expected HOST:PORT")
    if len(set(targets)) != len(targets):
        raise ValueError(f"drafter targets {spec!r}: a replica is listed twice")
    return StaticResolver(targets)


def rendezvous_owner(seq_id: str, replicas: Sequence[str]) -> str:
    """The replica with the highest hash of (replica, seq_id): the same answer from every
    client, and removing one replica moves only the sequences it owned."""
    return max(replicas, key=lambda replica: hashlib.blake2b(
        f"{replica}\x00{seq_id}".encode(), digest_size=8).digest())
