"""`fedweave init`, `federation found/sign/install`, `status`, `run` errors: one line each."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest
from typer.testing import CliRunner

from api.cli import app  # the console script's app: org_node's, with `run` on it
from org_node.config import NodeConfig

runner = CliRunner()


def init(tmp_path: Path, org: str, port: int) -> Path:
    d = tmp_path / org
    result = runner.invoke(
        app,
        [
            "init",
            "--org-id",
            org,
            "--data-dir",
            str(d),
            "--peer-port",
            str(port),
            "--admin-port",
            str(port + 1),
        ],
    )
    assert result.exit_code == 0, result.output
    assert "admin token (shown once" in result.output
    assert "fw_" in result.output
    return d


def one_line_error(output: str) -> str:
    lines = [line for line in output.strip().splitlines() if line]
    assert len(lines) == 1, output
    assert lines[0].startswith("error: ")
    assert "Traceback" not in output
    return lines[0]


def test_init_writes_a_node_and_shows_the_token_once(tmp_path: Path) -> None:
    d = init(tmp_path, "org-a", 9300)
    assert (d / "identity" / "identity.key").stat().st_mode & 0o077 == 0
    assert (d / "identity" / "recovery.secret").stat().st_mode & 0o077 == 0
    assert (d / "org-a-recovery-backup.json").stat().st_mode & 0o077 == 0
    member = json.loads((d / "member.json").read_text())
    assert member["org_id"] == "org-a" and member["endpoint"] == "https://127.0.0.1:9300"
    config = NodeConfig.load(d / "fedweave.toml")
    assert (config.network.peer_port, config.network.admin_port) == (9300, 9301)
    status = runner.invoke(app, ["status", "--data-dir", str(d)])
    assert "fw_" not in status.output and "federation: (none installed)" in status.output
    again = runner.invoke(app, ["init", "--org-id", "org-a", "--data-dir", str(d)])
    assert again.exit_code == 1
    assert "not empty" in one_line_error(again.output)


def test_bad_org_id_and_ports_are_one_line_errors(tmp_path: Path) -> None:
    r = runner.invoke(app, ["init", "--org-id", "a b", "--data-dir", str(tmp_path / "x")])
    assert r.exit_code == 1 and "node.org_id" in one_line_error(r.output)
    r = runner.invoke(
        app,
        [
            "init",
            "--org-id",
            "a",
            "--data-dir",
            str(tmp_path / "y"),
            "--peer-port",
            "5",
            "--admin-port",
            "5",
        ],
    )
    assert r.exit_code == 1 and "network.admin_port" in one_line_error(r.output)


def test_found_sign_install_and_status(tmp_path: Path) -> None:
    a, b = init(tmp_path, "org-a", 9310), init(tmp_path, "org-b", 9320)
    m = tmp_path / "manifest.json"
    r = runner.invoke(
        app,
        [
            "federation",
            "found",
            "--federation",
            "fed-x",
            "--member",
            str(a / "member.json"),
            "--member",
            str(b / "member.json"),
            "--out",
            str(m),
        ],
    )
    assert r.exit_code == 0, r.output
    r = runner.invoke(app, ["federation", "sign", str(m), "--data-dir", str(a)])
    assert "still to sign: org-b" in r.output
    early = runner.invoke(app, ["federation", "install", str(m), "--data-dir", str(a)])
    assert early.exit_code == 1 and "did not sign" in one_line_error(early.output)
    r = runner.invoke(app, ["federation", "sign", str(m), "--data-dir", str(b)])
    assert "every founder has signed" in r.output
    for d in (a, b):
        r = runner.invoke(app, ["federation", "install", str(m), "--data-dir", str(d)])
        assert r.exit_code == 0, r.output
    assert NodeConfig.load(a / "fedweave.toml").node.federation == "fed-x"
    backup = json.loads((a / "org-a-recovery-backup.json").read_text())
    assert backup["federation"] == "fed-x" and list(backup["peers"]) == ["org-b"]
    s = runner.invoke(app, ["status", "--data-dir", str(a)])
    assert s.exit_code == 0, s.output
    assert "federation: fed-x" in s.output and "node: not running" in s.output
    twice = runner.invoke(app, ["federation", "install", str(m), "--data-dir", str(a)])
    assert twice.exit_code == 1 and "already installed" in one_line_error(twice.output)


def test_run_errors_are_one_line(tmp_path: Path) -> None:
    missing = runner.invoke(app, ["run", "--data-dir", str(tmp_path / "nothing")])
    assert missing.exit_code == 1 and "fedweave init" in one_line_error(missing.output)
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        d = tmp_path / "n"
        r = runner.invoke(
            app,
            [
                "init",
                "--org-id",
                "n",
                "--data-dir",
                str(d),
                "--peer-port",
                str(port + 1 if port < 65000 else port - 2),
                "--admin-port",
                str(port),
            ],
        )
        assert r.exit_code == 0, r.output
        r = runner.invoke(app, ["run", "--data-dir", str(d)])
    assert r.exit_code == 1 and "cannot listen" in one_line_error(r.output)
    (d / "fedweave.toml").write_text('[node]\norg_id = "n"\n[network]\npeer_port = 0\n')
    r = runner.invoke(app, ["run", "--data-dir", str(d)])
    assert r.exit_code == 1 and "network.peer_port" in one_line_error(r.output)


def test_recover_refuses_a_non_empty_dir(tmp_path: Path) -> None:
    a = init(tmp_path, "org-a", 9330)
    r = runner.invoke(
        app,
        [
            "recover",
            "--data-dir",
            str(a),
            "--backup",
            str(a / "org-a-recovery-backup.json"),
            "--manifest",
            str(tmp_path / "none.json"),
        ],
    )
    assert r.exit_code == 1 and "not empty" in one_line_error(r.output)


def test_init_writes_the_dataset_roots_given(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    existing = tmp_path / "shared" / "cohorts"
    existing.mkdir(parents=True)
    d = tmp_path / "node"
    args = ["init", "--org-id", "org-a", "--data-dir", str(d), "--peer-port", "9340"]
    roots = ["--dataset-root", "rel/data", "--dataset-root", str(existing)]
    r = runner.invoke(app, [*args, "--admin-port", "9341", *roots])
    assert r.exit_code == 0, r.output
    written = NodeConfig.load(d / "fedweave.toml").datasets.roots
    assert written == (str(tmp_path / "rel" / "data"), str(existing))
    assert (tmp_path / "rel" / "data").is_dir() and not (d / "datasets").exists()
    assert f"dataset roots: {tmp_path / 'rel' / 'data'}, {existing}" in r.output
    default = init(tmp_path, "org-b", 9350)
    assert NodeConfig.load(default / "fedweave.toml").datasets.roots == (
        str((default / "datasets").resolve()),
    )
    assert (default / "datasets").is_dir()


def test_a_dataset_root_that_cannot_be_a_directory_writes_nothing(tmp_path: Path) -> None:
    a_file = tmp_path / "notes.txt"
    a_file.write_text("x")
    for root, reason in ((a_file, "is not a directory"), (a_file / "sub", "cannot be created")):
        d = tmp_path / "node"
        r = runner.invoke(
            app, ["init", "--org-id", "org-a", "--data-dir", str(d), "--dataset-root", str(root)]
        )
        assert r.exit_code == 1
        line = one_line_error(r.output)
        assert str(root) in line and reason in line
        assert not d.exists()
