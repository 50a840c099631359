"""Erasure-coded checkpoints: codec overhead, storage, and parallel recovery.

Run::

    python -m bench.checkpoints [--quick] [--json PATH]

Rows:

``encode_vs_zfec_raw`` / ``decode_vs_zfec_raw``
    our full path ÷ raw zfec on the same bytes, same ``k``/``m``. Ours, encoding: split
    (views, no copies), zfec parity (one call per parity shard), SHA-256 of every shard,
    Merkle root, manifest, Ed25519 signature of the manifest; the baseline is one
    ``zfec.Encoder.encode`` of the same k blocks. Ours, decoding from the last k shards
    (two data and two parity shards at m=2, parity only at m=6): manifest signature
    check, SHA-256 of the k shards used, zfec decode, the object joined into one
    ``bytes``; the baseline is zfec's decode and the same join (what ``zfec.easyfec``
    does to give the object back). The hashes run on a thread pool while zfec codes
    (both release the GIL) when the process may use two CPUs or more; the note says how
    many it had, and the CPU time of each side (what a one-CPU machine would pay).
    Measured alternately after one warm-up call each, minimum of the repeats, so that
    load from other processes hits both sides. Target ≤ 1.3.
``storage_vs_3x_replication``
    bytes stored on all holders (shards, manifests, sealing overhead) after a real
    checkpoint at k=4, m=2 on an in-memory federation ÷ 3 full copies. Target ≤ 0.55.
``recovery_vs_single_source``
    time for a wiped org to recover its state (sealed, 100 MB; 16 MB with ``--quick``)
    from k=4 holders in parallel ÷ the same recovery from one holder storing the whole
    sealed state (a k=1, m=0 set: the same code path, fetch, verification and
    decryption). Links: :class:`~coordinator_free.memory.InMemoryNetwork` caps each
    sender's **uplink** at ``bandwidth_bps`` bits per second, shared by that sender's
    concurrent sends. During a recovery every holder sends to one receiver only, so
    each transfer has a link of its own at the cap: the per-link model. The receiver's
    downlink is not capped, i.e. assumed at least k times a peer's uplink. Target ≤ 0.4.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import zfec
from coordinator_free.checkpoints import CheckpointReplicator, ShardService, ShardStore, recover
from coordinator_free.endpoint import Endpoint
from coordinator_free.erasure import (
    CodeParams,
    ErasureCodec,
    decode_set,
    encode_set,
    hashing_threads,
)
from coordinator_free.identity import OrgIdentity
from coordinator_free.memory import InMemoryNetwork
from coordinator_free.sealed import RecoverySecret

from bench.common import Report, run_main

__all__ = ["main"]

FEDERATION = "bench-checkpoints"
MiB = 1 << 20


def _identity(org: str) -> OrgIdentity:
    return OrgIdentity.generate(org, hashlib.sha256(org.encode()).digest())


def _paired(
    ours: Callable[[], object], raw: Callable[[], object], repeats: int
) -> tuple[float, float, float, float]:
    """Minimum wall seconds of each, then minimum CPU seconds (this process, all its
    threads) of each; measured alternately, after a warm-up call, so that load changes
    hit both sides."""
    raw()
    ours()
    ours_wall: list[float] = []
    raw_wall: list[float] = []
    ours_cpu: list[float] = []
    raw_cpu: list[float] = []
    for _ in range(repeats):
        for fn, wall, cpu in ((raw, raw_wall, raw_cpu), (ours, ours_wall, ours_cpu)):
            c0, t0 = time.process_time(), time.perf_counter()
            fn()
            wall.append(time.perf_counter() - t0)
            cpu.append(time.process_time() - c0)
    return min(ours_wall), min(raw_wall), min(ours_cpu), min(raw_cpu)


def _cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def codec_rows(report: Report, size: int, params: CodeParams, repeats: int) -> None:
    """encode/decode of our full path against raw zfec, same bytes, same parameters."""
    data = os.urandom(size)
    owner = _identity("owner")
    k, n = params.k, params.n
    shard = -(-size // k)
    view = memoryview(data)
    blocks = tuple(view[i * shard : (i + 1) * shard] for i in range(k))
    encoder = zfec.Encoder(k, n)
    codec = ErasureCodec(params)
    threads = (
        f"{_cpus()} CPUs: zfec + {min(hashing_threads(), n)} hashing thread(s)"
        if codec.parallel
        else f"{_cpus()} CPU: hashing after coding, one thread"
    )

    def ours_encode() -> None:
        encode_set(
            data,
            params=params,
            owner="owner",
            set_id="state",
            version=1,
            created_at=0,
            identity=owner,
            codec=codec,
        )

    ours, raw, ours_cpu, raw_cpu = _paired(ours_encode, lambda: encoder.encode(blocks), repeats)
    label = f"k={k},m={params.m},size={size // MiB}MiB"
    report.add(
        f"encode_vs_zfec_raw[{label}]",
        ours,
        "s",
        raw,
        target="<= 1.3",
        note=f"ours (split, parity, SHA-256 of {n} shards, Merkle root, signed manifest) "
        f"{size / ours / 1e6:.0f} MB/s, zfec {size / raw / 1e6:.0f} MB/s; {threads}; "
        f"CPU time ours/zfec {ours_cpu / raw_cpu:.2f}",
    )

    manifest, encoded = encode_set(
        data, params=params, owner="owner", set_id="state", version=1, created_at=0, identity=owner
    )
    use = tuple(range(n - k, n)) if params.m >= 2 else tuple(range(k))
    shards = {i: encoded.shards[i] for i in use}
    decoder = zfec.Decoder(k, n)
    raw_blocks = tuple(encoded.shards[i] for i in use)
    ours, raw, ours_cpu, raw_cpu = _paired(
        lambda: decode_set(manifest, shards, owner_public_key=owner.public_key, codec=codec),
        lambda: b"".join(decoder.decode(list(raw_blocks), list(use)))[:size],
        repeats,
    )
    assert decode_set(manifest, shards, codec=codec) == data
    report.add(
        f"decode_vs_zfec_raw[{label},from={list(use)}]",
        ours,
        "s",
        raw,
        target="<= 1.3",
        note=f"ours (signature check, SHA-256 of the {k} shards used, decode, join) "
        f"{size / ours / 1e6:.0f} MB/s, zfec {size / raw / 1e6:.0f} MB/s; both return the "
        f"object as one bytes (zfec's blocks joined, as zfec.easyfec does); {threads}; "
        f"CPU time ours/zfec {ours_cpu / raw_cpu:.2f}",
    )


class _Federation:
    """In-memory orgs serving shards (no membership: every org is live)."""

    def __init__(self, root: Path, n: int, *, max_size: int) -> None:
        self.network = InMemoryNetwork()
        self.root = root
        self.orgs = [f"org{i}" for i in range(n)]
        self.identities = {o: _identity(o) for o in self.orgs}
        self.keys = {o: i.public_key for o, i in self.identities.items()}
        self.endpoints: dict[str, Endpoint] = {}
        self.stores: dict[str, ShardStore] = {}
        for org in self.orgs:
            endpoint = Endpoint(
                self.identities[org],
                FEDERATION,
                self.network.transport(org),
                lambda: self.keys,
                max_size=max_size,
            )
            store = ShardStore(root / org, quota_bytes_per_owner=1 << 40)
            ShardService(endpoint, store, lambda: self.keys)
            self.endpoints[org] = endpoint
            self.stores[org] = store

    async def start(self) -> None:
        for endpoint in self.endpoints.values():
            await endpoint.start()

    async def close(self) -> None:
        for endpoint in self.endpoints.values():
            await endpoint.close()


async def _storage(report: Report, size: int) -> None:
    with tempfile.TemporaryDirectory(prefix="fedweave-bench-") as tmp:
        fed = _Federation(Path(tmp), 8, max_size=64 * MiB)
        await fed.start()
        try:
            params = CodeParams(4, 2)
            replicator = CheckpointReplicator(
                fed.endpoints["org0"],
                RecoverySecret(b"\x01" * 32),
                lambda: fed.orgs,
                params=params,
            )
            await replicator.checkpoint(os.urandom(size), 1)
            stored = sum(s.total_bytes() for s in fed.stores.values())
        finally:
            await fed.close()
    report.add(
        "storage_vs_3x_replication[k=4,m=2]",
        stored,
        "B",
        3 * size,
        target="<= 0.55",
        note=f"state {size // MiB} MiB on 7 peers; shards + manifests + AES-GCM overhead",
    )


async def _recovery(report: Report, size: int, bandwidth_bps: float) -> None:
    with tempfile.TemporaryDirectory(prefix="fedweave-bench-") as tmp:
        fed = _Federation(Path(tmp), 7, max_size=size + 64 * MiB)
        await fed.start()
        try:
            owner = fed.endpoints["org0"]
            secret = RecoverySecret(b"\x02" * 32)
            state = os.urandom(size)
            for set_id, params in (("state", CodeParams(4, 2)), ("whole", CodeParams(1, 0))):
                replicator = CheckpointReplicator(
                    owner, secret, lambda: fed.orgs, params=params, set_id=set_id, timeout=600
                )
                await replicator.checkpoint(state, 1)
            fed.network.bandwidth_bps = bandwidth_bps  # the links are capped from here on
            peers = fed.orgs[1:]
            loop = asyncio.get_running_loop()

            async def timed(set_id: str) -> float:
                started = loop.time()
                got = await recover(owner, secret, peers, set_id=set_id, timeout=600)
                elapsed = loop.time() - started
                assert got.state == state
                return elapsed

            parallel = await timed("state")
            single = await timed("whole")
        finally:
            await fed.close()
    report.add(
        f"recovery_vs_single_source[size={size // MiB}MiB,k=4]",
        parallel,
        "s",
        single,
        target="<= 0.4",
        note=f"per-sender uplink cap {bandwidth_bps / 1e6:.0f} Mbit/s (one link per holder; "
        "receiver downlink uncapped); both paths verify and decrypt",
    )


def body(report: Report) -> None:
    quick = report.quick
    size = 16 * MiB if quick else 64 * MiB
    repeats = 7 if quick else 9
    codec_rows(report, size, CodeParams(4, 2), repeats)
    codec_rows(report, size, CodeParams(4, 6), repeats)
    asyncio.run(_storage(report, 4 * MiB if quick else 32 * MiB))
    recovery_size = 16 * MiB if quick else 100 * 1000 * 1000
    asyncio.run(_recovery(report, recovery_size, 100e6))


def main(argv: Sequence[str] | None = None) -> Report:
    """Run the benchmark (see the module docstring)."""
    return run_main("checkpoints", body, argv, description=__doc__ or "")


if __name__ == "__main__":
    main()
