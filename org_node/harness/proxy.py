"""A loopback TCP relay that holds every byte ``delay_ms`` before passing it on.

``fedweave harness --delay-ms D`` puts one relay in front of each node's peer port and
publishes the relay's port as the org's peer endpoint in the federation manifest, so
every connection between two nodes crosses a relay: the TLS session runs end to end
through it (the relay sees ciphertext only) and each chunk arrives ``D`` ms late, in
order. The relays run on one asyncio loop in a daemon thread of the harness process.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Mapping

__all__ = ["DelayRelays"]

_CHUNK = 65536


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, delay: float) -> None:
    """Copy ``reader`` to ``writer``, each chunk released ``delay`` s after it arrived."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()

    async def release() -> None:
        while True:
            due, data = await queue.get()
            if not data:
                break
            wait = due - loop.time()
            if wait > 0:
                await asyncio.sleep(wait)
            writer.write(data)
            await writer.drain()
        with contextlib.suppress(OSError):
            writer.write_eof()

    sender = asyncio.create_task(release())
    try:
        while True:
            data = await reader.read(_CHUNK)
            queue.put_nowait((loop.time() + delay, data))
            if not data:
                break
        await sender  # the end of this direction is passed on as a half-close
    except (OSError, asyncio.IncompleteReadError):
        sender.cancel()


class DelayRelays:
    """Relays ``127.0.0.1:listen -> 127.0.0.1:target`` for each pair of ``routes``."""

    def __init__(self, routes: Mapping[int, int], delay_ms: int) -> None:
        self.routes = dict(routes)
        self.delay = delay_ms / 1000.0
        self._loop = asyncio.new_event_loop()
        self._servers: list[asyncio.Server] = []
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._started = False

    def start(self) -> None:
        """Bind every listening port (``OSError`` if one is taken) and start relaying."""
        self._thread.start()
        self._started = True
        future = asyncio.run_coroutine_threadsafe(self._bind(), self._loop)
        future.result(10)

    async def _bind(self) -> None:
        for listen, target in self.routes.items():

            async def handle(
                reader: asyncio.StreamReader, writer: asyncio.StreamWriter, target: int = target
            ) -> None:
                try:
                    up_reader, up_writer = await asyncio.open_connection("127.0.0.1", target)
                except OSError:
                    writer.close()
                    return
                try:
                    await asyncio.gather(
                        _pipe(reader, up_writer, self.delay),
                        _pipe(up_reader, writer, self.delay),
                        return_exceptions=True,
                    )
                finally:
                    for w in (writer, up_writer):
                        with contextlib.suppress(OSError, RuntimeError):
                            w.close()

            self._servers.append(await asyncio.start_server(handle, "127.0.0.1", listen))

    def stop(self) -> None:
        """Close every listening socket and stop the loop's thread."""
        if not self._started:
            return

        async def close() -> None:
            for server in self._servers:
                server.close()
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(server.wait_closed(), 2)
            for task in asyncio.all_tasks():
                if task is not asyncio.current_task():
                    task.cancel()

        with contextlib.suppress(Exception):
            asyncio.run_coroutine_threadsafe(close(), self._loop).result(5)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)
        self._started = False
