"""A running TLS server's trusted client certificates follow the federation: a member
removed from the trusted set fails the next handshake, one added passes it, without a
new server, over real TLS sockets on 127.0.0.1."""

from __future__ import annotations

import asyncio
import contextlib
import ssl

from coordinator_free.identity import OrgIdentity
from coordinator_free.tls import client_ssl_context, server_ssl_context
from coordinator_free.trust import TrustFollower

from tests.coordinator_free.transport_support import identity


async def _admitted(port: int, who: OrgIdentity) -> bool:
    """Whether ``who`` completes the handshake and gets the server's one-byte answer."""
    try:
        reader, writer = await asyncio.open_connection(
            "127.0.0.1", port, ssl=client_ssl_context(who)
        )
    except (ssl.SSLError, ConnectionError):
        return False
    try:
        writer.write(b"?")
        await writer.drain()
        return await reader.read(1) == b"!"
    except (ssl.SSLError, ConnectionError):
        return False
    finally:
        writer.close()
        with contextlib.suppress(ssl.SSLError, ConnectionError):
            await writer.wait_closed()


def test_a_removed_member_is_refused_at_the_next_handshake_and_an_added_one_admitted() -> None:
    server, a, b, c = identity("b"), identity("a"), identity("x"), identity("c")
    members = [server.certificate_pem, a.certificate_pem, b.certificate_pem]
    follower = TrustFollower(server, lambda: members)

    async def scenario() -> list[tuple[bool, bool, bool]]:
        async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            if await reader.read(1):
                writer.write(b"!")
                await writer.drain()
            writer.close()

        context = server_ssl_context(server, list(members))  # built once, as uvicorn does
        follower.follow(context)
        listening = await asyncio.start_server(answer, "127.0.0.1", 0, ssl=context)
        port = listening.sockets[0].getsockname()[1]
        seen = []
        try:
            seen.append((await _admitted(port, a), await _admitted(port, b), False))
            members.remove(b.certificate_pem)  # the manifest drops "x"
            seen.append((await _admitted(port, a), await _admitted(port, b), False))
            members.append(c.certificate_pem)  # and takes "c" in
            seen.append((await _admitted(port, a), False, await _admitted(port, c)))
        finally:
            listening.close()
            await listening.wait_closed()
        return seen

    assert asyncio.run(scenario()) == [
        (True, True, False),
        (True, False, False),
        (True, False, True),
    ]


def test_contexts_are_built_once_per_set_of_members() -> None:
    server, a = identity("b"), identity("a")
    members = [server.certificate_pem, a.certificate_pem]
    follower = TrustFollower(server, lambda: members)
    first = follower.context()
    assert follower.context() is first
    assert first.cert_store_stats()["x509"] == 2
    members.reverse()  # the same set in another order
    assert follower.context() is first
    members.pop()
    assert follower.context() is not first
    assert follower.context().cert_store_stats()["x509"] == 1
