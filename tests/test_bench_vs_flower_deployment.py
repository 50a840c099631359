"""``bench.vs_flower_deployment``: its app, its byte-counting relay, and (e2e) its quick mode."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from bench.flower_deployment import CountingRelay, descendants
from bench.vs_flower_deployment import APP, Case, main, prepare_app
from org_node.trainers.flower_client import task_identity


@pytest.fixture
def bench_app() -> Iterator[Any]:
    """The benchmark app's modules, imported as a runtime would (app root on the path)."""
    sys.path.insert(0, str(APP))
    try:
        from fedweave_bench_app import client_app, task

        yield client_app, task
    finally:
        sys.path.remove(str(APP))


def test_prepare_app_writes_the_cases_run_config(tmp_path: Path) -> None:
    case = Case("1M", 1_000_000, rounds=3, local_steps=4)
    dest = prepare_app(tmp_path / "app", case.config(secure=True))
    config = tomllib.loads((dest / "pyproject.toml").read_text())["tool"]["flwr"]["app"]["config"]
    assert config["model-params"] == 1_000_000
    assert config["num-server-rounds"] == 3 and config["local-steps"] == 4
    assert config["secure-aggregation"] is True and config["num-orgs"] == 4
    assert (dest / "fedweave_bench_app" / "client_app.py").is_file()
    with pytest.raises(ValueError, match="no single 'no-such-key'"):
        prepare_app(tmp_path / "bad", {"no-such-key": 1})


def test_the_model_has_the_configured_size_and_trains_to_finite_values(bench_app: Any) -> None:
    _client, task = bench_app
    model = task.initial_model(1_000_000, 1000)
    assert sum(a.size for a in model) == 999_999 and all(a.dtype == np.float32 for a in model)
    before = [a.copy() for a in model]
    config = {"samples": 16, "local-steps": 2, "batch-size": 8, "learning-rate": 5e-4}
    loss = task.train(model, config, partition_id=1, rnd=1)
    assert np.isfinite(loss) and loss > 0
    assert not np.array_equal(before[0], model[0])
    assert all(np.all(np.isfinite(a)) for a in model)


def test_the_mod_hands_only_secaggplus_messages_to_secaggplus(bench_app: Any) -> None:
    from flwr.app import ConfigRecord, Context, Message, MessageType, RecordDict
    from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS

    client_app, _task = bench_app
    seen: list[Message] = []

    def call_next(msg: Message, ctxt: Context) -> Message:
        seen.append(msg)
        return msg

    ctxt = Context(1, 2, {}, RecordDict(), {})
    with task_identity(1, 1, 1):  # what a ServerApp's process sets
        plain = Message(RecordDict(), 2, MessageType.TRAIN, group_id="1")
        stage = Message(
            RecordDict({RECORD_KEY_CONFIGS: ConfigRecord({"stage": "bogus"})}),
            2,
            MessageType.TRAIN,
            group_id="1",
        )
    assert client_app.secaggplus_when_asked(plain, ctxt, call_next) is plain
    assert seen == [plain]
    with pytest.raises(ValueError):  # secaggplus_mod checks the stage
        client_app.secaggplus_when_asked(stage, ctxt, call_next)
    assert seen == [plain]


def test_the_relay_passes_and_counts_both_directions() -> None:
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()

    def echo_twice() -> None:
        conn, _ = server.accept()
        with conn:
            data = b""
            while len(data) < 1000:
                data += conn.recv(4096)
            conn.sendall(data * 2)

    thread = threading.Thread(target=echo_twice, daemon=True)
    thread.start()
    relay = CountingRelay(server.getsockname()[1])
    relay.start()
    try:
        with socket.create_connection(("127.0.0.1", relay.listen), timeout=10) as c:
            c.sendall(b"x" * 1000)
            got = b""
            while len(got) < 2000:
                got += c.recv(4096)
        thread.join(10)
        assert got == b"x" * 2000
        assert (relay.up, relay.down, relay.total) == (1000, 2000, 3000)
    finally:
        relay.stop()
        server.close()


def test_descendants_finds_grandchildren_in_sessions_of_their_own() -> None:
    """What the SuperLink's SuperExec does to its ServerApp: a session of its own,
    out of reach of the parent's process group, but still a descendant."""
    parent = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import subprocess, sys, time; "
            "p = subprocess.Popen(['sleep', '30'], start_new_session=True); "
            "print(p.pid, flush=True); time.sleep(30)",
        ],
        stdout=subprocess.PIPE,
        start_new_session=True,
    )
    try:
        assert parent.stdout is not None
        grandchild = int(parent.stdout.readline())
        assert os.getsid(grandchild) != os.getsid(parent.pid)
        assert grandchild in descendants(parent.pid)
    finally:
        for pid in [*descendants(parent.pid), parent.pid]:
            os.kill(pid, signal.SIGKILL)
        parent.wait(10)


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_quick_mode_races_both_engines_to_completion(tmp_path: Path) -> None:
    out = tmp_path / "race.json"
    main(["--quick", "--json", str(out)])
    rows = {r["name"]: r for r in json.loads(out.read_text())["rows"]}
    tag = "[params=100k,n=4]"
    assert not [name for name in rows if name.startswith("run_failed")], rows
    for name in (
        "run_wall_vs_flower_secaggplus",
        "run_wall_vs_flower_plain",
        "busiest_node_bytes_vs_flower",
        "busiest_node_bytes_vs_flower_plain",
    ):
        row = rows[name + tag]
        assert row["value"] > 0 and row["baseline"] > 0 and row["ratio"] is not None
    assert rows["run_wall_vs_flower_secaggplus" + tag]["target"] == "<= 0.5"
    assert rows["startup_s[fedweave,params=100k,n=4]"]["baseline"] > 0
    assert rows["fedweave_rounds_with_all_orgs" + tag]["baseline"] == 2
