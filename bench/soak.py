"""Soak: five orgs over mutual TLS train one long run under a stream of faults.

Run ``python -m bench.soak [--quick] [--json PATH]``. The federation is the harness's
(:mod:`org_node.harness`): five real ``fedweave run`` processes on 127.0.0.1, mutual TLS
between them, ``t = 3``, the breast-cancer task. First a fault-free run of a few rounds
is timed (the baseline); then a run of 200 rounds (50 with ``--quick``) in which, every
few rounds, one fault from a seeded shuffle of these four starts, holds while the
federation finishes two more rounds (at most ``HOLD_S`` seconds), and heals:

- ``kill``: ``kill -9`` of a random org's process group; healed by starting it again
  (``fedweave run`` on the same data directory);
- ``wipe``: ``kill -9``, its data directory deleted, ``fedweave recover`` from its peers'
  shards and its offline backup, restarted, its trainer and data brought back;
- ``partition``: a random org's process group stopped (``SIGSTOP``): no byte leaves or
  reaches it (its connections stay open in the kernel), healed by ``SIGCONT``;
- ``disk_full``: the last org's data directory is a small tmpfs mount, filled up to
  ``ENOSPC`` by a filler file; healed by deleting the file (the node must notice on its
  own). Without the right to mount (not root, no user namespace) this fault is left out
  and the note says so.

One fault at a time, so four of five orgs are always up: every round's quorum (3) was up
by construction, and ``rounds_completed_ratio`` is the rounds the federation completed
over the rounds planned (target ``>= 0.99``). ``runs_failed``: orgs whose run ended
``failed`` (target 0). ``audit_verified``: orgs whose egress log passes ``fedweave audit
verify --from-peers`` against the heads their peers hold (target: all five).
``state_lost``: orgs that ended without the federation's final model (its hash differs
from the majority's, or the engine state is missing or behind; target 0). The row
``round_s[soak_vs_fault_free]`` is the mean wall time per round under faults against the
fault-free baseline measured in the same run. The faults injected and what each did are
in the JSON's notes and printed as they happen.
"""

from __future__ import annotations

import contextlib
import errno
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from bench.common import Report, run_main

__all__ = ["FAULTS", "main"]

ORGS = 5
ROUNDS, QUICK_ROUNDS = 200, 50
BASELINE_ROUNDS, QUICK_BASELINE_ROUNDS = 20, 10
EVERY = 5
"""Rounds between the end of one fault and the start of the next."""
HOLD_ROUNDS = 2
HOLD_S = 45.0
FAULTS = ("kill", "wipe", "partition", "disk_full")
TMPFS_SIZE = "96m"
_TERMINAL = {"completed", "failed", "aborted", "declined", "budget_exhausted"}


@dataclass
class Fault:
    """One fault: what, where, when it started and healed, and what was seen."""

    kind: str
    org: str
    start_round: int
    started: float = field(default_factory=time.monotonic)
    healed_round: int | None = None
    seen: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "org": self.org,
            "start_round": self.start_round,
            "healed_round": self.healed_round,
            **self.seen,
        }


def _say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


# --------------------------------------------------------------------------- the disk


def _mount_tmpfs(path: Path) -> str | None:
    """Mount a small tmpfs at ``path``; None, or why it could not."""
    path.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={TMPFS_SIZE}", "tmpfs", str(path)],
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        return (done.stderr.strip() or "mount failed").splitlines()[-1]
    return None


def _umount(path: Path) -> None:
    subprocess.run(["umount", "-l", str(path)], capture_output=True)


def _fill(path: Path) -> int:
    """Write zeros into ``path`` until the file system is full; bytes written."""
    written = 0
    chunk = b"\0" * (1 << 20)
    with open(path, "wb", buffering=0) as f:
        while True:
            try:
                written += f.write(chunk)
            except OSError as exc:
                if exc.errno != errno.ENOSPC:
                    raise
                break
    with contextlib.suppress(OSError), open(path, "ab", buffering=0) as f:
        while True:  # the last partial block too
            written += f.write(b"\0" * 4096)
    return written


# --------------------------------------------------------------------------- one run


class Soak:
    """One federation of the harness and one run on it, with faults injected."""

    def __init__(self, out: Path, rounds: int, seed: int, *, faults: bool) -> None:
        from org_node.harness.nodes import Observation, Processes
        from org_node.harness.scenario import Scenario

        self.out = out
        self.rounds = rounds
        self.rng = random.Random(seed)
        self.with_faults = faults
        scenario = Scenario(orgs=ORGS, rounds=rounds, task="breast_cancer", seed=seed)
        self.obs = Observation(scenario, out)
        self.procs = Processes()
        self.victim = scenario.names[-1]
        self.mounted: Path | None = None
        self.no_disk_reason = ""
        self.faults: list[Fault] = []
        self.active: Fault | None = None
        self.next_at = EVERY
        self.run_s = 0.0
        self.judged: dict[str, tuple[int, str]] = {}
        self.reasons: dict[str, str] = {}

    # ---- set-up and tear-down

    def create(self) -> None:
        from org_node.harness.setup import create

        for sub in ("nodes", "backups", "configs", "logs", "debug-export"):
            (self.out / sub).mkdir(parents=True, exist_ok=True)
        if self.with_faults:
            target = self.out / "nodes" / self.victim
            why = _mount_tmpfs(target)
            if why is None:
                self.mounted = target
            else:
                self.no_disk_reason = why
        self.obs.nodes = create(self.obs.scenario, self.out)

    def start(self) -> None:
        from org_node.harness.nodes import HarnessError, start, wait_ready
        from org_node.harness.runner import wait_converged
        from org_node.harness.setup import propose_and_accept, start_run

        for node in self.obs.nodes.values():
            start(self.procs, node, self.out)
        for node in self.obs.nodes.values():
            wait_ready(node, self.out)
        lacking = wait_converged(list(self.obs.nodes.values()))
        if lacking:
            raise HarnessError("membership never converged: " + "; ".join(lacking))
        propose_and_accept(self.obs)
        start_run(self.obs)

    def stop(self) -> None:
        for fault in [self.active] if self.active else []:
            if fault.kind == "partition":  # a stopped group cannot take SIGTERM
                self._signal(fault.org, signal.SIGCONT)
        self.procs.stop_all()
        if self.mounted is not None:
            _umount(self.mounted)

    # ---- what the nodes say

    def poll(self) -> None:
        for node in self.obs.nodes.values():
            if node.down or not node.run_id:
                continue
            if node.proc is not None and node.proc.poll() is not None:
                node.down, node.state = True, f"exited ({node.proc.returncode})"
                continue
            with contextlib.suppress(httpx.HTTPError, ValueError, KeyError):
                with node.client(timeout=3.0) as c:
                    row = c.get(f"/v1/runs/{self.obs.run_key}").json()
                node.state, node.round = str(row["state"]), int(row["current_round"])
                if row.get("state_reason"):
                    self.reasons[node.org] = str(row["state_reason"])

    def federation_round(self) -> int:
        return max((n.round for n in self.obs.nodes.values()), default=0)

    def ended(self) -> bool:
        live = [n for n in self.obs.nodes.values() if not n.down]
        return bool(live) and self.active is None and all(n.state in _TERMINAL for n in live)

    # ---- faults

    def _signal(self, org: str, sig: signal.Signals) -> None:
        proc = self.obs.nodes[org].proc
        if proc is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, sig)

    def _choose(self) -> str:
        kinds = [k for k in FAULTS if k != "disk_full" or self.mounted is not None]
        counts = Counter(f.kind for f in self.faults)
        least = min(counts.get(k, 0) for k in kinds)
        return self.rng.choice([k for k in kinds if counts.get(k, 0) == least])

    def _org_for(self, kind: str) -> str:
        if kind == "disk_full":
            return self.victim
        # a wipe deletes the data directory: never the mount point
        names = [o for o in self.obs.scenario.names if kind != "wipe" or o != self.victim]
        return self.rng.choice(names)

    def begin(self) -> None:
        from org_node.harness.runner import wipe_and_recover

        kind = self._choose()
        fault = Fault(kind, self._org_for(kind), self.federation_round())
        node = self.obs.nodes[fault.org]
        _say(f"round {fault.start_round}: {kind} {fault.org}")
        if kind == "kill":
            assert node.proc is not None
            self.procs.kill9(node.proc)
            node.down = True
        elif kind == "partition":
            self._signal(fault.org, signal.SIGSTOP)
        elif kind == "disk_full":
            fault.seen["filled_bytes"] = _fill(node.data_dir / ".soak-filler")
        elif kind == "wipe":
            record = wipe_and_recover(self.procs, self.obs, fault.org)
            fault.seen["outcome"] = record.get("outcome")
            fault.seen["recovered_round"] = record.get("recovered_round")
        self.faults.append(fault)
        self.active = fault

    def _readyz(self, org: str) -> int | None:
        node = self.obs.nodes[org]
        with contextlib.suppress(httpx.HTTPError):
            return httpx.get(f"{node.admin_url}/readyz", timeout=2.0).status_code
        return None

    def tend(self) -> None:
        """Heal the active fault once the federation moved on (or it held long enough)."""
        fault = self.active
        if fault is None:
            return
        if fault.kind == "disk_full" and self._readyz(fault.org) == 503:
            fault.seen["not_ready_while_full"] = True
        moved = self.federation_round() >= fault.start_round + HOLD_ROUNDS
        if fault.kind != "wipe" and not moved and time.monotonic() < fault.started + HOLD_S:
            return
        self.heal(fault)

    def heal(self, fault: Fault) -> None:
        from org_node.harness.nodes import start, wait_ready

        node = self.obs.nodes[fault.org]
        if fault.kind == "kill":
            start(self.procs, node, self.out)
            wait_ready(node, self.out)
            node.restarts += 1
        elif fault.kind == "partition":
            self._signal(fault.org, signal.SIGCONT)
        elif fault.kind == "disk_full":
            (node.data_dir / ".soak-filler").unlink(missing_ok=True)
            end = time.monotonic() + 60
            while time.monotonic() < end and self._readyz(fault.org) != 200:
                time.sleep(0.5)
            fault.seen["ready_again"] = self._readyz(fault.org) == 200
        fault.healed_round = self.federation_round()
        fault.seen["held_s"] = round(time.monotonic() - fault.started, 1)
        _say(f"round {fault.healed_round}: healed {fault.kind} {fault.org}")
        self.active = None
        self.next_at = fault.healed_round + EVERY

    # ---- the run

    def _fault_due(self) -> bool:
        r = self.federation_round()
        return self.next_at <= r < self.rounds - HOLD_ROUNDS and not self.ended()

    def follow(self, timeout: float) -> bool:
        """Inject faults until the run ends at every live org; whether it did in time."""
        t0 = time.monotonic()
        end = t0 + timeout
        while time.monotonic() < end:
            self.poll()
            if self.with_faults:
                if self.active is not None:
                    self.tend()
                elif self._fault_due():
                    self.begin()
            if self.ended():
                self.run_s = time.monotonic() - t0
                return True
            time.sleep(0.2)
        self.run_s = time.monotonic() - t0
        return False


# --------------------------------------------------------------------------- judging


def _final_hashes(soak: Soak) -> dict[str, tuple[int, str] | None]:
    from org_node.harness.verdict import final_state
    from org_node.run_state import model_hash

    out: dict[str, tuple[int, str] | None] = {}
    for org, node in soak.obs.nodes.items():
        state = final_state(node.data_dir, soak.obs.run_key)
        out[org] = None if state is None else (int(state.round), model_hash(state.model).hex())
    return out


def _state_lost(soak: Soak) -> tuple[int, str]:
    finals = _final_hashes(soak)
    hashes = Counter(v[1] for v in finals.values() if v is not None and v[0] == soak.rounds)
    majority = hashes.most_common(1)[0][0] if hashes else ""
    lost = sorted(
        org for org, v in finals.items() if v is None or v[0] < soak.rounds or v[1] != majority
    )
    return len(lost), ", ".join(lost) or "none"


def _audit_verified(soak: Soak) -> tuple[int, str]:
    from org_node.harness.nodes import cli

    failed: list[str] = []
    for org, node in soak.obs.nodes.items():
        log = node.data_dir / "audit" / "egress.jsonl"
        args = cli("audit", "verify", str(log), "--data-dir", str(node.data_dir), "--from-peers")
        env = dict(os.environ, FEDWEAVE_TOKEN=node.token)
        done = subprocess.run(args, capture_output=True, text=True, env=env, timeout=120)
        if done.returncode != 0:
            line = (done.stdout + done.stderr).strip().splitlines() or ["?"]
            failed.append(f"{org}: {line[-1][:120]}")
    return len(soak.obs.nodes) - len(failed), "; ".join(failed)


def _one_run(root: Path, rounds: int, seed: int, *, faults: bool) -> Soak:
    soak = Soak(root, rounds, seed, faults=faults)
    try:
        soak.create()
        soak.start()
        soak.follow(timeout=180.0 + 30.0 * rounds)
        soak.poll()
        soak.judged = {
            "state_lost": _state_lost(soak),
            "audit_verified": _audit_verified(soak) if faults else (0, ""),
        }
    finally:
        soak.stop()
    return soak


def body(report: Report) -> None:
    rounds = QUICK_ROUNDS if report.quick else ROUNDS
    base_rounds = QUICK_BASELINE_ROUNDS if report.quick else BASELINE_ROUNDS
    with tempfile.TemporaryDirectory(prefix="fw-soak-") as tmp:
        _say(f"fault-free baseline: {base_rounds} rounds")
        base = _one_run(Path(tmp) / "baseline", base_rounds, 7, faults=False)
        _say(f"soak: {rounds} rounds, a fault every {EVERY} rounds")
        soak = _one_run(Path(tmp) / "soak", rounds, 7, faults=True)
    kinds = Counter(f.kind for f in soak.faults)
    faults_note = ", ".join(f"{k} {kinds.get(k, 0)}" for k in FAULTS)
    if soak.no_disk_reason:
        faults_note += f" (disk_full left out: {soak.no_disk_reason})"
    done = max((n.round for n in soak.obs.nodes.values()), default=0)
    report.add(
        "rounds_completed_ratio",
        done / rounds,
        "x",
        target=">= 0.99",
        target_is_absolute=True,
        note=f"{done} of {rounds} rounds; one fault at a time, so 4 of 5 orgs (t = 3) were "
        f"up in every round; faults: {faults_note}",
    )
    failed = sorted(o for o, n in soak.obs.nodes.items() if n.state == "failed")
    states = Counter(n.state for n in soak.obs.nodes.values())
    report.add(
        "runs_failed",
        float(len(failed)),
        "orgs",
        target="<= 0",
        target_is_absolute=True,
        note=f"end states: {dict(states)}; "
        + "; ".join(f"{o}: {soak.reasons.get(o, '?')[:200]}" for o in failed),
    )
    verified, why = soak.judged["audit_verified"]
    report.add(
        "audit_verified",
        float(verified),
        "orgs",
        target=f">= {ORGS}",
        target_is_absolute=True,
        note="fedweave audit verify --from-peers: "
        + (f"failed: {why}" if why else "every org's log verified"),
    )
    lost, who = soak.judged["state_lost"]
    report.add(
        "state_lost",
        float(lost),
        "orgs",
        target="<= 0",
        target_is_absolute=True,
        note=f"orgs without the final model: {who}",
    )
    base_round = base.run_s / base_rounds
    report.add(
        "round_s[soak_vs_fault_free]",
        soak.run_s / rounds,
        "s",
        base_round,
        note=f"mean wall time per round; baseline: the same federation, {base_rounds} rounds, "
        "no fault; faults: " + "; ".join(str(f.to_json()) for f in soak.faults),
    )


def main(argv: Sequence[str] | None = None) -> Report:
    """``python -m bench.soak [--quick] [--json PATH]``."""
    return run_main("soak", body, argv, description=__doc__.splitlines()[0])


if __name__ == "__main__":
    main()
