"""One org process for the multi-process recovery test (mutual TLS on 127.0.0.1).

Usage::

    python -m tests.coordinator_free._shard_node --config C.json --org ORG --data DIR
    python -m tests.coordinator_free._shard_node --config C.json --org ORG --data DIR \\
        --recover BACKUP.json --out STATE.bin

``C.json`` holds the federation id, the code parameters, every member's certificate
(the federation manifest's part this test needs) and the folder where each process
publishes its port. Normal mode: load the identity and recovery secret from ``DIR``,
serve shards, checkpoint ``DIR/state.bin`` across the others, then write
``ORG.ready``. Recover mode: ``DIR`` is empty; the identity and secret come from the
backup file; rebuild the state from the peers, write it to ``--out``, checkpoint it
again as the next version (rejoin), then write ``ORG.recovered``. Either way the process
serves until SIGTERM.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from coordinator_free.checkpoints import (
    CheckpointReplicator,
    ShardRequestError,
    ShardService,
    ShardStore,
    list_shards,
    recover,
)
from coordinator_free.endpoint import Endpoint
from coordinator_free.erasure import CodeParams
from coordinator_free.errors import TransportError
from coordinator_free.identity import OrgIdentity, certificate_fingerprint
from coordinator_free.sealed import RecoveryBackup, RecoverySecret, atomic_write
from coordinator_free.tls import PeerAddress, TlsTransport, serve_peer_app, write_trust_bundle

from tests.coordinator_free.transport_support import bound_socket

STATE_VERSION = 7


def _keys(config: Mapping[str, Any]) -> dict[str, bytes]:
    return {org: bytes.fromhex(m["public_key"]) for org, m in config["members"].items()}


def _peers(config: Mapping[str, Any], me: str) -> Mapping[str, PeerAddress]:
    ports = Path(config["ports_dir"])
    out: dict[str, PeerAddress] = {}
    for org, member in config["members"].items():
        port_file = ports / f"{org}.port"
        if org != me and port_file.exists():
            fingerprint = certificate_fingerprint(member["certificate_pem"].encode())
            out[org] = PeerAddress(f"https://127.0.0.1:{port_file.read_text()}", fingerprint)
    return out


async def _wait_for_peers(endpoint: Endpoint, peers: list[str], timeout: float = 60.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    pending = set(peers)
    while pending:
        for peer in sorted(pending):
            try:
                await list_shards(endpoint, peer, endpoint.org_id, timeout=5.0)
                pending.discard(peer)
            except (TransportError, ShardRequestError):
                pass
        if pending:
            if loop.time() > deadline:
                raise TimeoutError(f"peers {sorted(pending)} never came up")
            await asyncio.sleep(0.2)


async def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", type=Path, required=True)
    parser.add_argument("--org", required=True)
    parser.add_argument("--data", type=Path, required=True)
    parser.add_argument("--recover", type=Path, default=None)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format=f"{args.org} %(levelname)s %(message)s")
    config = json.loads(args.config.read_text())
    me: str = args.org
    data: Path = args.data
    data.mkdir(mode=0o700, parents=True, exist_ok=True)
    if args.recover is not None:
        backup = RecoveryBackup.load(args.recover)
        identity = backup.identity()
        secret = backup.secret
        identity.save(data / "identity")  # the rebuilt data dir
    else:
        identity = OrgIdentity.load(data / "identity")
        secret = RecoverySecret.from_hex((data / "recovery.secret").read_text().strip())
    keys = _keys(config)
    certificates = [m["certificate_pem"].encode() for m in config["members"].values()]
    write_trust_bundle(data / "trust.pem", certificates)

    transport = TlsTransport(identity, lambda: _peers(config, me))
    endpoint = Endpoint(identity, config["federation"], transport, lambda: keys)
    ShardService(endpoint, ShardStore(data / "shards"), lambda: keys)
    await endpoint.start()

    sock = bound_socket()
    peer_app = transport.asgi_app()
    # a graceful shutdown bounded: idle keep-alive TLS connections from peers would
    # hold it for asyncio's 30 s SSL shutdown timeout
    async with serve_peer_app(
        peer_app, sock, data / "identity", data / "trust.pem", graceful_shutdown_s=2
    ) as server:
        await _take_part(args, config, endpoint, secret, sock.getsockname()[1])
        await server.task  # uvicorn stops it on SIGTERM
    await endpoint.close()
    return 0


async def _take_part(
    args: argparse.Namespace,
    config: Mapping[str, Any],
    endpoint: Endpoint,
    secret: RecoverySecret,
    port: int,
) -> None:
    """Publish the port, then checkpoint the state (normal mode) or recover it and
    rejoin (recover mode), and write the marker the test waits for."""
    me: str = args.org
    data: Path = args.data
    members = sorted(config["members"])
    others = [o for o in members if o != me]
    ports = Path(config["ports_dir"])
    atomic_write(ports / f"{me}.port", str(port).encode(), mode=0o644)

    params = CodeParams(config["k"], config["m"])
    replicator = CheckpointReplicator(endpoint, secret, lambda: members, params=params)
    if args.recover is None:
        await _wait_for_peers(endpoint, others)
        manifest = await replicator.checkpoint((data / "state.bin").read_bytes(), STATE_VERSION)
        marker = {"holders": list(manifest.holders), "version": manifest.version}
        atomic_write(ports / f"{me}.ready", json.dumps(marker).encode(), mode=0o644)
    else:
        recovered = await recover(endpoint, secret, others, timeout=30.0)
        recovered.write(args.out)
        # Rejoin: take the set over and checkpoint the state again as the next version.
        replicator.adopt(recovered.manifest)
        again = await replicator.checkpoint(recovered.state, recovered.version + 1)
        marker = {"version": recovered.version, "rejoined_version": again.version}
        atomic_write(ports / f"{me}.recovered", json.dumps(marker).encode(), mode=0o644)


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
