"""Three real `fedweave run` processes on 127.0.0.1: a run proposed, accepted and started
through each org's admin API, two rounds of the breast-cancer task over mutual TLS,
identical final models, and SIGTERM stopping every node cleanly with its ports freed."""

from __future__ import annotations

import os
import select
import signal
import socket
import ssl
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from coordinator_free.identity import OrgIdentity
from coordinator_free.tls import client_ssl_context

from org_node.config import NodeConfig
from org_node.engine import STATE_FILE, EngineState, RunPlan, TrainingConfig, model_hash
from org_node.harness.nodes import free_ports, port_is_free
from org_node.initialize import found_manifest, initialize, install_manifest, sign_manifest
from tests.run_flow import propose_once

pytestmark = pytest.mark.e2e

ORGS = ("hospital-a", "hospital-b", "hospital-c")


def wait_for_line(proc: subprocess.Popen[bytes], needle: bytes, timeout: float) -> bytes:
    assert proc.stdout is not None
    seen = b""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        ready, _, _ = select.select([proc.stdout], [], [], 0.2)
        if ready:
            line = proc.stdout.readline()
            seen += line
            if needle in line:
                return line
        if proc.poll() is not None:
            break
    raise AssertionError(f"no {needle!r} from the node (exit {proc.poll()}): {seen!r}")


def test_three_node_processes_train_two_rounds_and_stop_on_sigterm(tmp_path: Path) -> None:
    ports = free_ports(2 * len(ORGS))
    dirs, tokens = {}, {}
    for i, org in enumerate(ORGS):
        d = tmp_path / org
        result = initialize(
            d, org, peer_port=ports[2 * i], admin_port=ports[2 * i + 1], harness=True
        )
        dirs[org], tokens[org] = d, result.admin_token
        config = NodeConfig.load(d / "fedweave.toml")
        config.replace(
            training=TrainingConfig(
                local_steps=3,
                batch_size=16,
                num_partitions=len(ORGS),
                partition_index=i,
                evaluate=False,
            )
        ).save(d / "fedweave.toml")
    manifest = tmp_path / "manifest.json"
    found_manifest("hospitals", [d / "member.json" for d in dirs.values()], manifest)
    for d in dirs.values():
        sign_manifest(d, manifest)
    for d in dirs.values():
        install_manifest(d, manifest)

    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.pop("FEDWEAVE_HARNESS_DEBUG_EXPORT", None)
    procs: dict[str, subprocess.Popen[bytes]] = {}
    try:
        for org, d in dirs.items():
            procs[org] = subprocess.Popen(
                [sys.executable, "-m", "api.cli", "run", "--data-dir", str(d)],
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
            )
        for proc in procs.values():
            wait_for_line(proc, b"ready:", timeout=40)

        spec = {"trainer": "breast_cancer", "rounds": 2, "participants": list(ORGS), "threshold": 2}
        clients = {
            org: httpx.Client(
                base_url=f"http://127.0.0.1:{ports[2 * i + 1]}",
                headers={"Authorization": f"Bearer {tokens[org]}"},
                timeout=60,
            )
            for i, org in enumerate(ORGS)
        }
        run_ids = propose_once(clients, "cancer-demo", spec)

        states: dict[str, str] = {}
        end = time.monotonic() + 60
        while time.monotonic() < end:
            states = {
                o: c.get(f"/v1/runs/{run_ids[o]}").json()["state"] for o, c in clients.items()
            }
            if set(states.values()) <= {"completed", "failed"} and len(states) == len(ORGS):
                break
            time.sleep(0.2)
        assert states == {o: "completed" for o in ORGS}
        rounds = {
            o: c.get(f"/v1/runs/{run_ids[o]}").json()["current_round"] for o, c in clients.items()
        }
        assert rounds == {o: 2 for o in ORGS}
        metrics = clients[ORGS[0]].get(f"/v1/runs/{run_ids[ORGS[0]]}/metrics").json()["data"]
        assert {(m["round"], m["name"]) for m in metrics} >= {(1, "survivors"), (2, "survivors")}
        for c in clients.values():
            c.close()

        key = RunPlan.from_spec("cancer-demo", spec).run_key
        hashes = {
            org: model_hash(
                EngineState.from_bytes((d / "runs" / key / STATE_FILE).read_bytes()).model
            )
            for org, d in dirs.items()
        }
        assert len(set(hashes.values())) == 1, hashes

        # hospital-c loses its disk: `fedweave recover` rebuilds it from the offline
        # backup and the manifest chain, fetching its sealed shards over mutual TLS
        lost = ORGS[2]
        procs[lost].send_signal(signal.SIGTERM)
        assert procs[lost].wait(timeout=20) == 0
        fresh = tmp_path / f"{lost}-new"
        recovered = subprocess.run(
            [
                sys.executable,
                "-m",
                "api.cli",
                "recover",
                "--data-dir",
                str(fresh),
                "--backup",
                str(dirs[lost] / f"{lost}-recovery-backup.json"),
                "--manifest",
                str(dirs[ORGS[0]] / "federation" / "chain.json"),
                "--admin-port",
                str(ports[5]),
                "--timeout",
                "20",
            ],
            capture_output=True,
            text=True,
            env=env,
            timeout=60,
            check=False,
        )
        assert recovered.returncode == 0, recovered.stdout + recovered.stderr
        assert "new admin token" in recovered.stdout
        state = EngineState.from_bytes((fresh / "runs" / key / STATE_FILE).read_bytes())
        assert state.round == 2 and model_hash(state.model) == hashes[lost]

        # the two others remove hospital-c from the federation (a quorum of two signs):
        # from then on hospital-a's running peer port refuses hospital-c's certificate
        # at the TLS handshake, without a restart, and still admits hospital-b
        removed = identity_of(dirs[lost])
        assert _handshake(ports[0], removed)  # a member still: admitted
        admins = {
            org: httpx.Client(
                base_url=f"http://127.0.0.1:{ports[2 * i + 1]}",
                headers={"Authorization": f"Bearer {tokens[org]}"},
                timeout=60,
            )
            for i, org in enumerate(ORGS[:2])
        }
        body = {"action": "remove", "org_id": lost, "note": "left the consortium"}
        made = admins[ORGS[0]].post("/v1/federation/proposals", json=body)
        assert made.status_code == 201, made.text
        digest = made.json()["digest"]
        end = time.monotonic() + 30
        while digest not in {p["digest"] for p in _pending(admins[ORGS[1]])}:
            assert time.monotonic() < end, "the proposal never reached hospital-b"
            time.sleep(0.2)
        signed = admins[ORGS[1]].post(f"/v1/federation/proposals/{digest}/signature")
        assert signed.status_code == 200, signed.text
        while admins[ORGS[0]].get("/v1/federation/manifest").json()["version"] != 1:
            assert time.monotonic() < end, "hospital-a never installed the removal"
            time.sleep(0.2)
        for c in admins.values():
            c.close()
        assert not _handshake(ports[0], removed)
        assert _handshake(ports[0], identity_of(dirs[ORGS[1]]))

        for proc in procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for org, proc in procs.items():
            assert proc.wait(timeout=20) == 0, org
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)
            if proc.stdout is not None:
                proc.stdout.close()
    assert all(port_is_free(p) for p in ports)


def identity_of(data_dir: Path) -> OrgIdentity:
    return OrgIdentity.load(data_dir / "identity")


def _pending(client: httpx.Client) -> list[dict[str, object]]:
    data: list[dict[str, object]] = client.get("/v1/federation/proposals").json()["data"]
    return data


def _handshake(port: int, who: OrgIdentity) -> bool:
    """Whether ``who``'s certificate completes a TLS handshake (and an HTTP exchange)
    with the peer port on ``port``."""
    try:
        with (
            socket.create_connection(("127.0.0.1", port), timeout=10) as raw,
            client_ssl_context(who).wrap_socket(raw) as tls,
        ):
            tls.sendall(b"POST / HTTP/1.1\r\nHost: peer\r\nContent-Length: 0\r\n\r\n")
            return bool(tls.recv(1))
    except (ssl.SSLError, ConnectionResetError, BrokenPipeError):
        return False
