"""The node's listening sockets: connections accepted on them have Nagle's algorithm off.

asyncio sets ``TCP_NODELAY`` on an accepted connection only when the listening socket's
``proto`` is ``IPPROTO_TCP``; a socket made as ``socket(AF_INET, SOCK_STREAM)`` has
proto 0, and every response written as headers then body then waits for the client's
delayed ACK (40 ms on Linux) — a hidden floor under every request's latency.
"""

from __future__ import annotations

import asyncio
import socket

import pytest

from api.serve import bind
from org_node.node import NodeError


def test_connections_accepted_on_a_bound_socket_have_nodelay() -> None:
    async def main() -> int:
        seen: asyncio.Future[int] = asyncio.get_running_loop().create_future()

        class Probe(asyncio.Protocol):
            def connection_made(self, transport: asyncio.BaseTransport) -> None:
                conn = transport.get_extra_info("socket")
                seen.set_result(conn.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
                transport.close()

        sock = bind("127.0.0.1", 0)
        port = sock.getsockname()[1]
        server = await asyncio.get_running_loop().create_server(Probe, sock=sock)
        try:
            _, writer = await asyncio.open_connection("127.0.0.1", port)
            value = await asyncio.wait_for(seen, 10)
            writer.close()
            return value
        finally:
            server.close()
            await server.wait_closed()

    assert asyncio.run(main()) != 0


def test_bind_reports_a_port_in_use() -> None:
    first = bind("127.0.0.1", 0)
    try:
        with pytest.raises(NodeError, match=r"cannot listen on 127\.0\.0\.1"):
            bind("127.0.0.1", first.getsockname()[1])
    finally:
        first.close()
