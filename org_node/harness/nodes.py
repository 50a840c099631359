"""The harness's processes: free loopback ports, one org's node process, everything the
harness saw (:class:`Observation`), and stopping every child together.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from org_node.harness.scenario import Kill, Scenario

__all__ = [
    "EXPORT_DIR",
    "RUN_NAME",
    "HarnessError",
    "Interrupted",
    "NodeProcess",
    "Observation",
    "Processes",
    "ProgressFn",
    "check",
    "cli",
    "export_file",
    "free_ports",
    "hold_file",
    "interrupt",
    "no_signals",
    "node_env",
    "port_is_free",
    "round_hold",
    "start",
    "wait_ready",
]

RUN_NAME = "harness-run"
EXPORT_DIR = "debug-export"


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
    membership_converged: bool | None = None
    """Whether every node saw every other alive before the run (None: not checked yet)."""
    elapsed_s: float = 0.0
    listening: set[str] = field(default_factory=set)
    """Orgs whose event stream the harness reads."""
    t0: float = field(default_factory=time.monotonic)

    @property
    def export_dir(self) -> Path:
        return self.out / EXPORT_DIR


ProgressFn = Callable[[Observation], None]


class Processes:
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


class interrupt:
    """SIGINT/SIGTERM raise :class:`Interrupted` once; later ones are ignored while the
    harness stops its children."""

    def __init__(self) -> None:
        self.fired = False
        self.previous: dict[int, Any] = {}

    def __enter__(self) -> interrupt:
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
def no_signals() -> Iterator[None]:
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


def node_env(out: Path, *, export: bool = True) -> dict[str, str]:
    """The nodes' environment: the debug export on (``fedweave recover`` rebuilds a
    plain config, which refuses it, so the harness turns it off there)."""
    from org_node.node import HARNESS_EXPORT_ENV

    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.pop(HARNESS_EXPORT_ENV, None)
    if export:
        env[HARNESS_EXPORT_ENV] = str(out / EXPORT_DIR)
    env.pop("FEDWEAVE_DATABASE_URL", None)  # embedded SQLite in each data directory
    return env


def cli(*args: str) -> list[str]:
    """The installed ``fedweave`` console script (``fedweave run`` lives at the top layer)."""
    script = Path(sys.executable).with_name("fedweave")
    return [str(script) if script.exists() else "fedweave", *args]


def start(procs: Processes, node: NodeProcess, out: Path) -> None:
    node.proc = procs.popen(
        cli("run", "--data-dir", str(node.data_dir)),
        out / "logs" / f"{node.org}.log",
        node_env(out),
    )
    node.down = False


def wait_ready(node: NodeProcess, out: Path, timeout: float = 90.0) -> None:
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


def check(response: httpx.Response, what: str) -> dict[str, Any]:
    if response.status_code >= 400:
        try:
            detail = response.json().get("detail", response.text)
        except ValueError:
            detail = response.text
        raise HarnessError(f"{what}: HTTP {response.status_code}: {detail}")
    body: dict[str, Any] = response.json()
    return body


def export_file(obs: Observation, org: str, round0: int) -> Path:
    return obs.export_dir / org / obs.run_key / f"round-{round0:06d}.npy"


def hold_file(obs: Observation, kill: Kill) -> Path:
    """The file that holds ``kill.org`` after its update of the kill's round is exported."""
    return round_hold(obs, kill.org, kill.round - 1)


def round_hold(obs: Observation, org: str, round0: int) -> Path:
    """While this file exists, ``org``'s engine (harness nodes only) waits after exporting
    its update of round ``round0`` (0-based), before sending anything of the round."""
    return export_file(obs, org, round0).with_suffix(".hold")
