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
3. **wait** until every node's membership view has every other org alive (when they
   never do within 60 s, no run is started and the verdict says which org missed
   which), then **propose** the run once at org1's REST API (the node sends the signed
   proposal to every participant) and **accept** it at every org through its own API;
   the run starts by itself at the time the consents agree on;
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
import subprocess
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx

from org_node.harness.nodes import (
    EXPORT_DIR,
    RUN_NAME,
    HarnessError,
    NodeProcess,
    Observation,
    Processes,
    ProgressFn,
    cli,
    export_file,
    hold_file,
    interrupt,
    no_signals,
    node_env,
    round_hold,
    start,
    wait_ready,
)
from org_node.harness.proxy import DelayRelays
from org_node.harness.scenario import Kill, Scenario, Wipe
from org_node.harness.setup import (
    bring_data,
    bring_trainer,
    create,
    propose_and_accept,
    start_run,
)

__all__ = ["run_harness", "wait_converged", "wipe_and_recover"]

_TERMINAL = {"completed", "failed", "aborted", "declined"}
_TOKEN = re.compile(r"token[^:]*:\s*(\S+)")


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


def _kill_due(obs: Observation, kill: Kill) -> bool:
    node = obs.nodes[kill.org]
    if kill.stage == "reduce":
        return export_file(obs, kill.org, kill.round - 1).exists()
    return node.state == "running" and node.round >= kill.round - 1


def _inject_kill(procs: Processes, obs: Observation, kill: Kill) -> None:
    node = obs.nodes[kill.org]
    assert node.proc is not None
    procs.kill9(node.proc)
    node.down, node.state = True, "killed"
    hold_file(obs, kill).unlink(missing_ok=True)
    obs.faults.append(
        {
            "kind": "kill",
            "org": kill.org,
            "round": kill.round,
            "stage": kill.stage,
            "signal": "SIGKILL",
            "rounds_done_at_kill": node.round,
            "update_exported": export_file(obs, kill.org, kill.round - 1).exists(),
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
    """Time to pause everyone for a held wipe: every live org has its round-0 model (it
    is past its worker's start, which can hold an org back for seconds, and so inside
    the rounds) and the first org's update of round ``wipe.round`` is made. The round
    cannot end before every participant's update is in too, so every org is inside that
    round: each one finishes it and stops before the next (a pause acts between rounds;
    an org paused before it entered the round would leave the others short of the
    threshold there). Also due once any org finished that round (too late to hold it)."""
    live = [org for org, node in obs.nodes.items() if not node.down]
    started = all((obs.export_dir / org / obs.run_key / "initial.npz").exists() for org in live)
    if started and any(export_file(obs, org, wipe.round - 1).exists() for org in live):
        return True
    return any(node.state == "running" and node.round >= wipe.round for node in obs.nodes.values())


def _hold_next_round(obs: Observation, wipe: Wipe) -> None:
    """Before pausing for a held wipe, hold every live org at the round after
    ``wipe.round`` (before it sends anything of it): a pause that arrives once an org has
    entered that round (a fast round) acts only after it, but the hold stops the org
    there all the same, so every org stays at round ``wipe.round`` until released. The
    run's set-up made these holds already (:func:`org_node.harness.setup.propose_and_accept`),
    so an org cannot slip past them while the harness is slow to look; this makes sure."""
    for org, node in obs.nodes.items():
        if not node.down:
            hold = round_hold(obs, org, wipe.round)
            hold.parent.mkdir(parents=True, exist_ok=True)
            hold.touch()


def _unhold_next_round(obs: Observation, wipe: Wipe) -> None:
    for org in obs.nodes:
        round_hold(obs, org, wipe.round).unlink(missing_ok=True)


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


def _not_seen(nodes: list[NodeProcess]) -> list[str]:
    """One line per node of ``nodes`` that does not see every other one alive (empty when
    each does): which orgs it misses."""
    names = {n.org for n in nodes}
    lines = []
    for node in nodes:
        missing = sorted(names - {node.org} - _alive_seen(node))
        if missing:
            lines.append(f"{node.org} does not see {', '.join(missing)} alive")
    return lines


def _converged(nodes: list[NodeProcess]) -> bool:
    """Whether each of ``nodes`` sees every other one alive."""
    return not _not_seen(nodes)


CONVERGE_TIMEOUT_S = 60.0
"""How long the harness waits for the nodes to see each other alive before the run."""


def wait_converged(nodes: list[NodeProcess], timeout: float = CONVERGE_TIMEOUT_S) -> list[str]:
    """Wait until each node sees every other one alive (a round started before that may
    leave out an org whose view lags); what was still not seen after ``timeout`` (empty
    when they converged)."""
    end = time.monotonic() + timeout
    while True:
        lacking = _not_seen(nodes)
        if not lacking or time.monotonic() >= end:
            return lacking
        time.sleep(0.2)


def _converge_or_explain(obs: Observation) -> bool:
    """Wait for the membership views to converge before the run is proposed; when they
    never do, say so as the harness's failure reason (no run is started)."""
    lacking = wait_converged(list(obs.nodes.values()), CONVERGE_TIMEOUT_S)
    obs.membership_converged = not lacking
    if lacking:
        obs.errors.append(
            f"the nodes never all saw each other alive within {CONVERGE_TIMEOUT_S:g} s, so no "
            f"run was started (membership): {'; '.join(lacking)}"
        )
    return not lacking


def _engine_round(obs: Observation, node: NodeProcess) -> int:
    """Rounds done by ``node``'s engine, from its state file (-1 if unreadable)."""
    from org_node.engine import STATE_FILE, EngineError, EngineState

    try:
        data = (node.data_dir / "runs" / obs.run_key / STATE_FILE).read_bytes()
        return EngineState.from_bytes(data).round
    except (OSError, EngineError):
        return -1


def _worker_serving(obs: Observation, node: NodeProcess) -> bool:
    """Whether ``node``'s local worker for the run has started serving (its log says so)."""
    log = node.data_dir / "runs" / obs.run_key / "worker" / "worker.log"
    try:
        return "serving trainer" in log.read_text(errors="replace")
    except OSError:
        return False


def _release(
    obs: Observation, held: list[NodeProcess], node: NodeProcess, record: dict[str, Any]
) -> None:
    """Resume the run at the ``held`` orgs once the restarted ``node`` has caught up with
    the round they are at, its local worker is serving (starting one loads Python and
    torch: seconds of CPU in which its membership may lag) and all of them see each
    other alive (90 s at most; at once if the node did not come back)."""
    if not node.down and node.run_id:
        end = time.monotonic() + 90
        while time.monotonic() < end:
            for other in held:
                _poll(other)
            at = max((other.round for other in held), default=0)
            caught_up = _engine_round(obs, node) >= at and _worker_serving(obs, node)
            if caught_up and _converged([*held, node]):
                record["caught_up_before_resume"] = True
                break
            time.sleep(0.2)
        else:
            record["caught_up_before_resume"] = False
    resumed: list[NodeProcess] = []
    for _ in range(3):  # a resume lost to a busy node's API timeout is sent again
        resumed += _act_on_all([n for n in held if n not in resumed], "resume")
        if len(resumed) == len(held):
            break
        time.sleep(1.0)
    record["resumed_by"] = sorted(n.org for n in resumed)


def _kill_strays(data_dir: Path) -> None:
    """``kill -9`` what a killed node left running on ``data_dir`` (its local worker runs
    in a session of its own, and would exit only once it sees the node gone)."""
    needle = f"{data_dir}/".encode()
    for proc in Path("/proc").glob("[0-9]*"):
        with contextlib.suppress(OSError, ValueError):
            if needle in (proc / "cmdline").read_bytes():
                os.kill(int(proc.name), signal.SIGKILL)


def _inject_wipe(
    procs: Processes, obs: Observation, wipe: Wipe, paused: list[NodeProcess] | None = None
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
    _kill_strays(node.data_dir)
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
    hold = round_hold(obs, wipe.org, fault["held_at_round"]) if held else None
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
        if paused is not None:
            _unhold_next_round(obs, wipe)


def _recover_and_restart(
    procs: Processes,
    obs: Observation,
    node: NodeProcess,
    wipe: Wipe,
    chain: Path,
    record: dict[str, Any],
) -> None:
    out = obs.out
    log = out / "logs" / f"{wipe.org}-recover.log"
    proc = procs.popen(
        cli(
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
        node_env(out, export=False),
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
    start(procs, node, out)
    wait_ready(node, out)
    # the wiped database held the org's installed trainer and its registered dataset: its
    # admin installs and registers them again, and the node resumes the run once they are
    bring_trainer(node, obs.scenario)
    bring_data(node, obs.scenario)
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
    procs: Processes,
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
                            _hold_next_round(obs, wipe)
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
    procs = Processes()
    stop = threading.Event()
    relays: DelayRelays | None = None
    limit = timeout or 60.0 + 30.0 * (
        scenario.rounds + len(scenario.kills) + 2 * len(scenario.wipes)
    )
    with interrupt():
        try:
            obs.nodes = create(scenario, out)
            if scenario.delay_ms:
                relays = DelayRelays(
                    {n.public_peer_port: n.peer_port for n in obs.nodes.values()},
                    scenario.delay_ms,
                )
                relays.start()
            for node in obs.nodes.values():
                start(procs, node, out)
            for node in obs.nodes.values():
                wait_ready(node, out)
            if on_started is not None:
                on_started(obs, procs.pids)
            if _converge_or_explain(obs):
                propose_and_accept(obs)
                _listen(obs, stop)
                start_run(obs)
                _follow(procs, obs, limit, progress, stop)
                _collect_metrics(obs)
        finally:
            stop.set()
            with no_signals():
                procs.stop_all()
                if relays is not None:
                    relays.stop()
    obs.elapsed_s = round(time.monotonic() - obs.t0, 2)
    return obs


# --------------------------------------------------------------------------- steps for others


def wipe_and_recover(procs: Processes, obs: Observation, org: str) -> dict[str, Any]:
    """``kill -9`` ``org``, wipe its data directory, ``fedweave recover`` it from its
    peers and its offline backup, restart it and bring its trainer and data back (the
    others go on meanwhile); the recovery's record (``outcome``, ``recovered_round``)."""
    node = obs.nodes[org]
    _inject_wipe(procs, obs, Wipe(org, max(node.round, 1)))
    return obs.recoveries[-1]
