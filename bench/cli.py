"""How fast the ``fedweave`` client commands answer, end to end, against a real node.

Run ``python -m bench.cli [--quick] [--json PATH]``. Two orgs are initialized with
``fedweave init`` in a temporary directory and found a federation (``federation found``,
``sign`` and ``install`` by both); both nodes are started with ``fedweave run`` and train
one two-round run (``runs propose``, ``accept``, ``start``), so that every command has
something real to show and ``audit fetch`` a report to make. Then ``org2``'s node is
stopped (one node on the machine while the commands are timed, so that the other's load
does not blur the figures) and each client command is run as an admin would, as a fresh
process of the ``fedweave`` console script with ``--data-dir`` of ``org1`` and the token
in ``FEDWEAVE_TOKEN``, timed from start to exit; the row is the best of a few runs (3
with ``--quick``, 7 without).

Rows ``cli_wall_s[command=...]`` for ``runs list``, ``runs show``, ``status``, ``peers``,
``tokens list``, ``trainers list``, ``datasets list`` and ``audit fetch``; target
``<= 0.5`` s on the value itself. Rows ``cli_wall_s[command=init]`` and
``[command=federation found|sign|install]``: the set-up commands as the federation was
made (no target; they read and write the node's files and never import torch). The
baseline is the bare interpreter's start and exit (``python -c pass``) measured in the
same run, so the ratio shows what the CLI itself costs. A command that answers with an
error still answers (the note says so and gives the error line, and how the run ended);
every node started is stopped (SIGTERM, then SIGKILL) in every case.
"""

from __future__ import annotations

import os
import select
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from bench.common import Report, run_main

__all__ = ["COMMANDS", "main"]

TARGET_S = 0.5
READY_TIMEOUT_S = 120.0
RUN_NAME = "bench-cli"

COMMANDS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("runs list", ("runs", "list")),
    ("runs show", ("runs", "show", RUN_NAME)),
    ("status", ("status",)),
    ("peers", ("peers",)),
    ("tokens list", ("tokens", "list")),
    ("trainers list", ("trainers", "list")),
    ("datasets list", ("datasets", "list")),
    ("audit fetch", ("audit", "fetch", "{run_id}", "--out", "{out}")),
)
"""Row name and arguments (``--data-dir`` is added); ``{run_id}`` and ``{out}`` filled in."""


def fedweave() -> list[str]:
    """The console script next to this interpreter (what an admin runs), else its module."""
    script = Path(sys.executable).with_name("fedweave")
    return [str(script)] if script.exists() else [sys.executable, "-m", "api.cli"]


@dataclass(frozen=True)
class Answer:
    """One timed run of a command: its wall time, exit status and first error line."""

    wall_s: float
    returncode: int
    stdout: str
    error: str


def timed_run(argv: Sequence[str], env: dict[str, str], *, timeout: float = 120.0) -> Answer:
    t0 = time.perf_counter()
    r = subprocess.run(list(argv), capture_output=True, text=True, env=env, timeout=timeout)
    wall = time.perf_counter() - t0
    error = next((line for line in r.stderr.splitlines() if line.strip()), "")
    return Answer(wall, r.returncode, r.stdout, error)


SETUP_S: dict[str, list[float]] = {}
"""The wall time of each set-up step this process ran, by command (``init``,
``federation found``, ...): the set-up rows."""


def checked(argv: Sequence[str], env: dict[str, str], what: str, command: str) -> str:
    """Run a setup step; its stdout, or RuntimeError naming the step and its error. Its
    wall time goes to :data:`SETUP_S` under ``command``."""
    start = time.monotonic()
    r = subprocess.run(list(argv), capture_output=True, text=True, env=env, timeout=600)
    wall = time.monotonic() - start
    if r.returncode != 0:
        raise RuntimeError(f"{what} failed (exit {r.returncode}): {r.stderr.strip()[-500:]}")
    SETUP_S.setdefault(command, []).append(wall)
    return r.stdout


def free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [int(s.getsockname()[1]) for s in socks]
    finally:
        for s in socks:
            s.close()


def _wait_ready(proc: subprocess.Popen[bytes], timeout: float) -> None:
    assert proc.stdout is not None
    seen = b""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        ready, _, _ = select.select([proc.stdout], [], [], 0.2)
        if ready:
            line = proc.stdout.readline()
            seen += line
            if b"ready:" in line:
                return
        if proc.poll() is not None:
            break
    raise RuntimeError(f"the node did not get ready (exit {proc.poll()}): {seen[-500:]!r}")


def _drain(proc: subprocess.Popen[bytes]) -> None:
    assert proc.stdout is not None
    for _line in iter(proc.stdout.readline, b""):
        pass


@contextmanager
def running_node(data_dir: Path, env: dict[str, str]) -> Iterator[subprocess.Popen[bytes]]:
    """``fedweave run --data-dir DIR`` until the block ends; stopped in every case."""
    proc = subprocess.Popen(
        [*fedweave(), "run", "--data-dir", str(data_dir)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env=env,
        start_new_session=True,
    )
    drain: threading.Thread | None = None
    try:
        _wait_ready(proc, READY_TIMEOUT_S)
        drain = threading.Thread(target=_drain, args=(proc,), daemon=True)
        drain.start()
        yield proc
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
        if drain is not None:
            drain.join(timeout=5)
        if proc.stdout is not None:
            proc.stdout.close()


def make_federation(root: Path, env: dict[str, str]) -> dict[str, tuple[Path, str]]:
    """``org1`` and ``org2`` initialized and federated (founded, signed and installed by
    both): each org's data dir and admin token."""
    ports = free_ports(4)
    orgs: dict[str, tuple[Path, str]] = {}
    for i, org in enumerate(("org1", "org2")):
        d = root / org
        out = checked(
            [
                *fedweave(),
                "init",
                "--org-id",
                org,
                "--data-dir",
                str(d),
                "--peer-port",
                str(ports[2 * i]),
                "--admin-port",
                str(ports[2 * i + 1]),
            ],
            env,
            f"fedweave init {org}",
            "init",
        )
        token = next(line.rsplit(" ", 1)[1] for line in out.splitlines() if "admin token" in line)
        orgs[org] = (d, token)
    manifest = root / "manifest.json"
    members = [a for d, _ in orgs.values() for a in ("--member", str(d / "member.json"))]
    checked(
        [
            *fedweave(),
            "federation",
            "found",
            "--federation",
            "bench",
            *members,
            "--out",
            str(manifest),
        ],
        env,
        "fedweave federation found",
        "federation found",
    )
    for step in ("sign", "install"):
        for d, _ in orgs.values():
            checked(
                [*fedweave(), "federation", step, str(manifest), "--data-dir", str(d)],
                env,
                f"fedweave federation {step}",
                f"federation {step}",
            )
    return orgs


def _cli(org: tuple[Path, str], env: dict[str, str], *args: str) -> Answer:
    """A client command at ``org`` (its data dir and token)."""
    return timed_run(
        [*fedweave(), *args, "--data-dir", str(org[0])], env | {"FEDWEAVE_TOKEN": org[1]}
    )


def train_one_run(orgs: dict[str, tuple[Path, str]], env: dict[str, str]) -> tuple[str, str]:
    """Propose, accept and start a two-round run at both orgs (both nodes running) and
    wait until ``org1`` has finished it: ``org1``'s run id, and its state (``completed``
    unless something went wrong: the timed commands still answer then, with what the
    node says)."""
    from org_node.cli_http import HttpClient, HttpError

    spec = ["--trainer", "breast_cancer", "--rounds", "2"]
    spec += ["--participant", "org1", "--participant", "org2"]
    proposed = _cli(orgs["org1"], env, "runs", "propose", "--name", RUN_NAME, *spec)
    if proposed.returncode != 0:
        raise RuntimeError(f"fedweave runs propose failed: {proposed.error}")
    http = HttpClient(_admin_url(orgs["org1"][0]), {"Authorization": f"Bearer {orgs['org1'][1]}"})
    rows = http.request("GET", "/v1/runs", params={"limit": 1000}).json()["data"]
    run_id = str(next(r["id"] for r in rows if r["name"] == RUN_NAME))
    # org2 hears of the proposal by gossip, or is proposed the same run itself
    end = time.monotonic() + 30
    while _cli(orgs["org2"], env, "runs", "show", RUN_NAME).returncode != 0:
        if time.monotonic() > end:
            _cli(orgs["org2"], env, "runs", "propose", "--name", RUN_NAME, *spec)
            break
        time.sleep(1)
    for org in orgs.values():
        _cli(org, env, "runs", "accept", RUN_NAME)
    deadline = time.monotonic() + 300
    pending = set(orgs)
    state = "proposed"
    while time.monotonic() < deadline:
        for name in sorted(pending):
            started = _cli(orgs[name], env, "runs", "start", RUN_NAME)
            if started.returncode == 0 or "waiting" not in started.error:
                pending.discard(name)  # started, or started on its own, or refused for good
        try:
            state = str(http.request("GET", f"/v1/runs/{run_id}").json()["state"])
        except (HttpError, ValueError, KeyError):
            state = "unknown"
        if state in ("completed", "failed", "aborted", "declined"):
            break
        time.sleep(1)
    return run_id, state


def _admin_url(data_dir: Path) -> str:
    from org_node.cli_common import admin_url

    return admin_url(None, data_dir)


def body(report: Report) -> None:
    repeats = 3 if report.quick else 7
    with tempfile.TemporaryDirectory(prefix="fw-bench-cli-") as tmp:
        root = Path(tmp)
        env = dict(os.environ, PYTHONUNBUFFERED="1", COLUMNS="160")
        for name in ("FEDWEAVE_URL", "FEDWEAVE_TOKEN", "FEDWEAVE_HARNESS_DEBUG_EXPORT"):
            env.pop(name, None)
        orgs = make_federation(root, env)
        with running_node(orgs["org1"][0], env):
            with running_node(orgs["org2"][0], env):
                run_id, state = train_one_run(orgs, env)
            # org2 is stopped: only the node the commands ask runs while they are timed
            baseline = min(
                timed_run([sys.executable, "-c", "pass"], env).wall_s for _ in range(repeats)
            )
            for name, walls in SETUP_S.items():
                report.add(
                    f"cli_wall_s[command={name}]",
                    min(walls),
                    "s",
                    baseline,
                    note=f"set-up command, best of {len(walls)} (one per org; run before any "
                    "node started); baseline: python -c pass",
                )
            for name, args in COMMANDS:
                filled = [a.format(run_id=run_id, out=root / "reports") for a in args]
                answers = [_cli(orgs["org1"], env, *filled) for _ in range(repeats)]
                best = min(a.wall_s for a in answers)
                last = answers[-1]
                outcome = "answered" if last.returncode == 0 else f"answered with: {last.error}"
                report.add(
                    f"cli_wall_s[command={name}]",
                    best,
                    "s",
                    baseline,
                    target=f"<= {TARGET_S}",
                    target_is_absolute=True,
                    note=f"best of {repeats}; exit {last.returncode}, {outcome}; run {state}; "
                    "baseline: python -c pass",
                )


def main(argv: Sequence[str] | None = None) -> Report:
    """``python -m bench.cli [--quick] [--json PATH]``."""
    return run_main("cli", body, argv, description=__doc__.splitlines()[0])


if __name__ == "__main__":
    main()
