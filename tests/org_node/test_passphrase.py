"""Finding 6 (issue 20): ``fedweave init --passphrase-file`` (or ``FEDWEAVE_PASSPHRASE``)
encrypts the identity key, the recovery secret and the recovery backup; every command
that opens them reads the passphrase the same way and, without it or with a wrong one,
fails in one readable line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import Result
from coordinator_free.errors import IdentityError
from coordinator_free.identity import OrgIdentity
from coordinator_free.sealed import BackupError, RecoveryBackup
from typer.testing import CliRunner

import api.cli  # noqa: F401  (adds `fedweave run` to the command line)
from org_node.cli import app
from org_node.initialize import InitError, prepare_recovery
from org_node.node import NodeError, OrgNode, load_secret
from org_node.passphrase import PASSPHRASE_ENV, PassphraseError, read_passphrase
from tests.org_node.test_init_cli import one_line_error

runner = CliRunner()
PASS = b"correct horse battery staple"


def _init(
    tmp_path: Path, org: str, port: int, *extra: str, env: dict[str, str] | None = None
) -> tuple[Path, Result]:
    d = tmp_path / org
    args = ["init", "--org-id", org, "--data-dir", str(d), "--peer-port", str(port)]
    args += ["--admin-port", str(port + 1), *extra]
    result = runner.invoke(app, args, env=env)
    assert result.exit_code == 0, result.output
    return d, result


def _pass_file(tmp_path: Path, value: bytes = PASS) -> Path:
    path = tmp_path / "passphrase.txt"
    path.write_bytes(value + b"\n")
    path.chmod(0o600)
    return path


def _found(tmp_path: Path, *dirs: Path) -> Path:
    m = tmp_path / "manifest.json"
    members = [arg for d in dirs for arg in ("--member", str(d / "member.json"))]
    r = runner.invoke(
        app, ["federation", "found", "--federation", "fed-p", *members, "--out", str(m)]
    )
    assert r.exit_code == 0, r.output
    return m


def test_finding_6_init_with_a_passphrase_encrypts_the_key_secret_and_backup(
    tmp_path: Path,
) -> None:
    d, result = _init(tmp_path, "org-a", 9400, "--passphrase-file", str(_pass_file(tmp_path)))
    assert "warning" not in result.output
    key = (d / "identity" / "identity.key").read_bytes()
    assert key.startswith(b"-----BEGIN ENCRYPTED PRIVATE KEY-----")
    secret = load_secret(d / "identity" / "recovery.secret", PASS)
    secret_file = (d / "identity" / "recovery.secret").read_text()
    backup_file = (d / "org-a-recovery-backup.json").read_text()
    assert secret.hex() not in secret_file and secret.hex() not in backup_file
    assert json.loads(secret_file)["format"] == "fedweave-recovery-secret/v1"
    backup = RecoveryBackup.load(d / "org-a-recovery-backup.json", PASS)
    assert backup.encrypted and backup.secret == secret
    assert backup.identity(PASS).public_key == OrgIdentity.load(d / "identity", PASS).public_key
    with pytest.raises(IdentityError, match="a passphrase is needed"):
        OrgIdentity.load(d / "identity")
    with pytest.raises(IdentityError, match="wrong passphrase"):
        OrgIdentity.load(d / "identity", b"guess")
    with pytest.raises(NodeError, match="wrong passphrase for the recovery secret"):
        load_secret(d / "identity" / "recovery.secret", b"guess")
    with pytest.raises(BackupError, match="passphrase"):
        RecoveryBackup.load(d / "org-a-recovery-backup.json")
    with pytest.raises(NodeError, match="--passphrase-file"):
        OrgNode.open(d)
    node = OrgNode.open(d, passphrase=PASS)
    try:
        assert node.secret == secret and node.me == "org-a"
    finally:
        node.db.dispose()
        node.egress.close()


def test_finding_6_init_without_a_passphrase_warns_that_files_are_in_clear(
    tmp_path: Path,
) -> None:
    d, result = _init(tmp_path, "org-a", 9410)
    assert "warning: no passphrase given" in result.output and "unencrypted" in result.output
    assert b"ENCRYPTED" not in (d / "identity" / "identity.key").read_bytes()
    assert OrgIdentity.load(d / "identity", b"ignored for a key in clear").org_id == "org-a"


def test_finding_6_the_environment_variable_gives_the_passphrase(tmp_path: Path) -> None:
    env = {PASSPHRASE_ENV: PASS.decode()}
    a, _ = _init(tmp_path, "org-a", 9420, env=env)
    b, _ = _init(tmp_path, "org-b", 9430, env=env)
    assert b"ENCRYPTED" in (a / "identity" / "identity.key").read_bytes()
    m = _found(tmp_path, a, b)
    for d in (a, b):
        r = runner.invoke(app, ["federation", "sign", str(m), "--data-dir", str(d)], env=env)
        assert r.exit_code == 0, r.output
    r = runner.invoke(app, ["federation", "install", str(m), "--data-dir", str(a)], env=env)
    assert r.exit_code == 0, r.output
    backup = RecoveryBackup.load(a / "org-a-recovery-backup.json", PASS)
    assert backup.federation == "fed-p" and backup.encrypted and list(backup.peers) == ["org-b"]


def test_finding_6_commands_without_or_with_a_wrong_passphrase_fail_in_one_line(
    tmp_path: Path,
) -> None:
    good = _pass_file(tmp_path)
    a, _ = _init(tmp_path, "org-a", 9440, "--passphrase-file", str(good))
    b, _ = _init(tmp_path, "org-b", 9450, "--passphrase-file", str(good))
    m = _found(tmp_path, a, b)
    wrong = tmp_path / "wrong.txt"
    wrong.write_text("not it\n")
    sign = ["federation", "sign", str(m), "--data-dir", str(a)]
    r = runner.invoke(app, sign)
    line = one_line_error(r.output)
    assert r.exit_code == 1 and "a passphrase is needed" in line and "--passphrase-file" in line
    r = runner.invoke(app, [*sign, "--passphrase-file", str(wrong)])
    assert r.exit_code == 1 and "wrong passphrase" in one_line_error(r.output)
    r = runner.invoke(app, [*sign, "--passphrase-file", str(tmp_path / "none.txt")])
    assert r.exit_code == 1 and "cannot read the passphrase file" in one_line_error(r.output)
    r = runner.invoke(app, ["run", "--data-dir", str(a)])
    assert r.exit_code == 1 and "a passphrase is needed" in one_line_error(r.output)
    r = runner.invoke(app, ["run", "--data-dir", str(a), "--passphrase-file", str(wrong)])
    assert r.exit_code == 1 and "wrong passphrase" in one_line_error(r.output)
    r = runner.invoke(app, ["audit", "report", "run-x", "--data-dir", str(a), "--out", "o"])
    assert r.exit_code == 1 and "a passphrase is needed" in r.output
    assert "Traceback" not in r.output
    r = runner.invoke(app, [*sign, "--passphrase-file", str(good)])
    assert r.exit_code == 0 and "still to sign: org-b" in r.output


def test_finding_6_recovery_needs_the_passphrase_and_keeps_the_node_encrypted(
    tmp_path: Path,
) -> None:
    good = _pass_file(tmp_path)
    a, _ = _init(tmp_path, "org-a", 9460, "--passphrase-file", str(good))
    b, _ = _init(tmp_path, "org-b", 9470, "--passphrase-file", str(good))
    m = _found(tmp_path, a, b)
    for d in (a, b):
        r = runner.invoke(
            app,
            ["federation", "sign", str(m), "--data-dir", str(d), "--passphrase-file", str(good)],
        )
        assert r.exit_code == 0, r.output
    r = runner.invoke(
        app, ["federation", "install", str(m), "--data-dir", str(a), "--passphrase-file", str(good)]
    )
    assert r.exit_code == 0, r.output
    backup, chain = a / "org-a-recovery-backup.json", a / "federation" / "chain.json"
    fresh = tmp_path / "fresh"
    recover = [
        "recover",
        "--data-dir",
        str(fresh),
        "--backup",
        str(backup),
        "--manifest",
        str(chain),
    ]
    r = runner.invoke(app, recover)
    line = one_line_error(r.output)
    assert r.exit_code == 1 and "passphrase" in line and "FEDWEAVE_PASSPHRASE" in line
    assert not fresh.exists()
    with pytest.raises(InitError, match="wrong passphrase"):
        prepare_recovery(fresh, backup, chain, passphrase=b"guess")
    paths, token = prepare_recovery(fresh, backup, chain, passphrase=PASS)
    assert token.startswith("fw_")
    assert b"ENCRYPTED" in (paths.identity_dir / "identity.key").read_bytes()
    assert load_secret(paths.secret, PASS) == RecoveryBackup.load(backup, PASS).secret
    with pytest.raises(NodeError, match="passphrase"):
        OrgNode.open(fresh)


def test_read_passphrase_precedence_and_bad_files(tmp_path: Path) -> None:
    f = _pass_file(tmp_path, b"from-file")
    env = {PASSPHRASE_ENV: "from-env"}
    assert read_passphrase(f, env) == b"from-file"  # the file wins over the environment
    assert read_passphrase(None, env) == b"from-env"
    assert read_passphrase(None, {}) is None
    empty = tmp_path / "empty"
    empty.write_bytes(b"\n")
    with pytest.raises(PassphraseError, match="is empty"):
        read_passphrase(empty, env)
    big = tmp_path / "big"
    big.write_bytes(b"x" * 5000)
    with pytest.raises(PassphraseError, match="over"):
        read_passphrase(big, {})
    (tmp_path / "spaces").write_bytes(b"  inner spaces kept  \n")
    assert read_passphrase(tmp_path / "spaces", {}) == b"  inner spaces kept  "


def test_finding_6_the_local_worker_never_inherits_the_passphrase(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The trainer's worker runs the org's training code: it gets the node's environment
    but not the passphrase that opens the node's keys."""
    from org_node.training.launch import child_env

    monkeypatch.setenv(PASSPHRASE_ENV, PASS.decode())
    monkeypatch.setenv("FEDWEAVE_SOMETHING_ELSE", "kept")
    env = child_env({}, 1)
    assert PASSPHRASE_ENV not in env and env["FEDWEAVE_SOMETHING_ELSE"] == "kept"
