"""Flower's deployment engine on loopback, for ``bench.vs_flower_deployment``.

:class:`FlowerDeployment` starts, in processes of their own sessions, one
``flower-superlink`` (``--insecure``: plain HTTP on loopback) and one
``flower-supernode`` per org, each SuperNode given its ``partition-id`` /
``num-partitions`` as ``--node-config`` and reaching the SuperLink's Fleet API through
a :class:`CountingRelay`, a loopback TCP relay that counts every byte both ways: what
the SuperLink exchanges with the SuperNodes, its network traffic. The SuperLink's
ServerApp process (started by the SuperLink's own SuperExec) and the Control API calls
reach it directly, as they would on the SuperLink's host. :meth:`FlowerDeployment.run`
submits a Flower App with ``flwr run`` and follows the run through the Control API
until it has finished; its wall time is the SuperLink's own ``finished_at -
pending_at``. Every process is stopped on exit (its process group, SIGTERM then
SIGKILL, and whatever it had started in sessions of their own), also on an error.

Everything is offline: telemetry and the update check are off, and the runtime
installation of the app's dependencies (``uv sync``) is disabled on both sides.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from types import TracebackType
from typing import Any

__all__ = [
    "CountingRelay",
    "FlowerDeployment",
    "FlowerRun",
    "descendants",
    "free_port",
    "stop_group",
]

_CHUNK = 1 << 16
_BIN = Path(sys.executable).parent


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def stop_group(proc: subprocess.Popen[bytes], grace: float = 5.0) -> None:
    """SIGTERM to ``proc``'s process group, SIGKILL to it after ``grace`` seconds."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, sig)
        try:
            proc.wait(grace)
            if sig == signal.SIGTERM:  # the group may hold children that outlive it
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(proc.pid, signal.SIGKILL)
            return
        except subprocess.TimeoutExpired:
            continue


def descendants(pid: int) -> list[int]:
    """The processes below ``pid`` now (children, theirs, ...), from ``/proc``."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
            children.setdefault(ppid, []).append(int(stat.parent.name))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


class CountingRelay:
    """``127.0.0.1:listen -> 127.0.0.1:target``, counting the bytes of each direction
    (``up``: towards the target); an asyncio loop in a daemon thread."""

    def __init__(self, target: int) -> None:
        self.target, self.listen = target, free_port()
        self.up = self.down = 0
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._server: asyncio.Server | None = None

    @property
    def total(self) -> int:
        return self.up + self.down

    def start(self) -> None:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._bind(), self._loop).result(10)

    async def _pipe(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, up: bool
    ) -> None:
        with contextlib.suppress(OSError, asyncio.IncompleteReadError):
            while data := await reader.read(_CHUNK):
                if up:
                    self.up += len(data)
                else:
                    self.down += len(data)
                writer.write(data)
                await writer.drain()
            with contextlib.suppress(OSError):
                writer.write_eof()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target)
        except OSError:
            writer.close()
            return
        try:
            await asyncio.gather(
                self._pipe(reader, up_writer, True), self._pipe(up_reader, writer, False)
            )
        finally:
            for w in (writer, up_writer):
                with contextlib.suppress(OSError, RuntimeError):
                    w.close()

    async def _bind(self) -> None:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", self.listen)

    def stop(self) -> None:
        async def close() -> None:
            if self._server is not None:
                self._server.close()
            for task in asyncio.all_tasks():
                if task is not asyncio.current_task():
                    task.cancel()

        if self._thread.is_alive():
            with contextlib.suppress(Exception):
                asyncio.run_coroutine_threadsafe(close(), self._loop).result(5)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(5)


@dataclass(frozen=True)
class FlowerRun:
    """One finished Flower run.

    wall_s: ``finished_at - pending_at`` as the SuperLink recorded them.
    status: Flower's final status, e.g. ``finished:completed``.
    fleet_bytes: bytes through the Fleet relay while the run was followed (both ways).
    flower_bytes: the run's ``bytes_sent + bytes_recv`` as the SuperLink counts them.
    """

    run_id: int
    wall_s: float
    status: str
    fleet_bytes: int
    flower_bytes: int

    @property
    def completed(self) -> bool:
        return self.status == "finished:completed"


def _iso(text: str) -> datetime:
    return datetime.fromisoformat(text.replace("Z", "+00:00"))


class FlowerDeployment:
    """A SuperLink and ``orgs`` SuperNodes on loopback, under ``workdir`` (see the module
    docstring); a context manager that stops them all on exit."""

    def __init__(self, workdir: Path, orgs: int) -> None:
        self.workdir, self.orgs = Path(workdir), orgs
        self.home = self.workdir / "flwr-home"
        self.logs = self.workdir / "logs"
        self.port = free_port()
        self.relay = CountingRelay(self.port)
        self.procs: list[subprocess.Popen[bytes]] = []
        self.startup_s = 0.0
        self._control: Any = None

    def env(self) -> dict[str, str]:
        return {
            **os.environ,
            "PATH": f"{_BIN}{os.pathsep}{os.environ.get('PATH', '')}",
            "FLWR_HOME": str(self.home),
            "FLWR_TELEMETRY_ENABLED": "0",
            "FLWR_DISABLE_UPDATE_CHECK": "1",
            "PYTHONUNBUFFERED": "1",
        }

    def _popen(self, name: str, args: list[str]) -> subprocess.Popen[bytes]:
        with open(self.logs / f"{name}.log", "ab") as log:
            proc = subprocess.Popen(
                args, stdout=log, stderr=subprocess.STDOUT, env=self.env(), start_new_session=True
            )
        self.procs.append(proc)
        return proc

    def __enter__(self) -> FlowerDeployment:
        try:
            self.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def start(self, timeout: float = 120.0) -> None:
        """Start the processes; return once every SuperNode is online at the SuperLink."""
        self.logs.mkdir(parents=True, exist_ok=True)
        self.home.mkdir(parents=True, exist_ok=True)
        (self.home / "config.toml").write_text(
            '[superlink]\ndefault = "bench"\n\n[superlink.bench]\n'
            f'address = "127.0.0.1:{self.port}"\ninsecure = true\n'
        )
        t0 = time.perf_counter()
        self._popen(
            "superlink",
            [
                str(_BIN / "flower-superlink"),
                "--insecure",
                "--host",
                "127.0.0.1",
                "--port",
                str(self.port),
                "--disable-runtime-dependency-installation",
            ],
        )
        self.relay.start()
        for i in range(self.orgs):
            self._popen(
                f"supernode{i}",
                [
                    str(_BIN / "flower-supernode"),
                    "--insecure",
                    "--superlink",
                    f"127.0.0.1:{self.relay.listen}",
                    "--port",
                    str(free_port()),
                    "--node-config",
                    f"partition-id={i} num-partitions={self.orgs}",
                ],
            )
        self._wait_online(timeout)
        self.startup_s = time.perf_counter() - t0

    def control(self) -> Any:
        """Flower's Control API client for this SuperLink (made once)."""
        if self._control is None:
            from flwr.cli.typing import SuperLinkConnection
            from flwr.cli.utils import init_http_client_from_connection

            os.environ["FLWR_HOME"] = str(self.home)  # where its credential store looks
            conn = SuperLinkConnection(
                name="bench", address=f"127.0.0.1:{self.port}", insecure=True
            )
            with contextlib.redirect_stdout(io.StringIO()):  # "Using SuperLink: ..."
                self._control = init_http_client_from_connection(conn)
        return self._control

    def _check_alive(self) -> None:
        for proc in self.procs:
            if proc.poll() is not None:
                name = Path(str(proc.args[0])).name  # type: ignore[index]
                raise RuntimeError(f"{name} exited with {proc.returncode}; see {self.logs}")

    def _wait_online(self, timeout: float) -> None:
        from flwr.proto.control_pb2 import ListNodesRequest

        end = time.monotonic() + timeout
        online = 0
        while time.monotonic() < end:
            self._check_alive()
            with contextlib.suppress(Exception):
                nodes = self.control().ListNodes(ListNodesRequest()).nodes_info
                online = sum(1 for n in nodes if n.status == "online")
                if online >= self.orgs:
                    return
            time.sleep(0.2)
        raise RuntimeError(f"only {online} of {self.orgs} SuperNodes came online in {timeout:g} s")

    def run(self, app: Path, timeout: float) -> FlowerRun:
        """``flwr run APP`` at this SuperLink; follow the run until it has finished."""
        from flwr.common.serde import run_from_proto
        from flwr.proto.control_pb2 import ListRunsRequest

        before = self.relay.total
        out = subprocess.run(
            [str(_BIN / "flwr"), "run", str(app), "bench", "--format", "json"],
            env=self.env(),
            capture_output=True,
            timeout=120,
            check=False,
        )
        try:
            run_id = int(json.loads(out.stdout)["run-id"])
        except (ValueError, KeyError, TypeError):
            tail = (out.stdout + out.stderr).decode(errors="replace")[-800:]
            raise RuntimeError(f"flwr run failed ({out.returncode}): {tail}") from None
        end = time.monotonic() + timeout
        while True:
            self._check_alive()
            res = self.control().ListRuns(ListRunsRequest(run_id=run_id))
            run = run_from_proto(res.run_dict[run_id])
            if run.status.status == "finished":
                break
            if time.monotonic() > end:
                raise RuntimeError(f"the Flower run {run_id} did not finish in {timeout:g} s")
            time.sleep(0.1)
        fleet = self.relay.total - before
        status = f"{run.status.status}:{run.status.sub_status}"
        if run.status.details:
            status += f" ({run.status.details})"
        wall = (_iso(run.finished_at) - _iso(run.pending_at)).total_seconds()
        return FlowerRun(run_id, wall, status, fleet, int(run.bytes_sent + run.bytes_recv))

    def close(self) -> None:
        """Stop every process (process groups) and the relay."""
        if self._control is not None:
            with contextlib.suppress(Exception):
                self._control.close()
            self._control = None
        # the SuperLink's SuperExec starts the ServerApp in a session of its own, which
        # the SuperLink's process group does not reach: its descendants, taken first
        tree = [pid for proc in self.procs for pid in descendants(proc.pid)]
        for proc in reversed(self.procs):
            stop_group(proc)
        for pid in tree:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        self.procs.clear()
        self.relay.stop()
