"""Five org processes over real mutual TLS on 127.0.0.1: one is wiped and recovers.

Each process checkpoints its own state, coded (k=2, m=2) across the four others. Then
one org loses its process and its whole data dir, and two of its shard holders die at
the same moment (m = 2 simultaneous losses). A new process started from the org's
offline backup file alone rebuilds the state from the two survivors, byte for byte, and
rejoins by checkpointing it again.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from coordinator_free.sealed import RecoveryBackup, RecoverySecret, atomic_write
from coordinator_free.tls import PeerAddress

from tests.coordinator_free.transport_support import FEDERATION, identity

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]

ROOT = Path(__file__).resolve().parents[2]
ORGS = ["org-a", "org-b", "org-c", "org-d", "org-e"]
VICTIM = "org-e"


def _state(org: str) -> bytes:
    out = bytearray()
    counter = 0
    while len(out) < 300_000:
        out += hashlib.sha256(f"{org}/{counter}".encode()).digest()
        counter += 1
    return bytes(out)


def _wait(paths: list[Path], procs: dict[str, subprocess.Popen[bytes]], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not all(p.exists() for p in paths):
        for org, proc in procs.items():
            if proc.poll() is not None:
                raise AssertionError(f"{org} exited with {proc.returncode}")
        if time.monotonic() > deadline:
            missing = [p.name for p in paths if not p.exists()]
            raise AssertionError(f"timed out waiting for {missing}")
        time.sleep(0.1)


def _start(org: str, config: Path, data: Path, log: Path, *extra: str) -> subprocess.Popen[bytes]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cmd = [
        sys.executable,
        "-m",
        "tests.coordinator_free._shard_node",
        "--config",
        str(config),
        "--org",
        org,
        "--data",
        str(data),
        *extra,
    ]
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log.open("wb"), stderr=subprocess.STDOUT)


def test_wiped_org_recovers_over_mtls_with_two_holders_down(tmp_path: Path) -> None:
    ports = tmp_path / "ports"
    ports.mkdir()
    members = {}
    secrets = {}
    for org in ORGS:
        ident = identity(org)
        data = tmp_path / org
        ident.save(data / "identity")
        atomic_write(data / "state.bin", _state(org))
        secrets[org] = RecoverySecret(hashlib.sha256(b"secret/" + org.encode()).digest())
        atomic_write(data / "recovery.secret", secrets[org].hex().encode())
        members[org] = {
            "public_key": ident.public_key.hex(),
            "certificate_pem": ident.certificate_pem.decode(),
        }
    config = tmp_path / "config.json"
    config.write_text(
        json.dumps(
            {
                "federation": FEDERATION,
                "k": 2,
                "m": 2,
                "members": members,
                "ports_dir": str(ports),
            }
        )
    )
    procs: dict[str, subprocess.Popen[bytes]] = {}
    try:
        for org in ORGS:
            procs[org] = _start(org, config, tmp_path / org, tmp_path / f"{org}.log")
        _wait([ports / f"{org}.ready" for org in ORGS], procs, timeout=120)
        placed = json.loads((ports / f"{VICTIM}.ready").read_text())["holders"]
        assert sorted(placed) == sorted(o for o in ORGS if o != VICTIM)

        # The operator's offline backup of the victim, made while the federation ran.
        peers = {
            org: PeerAddress(
                f"https://127.0.0.1:{(ports / f'{org}.port').read_text()}",
                identity(org).fingerprint,
            )
            for org in ORGS
            if org != VICTIM
        }
        backup = tmp_path / "offline" / f"{VICTIM}.backup.json"
        backup.parent.mkdir()
        RecoveryBackup.create(identity(VICTIM), FEDERATION, secrets[VICTIM], peers=peers).save(
            backup
        )

        # The victim crashes and loses its disk; m = 2 of its holders die too.
        original = (tmp_path / VICTIM / "state.bin").read_bytes()
        down = [placed[0], placed[1]]
        for org in [VICTIM, *down]:  # a crash: no chance to say goodbye
            procs[org].kill()
            procs[org].wait(timeout=30)
            del procs[org]
        shutil.rmtree(tmp_path / VICTIM)
        (ports / f"{VICTIM}.port").unlink()
        for org in down:
            (ports / f"{org}.port").unlink()

        out = tmp_path / "recovered.bin"
        procs[VICTIM] = _start(
            VICTIM,
            config,
            tmp_path / VICTIM,
            tmp_path / f"{VICTIM}.recover.log",
            "--recover",
            str(backup),
            "--out",
            str(out),
        )
        _wait([ports / f"{VICTIM}.recovered"], procs, timeout=120)
        assert out.read_bytes() == original
        marker = json.loads((ports / f"{VICTIM}.recovered").read_text())
        assert marker == {"version": 7, "rejoined_version": 8}
        # The rebuilt data dir holds the identity again, nothing partial.
        assert not list((tmp_path / VICTIM).rglob("*.tmp"))
    finally:
        for proc in procs.values():
            proc.terminate()
        for proc in procs.values():
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=20)
