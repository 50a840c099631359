"""HTTPS with mutual TLS between a uvicorn server (in a thread) and the httpx client."""

from __future__ import annotations

import asyncio
import socket
import ssl
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from coordinator_free.endpoint import Endpoint
from coordinator_free.errors import (
    PeerUnreachable,
    RefusalReason,
    Refused,
    UntrustedPeer,
)
from coordinator_free.identity import OrgIdentity
from coordinator_free.tls import (
    PeerAddress,
    TlsConfig,
    TlsTransport,
    client_ssl_context,
    server_ssl_context,
    write_trust_bundle,
)
from coordinator_free.transport import PROCESS_SEQUENCE
from coordinator_free.wire import Envelope

from tests.coordinator_free.transport_support import (
    FEDERATION,
    bound_socket,
    identity,
    serve_tls,
    signed,
    tampered,
)

pytestmark = pytest.mark.timeout(120)

SERVER_LIMIT = 8 << 20


@dataclass
class Cluster:
    """Org ``b`` serving over mTLS; ``a`` is a member, ``m`` holds an unpinned cert."""

    a: OrgIdentity
    b: OrgIdentity
    m: OrgIdentity
    server: Endpoint
    address: PeerAddress
    port: int
    calls: list[str]

    def peers(self) -> Mapping[str, PeerAddress]:
        return {"b": self.address}

    def members(self) -> Mapping[str, bytes]:
        return {"a": self.a.public_key, "b": self.b.public_key}

    def client(self, who: OrgIdentity | None = None, **config: Any) -> TlsTransport:
        return TlsTransport(who or self.a, self.peers, config=TlsConfig(**config))

    def endpoint(self, transport: TlsTransport) -> Endpoint:
        return Endpoint(self.a, FEDERATION, transport, self.members)


def _setup_server(
    tmp: Path, sock: socket.socket
) -> tuple[Cluster, TlsTransport, tuple[Path, Path, bytes]]:
    """Org ``b``'s endpoint on ``sock``'s port; also the identity directory, trust bundle
    and key passphrase its server is started with."""
    a, b, m = identity("a"), identity("b"), identity("m")
    b.save(tmp / "b", b"pass")
    write_trust_bundle(tmp / "trust.pem", [a.certificate_pem, b.certificate_pem])
    calls: list[str] = []

    async def echo(env: Envelope) -> bytes:
        calls.append(env.kind)
        return env.payload

    transport = TlsTransport(b, dict, config=TlsConfig(max_message_bytes=SERVER_LIMIT))
    server = Endpoint(
        b,
        FEDERATION,
        transport,
        lambda: {"a": a.public_key, "b": b.public_key},
        max_size=SERVER_LIMIT,
    )
    server.on("echo", echo)
    asyncio.run(server.start())
    port = sock.getsockname()[1]
    address = PeerAddress(f"https://127.0.0.1:{port}", b.fingerprint)
    cluster = Cluster(a, b, m, server, address, port, calls)
    return cluster, transport, (tmp / "b", tmp / "trust.pem", b"pass")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    sock = bound_socket()
    found, transport, tls = _setup_server(tmp_path_factory.mktemp("tls"), sock)
    with serve_tls(transport.asgi_app(), sock, *tls):
        yield found


def _run(coro: Any) -> Any:
    return asyncio.run(coro)


def test_signed_round_trip_over_mtls(cluster: Cluster) -> None:
    async def main() -> bytes:
        transport = cluster.client()
        try:
            return await cluster.endpoint(transport).send("b", "echo", b"hello", timeout=10)
        finally:
            await transport.close()

    assert _run(main()) == b"hello"


def test_four_megabyte_payload_round_trip(cluster: Cluster) -> None:
    payload = bytes(range(256)) * (4 * 4096)
    assert len(payload) == 4 << 20

    async def main() -> bytes:
        transport = cluster.client(chunk_size=64 << 10)
        try:
            return await cluster.endpoint(transport).send("b", "echo", payload, timeout=60)
        finally:
            await transport.close()

    assert _run(main()) == payload


def _raw_handshake(cluster: Cluster, who: OrgIdentity | None) -> None:
    """Connect with plain ``ssl``, optionally presenting ``who``'s certificate, and read."""
    if who is None:
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
    else:
        context = client_ssl_context(who)
    with (
        socket.create_connection(("127.0.0.1", cluster.port), timeout=10) as raw,
        context.wrap_socket(raw) as tls,
    ):
        tls.sendall(b"POST / HTTP/1.1\r\nHost: b\r\nContent-Length: 0\r\n\r\n")
        if not tls.recv(1):
            raise ConnectionResetError("closed")


@pytest.mark.parametrize("who", ["none", "unpinned"])
def test_client_without_pinned_certificate_is_rejected_by_tls(cluster: Cluster, who: str) -> None:
    before = len(cluster.calls)
    refusals_before = cluster.server.guard.refusals.total()
    with pytest.raises((ssl.SSLError, ConnectionResetError, BrokenPipeError)) as info:
        _raw_handshake(cluster, None if who == "none" else cluster.m)
    if isinstance(info.value, ssl.SSLError):
        assert "CERTIFICATE" in str(info.value).upper() or "UNKNOWN_CA" in str(info.value).upper()
    assert len(cluster.calls) == before

    async def via_transport() -> None:
        transport = cluster.client(cluster.m, connect_retries=0)
        try:
            await transport.request("b", b"anything", timeout=10)
        finally:
            await transport.close()

    with pytest.raises(PeerUnreachable):
        _run(via_transport())
    assert len(cluster.calls) == before
    assert cluster.server.guard.refusals.total() == refusals_before  # stopped before the guard


def test_member_certificate_passes_the_tls_layer(cluster: Cluster) -> None:
    # Sanity check of the raw helper: the pinned member completes an HTTP exchange.
    _raw_handshake(cluster, cluster.a)


def test_server_with_an_unpinned_certificate_is_untrusted(cluster: Cluster) -> None:
    before = len(cluster.calls)
    wrong = PeerAddress(cluster.address.url, cluster.m.fingerprint)

    async def main() -> None:
        transport = TlsTransport(
            cluster.a, lambda: {"b": wrong}, config=TlsConfig(connect_retries=3)
        )
        try:
            await cluster.endpoint(transport).send("b", "echo", b"secret", timeout=10)
        finally:
            await transport.close()
            assert transport.retries == 0

    with pytest.raises(UntrustedPeer):
        _run(main())
    assert len(cluster.calls) == before


@pytest.mark.parametrize(
    "reason",
    [
        RefusalReason.REPLAY,
        RefusalReason.BAD_SIGNATURE,
        RefusalReason.MALFORMED,
        RefusalReason.OVERSIZED,
        RefusalReason.NO_HANDLER,
        RefusalReason.WRONG_RECIPIENT,
    ],
    ids=lambda r: r.value,
)
def test_refusals_over_mtls(cluster: Cluster, reason: RefusalReason) -> None:
    seq = PROCESS_SEQUENCE.next()
    good = signed(cluster.a, "b", seq)
    attacks = {
        RefusalReason.REPLAY: [good.to_wire(), good.to_wire()],
        RefusalReason.BAD_SIGNATURE: [tampered(good, payload=b"evil").to_wire()],
        RefusalReason.MALFORMED: [b"\x00 not an envelope"],
        RefusalReason.OVERSIZED: [
            signed(cluster.a, "b", seq, payload=bytes(SERVER_LIMIT)).to_wire()
        ],
        RefusalReason.NO_HANDLER: [signed(cluster.a, "b", seq, kind="nope").to_wire()],
        RefusalReason.WRONG_RECIPIENT: [signed(cluster.a, "c", seq).to_wire()],
    }
    *setup, attack = attacks[reason]
    before = cluster.server.guard.refusals[reason]

    async def main() -> None:
        transport = cluster.client(connect_retries=0)
        try:
            for data in setup:
                await transport.request("b", data, timeout=30)
            with pytest.raises(Refused) as info:
                await transport.request("b", attack, timeout=30)
            assert info.value.reason is reason
            # The connection and the server are fine afterwards.
            fresh = signed(cluster.a, "b", PROCESS_SEQUENCE.next(), payload=b"after")
            reply = Envelope.from_wire(
                await transport.request("b", fresh.to_wire(), timeout=30), 1 << 20
            )
            assert reply.payload.endswith(b"after")
        finally:
            await transport.close()

    _run(main())
    assert cluster.server.guard.refusals[reason] == before + 1


def test_retries_with_backoff_until_the_server_appears(tmp_path: Path) -> None:
    sock = bound_socket()
    cluster, server_transport, tls = _setup_server(tmp_path, sock)

    async def main() -> bytes:
        transport = cluster.client(connect_retries=30, backoff_base_s=0.02, backoff_max_s=0.2)
        endpoint = cluster.endpoint(transport)
        sending = asyncio.create_task(endpoint.send("b", "echo", b"late", timeout=60))
        while transport.retries < 2:
            assert not sending.done(), "the request should wait for the server"
            await asyncio.sleep(0.01)
        server = serve_tls(server_transport.asgi_app(), sock, *tls)
        await asyncio.to_thread(server.__enter__)
        try:
            return await sending
        finally:
            await transport.close()
            await asyncio.to_thread(server.__exit__, None, None, None)

    assert _run(main()) == b"late"
    assert cluster.calls == ["echo"]


def test_unreachable_peer_gives_up_after_the_retries() -> None:
    sock = bound_socket()  # bound, never listening: connections are refused
    port = sock.getsockname()[1]
    address = PeerAddress(f"https://127.0.0.1:{port}", "0" * 64)

    async def main() -> int:
        transport = TlsTransport(
            identity("a"),
            lambda: {"b": address},
            config=TlsConfig(connect_retries=2, backoff_base_s=0.001),
        )
        try:
            with pytest.raises(PeerUnreachable):
                await transport.request("b", b"x", timeout=30)
            with pytest.raises(PeerUnreachable, match="no address"):
                await transport.request("nobody", b"x", timeout=30)
            return transport.retries
        finally:
            await transport.close()

    try:
        assert _run(main()) == 2
    finally:
        sock.close()


def test_backoff_grows_exponentially_with_bounded_jitter() -> None:
    import random

    transport = TlsTransport(
        identity("a"),
        dict,
        config=TlsConfig(backoff_base_s=0.1, backoff_max_s=1.0),
        rng=random.Random(7),
    )
    delays = [transport.backoff(k) for k in range(8)]
    for k, delay in enumerate(delays):
        ceiling = min(1.0, 0.1 * 2**k)
        assert ceiling / 2 <= delay <= ceiling
    again = TlsTransport(
        identity("a"),
        dict,
        config=TlsConfig(backoff_base_s=0.1, backoff_max_s=1.0),
        rng=random.Random(7),
    )
    assert [again.backoff(k) for k in range(8)] == delays


@pytest.mark.parametrize(
    "kwargs",
    [
        {"max_message_bytes": 0},
        {"chunk_size": 0},
        {"connect_retries": -1},
        {"backoff_base_s": 2.0, "backoff_max_s": 1.0},
        {"max_connections_per_peer": 0},
    ],
)
def test_invalid_tls_config_is_rejected(kwargs: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        TlsConfig(**kwargs)


@pytest.mark.parametrize(
    ("url", "fingerprint"),
    [
        ("http://127.0.0.1:1", "0" * 64),
        ("https://", "0" * 64),
        ("https://h:1", "0" * 63),
        ("https://h:1", "A" * 64),
    ],
)
def test_invalid_peer_address_is_rejected(url: str, fingerprint: str) -> None:
    with pytest.raises(ValueError):
        PeerAddress(url, fingerprint)


def test_server_ssl_context_requires_client_certificates() -> None:
    a = identity("a")
    context = server_ssl_context(a, [a.certificate_pem])
    assert context.verify_mode is ssl.CERT_REQUIRED
    assert context.cert_store_stats()["x509"] == 1
    with pytest.raises(ValueError):
        server_ssl_context(a, [])
    with pytest.raises(ValueError):
        write_trust_bundle(Path("unused.pem"), [])


# --- the peer port's ASGI application, driven with ASGI messages -------------------------


def _asgi(
    transport: TlsTransport, method: str, path: str, pieces: list[bytes], disconnect: bool = False
) -> tuple[int, dict[str, str], list[dict[str, Any]]]:
    """One request through ``transport.asgi_app()``: status, headers, body messages."""
    incoming: list[dict[str, Any]] = [
        {"type": "http.request", "body": p, "more_body": i + 1 < len(pieces) or disconnect}
        for i, p in enumerate(pieces)
    ]
    if disconnect:
        incoming.append({"type": "http.disconnect"})
    out: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return incoming.pop(0)

    async def send(message: Any) -> None:
        out.append(dict(message))

    scope = {"type": "http", "method": method, "path": path}
    asyncio.run(transport.asgi_app()(scope, receive, send))
    start, bodies = out[0], out[1:]
    headers = {k.decode(): v.decode() for k, v in start["headers"]}
    return start["status"], headers, bodies


def _echo_transport(chunk_size: int = 1024) -> tuple[TlsTransport, list[bytes]]:
    seen: list[bytes] = []

    async def handler(data: bytes) -> bytes:
        if data == b"refuse":
            raise Refused(RefusalReason.REPLAY, "seen before")
        seen.append(data)
        return data * 3

    transport = TlsTransport(identity("b"), dict, config=TlsConfig(chunk_size=chunk_size))
    asyncio.run(transport.start(handler))
    return transport, seen


def test_peer_app_answers_the_peer_route_only() -> None:
    transport, seen = _echo_transport()
    status, _, _ = _asgi(transport, "POST", "/elsewhere", [b"x"])
    assert status == 404
    status, headers, _ = _asgi(transport, "GET", "/fedweave/peer/v1/message", [b""])
    assert status == 405 and headers["allow"] == "POST"
    assert seen == []


def test_peer_app_reads_a_body_in_pieces_and_streams_a_long_reply() -> None:
    transport, seen = _echo_transport(chunk_size=1024)
    status, headers, bodies = _asgi(
        transport, "POST", "/fedweave/peer/v1/message", [b"a" * 700, b"b" * 700]
    )
    assert seen == [b"a" * 700 + b"b" * 700]
    assert status == 200 and headers["content-length"] == str(3 * 1400)
    assert headers["content-type"] == "application/octet-stream"
    assert len(bodies) == 5 and all(len(b["body"]) <= 1024 for b in bodies)
    assert [b["more_body"] for b in bodies] == [True, True, True, True, False]
    assert b"".join(b["body"] for b in bodies) == (b"a" * 700 + b"b" * 700) * 3


def test_peer_app_refusals_and_a_sender_that_hangs_up() -> None:
    transport, seen = _echo_transport()
    status, headers, bodies = _asgi(transport, "POST", "/fedweave/peer/v1/message", [b"refuse"])
    assert status == 403 and headers["x-fedweave-refusal"] == RefusalReason.REPLAY.value
    assert b"".join(b["body"] for b in bodies) == b""
    status, _, _ = _asgi(transport, "POST", "/fedweave/peer/v1/message", [b"half"], True)
    assert status == 400 and seen == []
    idle = TlsTransport(identity("c"), dict)  # not started: no handler yet
    assert _asgi(idle, "POST", "/fedweave/peer/v1/message", [b"x"])[0] == 503
