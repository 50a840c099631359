"""bench.overlay's rows over mutual TLS: ``n`` org processes on 127.0.0.1.

:func:`tls_figures` starts one process per org (``python -m bench.overlay_tls ...``),
each a real TLS transport, endpoint and round engine; each process runs plain ring
all-reduces and secure rounds, interleaved after a warm-up of each, then a secure star
round, and writes its figures; the parent takes the median of the timed runs.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import hashlib
import itertools
import json
import logging
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from coordinator_free.endpoint import Endpoint
from coordinator_free.files import atomic_write
from coordinator_free.identity import OrgIdentity
from coordinator_free.ring import ring_order
from coordinator_free.rounds import RoundEngine, endpoint_signer, secagg_sessions
from coordinator_free.transport import RawHandler, Transport

from bench.common import can_measure_memory, peak_rss_since_reset
from bench.overlay_sim import MILLION, round_config

__all__ = ["CountingTransport", "node_main", "tls_figures"]

FEDERATION = "bench-overlay"


class CountingTransport:
    """A transport wrapper counting what its org sends: requests and replies.

    The same accounting as :class:`~coordinator_free.memory.InMemoryNetwork`'s
    ``bytes_sent`` (a reply is counted for the org that answers).
    """

    def __init__(self, inner: Transport) -> None:
        self.inner = inner
        self.org_id = inner.org_id
        self.bytes_sent = 0
        self.messages_sent = 0

    async def start(self, handler: RawHandler) -> None:
        async def counted(data: bytes) -> bytes:
            reply = await handler(data)
            self.bytes_sent += len(reply)
            self.messages_sent += 1
            return reply

        await self.inner.start(counted)

    async def request(self, peer: str, data: bytes, *, timeout: float) -> bytes:
        self.bytes_sent += len(data)
        self.messages_sent += 1
        return await self.inner.request(peer, data, timeout=timeout)

    async def close(self) -> None:
        await self.inner.close()


# -- processes over mutual TLS --------------------------------------------------------


def _node_input(org: str, params: int) -> np.ndarray:
    seed = int.from_bytes(hashlib.sha256(org.encode()).digest()[:4], "big")
    return np.random.default_rng(seed).integers(0, 2**32, params, dtype=np.uint32)


def _open_plain_rounds(engine: RoundEngine, params: int, repeats: int) -> None:
    """Open the rounds of the reductions a bench node runs outside its engine (warm-up,
    plain rings, barriers), before any peer can learn its port: no chunk arrives for a
    round not open."""
    opened = [("warmup", 0), ("warmup", 1)]
    opened += [("plain", r) for r in range(repeats + 1)]
    opened += [("sync", r) for r in range(3 * repeats + 4)]  # three per pair, the star
    for run, rnd in opened:
        engine.ring.open(run, rnd)
        engine.ring.expect(run, rnd, 4 * params, 1)


async def _find_peers(workdir: Path, members: dict[str, Any], addresses: dict[str, Any]) -> None:
    """Wait until every member's process wrote its port; fill ``addresses``."""
    from coordinator_free.tls import PeerAddress

    while len(addresses) < len(members):
        for org in members:
            path = workdir / f"{org}.port"
            if org not in addresses and path.exists():
                addresses[org] = PeerAddress(
                    f"https://127.0.0.1:{int(path.read_text())}", members[org]["fingerprint"]
                )
        await asyncio.sleep(0.05)


async def _warm_connections(engine: RoundEngine, order: list[str], timeout: float) -> None:
    """One plain ring and one star reduction of a small vector, so that every TLS
    connection either uses is open before anything is timed."""
    warm = np.zeros(4096 * len(order), dtype=np.uint32)
    await engine.ring.allreduce(order, warm, run="warmup", round=0, timeout=timeout)
    engine.ring.close("warmup", 0)
    await engine.ring.star_allreduce(order, warm, run="warmup", round=1, timeout=timeout)
    engine.ring.close("warmup", 1)


class _Rounds:
    """What one org process times: plain rings and secure rounds of its engine, each
    started together with the other processes, and the figures they leave."""

    def __init__(
        self, engine: RoundEngine, transport: CountingTransport, me: str, orgs: list[str]
    ) -> None:
        self.engine, self.transport, self.me, self.orgs = engine, transport, me, orgs
        self.order = ring_order(orgs, 0)
        self.figures: dict[str, float] = {}
        self.stage_times: list[Any] = []
        self.prepared: list[bool] = []  # whether each secure round took prepared masks
        self.prepare_s: list[float] = []  # seconds waited for each next round's masks
        self.memory = can_measure_memory()
        self._syncs = itertools.count()

    async def barrier(self) -> float:
        """Every process's clock time on arrival, summed along the ring; all start
        together a little after the last arrival (the processes share one clock)."""
        arrivals = np.zeros(len(self.orgs), dtype=np.uint64)
        arrivals[self.orgs.index(self.me)] = time.time_ns() // 1000
        rnd = next(self._syncs)
        total = await self.engine.ring.allreduce(self.order, arrivals, run="sync", round=rnd)
        self.engine.ring.close("sync", rnd)
        start = float(total.max()) / 1e6 + 0.05
        await asyncio.sleep(max(0.0, start - time.time()))
        return start

    async def measure(self, name: str, work: Callable[[], Awaitable[object]]) -> None:
        """Time ``work`` from the common start: its seconds' ends, bytes and memory."""
        b0 = self.transport.bytes_sent
        t0 = await self.barrier()
        peak = peak_rss_since_reset() if self.memory else None
        await work()
        self.figures[f"{name}_start"] = t0
        self.figures[f"{name}_end"] = time.time()
        self.figures[f"{name}_bytes"] = self.transport.bytes_sent - b0
        if peak is not None:
            # how far this process's resident set rose during the work: the round's
            # vectors, buffers and copies (the input was made before)
            self.figures[f"{name}_rss"] = peak()

    async def secure_round(self, x: np.ndarray, round_: int) -> None:
        result = await self.engine.run_round("bench", round_, x)
        # what a caller keeps of a round: its times (its sum goes before the next)
        self.stage_times.append(result.stage_times)
        self.prepared.append(result.masks_prepared)

    async def prepare_next(self) -> None:
        """Wait while the engine expands the next round's masks, as an org node's next
        update trains meanwhile: untimed, and not on the CPU of the next timing."""
        await self.barrier()  # every node's round is done (the nodes share the cores)
        t0 = time.perf_counter()
        self.engine.prepare_masks("bench")
        await self.engine.masks_prepared("bench")
        self.prepare_s.append(time.perf_counter() - t0)

    async def plain(self, x: np.ndarray, round_: int, timeout: float) -> None:
        await self.engine.ring.allreduce(self.order, x, run="plain", round=round_, timeout=timeout)
        self.engine.ring.close("plain", round_)

    async def run(self, x: np.ndarray, params: int, repeats: int) -> dict[str, float]:
        """The warm-up, ``repeats`` interleaved pairs, the star round; the figures."""
        # warm up: every TLS connection either reduction uses is opened before anything is
        # timed (a deployment's connections outlive its rounds), the plain ring's and the
        # star's by one reduction each, the secure round's by one round
        timeout = 120.0 + params / MILLION
        await _warm_connections(self.engine, self.order, timeout)
        # the baseline and the secure round alternate, so that a load that comes and goes
        # on the machine weighs on both alike; the reports take the median of each
        for r in range(repeats + 1):
            await self.measure(f"plain{r}", functools.partial(self.plain, x, r, timeout))
            await self.measure(f"ring{r}", functools.partial(self.secure_round, x, r + 1))
            await self.prepare_next()
        # the star round: the same engine's messages, star topology for the masked vectors
        self.engine.config = round_config(len(self.orgs), "star", params)
        await self.measure("star", functools.partial(self.secure_round, x, repeats + 2))
        # the timed secure rounds (not the warm-up) that took masks prepared before them
        self.figures["ring_prepared"] = sum(self.prepared[1 : repeats + 1]) / repeats
        self.figures["ring_prepare_s"] = statistics.median(self.prepare_s[1 : repeats + 1])
        for name, times in (("ring", self.stage_times[-2]), ("star", self.stage_times[-1])):
            for stage, seconds in times.items():
                self.figures[f"{name}_stage_{stage}"] = seconds
        return self.figures


async def _node(workdir: Path, me: str, orgs: list[str], params: int, repeats: int) -> None:
    """One org process: plain rings and secure ring rounds, interleaved ``repeats``
    times after a warm-up of each, then a secure star round; write the figures."""
    from coordinator_free.tls import PeerAddress, TlsTransport, serve_peer_app

    identity = OrgIdentity.load(workdir / me)
    members = json.loads((workdir / "members.json").read_text())
    keys = {o: bytes.fromhex(m["public_key"]) for o, m in members.items()}
    addresses: dict[str, PeerAddress] = {}
    transport = CountingTransport(TlsTransport(identity, lambda: addresses))
    endpoint = Endpoint(identity, FEDERATION, transport, lambda: keys)
    sessions = secagg_sessions(*endpoint_signer(endpoint))
    engine = RoundEngine(endpoint, lambda: orgs, sessions, round_config(len(orgs), params=params))
    engine.prepare_on_done = False  # started once every node's round is done
    _open_plain_rounds(engine, params, repeats)
    await endpoint.start()
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    tls_app = transport.inner.asgi_app()  # type: ignore[attr-defined]
    async with serve_peer_app(
        tls_app, sock, workdir / me, workdir / "trust.pem", graceful_shutdown_s=1
    ):
        atomic_write(workdir / f"{me}.port", str(sock.getsockname()[1]).encode())
        await _find_peers(workdir, members, addresses)
        rounds = _Rounds(engine, transport, me, orgs)
        figures = await rounds.run(_node_input(me, params), params, repeats)
        atomic_write(workdir / f"{me}.json", json.dumps(figures).encode())
        until = time.monotonic() + 120
        while not (workdir / "done").exists() and time.monotonic() < until:
            await asyncio.sleep(0.05)
        await endpoint.close()


def _prepare(workdir: Path, orgs: list[str]) -> None:
    """Each org's identity, the trust bundle and the member list, in ``workdir``."""
    from coordinator_free.tls import write_trust_bundle

    identities = {
        o: OrgIdentity.generate(o, hashlib.sha256(f"bench/{o}".encode()).digest()) for o in orgs
    }
    for org, ident in identities.items():
        ident.save(workdir / org)
    write_trust_bundle(workdir / "trust.pem", [i.certificate_pem for i in identities.values()])
    members = {
        o: {"public_key": i.public_key.hex(), "fingerprint": i.fingerprint}
        for o, i in identities.items()
    }
    (workdir / "members.json").write_text(json.dumps(members))


def _run_nodes(workdir: Path, orgs: list[str], params: int, repeats: int) -> dict[str, Any]:
    """One process per org until each wrote its figures; each one's figures."""
    root = Path(__file__).resolve().parent.parent
    logs = {o: (workdir / f"{o}.log").open("wb") for o in orgs}
    args = ["--dir", str(workdir), "--orgs", ",".join(orgs), "--params", str(params)]
    args += ["--repeats", str(repeats)]
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "bench.overlay_tls", "--org", o, *args],
            cwd=root,
            stdout=logs[o],
            stderr=subprocess.STDOUT,
        )
        for o in orgs
    ]
    try:
        deadline = time.monotonic() + 600 + 10 * repeats * params / MILLION
        while not all((workdir / f"{o}.json").exists() for o in orgs):
            failed = [p for p in procs if p.poll() not in (None, 0)]
            if failed or time.monotonic() > deadline:
                text = "\n".join(
                    (workdir / f"{o}.log").read_text(errors="replace")[-2000:] for o in orgs
                )
                raise RuntimeError(f"TLS nodes failed or timed out:\n{text}")
            time.sleep(0.2)
        (workdir / "done").touch()
        for p in procs:
            p.wait(timeout=60)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=30)
        for f in logs.values():
            f.close()
    return {o: json.loads((workdir / f"{o}.json").read_text()) for o in orgs}


def _summary(per: dict[str, Any], repeats: int) -> dict[str, float]:
    """The figures of every process together: medians of the timed runs, the busiest
    node's bytes, the most any node's resident set rose, the slowest node's stages."""
    out: dict[str, float] = {}

    def span(name: str) -> float:
        """Seconds from the common start until the last process finished ``name``."""
        return float(
            max(f[f"{name}_end"] for f in per.values())
            - min(f[f"{name}_start"] for f in per.values())
        )

    for name in ("plain", "ring"):
        # run 0 of each is the warm-up (the secure round's first connections)
        runs = [span(f"{name}{r}") for r in range(1, repeats + 1)]
        out[f"{name}_s"] = statistics.median(runs)
        out[f"{name}_min_s"] = min(runs)
        out[f"{name}_max_s"] = max(runs)
        out[f"{name}_busiest"] = max(f[f"{name}{repeats}_bytes"] for f in per.values())
        peaks = [f.get(f"{name}{r}_rss") for f in per.values() for r in range(1, repeats + 1)]
        if peaks and all(p is not None for p in peaks):
            # the node whose resident set rose the most, in its worst timed run
            out[f"{name}_rss"] = float(max(peaks))
    if all("ring_prepared" in f for f in per.values()):
        # the least share of timed rounds a node took prepared masks in; the longest wait
        out["ring_prepared"] = min(f["ring_prepared"] for f in per.values())
        out["ring_prepare_s"] = max(f["ring_prepare_s"] for f in per.values())
    out["star_s"] = span("star")
    out["star_busiest"] = max(f["star_bytes"] for f in per.values())
    for key in next(iter(per.values())):
        if "_stage_" in key:
            out[key] = max(f.get(key, 0.0) for f in per.values())
    return out


def tls_figures(params: int, n: int = 4, repeats: int = 5) -> dict[str, float]:
    """Run ``n`` org processes over mutual TLS; the figures of the three reductions
    (the plain and the secure ring: the median of ``repeats`` warm runs of each)."""
    orgs = [f"org-{i}" for i in range(n)]
    with tempfile.TemporaryDirectory(prefix="fedweave-bench-") as tmp:
        workdir = Path(tmp)
        _prepare(workdir, orgs)
        per = _run_nodes(workdir, orgs, params, repeats)
    return _summary(per, repeats)


def node_main(argv: Sequence[str] | None = None) -> None:
    """``python -m bench.overlay_tls --dir D --org O --orgs A,B,... --params P``: one org."""
    parser = argparse.ArgumentParser(prog="python -m bench.overlay_tls")
    parser.add_argument("--dir", type=Path, required=True)
    parser.add_argument("--org", required=True)
    parser.add_argument("--orgs", required=True)
    parser.add_argument("--params", type=int, required=True)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    logging.getLogger("coordinator_free").setLevel(logging.ERROR)
    asyncio.run(_node(args.dir, args.org, args.orgs.split(","), args.params, args.repeats))


if __name__ == "__main__":
    node_main()
