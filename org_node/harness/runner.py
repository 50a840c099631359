"""Run a scenario: a federation of real ``fedweave run`` processes on 127.0.0.1.

:func:`run_harness` does, in order (docs/OPERATIONS.md, "The local harness"):

1. **create** the federation in ``DIR``: per org a data directory (``fedweave init``'s
   :func:`~org_node.initialize.initialize`, with the harness-only debug section), its
   config (the scenario's task, strategy, seed, and a Dirichlet(alpha) non-IID share of
   the task's data), its offline backup under ``DIR/backups``; then the founding
   manifest, signed by every org and installed everywhere;
2. **start** one ``fedweave run`` process per org (its own session, so that one
   ``kill -9`` of its process group is a crash of the whole node), on free loopback
   ports, with ``FEDWEAVE_HARNESS_DEBUG_EXPORT`` pointing at ``DIR/debug-export``;
3. **propose** the run at org1's REST API, relay the proposal (name and spec) to each
   other org's API, and **accept** and start it at every org through its own API;
4. **follow** every org's run until it ends (a progress bar of rounds), reading each
   org's event stream for the survivors of every round, and **inject** the faults of
   the scenario (:mod:`org_node.harness.scenario`);
5. **stop** every process it started (SIGTERM, then ``kill -9`` of the process group),
   also on Ctrl-C or an error, so that no process is left and no port stays bound;
6. hand what it saw to :mod:`org_node.harness.verdict` (``summary.json``) and
   :mod:`org_node.harness.plot` (``progress.png``).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from org_node.harness.proxy import DelayRelays
from org_node.harness.scenario import Kill, Scenario, Wipe

__all__ = [
    "EXPORT_DIR",
    "RUN_NAME",
    "HarnessError",
    "Interrupted",
    "NodeProcess",
    "Observation",
    "free_ports",
    "port_is_free",
    "run_harness",
]

RUN_NAME = "harness-run"
EXPORT_DIR = "debug-export"
_TERMINAL = {"completed", "failed", "aborted", "declined"}
_TOKEN = re.compile(r"token[^:]*:\s*(\S+)")


class HarnessError(Exception):
    """The harness could not set up or drive the federation (the message says why)."""


class Interrupted(HarnessError):
    """Ctrl-C (SIGINT) or SIGTERM: every process was stopped."""


def free_ports(n: int) -> list[int]:
    """``n`` distinct TCP ports free on 127.0.0.1 at the time of the call."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def port_is_free(port: int) -> bool:
    """Whether ``port`` can be bound on 127.0.0.1 now."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


@dataclass
class NodeProcess:
    """One org's node: its files, ports, admin token and running process."""

    org: str
    index: int
    data_dir: Path
    peer_port: int
    admin_port: int
    public_peer_port: int
    token: str = ""
    proc: subprocess.Popen[bytes] | None = None
    run_id: str = ""
    state: str = "proposed"
    round: int = 0
    down: bool = False
    restarts: int = 0

    @property
    def admin_url(self) -> str:
        return f"http://127.0.0.1:{self.admin_port}"

    def client(self, timeout: float | None = 30.0) -> httpx.Client:
        return httpx.Client(
            base_url=self.admin_url,
            headers={"Authorization": f"Bearer {self.token}"},
            timeout=timeout,
        )


@dataclass
class Observation:
    """Everything the harness saw, for the verdict."""

    scenario: Scenario
    out: Path
    run_key: str = ""
    spec: dict[str, Any] = field(default_factory=dict)
    nodes: dict[str, NodeProcess] = field(default_factory=dict)
    survivors: dict[int, tuple[str, ...]] = field(default_factory=dict)
    """1-based round -> the orgs whose updates are in that round's sum."""
    metrics: dict[str, dict[int, dict[str, float]]] = field(default_factory=dict)
    """org -> 1-based round -> metric name -> value (from each org's API)."""
    faults: list[dict[str, Any]] = field(default_factory=list)
    recoveries: list[dict[str, Any]] = field(default_factory=list)
    states: dict[str, str] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)
    wiped_exports: dict[str, Path] = field(default_factory=dict)
    """org -> a copy of its exported updates taken when it was wiped."""
    timed_out: bool = False
    elapsed_s: float = 0.0
    listening: set[str] = field(default_factory=set)
    """Orgs whose event stream the harness reads."""
    t0: float = field(default_factory=time.monotonic)

    @property
    def export_dir(self) -> Path:
        return self.out / EXPORT_DIR


ProgressFn = Callable[[Observation], None]


class _Processes:
    """Every child process the harness started, stopped together (process groups)."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen[bytes]] = []
        self.lock = threading.Lock()

    def popen(self, args: list[str], log: Path, env: dict[str, str]) -> subprocess.Popen[bytes]:
        log.parent.mkdir(parents=True, exist_ok=True)
        with open(log, "ab") as out, self.lock:
            # appended as soon as it exists, so that a Ctrl-C right after still stops it
            self.procs.append(
                subprocess.Popen(
                    args, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
                )
            )
            return self.procs[-1]

    @staticmethod
    def kill9(proc: subprocess.Popen[bytes]) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=10)

    def stop_all(self, grace: float = 15.0) -> None:
        with self.lock:
            procs = list(self.procs)
        for proc in procs:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    proc.send_signal(signal.SIGTERM)
        end = time.monotonic() + grace
        for proc in procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=max(0.1, end - time.monotonic()))
        for proc in procs:
            # the whole group: a node's local training job (torchrun) dies with it
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=10)

    @property
    def pids(self) -> list[int]:
        with self.lock:
            return [p.pid for p in self.procs]


class _Interrupt:
    """SIGINT/SIGTERM raise :class:`Interrupted` once; later ones are ignored while the
    harness stops its children."""

    def __init__(self) -> None:
        self.fired = False
        self.previous: dict[int, Any] = {}

    def __enter__(self) -> _Interrupt:
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self.previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum: int, frame: Any) -> None:
        if self.fired:
            return
        self.fired = True
        raise Interrupted(f"interrupted by {signal.Signals(signum).name}")

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)


@contextlib.contextmanager
def _no_signals() -> Iterator[None]:
    """Defer SIGINT/SIGTERM while the children are being stopped."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {s: signal.signal(s, signal.SIG_IGN) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


# --------------------------------------------------------------------------- setup


def _create(scenario: Scenario, out: Path) -> dict[str, NodeProcess]:
    """Data directories, configs, backups, and the founded and installed manifest."""
    from org_node.config import DebugSection, NodeConfig
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
            config = config.replace(
                training=TrainingConfig(
                    local_steps=scenario.local_steps,
                    batch_size=scenario.batch_size,
                    lr=1e-2,
                    seed=scenario.seed + i,
                    num_partitions=n,
                    partition_index=i,
                    partition_seed=scenario.seed,
                    dirichlet_alpha=scenario.dirichlet_alpha,
                    evaluate=True,
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


def _node_env(out: Path, *, export: bool = True) -> dict[str, str]:
    """The nodes' environment: the debug export on (``fedweave recover`` rebuilds a
    plain config, which refuses it, so the harness turns it off there)."""
    from org_node.node import HARNESS_EXPORT_ENV

    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.pop(HARNESS_EXPORT_ENV, None)
    if export:
        env[HARNESS_EXPORT_ENV] = str(out / EXPORT_DIR)
    env.pop("FEDWEAVE_DATABASE_URL", None)  # embedded SQLite in each data directory
    return env


def _cli(*args: str) -> list[str]:
    """The installed ``fedweave`` console script (``fedweave run`` lives at the top layer)."""
    script = Path(sys.executable).with_name("fedweave")
    return [str(script) if script.exists() else "fedweave", *args]


def _start(procs: _Processes, node: NodeProcess, out: Path) -> None:
    node.proc = procs.popen(
        _cli("run", "--data-dir", str(node.data_dir)),
        out / "logs" / f"{node.org}.log",
        _node_env(out),
    )
    node.down = False


def _wait_ready(node: NodeProcess, out: Path, timeout: float = 90.0) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if node.proc is not None and node.proc.poll() is not None:
            raise HarnessError(
                f"{node.org}'s node exited with status {node.proc.returncode}; "
                f"see {out / 'logs' / (node.org + '.log')}"
            )
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{node.admin_url}/healthz", timeout=1.0).status_code == 200:
                return
        time.sleep(0.2)
    raise HarnessError(f"{node.org}'s node did not answer on {node.admin_url} in {timeout:g} s")


def _check(response: httpx.Response, what: str) -> dict[str, Any]:
    if response.status_code >= 400:
        try:
            detail = response.json().get("detail", response.text)
        except ValueError:
            detail = response.text
        raise HarnessError(f"{what}: HTTP {response.status_code}: {detail}")
    body: dict[str, Any] = response.json()
    return body


def _propose_and_accept(obs: Observation) -> None:
    """Propose at org1, relay the proposal to every other org, accept it at each."""
    s = obs.scenario
    spec = {
        "task": s.task_ref,
        "rounds": s.rounds,
        "participants": list(s.names),
        "backend": s.backend,
        "threshold": s.t,
    }
    obs.spec = spec
    first = obs.nodes[s.names[0]]
    with first.client() as c:
        proposal = _check(
            c.post("/v1/runs", json={"name": RUN_NAME, "spec": spec}), f"propose at {first.org}"
        )
    first.run_id = proposal["id"]
    relayed = {"name": proposal["name"], "spec": proposal["spec"]}
    for org in s.names[1:]:
        node = obs.nodes[org]
        with node.client() as c:
            node.run_id = _check(c.post("/v1/runs", json=relayed), f"relay to {org}")["id"]
    for org in s.names:
        node = obs.nodes[org]
        with node.client() as c:
            _check(c.post(f"/v1/runs/{node.run_id}/accept", json={}), f"accept at {org}")
    from org_node.engine import RunPlan

    obs.run_key = RunPlan.from_spec(RUN_NAME, spec).run_key


def _start_run(obs: Observation) -> None:
    """Start the accepted run at every org through its own API.

    First, for each ``reduce`` kill, the hold file that stops the org once its update of
    that round is made and exported, before any of it is sent: the kill then always
    finds it there (watching the export alone, the round could end first)."""
    for kill in obs.scenario.kills:
        if kill.stage == "reduce":
            hold = _hold_file(obs, kill)
            hold.parent.mkdir(parents=True, exist_ok=True)
            hold.touch()
    for org in obs.scenario.names:
        node = obs.nodes[org]
        with node.client() as c:
            _check(c.post(f"/v1/runs/{node.run_id}/start", json={}), f"start at {org}")
            node.state = "running"


# --------------------------------------------------------------------------- following


def _follow_events(node: NodeProcess, run_id: str, obs: Observation, stop: threading.Event) -> None:
    """Read the org's event stream; record each round's survivors."""
    try:
        with (
            node.client(timeout=None) as c,
            c.stream("GET", f"/v1/runs/{run_id}/events") as response,
        ):
            kind = ""
            obs.listening.add(node.org)
            for line in response.iter_lines():
                if stop.is_set():
                    return
                if line.startswith("event:"):
                    kind = line.partition(":")[2].strip()
                elif line.startswith("data:") and kind == "round":
                    data = json.loads(line.partition(":")[2])
                    obs.survivors.setdefault(int(data["round"]), tuple(data["survivors"]))
    except (httpx.HTTPError, ValueError, KeyError):
        return


def _poll(node: NodeProcess) -> None:
    if node.down or not node.run_id:
        return
    try:
        with node.client(timeout=5.0) as c:
            row = c.get(f"/v1/runs/{node.run_id}").json()
        node.state, node.round = str(row["state"]), int(row["current_round"])
    except (httpx.HTTPError, ValueError, KeyError):
        return


def _collect_metrics(obs: Observation) -> None:
    for org, node in obs.nodes.items():
        if node.down or not node.run_id:
            continue
        rows: list[dict[str, Any]] = []
        with contextlib.suppress(httpx.HTTPError, ValueError, KeyError), node.client() as c:
            offset = 0
            while True:
                page = c.get(
                    f"/v1/runs/{node.run_id}/metrics", params={"offset": offset, "limit": 1000}
                ).json()
                rows.extend(page["data"])
                offset += len(page["data"])
                if not page["data"] or offset >= page["count"]:
                    break
        per_round = obs.metrics.setdefault(org, {})
        for row in rows:
            per_round.setdefault(int(row["round"]), {})[str(row["name"])] = float(row["value"])


def _export_file(obs: Observation, org: str, round0: int) -> Path:
    return obs.export_dir / org / obs.run_key / f"round-{round0:06d}.npy"


def _hold_file(obs: Observation, kill: Kill) -> Path:
    """The file that holds ``kill.org`` after its update of the kill's round is exported."""
    return _round_hold(obs, kill.org, kill.round - 1)


def _round_hold(obs: Observation, org: str, round0: int) -> Path:
    """While this file exists, ``org``'s engine (harness nodes only) waits after exporting
    its update of round ``round0`` (0-based), before sending anything of the round."""
    return _export_file(obs, org, round0).with_suffix(".hold")


def _kill_due(obs: Observation, kill: Kill) -> bool:
    node = obs.nodes[kill.org]
    if kill.stage == "reduce":
        return _export_file(obs, kill.org, kill.round - 1).exists()
    return node.state == "running" and node.round >= kill.round - 1


def _inject_kill(procs: _Processes, obs: Observation, kill: Kill) -> None:
    node = obs.nodes[kill.org]
    assert node.proc is not None
    procs.kill9(node.proc)
    node.down, node.state = True, "killed"
    _hold_file(obs, kill).unlink(missing_ok=True)
    obs.faults.append(
        {
            "kind": "kill",
            "org": kill.org,
            "round": kill.round,
            "stage": kill.stage,
            "signal": "SIGKILL",
            "rounds_done_at_kill": node.round,
            "update_exported": _export_file(obs, kill.org, kill.round - 1).exists(),
            "at_s": round(time.monotonic() - obs.t0, 2),
        }
    )


def _run_action(node: NodeProcess, action: str) -> bool:
    """``POST /v1/runs/{id}/<action>`` at ``node`` (``pause`` or ``resume``); whether it took."""
    with contextlib.suppress(httpx.HTTPError), node.client(timeout=10.0) as c:
        return c.post(f"/v1/runs/{node.run_id}/{action}", json={}).is_success
    return False


def _act_on_all(nodes: list[NodeProcess], action: str) -> list[NodeProcess]:
    """``action`` (``pause`` or ``resume``) at every node at once; the nodes where it took.

    Sent concurrently: one after another, the last org could finish its round and start
    the next before its pause arrived, or start a round well after the first resumed."""
    if not nodes:
        return []
    with ThreadPoolExecutor(max_workers=len(nodes)) as pool:
        took = list(pool.map(lambda n: _run_action(n, action), nodes))
    return [n for n, ok in zip(nodes, took, strict=True) if ok]


def _pause_all(obs: Observation) -> list[NodeProcess]:
    """Pause the run at every live org whose run is still going; those paused."""
    going = [n for n in obs.nodes.values() if not (n.down or n.state in _TERMINAL)]
    return _act_on_all(going, "pause")


def _pause_due(obs: Observation, wipe: Wipe) -> bool:
    """Time to pause everyone for a held wipe: the first org's update of round
    ``wipe.round`` is in the secure sum. The round cannot end before every participant's
    update is in too, so every org is inside that round: each one finishes it and stops
    before the next. Also due once any org finished that round (too late to hold it)."""
    for org, node in obs.nodes.items():
        if _export_file(obs, org, wipe.round - 1).exists():
            return True
        if node.state == "running" and node.round >= wipe.round:
            return True
    return False


def _paused_between_rounds(nodes: list[NodeProcess], wipe: Wipe) -> bool:
    """Whether every paused org finished the same round, ``wipe.round`` or later."""
    for node in nodes:
        _poll(node)
    rounds = {node.round for node in nodes}
    return len(rounds) == 1 and min(rounds) >= wipe.round


def _alive_seen(node: NodeProcess) -> set[str]:
    """The orgs ``node``'s membership view has alive now (empty if it does not answer)."""
    with contextlib.suppress(httpx.HTTPError, ValueError, KeyError), node.client(5.0) as c:
        peers = c.get("/v1/peers").json()["data"]
        return {str(p["org_id"]) for p in peers if p["status"] == "alive"}
    return set()


def _converged(nodes: list[NodeProcess]) -> bool:
    """Whether each of ``nodes`` sees every other one alive."""
    names = {n.org for n in nodes}
    return all(names - {n.org} <= _alive_seen(n) for n in nodes)


def _wait_converged(nodes: list[NodeProcess], timeout: float = 60.0) -> bool:
    """Wait until each node sees every other one alive (a round started before that may
    leave out an org whose view lags); whether they did within ``timeout``."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if _converged(nodes):
            return True
        time.sleep(0.2)
    return False


def _engine_round(obs: Observation, node: NodeProcess) -> int:
    """Rounds done by ``node``'s engine, from its state file (-1 if unreadable)."""
    from org_node.engine import STATE_FILE, EngineError, EngineState

    try:
        data = (node.data_dir / "runs" / obs.run_key / STATE_FILE).read_bytes()
        return EngineState.from_bytes(data).round
    except (OSError, EngineError):
        return -1


def _release(
    obs: Observation, held: list[NodeProcess], node: NodeProcess, record: dict[str, Any]
) -> None:
    """Resume the run at the ``held`` orgs once the restarted ``node`` has caught up with
    the round they are at and all of them see each other alive (90 s at most; at once
    if the node did not come back)."""
    if not node.down and node.run_id:
        end = time.monotonic() + 90
        while time.monotonic() < end:
            for other in held:
                _poll(other)
            at = max((other.round for other in held), default=0)
            if _engine_round(obs, node) >= at and _converged([*held, node]):
                record["caught_up_before_resume"] = True
                break
            time.sleep(0.2)
        else:
            record["caught_up_before_resume"] = False
    record["resumed_by"] = sorted(n.org for n in _act_on_all(held, "resume"))


def _inject_wipe(
    procs: _Processes, obs: Observation, wipe: Wipe, paused: list[NodeProcess] | None = None
) -> None:
    """kill -9, wipe the data directory, ``fedweave recover``, restart; record the outcome.

    ``paused``: for a held wipe, the orgs whose run was paused before it (the wiped one
    among them); the others resume once the org is back (see
    :mod:`org_node.harness.scenario`).
    """
    node = obs.nodes[wipe.org]
    out = obs.out
    assert node.proc is not None
    procs.kill9(node.proc)
    node.down = True
    done = node.round
    fault: dict[str, Any] = {
        "kind": "wipe",
        "org": wipe.org,
        "round": wipe.round,
        "signal": "SIGKILL",
        "rounds_done_at_wipe": done,
        "at_s": round(time.monotonic() - obs.t0, 2),
    }
    obs.faults.append(fault)
    held = [n for n in paused or [] if n.org != wipe.org]
    if paused is not None:
        fault["held_by"] = sorted(n.org for n in held)
        fault["held_at_round"] = max((n.round for n in held), default=done)
    # the updates it exported so far are in sums already: keep them as they were
    kept = out / "wiped-exports" / wipe.org
    source = obs.export_dir / wipe.org
    if source.exists():
        shutil.copytree(source, kept, dirs_exist_ok=True)
        obs.wiped_exports[wipe.org] = kept
    shutil.rmtree(node.data_dir)
    peer = next(o for o in obs.scenario.names if o != wipe.org and not obs.nodes[o].down)
    chain = out / "chains" / f"{peer}-for-{wipe.org}.json"
    chain.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(obs.nodes[peer].data_dir / "federation" / "chain.json", chain)
    record: dict[str, Any] = {"org": wipe.org, "after_round": wipe.round, "chain_from": peer}
    obs.recoveries.append(record)
    # the restarted org waits at the round the others are held before, so that all of
    # them enter it together once released (its ready window would otherwise start
    # while the others wait for the membership views to converge)
    hold = _round_hold(obs, wipe.org, fault["held_at_round"]) if held else None
    if hold is not None:
        hold.parent.mkdir(parents=True, exist_ok=True)
        hold.touch()
    try:
        _recover_and_restart(procs, obs, node, wipe, chain, record)
    finally:
        if held:
            _release(obs, held, node, record)
        if hold is not None:  # the restarted org goes on with the others
            hold.unlink(missing_ok=True)


def _recover_and_restart(
    procs: _Processes,
    obs: Observation,
    node: NodeProcess,
    wipe: Wipe,
    chain: Path,
    record: dict[str, Any],
) -> None:
    out = obs.out
    log = out / "logs" / f"{wipe.org}-recover.log"
    proc = procs.popen(
        _cli(
            "recover",
            "--data-dir",
            str(node.data_dir),
            "--backup",
            str(out / "backups" / f"{wipe.org}-recovery-backup.json"),
            "--manifest",
            str(chain),
            "--admin-port",
            str(node.admin_port),
            "--timeout",
            "60",
        ),
        log,
        _node_env(out, export=False),
    )
    try:
        rc = proc.wait(timeout=120)
    except subprocess.TimeoutExpired:
        procs.kill9(proc)
        rc = -9
    text = log.read_text(errors="replace")
    record["recover_exit"] = rc
    if rc != 0:
        record["outcome"] = "recover failed: " + (text.strip().splitlines() or ["?"])[-1]
        return
    tokens = _TOKEN.findall(text)
    node.token = tokens[-1] if tokens else ""
    from org_node.engine import STATE_FILE, EngineState

    state_file = node.data_dir / "runs" / obs.run_key / STATE_FILE
    if state_file.exists():
        record["recovered_round"] = EngineState.from_bytes(state_file.read_bytes()).round
    # the operator's config (training share, engine, peer port behind the relay) back in place
    shutil.copyfile(out / "configs" / f"{wipe.org}.toml", node.data_dir / "fedweave.toml")
    node.restarts += 1
    _start(procs, node, out)
    _wait_ready(node, out)
    node.run_id, node.state, node.round = "", "running", int(record.get("recovered_round", 0))
    end = time.monotonic() + 30
    while time.monotonic() < end and not node.run_id:
        with contextlib.suppress(httpx.HTTPError, ValueError, KeyError), node.client() as c:
            for row in c.get("/v1/runs").json()["data"]:
                if row["name"] == RUN_NAME:
                    node.run_id = str(row["id"])
        time.sleep(0.2)
    record["outcome"] = "restarted" if node.run_id else "restarted, but the run did not resume"


def _listen(obs: Observation, stop: threading.Event) -> None:
    """One event-stream reader per org, subscribed before the run starts."""
    for nd in obs.nodes.values():
        threading.Thread(
            target=_follow_events, args=(nd, nd.run_id, obs, stop), daemon=True
        ).start()
    end = time.monotonic() + 5
    while time.monotonic() < end and len(obs.listening) < len(obs.nodes):
        time.sleep(0.05)


def _follow(
    procs: _Processes,
    obs: Observation,
    timeout: float,
    progress: ProgressFn | None,
    stop: threading.Event,
) -> None:
    s = obs.scenario
    kills = list(s.kills)
    wipes = list(s.wipes)
    holds: dict[Wipe, tuple[float, list[NodeProcess]]] = {}
    end = time.monotonic() + timeout
    try:
        while True:
            for node in obs.nodes.values():
                _poll(node)
                if not node.down and node.proc is not None and node.proc.poll() is not None:
                    node.down, node.state = True, f"exited ({node.proc.returncode})"
            for kill in list(kills):
                if _kill_due(obs, kill):
                    _inject_kill(procs, obs, kill)
                    kills.remove(kill)
            for wipe in list(wipes):
                node = obs.nodes[wipe.org]
                if wipe.hold:
                    if wipe not in holds:
                        if _pause_due(obs, wipe):
                            holds[wipe] = (time.monotonic(), _pause_all(obs))
                        continue
                    since, paused = holds[wipe]
                    if not _paused_between_rounds(paused, wipe) and time.monotonic() < since + 120:
                        continue
                    _inject_wipe(procs, obs, wipe, paused)
                    wipes.remove(wipe)
                elif node.state == "running" and node.round >= wipe.round:
                    _inject_wipe(procs, obs, wipe)
                    wipes.remove(wipe)
            if progress is not None:
                progress(obs)
            live = [n for n in obs.nodes.values() if not n.down]
            if not kills and not wipes and all(n.state in _TERMINAL for n in live):
                break
            if not live:
                obs.errors.append("every node is down")
                break
            if time.monotonic() > end:
                obs.timed_out = True
                obs.errors.append(f"the run did not end within {timeout:g} s")
                break
            time.sleep(0.1)
    finally:
        obs.states = {org: node.state for org, node in obs.nodes.items()}


# --------------------------------------------------------------------------- entry point


def run_harness(
    scenario: Scenario,
    out: Path,
    *,
    timeout: float | None = None,
    progress: ProgressFn | None = None,
    on_started: Callable[[Observation, list[int]], None] | None = None,
) -> Observation:
    """Create the federation in ``out``, run ``scenario``, stop everything; what was seen.

    ``timeout`` bounds the run itself (default: 60 s plus 30 s per round and per fault).
    ``on_started(observation, pids)`` is called once every node is ready.
    Raises :class:`HarnessError` (set-up failures) or :class:`Interrupted` (Ctrl-C).
    """
    out = Path(out)
    if out.exists() and any(out.iterdir()):
        raise HarnessError(f"{out} is not empty; choose a new --out directory")
    for sub in ("nodes", "backups", "configs", "logs", EXPORT_DIR):
        (out / sub).mkdir(parents=True, exist_ok=True)
    obs = Observation(scenario, out)
    procs = _Processes()
    stop = threading.Event()
    relays: DelayRelays | None = None
    limit = timeout or 60.0 + 30.0 * (
        scenario.rounds + len(scenario.kills) + 2 * len(scenario.wipes)
    )
    with _Interrupt():
        try:
            obs.nodes = _create(scenario, out)
            if scenario.delay_ms:
                relays = DelayRelays(
                    {n.public_peer_port: n.peer_port for n in obs.nodes.values()},
                    scenario.delay_ms,
                )
                relays.start()
            for node in obs.nodes.values():
                _start(procs, node, out)
            for node in obs.nodes.values():
                _wait_ready(node, out)
            if on_started is not None:
                on_started(obs, procs.pids)
            _propose_and_accept(obs)
            _listen(obs, stop)
            _wait_converged(list(obs.nodes.values()))
            _start_run(obs)
            _follow(procs, obs, limit, progress, stop)
            _collect_metrics(obs)
        finally:
            stop.set()
            with _no_signals():
                procs.stop_all()
                if relays is not None:
                    relays.stop()
    obs.elapsed_s = round(time.monotonic() - obs.t0, 2)
    return obs
