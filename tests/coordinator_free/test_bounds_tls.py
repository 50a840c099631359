"""Finding 4's attacks over real mutual TLS: a member's invented runs, deep JSON and a
far-future sequence number reach a round engine and a shard service served by uvicorn
on loopback, are refused with their reasons, and leave the server serving."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Collection
from pathlib import Path

import pytest
from coordinator_free.checkpoints import ShardStore
from coordinator_free.checkpoints.service import LIST, STAGE, ShardService
from coordinator_free.endpoint import Endpoint
from coordinator_free.errors import RefusalReason, Refused
from coordinator_free.rounds import KIND_READY, RoundConfig, RoundEngine
from coordinator_free.tls import PeerAddress, TlsConfig, TlsTransport, write_trust_bundle

from tests.coordinator_free.transport_support import (
    FEDERATION,
    bound_socket,
    identity,
    serve_tls,
    signed,
)

pytestmark = pytest.mark.timeout(120)


def test_finding_4_attacks_over_mutual_tls_are_refused_and_the_node_serves_on(
    tmp_path: Path,
) -> None:
    a, b = identity("a"), identity("b")
    b.save(tmp_path / "b", b"pass")
    write_trust_bundle(tmp_path / "trust.pem", [a.certificate_pem, b.certificate_pem])
    members = {"a": a.public_key, "b": b.public_key}
    server_transport = TlsTransport(b, dict)
    server = Endpoint(b, FEDERATION, server_transport, lambda: members)

    def admit(run: str) -> Collection[str] | None:
        return {"a", "b"} if run == "accepted-run" else None

    engine = RoundEngine.secure(server, lambda: ["a", "b"], RoundConfig(), admit=admit)
    ShardService(server, ShardStore(tmp_path / "shards"), lambda: members)
    asyncio.run(server.start())
    sock = bound_socket()
    address = PeerAddress(f"https://127.0.0.1:{sock.getsockname()[1]}", b.fingerprint)

    async def attack() -> None:
        transport = TlsTransport(a, lambda: {"b": address}, config=TlsConfig(connect_retries=2))
        client = Endpoint(a, FEDERATION, transport, lambda: members)
        try:
            for i in range(80):
                with pytest.raises(Refused) as info:
                    await client.send("b", KIND_READY, bytes(40), run=f"invented-{i}", round=1)
                assert info.value.reason is RefusalReason.NOT_ADMITTED
            deep = b'{"owner": ' + b"[" * 50_000 + b"]" * 50_000 + b"}"
            with pytest.raises(Refused) as info:
                await client.send("b", LIST, deep, stage=STAGE, timeout=30)
            assert info.value.reason is RefusalReason.MALFORMED
            far = signed(a, "b", 2**63, kind=LIST, stage=STAGE, sent_at=time.time())
            with pytest.raises(Refused) as info:
                await transport.request("b", far.to_wire(), timeout=30)
            assert info.value.reason is RefusalReason.STALE
            # the server still answers this member (its window was not moved)
            assert await client.send("b", LIST, b'{"owner": "a"}', stage=STAGE, timeout=30)
        finally:
            await transport.close()

    with serve_tls(
        server_transport.asgi_app(), sock, tmp_path / "b", tmp_path / "trust.pem", b"pass"
    ):
        asyncio.run(attack())
    assert engine.open_rounds() == []
