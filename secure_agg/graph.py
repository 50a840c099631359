"""The SecAgg+ neighbour graph: who masks with, and holds key shares of, whom.

Bell et al., *Secure Single-Server Aggregation with (Poly)Logarithmic Overhead*,
CCS'20, §3 replace the complete graph of Bonawitz et al. (CCS'17) with a sparse
``k``-regular graph: a participant agrees pairwise masks with, and Shamir-shares its
secrets among, only its ``k`` neighbours. The graph must be the same for every
participant and unpredictable before the round's participant set is fixed, so it is
derived from a seed that binds the round context: the participants are put in a
pseudo-random cyclic order (sorted by ``SHA-256(seed || id)``) and joined as a
Harary graph ``H(k, n)``: each one to its ``k // 2`` nearest on either side of the
cycle and, for odd ``k`` (which needs an even ``n``), also to the diametrically
opposite one. ``k = None`` or ``k = n - 1`` is the complete graph.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from secure_agg.errors import ConfigError

__all__ = ["NeighbourGraph", "graph_seed"]

_GRAPH_LABEL = b"fedweave/secagg+/graph/v1"


def graph_seed(ctx_bytes: bytes, participants: Sequence[str]) -> bytes:
    """The 32-byte seed of a round's graph: binds the round context and the set U0."""
    h = hashlib.sha256(_GRAPH_LABEL)
    h.update(struct.pack(">I", len(ctx_bytes)) + ctx_bytes)
    for org in sorted(participants):
        raw = org.encode("utf-8")
        h.update(struct.pack(">I", len(raw)) + raw)
    return h.digest()


@dataclass(frozen=True)
class NeighbourGraph:
    """An undirected, ``k``-regular graph over ``participants`` (no self loops).

    participants: the org ids (unique).
    k: neighbours per participant, ``2 <= k <= n - 1``; ``None`` for the complete graph.
    seed: 32 bytes fixing the pseudo-random cyclic order (see :func:`graph_seed`).
    """

    participants: tuple[str, ...]
    k: int | None
    seed: bytes
    _adjacency: Mapping[str, frozenset[str]] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        n = len(self.participants)
        if len(set(self.participants)) != n:
            raise ConfigError("participants: org ids must be unique")
        if n < 2:
            raise ConfigError(f"participants: need at least 2, got {n}")
        if len(self.seed) != 32:
            raise ConfigError(f"seed: must be 32 bytes, got {len(self.seed)}")
        k = self.k
        if k is not None:
            if isinstance(k, bool) or not isinstance(k, int):
                raise ConfigError(f"neighbours: must be an int or None, got {k!r}")
            if not 2 <= k <= n - 1:
                raise ConfigError(
                    f"neighbours: must be in [2, {n - 1}] for {n} participants, got {k}"
                )
            if k % 2 == 1 and n % 2 == 1:
                raise ConfigError(
                    f"neighbours: no {k}-regular graph on {n} participants exists "
                    "(odd k needs an even participant count); use an even k"
                )
        object.__setattr__(self, "_adjacency", self._build())

    def _build(self) -> dict[str, frozenset[str]]:
        n = len(self.participants)
        everyone = frozenset(self.participants)
        if self.k is None or self.k == n - 1:
            return {p: everyone - {p} for p in self.participants}
        order = sorted(
            self.participants, key=lambda p: hashlib.sha256(self.seed + p.encode()).digest()
        )
        adj: dict[str, set[str]] = {p: set() for p in order}
        for pos, p in enumerate(order):
            for step in range(1, self.k // 2 + 1):
                q = order[(pos + step) % n]
                adj[p].add(q)
                adj[q].add(p)
            if self.k % 2 == 1:
                q = order[(pos + n // 2) % n]
                adj[p].add(q)
                adj[q].add(p)
        return {p: frozenset(s) for p, s in adj.items()}

    def neighbours(self, org: str) -> frozenset[str]:
        """The open neighbourhood N(org): the orgs ``org`` masks with."""
        try:
            return self._adjacency[org]
        except KeyError:
            raise ConfigError(f"org {org!r} is not a participant of this graph") from None

    def closed(self, org: str) -> frozenset[str]:
        """The closed neighbourhood N[org] = N(org) + {org}: the holders of org's shares."""
        return self.neighbours(org) | {org}

    def edges(self) -> frozenset[frozenset[str]]:
        """Every edge once, as a two-element frozenset."""
        return frozenset(frozenset((p, q)) for p, qs in self._adjacency.items() for q in qs)
