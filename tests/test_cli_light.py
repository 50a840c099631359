"""The client commands of ``fedweave`` start light: running one imports no torch, numpy,
scipy, DP accountant, database layer, web framework or harness. The commands that need
those (``run``, ``init``, ``recover``, ``harness``, ``audit report``, ...) import them
when they run. Each check runs in a fresh interpreter; no wall-clock time is asserted."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

HEAVY_PACKAGES = (
    "torch",
    "numpy",
    "scipy",
    "dp_accounting",
    "sqlalchemy",
    "sqlmodel",
    "alembic",
    "fastapi",
    "starlette",
    "uvicorn",
    "httpcore",
    "trio",
    "anyio",
    "pydantic",
    "flwr",
    "tenseal",
    "sklearn",
)
HEAVY_MODULES = (
    "coordinator_free.tls",
    "org_node.harness",
    "org_node.node",
    "org_node.engine",
    "org_node.privacy",
    "org_node.audit.report",
    "org_node.db",
    "org_node.training",
    "api.app",
    "api.serve",
)

CLIENT_COMMANDS = (
    "runs list",
    "runs show",
    "runs propose",
    "runs accept",
    "status",
    "peers",
    "audit fetch",
    "audit events",
    "tokens create",
    "tokens list",
    "tokens revoke",
    "trainers list",
    "trainers install",
    "datasets list",
    "datasets register",
)


def heavy(modules: list[str]) -> list[str]:
    """The heavy ones among ``modules``."""
    return sorted(
        m
        for m in modules
        if m.split(".")[0] in HEAVY_PACKAGES
        or any(m == h or m.startswith(h + ".") for h in HEAVY_MODULES)
    )


def python(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env=dict(os.environ, **(env or {})),
    )


def test_importing_the_cli_imports_nothing_heavy() -> None:
    script = (
        "import json, sys; import org_node.cli, api.cli; print(json.dumps(sorted(sys.modules)))"
    )
    r = python("-c", script)
    assert r.returncode == 0, r.stderr
    modules = json.loads(r.stdout)
    assert "org_node.cli" in modules and "typer" in modules
    assert heavy(modules) == []


def test_heavy_is_what_the_check_looks_for() -> None:
    assert heavy(["numpy.linalg", "org_node.harness", "org_node.harness.cli", "api.serve"]) == [
        "api.serve",
        "numpy.linalg",
        "org_node.harness",
        "org_node.harness.cli",
    ]
    assert heavy(["org_node.cli", "org_node.nodes_x", "typer", "httpx", "api.cli"]) == []


@pytest.mark.parametrize("command", CLIENT_COMMANDS)
def test_a_client_commands_help_imports_nothing_heavy(command: str) -> None:
    """``python -X importtime -m api.cli CMD --help``: the console script's entry point;
    every module imported is on stderr."""
    r = python("-X", "importtime", "-m", "api.cli", *command.split(), "--help")
    assert r.returncode == 0, r.stderr[-2000:]
    assert "Usage" in r.stdout and command.split()[-1] in r.stdout
    modules = [
        line.rsplit("|", 1)[1].strip()
        for line in r.stderr.splitlines()
        if line.startswith("import time:") and "|" in line
    ]
    assert "typer" in modules
    assert heavy(modules) == [], command
    assert "httpx" not in modules, command  # the client commands speak HTTP with the stdlib


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


RUN_COMMANDS = """
import json, sys
from api.cli import app
for args in json.loads(sys.argv[1]):
    try:
        app(args, prog_name="fedweave")
    except SystemExit as exc:
        print(f"exit {exc.code}: {' '.join(args[:2])}", file=sys.stderr)
print(json.dumps(sorted(sys.modules)))
"""


def test_running_client_commands_against_a_node_dir_imports_nothing_heavy(tmp_path: Path) -> None:
    """The commands really run, with ``--data-dir`` (the config read, the manifest chain
    verified, the database read by ``status``), against a node that does not answer."""
    from org_node.initialize import found_manifest, initialize, install_manifest, sign_manifest

    dirs = [tmp_path / org for org in ("org-a", "org-b")]
    for d in dirs:
        initialize(d, d.name, peer_port=_free_port(), admin_port=_free_port())
    manifest = tmp_path / "manifest.json"
    found_manifest("fed", [d / "member.json" for d in dirs], manifest)
    for d in dirs:
        sign_manifest(d, manifest)
    install_manifest(dirs[0], manifest)
    node = ["--data-dir", str(dirs[0])]
    commands = [
        ["status", *node],
        ["status", *node, "--token", "fw_x"],
        *(
            [*c.split(), *node, "--token", "fw_x"]
            for c in ("runs list", "peers", "tokens list", "trainers list", "datasets list")
        ),
        ["runs", "show", "r1", *node, "--token", "fw_x"],
        ["audit", "events", *node, "--token", "fw_x"],
        ["audit", "fetch", "r1", "--out", str(tmp_path / "out"), *node, "--token", "fw_x"],
        ["tokens", "revoke", "3", *node, "--token", "fw_x"],
    ]
    r = python("-c", RUN_COMMANDS, json.dumps(commands), env={"COLUMNS": "200"})
    assert r.returncode == 0, r.stderr[-2000:]
    assert "federation: fed" in r.stdout and "node: not running" in r.stdout
    assert r.stderr.count("error: no node answers at http://127.0.0.1:") == len(commands) - 2
    modules = json.loads(r.stdout.strip().splitlines()[-1])
    assert "org_node.cli_http" in modules and "coordinator_free.manifest" in modules
    assert heavy(modules) == []


LOCAL_HEAVY = ("torch", "dp_accounting", "scipy", "flwr", "tenseal", "sklearn")
"""What the local set-up commands need not import: they read and write the node's files,
its database and its TLS material, never train, account privacy or run a node."""
NODE_LAYERS = ("org_node.node.assembly", "org_node.engine", "org_node.tasks", "org_node.privacy")


def test_the_set_up_commands_import_no_torch_and_no_node(tmp_path: Path) -> None:
    """``init``, ``federation found``, ``federation sign`` and ``federation install``, run
    for real in one interpreter: the federation is founded and installed, and none of
    them imported torch, the DP accountant or the node's layers."""
    dirs = [tmp_path / org for org in ("org-a", "org-b")]
    manifest = str(tmp_path / "manifest.json")
    commands = [
        *(
            [
                "init",
                "--org-id",
                d.name,
                "--data-dir",
                str(d),
                "--peer-port",
                str(_free_port()),
                "--admin-port",
                str(_free_port()),
            ]
            for d in dirs
        ),
        ["federation", "found", "--federation", "fed", "--out", manifest]
        + [a for d in dirs for a in ("--member", str(d / "member.json"))],
        *(["federation", "sign", manifest, "--data-dir", str(d)] for d in dirs),
        *(["federation", "install", manifest, "--data-dir", str(d)] for d in dirs),
    ]
    r = python("-c", RUN_COMMANDS, json.dumps(commands), env={"COLUMNS": "200"})
    assert r.returncode == 0, r.stderr[-2000:]
    exits = [line for line in r.stderr.splitlines() if line.startswith("exit ")]
    assert exits == [f"exit 0: {' '.join(c[:2])}" for c in commands]
    assert all((d / "federation" / "chain.json").exists() for d in dirs)
    modules = json.loads(r.stdout.strip().splitlines()[-1])
    assert "org_node.initialize" in modules and "org_node.node.files" in modules
    assert sorted(m for m in modules if m.split(".")[0] in LOCAL_HEAVY) == []
    assert [m for m in modules if m in NODE_LAYERS] == []
