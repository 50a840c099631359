"""One org node of the multi-process round test over mutual TLS on 127.0.0.1.

Run by ``test_rounds_tls_multiprocess.py`` as
``python -m tests.coordinator_free._tls_node --dir D --org O --orgs A,B,C,D [--die-at STAGE]``.
The directory holds every org's identity (``D/ORG/``), the trust bundle
(``D/trust.pem``) and the members' public keys and certificate fingerprints
(``D/members.json``). The node serves its peer port with uvicorn, writes ``D/ORG.port``,
waits for every other port, runs round 1 with its input and writes ``D/ORG.json`` and
``D/ORG.sum.npy``; it then keeps serving until ``D/done`` appears. With ``--die-at``
it exits with status 17 (``os._exit``: no clean-up, like a crash) when its round engine
enters that stage. With ``--relayed R`` it first runs rounds 1 to ``R`` with the readies
relayed and the shares sealed ahead (the defaults from 32 and 33 members on), each
round's sum written to ``D/ORG.sum.R.npy``, and the summary counts the kinds of the
messages it sent in each round.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
from coordinator_free.endpoint import Endpoint
from coordinator_free.identity import OrgIdentity
from coordinator_free.rounds import (
    RoundConfig,
    RoundEngine,
    RoundObservation,
    endpoint_signer,
    mask_stream,
    secagg_sessions,
)
from coordinator_free.tls import PeerAddress, TlsTransport, serve_peer_app

from tests.coordinator_free.transport_support import bound_socket

FEDERATION = "fed-tls-rounds"
RUN = "tls-run"
LENGTH = 20_000
DIE_STATUS = 17
CONFIG = RoundConfig(ready_timeout=30.0, stage_timeout=30.0, step_timeout=15.0, send_timeout=15.0)


def node_input(org: str) -> np.ndarray:
    """The org's input vector: uniform uint32 ring elements seeded by its name."""
    seed = int.from_bytes(org.encode("utf-8"), "big") % (2**32)
    return np.random.default_rng(seed).integers(0, 2**32, LENGTH, dtype=np.uint32)


async def run_node(
    workdir: Path,
    me: str,
    orgs: list[str],
    die_at: str | None,
    owners: bool = False,
    relayed: int = 0,
    mask_helper: str = "thread",
    ring_waits: bool = False,
) -> None:
    identity = OrgIdentity.load(workdir / me)
    members = json.loads((workdir / "members.json").read_text())
    keys = {o: bytes.fromhex(m["public_key"]) for o, m in members.items()}
    addresses: dict[str, PeerAddress] = {}

    transport = TlsTransport(identity, lambda: addresses)
    endpoint = Endpoint(identity, FEDERATION, transport, lambda: keys)

    async def hook(org: str, run: str, round: int, stage: str) -> None:
        if stage == die_at:
            os._exit(DIE_STATUS)

    # owners: every member unmasks only the chunks it holds (the owner path, which
    # the engine takes from 8 members on by default)
    config = dataclasses.replace(CONFIG, owner_unmask_from=3) if owners else CONFIG
    if relayed:
        config = dataclasses.replace(config, ready_relay_from=3, shares_ahead_from=3)
    config = dataclasses.replace(config, mask_helper=mask_helper, ring_first=not ring_waits)
    sent: dict[int, Counter[str]] = {}

    lock = threading.Lock()

    def egress(env: Any, wire: bytes) -> None:
        # called from a worker thread for a large message
        with lock:
            sent.setdefault(env.round, Counter())[env.kind] += 1

    endpoint.on_egress = egress
    engine = RoundEngine(
        endpoint, lambda: orgs, secagg_sessions(*endpoint_signer(endpoint)), config, hook=hook
    )
    took_sum: list[str] = []
    took_chunks: list[str] = []

    def watch(obs: RoundObservation) -> None:
        if "took the masked sum" in obs.detail:
            took_sum.append(obs.peer)
        if "of the sum from a member that holds it" in obs.detail:
            took_chunks.append(obs.peer)

    engine.add_observer(watch)
    await endpoint.start()

    sock = bound_socket()
    peer_app = transport.asgi_app()
    async with serve_peer_app(
        peer_app, sock, workdir / me, workdir / "trust.pem", graceful_shutdown_s=1
    ):
        port_file = workdir / f"{me}.port"
        port_file.with_suffix(".tmp").write_text(str(sock.getsockname()[1]))
        port_file.with_suffix(".tmp").replace(port_file)

        deadline = time.monotonic() + 60
        while len(addresses) < len(orgs):
            for org in orgs:
                path = workdir / f"{org}.port"
                if org not in addresses and path.exists():
                    addresses[org] = PeerAddress(
                        f"https://127.0.0.1:{int(path.read_text())}", members[org]["fingerprint"]
                    )
            if time.monotonic() > deadline:
                raise SystemExit(f"{me}: peers did not come up")
            await asyncio.sleep(0.05)

        for round_ in range(1, relayed + 1):
            result = await engine.run_round(RUN, round_, node_input(me))
            np.save(workdir / f"{me}.sum.{round_}.npy", result.sum)
        started = time.monotonic()
        result = await engine.run_round(RUN, relayed + 1, node_input(me))
        print(f"{me}: round took {time.monotonic() - started:.2f}s", flush=True)
        np.save(workdir / f"{me}.sum.npy", result.sum)
        summary = {
            "org": me,
            "participants": list(result.participants),
            "survivors": list(result.survivors),
            "dropped": list(result.dropped),
            "ring_attempts": result.ring_attempts,
            "took_sum_from": took_sum,
            "took_chunks_from": took_chunks,
            "bytes_sent": result.bytes_sent,
            "stage_times": result.stage_times,
            "sent": {str(r): dict(c) for r, c in sent.items()},
            "mask_helper_starts": mask_stream.helper().starts,
        }
        out = workdir / f"{me}.json"
        out.with_suffix(".tmp").write_text(json.dumps(summary))
        out.with_suffix(".tmp").replace(out)

        # keep answering the others (a late view, a release) until the test is done
        until = time.monotonic() + 60
        while not (workdir / "done").exists() and time.monotonic() < until:
            await asyncio.sleep(0.05)
        await endpoint.close()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dir", type=Path, required=True)
    parser.add_argument("--org", required=True)
    parser.add_argument("--orgs", required=True)
    parser.add_argument("--die-at", default=None)
    parser.add_argument("--owners", action="store_true")
    parser.add_argument("--relayed", type=int, default=0)
    parser.add_argument("--mask-helper", default="thread")
    parser.add_argument("--ring-waits", action="store_true")
    args = parser.parse_args()
    asyncio.run(
        run_node(
            args.dir,
            args.org,
            args.orgs.split(","),
            args.die_at,
            args.owners,
            args.relayed,
            args.mask_helper,
            args.ring_waits,
        )
    )


if __name__ == "__main__":
    main()
