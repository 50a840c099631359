"""The harness scenario: parsing of --kill/--wipe, refusals of impossible scenarios before
anything starts, and the parts of the verdict that need no running node (the plaintext
FedAvg recomputation from exported updates, and the PNG writer)."""

from __future__ import annotations

import struct
import subprocess
import sys
import zlib
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from org_node.harness.nodes import EXPORT_DIR, Observation
from org_node.harness.plot import Canvas, plot_progress, png_bytes
from org_node.harness.scenario import (
    Kill,
    Scenario,
    ScenarioError,
    Wipe,
    default_threshold,
    org_names,
    parse_kill,
    parse_wipe,
)
from org_node.harness.verdict import VerdictError, plaintext_fedavg
from org_node.training.exchange import npz_bytes


def test_org_names_and_default_threshold() -> None:
    assert org_names(3) == ("org1", "org2", "org3")
    assert [default_threshold(n) for n in (2, 3, 4, 5, 7)] == [2, 2, 3, 3, 4]


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("org2@3", Kill("org2", 3, "train")),
        ("org2@3:reduce", Kill("org2", 3, "reduce")),
        (" org10@1:train ", Kill("org10", 1, "train")),
    ],
)
def test_parse_kill(text: str, expected: Kill) -> None:
    assert parse_kill(text) == expected


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("org2", "expected ORG@ROUND"),
        ("org2@x", "positive integer"),
        ("org2@-1", "positive integer"),
        ("org2@2:mask", "unknown stage 'mask'"),
        ("@2", "expected ORG@ROUND"),
    ],
)
def test_parse_kill_refuses(text: str, message: str) -> None:
    with pytest.raises(ScenarioError, match=message):
        parse_kill(text)


def test_parse_wipe() -> None:
    assert parse_wipe("org3@2") == Wipe("org3", 2)
    with pytest.raises(ScenarioError, match="expected ORG@ROUND"):
        parse_wipe("org3@2:train")


def test_a_valid_scenario_fills_names_and_threshold() -> None:
    s = Scenario(orgs=4, rounds=3, kills=(Kill("org2", 2, "reduce"),))
    assert s.names == ("org1", "org2", "org3", "org4")
    assert s.t == 3
    assert s.task_ref == "breast_cancer"
    d = s.to_dict()
    assert d["kills"] == ["org2@2:reduce"] and d["threshold"] == 3
    assert Scenario(orgs=3, rounds=1, task="digits").task_ref == "digits"
    assert s.strategy_options == {}
    assert Scenario(orgs=3, rounds=1, strategy="diloco", local_steps=4).strategy_options == {
        "inner_steps": 4
    }


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"orgs": 1, "rounds": 3}, "at least 2 orgs"),
        ({"orgs": 17, "rounds": 3}, "at most 16"),
        ({"orgs": 3, "rounds": 0}, "at least 1 round"),
        ({"orgs": 3, "rounds": -2}, "at least 1 round"),
        ({"orgs": 3, "rounds": 2, "task": "mnist"}, "--task mnist"),
        ({"orgs": 3, "rounds": 2, "backend": "paillier"}, "--backend paillier"),
        ({"orgs": 3, "rounds": 2, "strategy": "fedsgd"}, "--strategy fedsgd"),
        ({"orgs": 3, "rounds": 2, "delay_ms": -1}, "--delay-ms"),
        ({"orgs": 3, "rounds": 2, "seed": -1}, "--seed"),
        ({"orgs": 3, "rounds": 2, "threshold": 4}, "threshold 4"),
        ({"orgs": 3, "rounds": 2, "kills": (Kill("org9", 1),)}, "unknown org 'org9'"),
        ({"orgs": 3, "rounds": 2, "wipes": (Wipe("hospital", 1),)}, "unknown org"),
        ({"orgs": 3, "rounds": 2, "kills": (Kill("org2", 3),)}, "outside 1..2"),
        ({"orgs": 3, "rounds": 2, "wipes": (Wipe("org2", 2),)}, "outside 1..1"),
        (
            {"orgs": 3, "rounds": 2, "kills": (Kill("org2", 1), Kill("org2", 2))},
            "already has a fault",
        ),
        (
            {"orgs": 3, "rounds": 3, "kills": (Kill("org2", 1),), "wipes": (Wipe("org2", 1),)},
            "already has a fault",
        ),
        (
            {"orgs": 3, "rounds": 2, "kills": (Kill("org1", 1), Kill("org2", 1))},
            "leaves 1, below the threshold t=2",
        ),
        (
            {"orgs": 4, "rounds": 2, "kills": (Kill("org1", 1), Kill("org2", 1))},
            "leaves 2, below the threshold t=3",
        ),
        (
            {"orgs": 3, "rounds": 2, "backend": "ckks", "kills": (Kill("org1", 1),)},
            "CKKS round needs every participant",
        ),
        (
            {"orgs": 4, "rounds": 3, "strategy": "fedadam", "wipes": (Wipe("org1", 1),)},
            "server state is not in the model",
        ),
        (
            {"orgs": 2, "rounds": 3, "threshold": 2, "wipes": (Wipe("org1", 1),)},
            "below the threshold",
        ),
        ({"orgs": 3, "rounds": 2, "compression": "top-k=0.1"}, "--compression: .*random-k"),
        (
            {"orgs": 3, "rounds": 2, "backend": "ckks", "compression": "q8"},
            "--compression: .*masked backend",
        ),
        (
            {"orgs": 4, "rounds": 3, "compression": "q8", "wipes": (Wipe("org1", 1),)},
            "q8's agreed ranges",
        ),
    ],
)
def test_impossible_scenarios_are_refused(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ScenarioError, match=message) as info:
        Scenario(**kwargs)  # type: ignore[arg-type]
    assert "\n" not in str(info.value)


def test_what_the_orgs_train_is_checked_before_anything_starts(tmp_path: Path) -> None:
    app = tmp_path / "client.py"
    app.write_text("app = None\n")
    data = tmp_path / "data"
    data.mkdir()
    for org in ("org1", "org2"):
        (data / f"{org}.csv").write_text("x,y\n1,0\n")
    refusals: list[tuple[dict[str, Any], str]] = [
        ({"flower_app": str(tmp_path / "nope.py")}, "not a .py file or a Flower App directory"),
        ({"flower_app": str(tmp_path)}, "not a .py file or a Flower App directory"),
        ({"flower_app": str(app), "task": "digits"}, "leave it out"),
        ({"data": str(tmp_path / "none")}, "not a directory"),
        ({"data": str(data)}, "no org3.csv or org3.parquet"),
        ({"data": str(data), "orgs": 2}, "name the label column with --target"),
        ({"target": "y"}, "give --data DIR too"),
    ]
    for kwargs, message in refusals:
        values: dict[str, Any] = {"orgs": 3, "rounds": 2, **kwargs}
        with pytest.raises(ScenarioError, match=message):
            Scenario(**values)
    flower = Scenario(orgs=2, rounds=1, flower_app=f"{app}:app")
    assert (flower.trainer, flower.demo_task, flower.flower_path()) == ("flower-app", False, app)
    own = Scenario(orgs=2, rounds=1, data=str(data), target="y")
    assert own.trainer == "tabular" and own.data_file("org2") == (data / "org2.csv").resolve()
    assert Scenario(orgs=2, rounds=1).trainer == "breast_cancer"


def test_the_cli_refuses_before_anything_starts(tmp_path: Path) -> None:
    """Exit status 2, one line on stderr, and not even the output directory is made."""
    out = tmp_path / "demo"
    code = (
        "import typer\n"
        "from org_node.harness.cli import harness\n"
        "app = typer.Typer()\n"
        "app.command()(harness)\n"
        "app()\n"
    )
    for args, message in (
        (["--orgs", "3", "--rounds", "2", "--kill", "org1@1", "--kill", "org2@1"], "threshold"),
        (["--orgs", "3", "--rounds", "0"], "at least 1 round"),
        (["--orgs", "3", "--rounds", "2", "--wipe", "org7@1"], "unknown org 'org7'"),
    ):
        done = subprocess.run(
            [sys.executable, "-c", code, "--out", str(out), *args],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert done.returncode == 2, done.stderr
        lines = done.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("refused:") and message in lines[0]
        assert not out.exists()


# --------------------------------------------------------------------------- verdict


def _observation(tmp_path: Path, orgs: int = 3, rounds: int = 2) -> Observation:
    """What the harness saw, with the round-0 model every org's engine exported."""
    from org_node.tasks import initial_state

    obs = Observation(Scenario(orgs=orgs, rounds=rounds), tmp_path)
    obs.run_key = "k" * 32
    d = obs.out / EXPORT_DIR / "org1" / obs.run_key
    d.mkdir(parents=True, exist_ok=True)
    (d / "initial.npz").write_bytes(npz_bytes(initial_state("breast_cancer", 0)))
    return obs


def _export(obs: Observation, org: str, round0: int, vec: np.ndarray) -> None:
    d = tmp = obs.out / EXPORT_DIR / org / obs.run_key
    tmp.mkdir(parents=True, exist_ok=True)
    np.save(d / f"round-{round0:06d}.npy", vec)


def _model_size() -> int:
    from org_node.tasks import initial_state

    return sum(int(v.size) for v in initial_state("breast_cancer", 0).values())


def test_plaintext_fedavg_is_the_weighted_mean_of_the_survivors(tmp_path: Path) -> None:
    from org_node.tasks import initial_state

    obs = _observation(tmp_path, rounds=1)
    size = _model_size()
    rng = np.random.default_rng(1)
    deltas = {o: rng.normal(size=size) * 1e-2 for o in obs.scenario.names}
    weights = {"org1": 10.0, "org2": 30.0, "org3": 60.0}
    tau = 3.0
    for org in obs.scenario.names:
        w = weights[org]
        # FedNova packing: w * delta / tau, then w * tau, then w
        _export(obs, org, 0, np.concatenate([w * deltas[org] / tau, [w * tau], [w]]))
    model = plaintext_fedavg(obs, {1: ("org1", "org3")}, 1)
    init = initial_state("breast_cancer", 0)
    flat_init = np.concatenate([init[k].ravel() for k in sorted(init)]).astype(np.float64)
    flat = np.concatenate([model[k].ravel() for k in sorted(model)]).astype(np.float64)
    expected = flat_init + (10 * deltas["org1"] + 60 * deltas["org3"]) / 70
    np.testing.assert_allclose(flat, expected, atol=1e-6)
    # org2 is not among the survivors: including it gives another model
    other = plaintext_fedavg(obs, {1: ("org1", "org2", "org3")}, 1)
    assert max(float(np.max(np.abs(other[k] - model[k]))) for k in model) > 1e-4


def test_plaintext_fedavg_needs_every_export_and_the_survivors(tmp_path: Path) -> None:
    obs = _observation(tmp_path, rounds=1)
    size = _model_size()
    _export(obs, "org1", 0, np.concatenate([np.zeros(size), [3.0], [1.0]]))
    with pytest.raises(VerdictError, match="no exported update of org2 for round 1"):
        plaintext_fedavg(obs, {1: ("org1", "org2")}, 1)
    with pytest.raises(VerdictError, match="survivors of round 1 were not observed"):
        plaintext_fedavg(obs, {}, 1)


def test_png_bytes_is_a_valid_png() -> None:
    c = Canvas(4, 3)
    c.line(0, 0, 3, 2, (255, 0, 0))
    data = c.png()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    length, kind = struct.unpack(">I4s", data[8:16])
    assert kind == b"IHDR" and length == 13
    assert struct.unpack(">II", data[16:24]) == (4, 3)
    idat = data.index(b"IDAT")
    (n,) = struct.unpack(">I", data[idat - 4 : idat])
    raw = zlib.decompress(data[idat + 4 : idat + 4 + n])
    assert len(raw) == 3 * (1 + 4 * 3)
    assert raw[1:4] == b"\xff\x00\x00"  # the line starts at (0, 0)
    assert raw[-3:] == b"\xff\x00\x00"  # and ends at (3, 2)
    with pytest.raises(ValueError, match="expected 36 bytes"):
        png_bytes(4, 3, b"\x00")


def test_plot_progress_writes_a_png(tmp_path: Path) -> None:
    history = {
        "org1": {1: {"eval_loss": 0.7, "eval_accuracy": 0.5}, 2: {"eval_loss": 0.5}},
        "org2": {1: {"train_loss": 0.9}, 2: {"eval_loss": 0.4, "eval_accuracy": 0.8}},
    }
    path = plot_progress(history, 2, tmp_path / "p.png")
    data = path.read_bytes()
    assert data.startswith(b"\x89PNG") and data.endswith(b"IEND\xaeB`\x82")
    assert struct.unpack(">II", data[16:24]) == (900, 380)


# --------------------------------------------------------------------------- delay relay


def test_delay_relay_passes_bytes_both_ways_and_frees_its_port() -> None:
    import socket
    import threading

    from org_node.harness.nodes import free_ports, port_is_free
    from org_node.harness.proxy import DelayRelays

    server = socket.create_server(("127.0.0.1", 0))
    target = server.getsockname()[1]

    def echo() -> None:
        conn, _ = server.accept()
        with conn:
            while data := conn.recv(65536):
                conn.sendall(bytes(b ^ 0xFF for b in data))

    thread = threading.Thread(target=echo, daemon=True)
    thread.start()
    (listen,) = free_ports(1)
    relays = DelayRelays({listen: target}, delay_ms=20)
    relays.start()
    try:
        assert not port_is_free(listen)
        payload = bytes(range(256)) * 40
        with socket.create_connection(("127.0.0.1", listen), timeout=10) as c:
            c.sendall(payload)
            c.shutdown(socket.SHUT_WR)
            got = b""
            while chunk := c.recv(65536):
                got += chunk
        assert got == bytes(b ^ 0xFF for b in payload)
    finally:
        relays.stop()
        server.close()
    assert port_is_free(listen)


def test_the_verdict_fails_and_says_why_when_the_models_differ(tmp_path: Path) -> None:
    """Two orgs that end with different models, no audit log, and an export that does not
    add up: ``ok`` is false and ``reason`` names each failed check."""
    from org_node.engine import STATE_FILE, EngineState
    from org_node.harness.nodes import NodeProcess
    from org_node.harness.verdict import build_summary
    from org_node.tasks import initial_state

    obs = _observation(tmp_path, orgs=2, rounds=1)
    base = initial_state("breast_cancer", 0)
    size = _model_size()
    for i, org in enumerate(obs.scenario.names):
        node = NodeProcess(org, i, tmp_path / "nodes" / org, 1000 + i, 2000 + i, 1000 + i)
        obs.nodes[org] = node
        model = {k: v + np.float32(i + 1) for k, v in base.items()}
        state = EngineState(obs.run_key, 1, model, {"round": 1, "arrays": {}})
        path = node.data_dir / "runs" / obs.run_key / STATE_FILE
        path.parent.mkdir(parents=True)
        path.write_bytes(state.to_bytes())
        _export(obs, org, 0, np.concatenate([np.zeros(size), [3.0], [1.0]]))
    obs.states = {"org1": "completed", "org2": "completed"}
    obs.survivors = {1: ("org1", "org2")}
    summary = build_summary(obs)
    assert summary["ok"] is False
    shas = summary["final_model_sha256"]
    assert shas["org1"] and shas["org2"] and shas["org1"] != shas["org2"]
    assert summary["rounds_completed"] == 1
    assert "the surviving orgs' final models differ" in summary["reason"]
    assert "audit verify failed at org1" in summary["reason"]
    check = summary["harness_check"]
    # zero updates leave the round-0 model; org1 holds it plus 1 everywhere
    assert check["ok"] is False and check["max_abs_diff"] == pytest.approx(1.0)
    assert "harness_check" in summary["reason"]


def test_fedweave_harness_is_on_the_console_app(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from api.cli import app

    out = tmp_path / "demo"
    result = CliRunner().invoke(
        app, ["harness", "--orgs", "4", "--rounds", "2", "--kill", "org5@1", "--out", str(out)]
    )
    assert result.exit_code == 2
    assert "refused: --kill org5@1:train: unknown org 'org5'" in result.output
    assert not out.exists()


def test_a_compression_goes_into_the_proposed_spec_in_its_canonical_form() -> None:
    from org_node.harness.setup import run_spec

    scenario = Scenario(orgs=3, rounds=2, compression="q8, random-k=0.1")
    assert scenario.compression == "random-k=0.1,q8"
    assert run_spec(scenario)["compression"] == "random-k=0.1,q8"
    assert scenario.to_dict()["compression"] == "random-k=0.1,q8"
    assert "compression" not in run_spec(Scenario(orgs=3, rounds=2))  # none: the old key
    # random-k alone survives a wipe: the rejoining org needs only the model
    assert Scenario(orgs=4, rounds=3, compression="random-k=0.5", wipes=(Wipe("org1", 1),))
