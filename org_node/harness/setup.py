"""Setting up a harness federation: the orgs' data directories and configs, the founding
manifest, what each org trains (a demo task, a Flower app installed through its API,
or its own data registered through its API), and the run proposed at org1, relayed,
accepted and started at every org through its own API.
"""

from __future__ import annotations

import contextlib
import csv
import shutil
import time
from pathlib import Path
from typing import Any

import httpx

from org_node.harness.nodes import (
    RUN_NAME,
    HarnessError,
    NodeProcess,
    Observation,
    check,
    free_ports,
    hold_file,
    round_hold,
)
from org_node.harness.scenario import FLOWER_TRAINER, Scenario

START_DELAY_S = 5
"""Seconds from the last consent to the run's start (each org's event stream is
subscribed meanwhile)."""

__all__ = [
    "bring_data",
    "bring_trainer",
    "create",
    "dataset_name",
    "propose_and_accept",
    "run_spec",
    "start_run",
]


def create(scenario: Scenario, out: Path) -> dict[str, NodeProcess]:
    """Data directories, configs, backups, and the founded and installed manifest."""
    from org_node.config import DatasetsSection, DebugSection, NodeConfig
    from org_node.engine import EngineConfig, TrainingConfig
    from org_node.initialize import (
        InitError,
        found_manifest,
        initialize,
        install_manifest,
        sign_manifest,
    )

    n = scenario.orgs
    ports = free_ports(3 * n)
    nodes: dict[str, NodeProcess] = {}
    try:
        for i, org in enumerate(scenario.names):
            peer, admin, relay = ports[3 * i], ports[3 * i + 1], ports[3 * i + 2]
            public = relay if scenario.delay_ms else peer
            node = NodeProcess(org, i, out / "nodes" / org, peer, admin, public)
            result = initialize(
                node.data_dir,
                org,
                peer_port=peer,
                admin_port=admin,
                advertise_url=f"https://127.0.0.1:{public}",
                backup_file=out / "backups" / f"{org}-recovery-backup.json",
                harness=True,
            )
            node.token = result.admin_token
            config = NodeConfig.load(node.data_dir / "fedweave.toml")
            roots = config.datasets.roots
            if scenario.data is not None:
                roots = (*roots, str(Path(scenario.data).resolve()))
            config = config.replace(
                datasets=DatasetsSection(roots),
                training=TrainingConfig(
                    local_steps=scenario.local_steps,
                    batch_size=scenario.batch_size,
                    lr=1e-2,
                    seed=scenario.seed + i,
                    # a demo task or Flower app splits one data set; own data is whole
                    num_partitions=1 if scenario.data else n,
                    partition_index=0 if scenario.data else i,
                    partition_seed=scenario.seed,
                    dirichlet_alpha=None if scenario.data else scenario.dirichlet_alpha,
                    evaluate=True,
                    worker=scenario.worker,
                ),
                engine=EngineConfig(
                    strategy=scenario.strategy,
                    strategy_options=scenario.strategy_options,
                    model_seed=scenario.seed,
                    checkpoint_every=1,
                    ready_timeout_s=20.0,
                    model_hash_timeout_s=20.0,
                    max_attempts=4,
                ),
                debug=DebugSection(harness=True, fast_membership=True),
            )
            config.save(node.data_dir / "fedweave.toml")
            # kept outside the data directory: what an operator restores after a wipe
            shutil.copyfile(node.data_dir / "fedweave.toml", out / "configs" / f"{org}.toml")
            nodes[org] = node
        manifest = out / "manifest.json"
        found_manifest("harness", [nd.data_dir / "member.json" for nd in nodes.values()], manifest)
        for nd in nodes.values():
            sign_manifest(nd.data_dir, manifest)
        for nd in nodes.values():
            install_manifest(
                nd.data_dir,
                manifest,
                backup_file=out / "backups" / f"{nd.org}-recovery-backup.json",
            )
    except InitError as exc:
        raise HarnessError(f"cannot create the federation: {exc}") from None
    return nodes


def dataset_name(org: str) -> str:
    return f"{org}-data"


def bring_trainer(node: NodeProcess, s: Scenario) -> None:
    """Install ``--flower-app`` at the org through its own API (an admin's act)."""
    if s.flower_app is None:
        return
    from org_node.cli_catalog import guess_kind

    kind, ref = guess_kind(s.flower_app)
    body = {"name": FLOWER_TRAINER, "kind": kind, "ref": ref, "description": "--flower-app"}
    with node.client(timeout=240.0) as c:
        check(c.post("/v1/trainers", json=body), f"install the Flower app at {node.org}")


def bring_data(node: NodeProcess, s: Scenario) -> None:
    """Register the org's ``--data`` file through its own API."""
    if s.data is None:
        return
    body = {"name": dataset_name(node.org), "path": str(s.data_file(node.org))}
    with node.client(timeout=120.0) as c:
        check(c.post("/v1/datasets", json=body), f"register the data of {node.org}")


def _labels(path: Path, column: str) -> set[str]:
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        return {str(v) for v in pq.read_table(path, columns=[column]).column(0).to_pylist()}
    with path.open(newline="", encoding="utf-8") as f:
        return {row[column].strip() for row in csv.DictReader(f)}


def _tabular(s: Scenario) -> tuple[dict[str, Any], dict[str, Any]]:
    """The data requirement and config of a ``--data`` run: the numeric columns every
    org's file holds are the features, ``--target`` the label, and its classes the
    values found in the files (a harness on one host may read them all)."""
    from org_node.datasets import DatasetError, inspect_table

    try:
        tables = {org: inspect_table(s.data_file(org))[0] for org in s.names}
    except DatasetError as exc:
        raise HarnessError(f"--data: {exc}") from None
    first = tables[s.names[0]]
    target = s.target
    if target is None:
        return {"kind": "table", "columns": {}}, {}
    for org, columns in tables.items():
        if target not in columns:
            raise HarnessError(f"--target {target}: {org}'s file has no such column")
    features = [
        name
        for name, typ in first.items()
        if name != target and all(t.get(name) in ("int", "float", "bool") for t in tables.values())
    ]
    if s.flower_app is not None:
        return {"kind": "table", "columns": {}}, {"target": target}
    if not features:
        raise HarnessError("--data: the files share no numeric feature column")
    classes = sorted(set().union(*(_labels(s.data_file(o), target) for o in s.names)))
    if len(classes) < 2:
        raise HarnessError(f"--target {target}: the files hold fewer than 2 classes")
    columns = {f: "number" for f in features} | {target: "any"}
    return {"kind": "table", "columns": columns}, {"target": target, "classes": ",".join(classes)}


def run_spec(s: Scenario) -> dict[str, Any]:
    """The spec org1 proposes."""
    spec: dict[str, Any] = {
        "trainer": s.trainer,
        "rounds": s.rounds,
        "participants": list(s.names),
        "backend": s.backend,
        "threshold": s.t,
    }
    if s.compression != "none":
        spec["compression"] = s.compression
    if s.data is not None:
        spec["data"], spec["config"] = _tabular(s)
    return spec


def propose_and_accept(obs: Observation) -> None:
    """Bring each org's trainer and data through its API, propose the run once at org1
    (the node sends the signed proposal to every participant), wait until each org
    sees it, and accept it at each (binding its dataset); the run then starts by itself
    at the time the consents agree on.

    Once the run key is known (the proposal's), and before any org accepts, for each
    ``reduce`` kill the hold file that stops the org once its update of that round is
    made and exported, before any of it is sent: the kill then always finds it there
    (watching the export alone, the round could end first)."""
    s = obs.scenario
    for org in s.names:
        bring_trainer(obs.nodes[org], s)
        bring_data(obs.nodes[org], s)
    spec = run_spec(s)
    obs.spec = spec
    first = obs.nodes[s.names[0]]
    with first.client() as c:
        body = {"name": RUN_NAME, "spec": spec, "start_delay_s": START_DELAY_S}
        proposal = check(c.post("/v1/runs", json=body), f"propose at {first.org}")
    obs.run_key = str(proposal["run_key"])
    holds = [hold_file(obs, kill) for kill in s.kills if kill.stage == "reduce"]
    # a held wipe: every org stops before sending anything of the round after the
    # wipe's, however late the harness sees that round end (see runner._pause_due)
    holds += [round_hold(obs, org, w.round) for w in s.wipes if w.hold for org in s.names]
    for hold in holds:  # its path names the run: before any org accepts, so in time
        hold.parent.mkdir(parents=True, exist_ok=True)
        hold.touch()
    for org in s.names:
        obs.nodes[org].run_id = _proposed_at(obs.nodes[org], obs.run_key)
    for org in s.names:
        node = obs.nodes[org]
        accept = {"dataset": dataset_name(org)} if s.data is not None else {}
        with node.client() as c:
            check(c.post(f"/v1/runs/{obs.run_key}/accept", json=accept), f"accept at {org}")


def _proposed_at(node: NodeProcess, run_key: str, timeout: float = 60.0) -> str:
    """The local id of the run once ``node`` has received its proposal."""
    end = time.monotonic() + timeout
    while True:
        with contextlib.suppress(httpx.HTTPError), node.client() as c:
            r = c.get(f"/v1/runs/{run_key}")
            if r.status_code == 200:
                return str(r.json()["id"])
        if time.monotonic() > end:
            raise HarnessError(f"{node.org} did not receive the run's proposal in {timeout:.0f} s")
        time.sleep(0.1)


def start_run(obs: Observation, timeout: float = 60.0) -> None:
    """Wait until the run has started by itself at every org (every consent is in)."""
    end = time.monotonic() + timeout
    for org in obs.scenario.names:
        node = obs.nodes[org]
        while True:
            with contextlib.suppress(httpx.HTTPError), node.client() as c:
                row = c.get(f"/v1/runs/{obs.run_key}").json()
                if row.get("state") not in ("proposed", "accepted"):
                    node.state = str(row["state"])
                    break
            if time.monotonic() > end:
                raise HarnessError(f"the run did not start at {org}: {row.get('waiting')}")
            time.sleep(0.1)
