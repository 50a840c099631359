"""A small harness of real ``fedweave run`` processes on 127.0.0.1 for end-to-end tests:
initialized data directories, a founded and installed manifest, one admin client per
org, and a clean stop (SIGTERM, then SIGKILL for a node that does not stop)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from org_node.config import NodeConfig
from org_node.engine import TrainingConfig
from org_node.harness.nodes import free_ports, port_is_free
from org_node.initialize import found_manifest, initialize, install_manifest, sign_manifest
from tests.org_node.test_node_processes import wait_for_line
from tests.run_flow import propose_once, wait_states

__all__ = ["Harness", "running_nodes"]


@dataclass
class Harness:
    """Running nodes: their admin ports, tokens, data directories and processes."""

    orgs: tuple[str, ...]
    admin_ports: dict[str, int]
    tokens: dict[str, str]
    dirs: dict[str, Path]
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    output: dict[str, list[bytes]] = field(default_factory=dict)
    """What each node printed after it was ready (drained, so that no pipe fills up)."""

    def url(self, org: str) -> str:
        return f"http://127.0.0.1:{self.admin_ports[org]}"

    def client(self, org: str) -> httpx.Client:
        return httpx.Client(
            base_url=self.url(org),
            headers={"Authorization": f"Bearer {self.tokens[org]}"},
            timeout=60,
        )

    def propose_and_accept(self, name: str, spec: Mapping[str, Any]) -> dict[str, str]:
        """Propose ``spec`` once (at the first org), accept it at every org; the run id at
        each. The run starts by itself once every consent is in."""
        clients = {org: self.client(org) for org in self.orgs}
        try:
            return propose_once(clients, name, spec)
        finally:
            for c in clients.values():
                c.close()

    def start(self, run_ids: Mapping[str, str]) -> None:
        """Wait until the run has started (by itself) at every org."""
        clients = {org: self.client(org) for org in self.orgs}
        try:
            name = {
                r["id"]: r["name"]
                for r in [clients[self.orgs[0]].get(f"/v1/runs/{run_ids[self.orgs[0]]}").json()]
            }[run_ids[self.orgs[0]]]
            rows = wait_states(clients, name, {"running", "completed", "failed"})
            assert all(r["state"] != "accepted" for r in rows.values()), rows
        finally:
            for c in clients.values():
                c.close()


@contextmanager
def running_nodes(
    tmp_path: Path,
    orgs: Sequence[str],
    *,
    display_names: Mapping[str, str] | None = None,
    local_steps: int = 3,
) -> Iterator[Harness]:
    """Initialize, federate and start one node process per org; stop them all after."""
    ports = free_ports(2 * len(orgs))
    names = dict(display_names or {})
    harness = Harness(tuple(orgs), {}, {}, {})
    for i, org in enumerate(orgs):
        d = tmp_path / org
        result = initialize(
            d,
            org,
            peer_port=ports[2 * i],
            admin_port=ports[2 * i + 1],
            display_name=names.get(org, ""),
            harness=True,
        )
        harness.dirs[org], harness.tokens[org] = d, result.admin_token
        harness.admin_ports[org] = ports[2 * i + 1]
        config = NodeConfig.load(d / "fedweave.toml")
        config.replace(
            training=TrainingConfig(
                local_steps=local_steps,
                batch_size=16,
                num_partitions=len(orgs),
                partition_index=i,
                evaluate=False,
            )
        ).save(d / "fedweave.toml")
    manifest = tmp_path / "manifest.json"
    found_manifest("e2e", [d / "member.json" for d in harness.dirs.values()], manifest)
    for d in harness.dirs.values():
        sign_manifest(d, manifest)
    for d in harness.dirs.values():
        install_manifest(d, manifest)

    drains: list[threading.Thread] = []
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.pop("FEDWEAVE_HARNESS_DEBUG_EXPORT", None)
    try:
        for org, d in harness.dirs.items():
            harness.procs[org] = subprocess.Popen(
                [sys.executable, "-m", "api.cli", "run", "--data-dir", str(d)],
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
            )
        for org, proc in harness.procs.items():
            wait_for_line(proc, b"ready:", timeout=40)
            lines = harness.output.setdefault(org, [])
            drain = threading.Thread(target=_drain, args=(proc, lines), daemon=True)
            drain.start()
            drains.append(drain)
        yield harness
    finally:
        for proc in harness.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in harness.procs.values():
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)
        for drain in drains:
            drain.join(timeout=5)
        for proc in harness.procs.values():
            if proc.stdout is not None:
                proc.stdout.close()
    assert all(port_is_free(p) for p in ports)


def _drain(proc: subprocess.Popen[bytes], into: list[bytes]) -> None:
    assert proc.stdout is not None
    for line in iter(proc.stdout.readline, b""):
        into.append(line)
