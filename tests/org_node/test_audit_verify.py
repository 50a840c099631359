"""``fedweave audit verify``: one line and exit 0, or exit 1 naming the first broken entry."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
from coordinator_free.identity import OrgIdentity
from coordinator_free.wire import Envelope

from org_node.audit.log import EgressLog, canonical, entry_hash, read_log
from org_node.audit.report import (
    ConsentRecord,
    RoundFacts,
    RunFacts,
    SecAggFacts,
    build_report,
    report_to_bytes,
)
from org_node.audit.verify import main, peer_heads_from_logs, verify_log, verify_path
from org_node.policy import Policy, RunSpec


def identity(org: str) -> OrgIdentity:
    return OrgIdentity.generate(org, hashlib.sha256(org.encode()).digest())


def send(log: EgressLog, peer: str, kind: str, payload: bytes, rnd: int = 1) -> None:
    env = Envelope("fed", "r", rnd, "st", kind, log.org, peer, 1, 1.0e9, payload)
    env = env.with_signature(log.identity.sign(env.signing_bytes()))
    log.record(env, env.to_wire())


def small_log(path: Path, org: str = "a") -> EgressLog:
    log = EgressLog(identity(org), path)
    send(log, "b", "round.ready", b"k")
    send(log, "c", "agg.chunk", b"m" * 64)
    log.sign_head("r", 1)
    return log


def append_chained(path: Path, kind: str, privacy_class: str) -> None:
    """Append a well-chained entry, as a log writer that skipped the hook would."""
    records = read_log(path)
    last = records.entries()[-1]
    body = {
        **last.to_dict(),
        "index": last.index + 1,
        "kind": kind,
        "privacy_class": privacy_class,
        "prev_hash": last.entry_hash,
    }
    body["entry_hash"] = entry_hash(last.entry_hash, body)
    with path.open("ab") as f:
        f.write(canonical({"type": "entry", **body}) + b"\n")


def test_main_prints_one_line_and_exits_0(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    small_log(tmp_path / "a.log").close()
    assert main(tmp_path / "a.log") == 0
    out = capsys.readouterr().out
    assert out.count("\n") == 1 and out.startswith("OK: log of a: 2 entries, 1 signed heads")
    assert "not pinned" in out
    assert main(tmp_path / "a.log", keys={"a": identity("a").public_key}) == 0
    assert "not pinned" not in capsys.readouterr().out


def test_main_exits_1_naming_the_first_broken_entry(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "a.log"
    small_log(path).close()
    lines = path.read_bytes().split(b"\n")
    lines[2] = lines[2].replace(b'"bytes":', b'"bytes":1')
    path.write_bytes(b"\n".join(lines))
    assert main(path) == 1
    out = capsys.readouterr().out
    assert out.count("\n") == 1
    assert out.startswith("FAIL: log of a: entry 1 (line 3): contents do not match")


def test_a_forbidden_message_in_the_log_is_reported_as_sent(tmp_path: Path) -> None:
    path = tmp_path / "a.log"
    small_log(path).close()
    append_chained(path, "data.rows", "raw_data")
    result = verify_log(path)
    assert not result.ok and result.index == 2
    assert "forbidden class raw_data ('data.rows') was sent to 'c'" in result.summary


@pytest.mark.parametrize(
    "kind, cls, message",
    [
        ("round.ready", "control", "is encrypted_share, recorded as control"),
        ("round.share", "public_key", "is encrypted_share, recorded as public_key"),
        ("nobody.knows", "control", "has no privacy class"),
        ("round.ready", "secret", "unknown privacy class"),
    ],
)
def test_a_misclassified_entry_is_named(tmp_path: Path, kind: str, cls: str, message: str) -> None:
    path = tmp_path / "a.log"
    small_log(path).close()
    append_chained(path, kind, cls)
    result = verify_log(path)
    assert not result.ok and "entry 2" in result.summary and message in result.summary


@pytest.mark.parametrize("kind", ["round.ready", "round.ready.reply", "round.readies"])
def test_a_ready_classed_public_key_in_an_older_log_still_verifies(
    tmp_path: Path, kind: str
) -> None:
    """Before the shares rode with the readies, a ready was ``public_key``."""
    path = tmp_path / "a.log"
    small_log(path).close()
    append_chained(path, kind, "public_key")
    assert verify_log(path).ok


def test_a_key_other_than_the_pinned_one_is_refused(tmp_path: Path) -> None:
    small_log(tmp_path / "a.log").close()
    result = verify_log(tmp_path / "a.log", trusted_keys={"a": identity("z").public_key})
    assert not result.ok and "pinned key" in result.summary


def test_a_forked_log_disagrees_with_the_head_a_peer_holds(tmp_path: Path) -> None:
    """The org signed a head, gossiped it, then rewrote its log and signed again."""
    a = identity("a")
    original = small_log(tmp_path / "a.log")
    peer = EgressLog(identity("b"), tmp_path / "b.log")
    peer.hold_peer_head(original.heads[0], a.public_key)
    peer.close()
    original.close()
    (tmp_path / "a.log").unlink()
    forged = EgressLog(a, tmp_path / "a.log")
    send(forged, "b", "round.ready", b"k")
    send(forged, "c", "agg.chunk", b"n" * 64)  # a different payload
    forged.sign_head("r", 1)
    forged.close()
    assert verify_log(tmp_path / "a.log").ok  # alone, the forgery is consistent
    held = peer_heads_from_logs([tmp_path / "b.log"])
    assert [h.org for h in held] == ["a"]
    result = verify_log(tmp_path / "a.log", peer_heads=held)
    assert not result.ok and result.index == 1
    assert "differs from the signed head the peers hold" in result.summary
    by_path = verify_path(tmp_path / "a.log", peer_logs=[tmp_path / "b.log"])
    assert not by_path.ok and by_path.summary == result.summary


def test_a_peer_head_with_a_bad_signature_is_refused(tmp_path: Path) -> None:
    log = small_log(tmp_path / "a.log")
    log.close()
    other = EgressLog(identity("z"))
    send(other, "b", "round.ready", b"k")
    send(other, "c", "agg.chunk", b"m" * 64)
    fake = other.sign_head("r", 1)
    fake = type(fake)(**{**fake.to_dict(), "org": "a"})
    result = verify_log(tmp_path / "a.log", peer_heads=[fake])
    assert not result.ok and "held by a peer: the signature is not valid" in result.summary


def test_verify_path_tells_logs_reports_and_garbage_apart(tmp_path: Path) -> None:
    assert not verify_path(tmp_path / "missing.json").ok
    (tmp_path / "junk.bin").write_bytes(b"\xff\x00junk")
    assert "neither a log nor a report" in verify_path(tmp_path / "junk.bin").summary
    (tmp_path / "other.json").write_text(json.dumps({"schema": "something/else"}))
    assert "not a fedweave/audit-report/v1 report" in verify_path(tmp_path / "other.json").summary
    (tmp_path / "empty.log").write_bytes(b"")
    assert not verify_path(tmp_path / "empty.log").ok
    log = small_log(tmp_path / "a.log")
    report = build_report(
        log,
        RunFacts(
            run="r",
            spec=RunSpec(trainer="t", rounds=1, participants=("a", "b", "c"), threshold=2),
            policies={"p": Policy()},
            consents=(ConsentRecord("b", "accepted", "2026-01-01", "ops"),),
            secure_aggregation=SecAggFacts("masked", 3, 2, 32, None),
            rounds=(RoundFacts(1, ("a", "b", "c"), ("a", "b", "c")),),
        ),
    )
    path = tmp_path / "r.json"
    path.write_bytes(report_to_bytes(report))
    result = verify_path(path)
    assert result.ok and result.what == "report" and "run 'r'" in result.summary
    # a change of layout only (no value changed) is still a changed byte
    path.write_bytes(report_to_bytes(report).replace(b'  "org"', b'   "org"', 1))
    result = verify_path(path)
    assert not result.ok and "bytes changed outside the signed values" in result.summary
    assert result.location.startswith("line ")


def test_a_report_with_an_unknown_or_changed_section_is_named(tmp_path: Path) -> None:
    log = small_log(tmp_path / "a.log")
    report = build_report(
        log,
        RunFacts(
            run="r",
            spec=RunSpec(trainer="t", rounds=1, participants=("a", "b"), threshold=2),
            policies={},
            consents=(),
            secure_aggregation=SecAggFacts("masked", 2, 2, 32, None),
            rounds=(RoundFacts(1, ("a", "b"), ("a", "b"), loss=0.5),),
        ),
    )
    report["rounds"][0]["loss"] = 0.25
    path = tmp_path / "r.json"
    path.write_bytes(report_to_bytes(report))
    result = verify_path(path)
    assert not result.ok and result.location == "rounds"
    assert result.summary == (
        "FAIL: report of a: rounds: the section was changed after the report was signed"
    )


def test_the_audit_cli_verifies_and_writes_reports(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from org_node.audit.cli import audit_app, write_run_report

    log = small_log(tmp_path / "a.log")
    runner = CliRunner()
    ok = runner.invoke(audit_app, ["verify", str(tmp_path / "a.log")])
    assert ok.exit_code == 0 and ok.output.startswith("OK: log of a")
    pinned = runner.invoke(
        audit_app,
        ["verify", str(tmp_path / "a.log"), "--key", f"a={identity('z').public_key.hex()}"],
    )
    assert pinned.exit_code == 1 and "pinned key" in pinned.output
    bad = runner.invoke(audit_app, ["verify", str(tmp_path / "a.log"), "--key", "a=zz"])
    assert bad.exit_code == 2
    facts = RunFacts(
        run="r",
        spec=RunSpec(trainer="t", rounds=1, participants=("a", "b"), threshold=2),
        policies={},
        consents=(),
        secure_aggregation=SecAggFacts("masked", 2, 2, 32, None),
        rounds=(RoundFacts(1, ("a", "b"), ("a", "b")),),
    )
    assert write_run_report(log, facts, tmp_path / "out") == 0
    assert verify_path(tmp_path / "out" / "r.audit.json").ok
    unknown = RunFacts(**{**facts.__dict__, "run": "nope"})
    assert write_run_report(log, unknown, tmp_path / "out") == 1


def _federated_node(tmp_path: Path) -> Path:
    """A data dir of org 'a' with an installed two-member federation 'fed'."""
    from org_node.initialize import found_manifest, initialize, install_manifest, sign_manifest

    dirs = [tmp_path / org for org in ("a", "b")]
    for i, d in enumerate(dirs):
        initialize(d, d.name, peer_port=9400 + 2 * i, admin_port=9401 + 2 * i)
    manifest = tmp_path / "manifest.json"
    found_manifest("fed", [d / "member.json" for d in dirs], manifest)
    for d in dirs:
        sign_manifest(d, manifest)
    install_manifest(dirs[0], manifest)
    return dirs[0]


def _report_of(log: EgressLog, path: Path) -> Path:
    report = build_report(
        log,
        RunFacts(
            run="r",
            spec=RunSpec(trainer="t", rounds=1, participants=("a", "b"), threshold=2),
            policies={},
            consents=(),
            secure_aggregation=SecAggFacts("masked", 2, 2, 32, None),
            rounds=(RoundFacts(1, ("a", "b"), ("a", "b")),),
        ),
    )
    path.write_bytes(report_to_bytes(report))
    return path


def test_audit_verify_pins_the_key_of_the_installed_manifest(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from typer.testing import CliRunner

    from org_node.audit.cli import audit_app

    monkeypatch.delenv("FEDWEAVE_DATA_DIR", raising=False)
    node = _federated_node(tmp_path)
    fingerprint = json.loads((node / "member.json").read_text())["fingerprint"]
    real = EgressLog(OrgIdentity.load(node / "identity"), tmp_path / "real.log")
    send(real, "b", "round.ready", b"k")
    real.sign_head("r", 1)
    genuine = _report_of(real, tmp_path / "genuine.json")
    forged = _report_of(small_log(tmp_path / "forged.log"), tmp_path / "forged.json")
    runner = CliRunner()

    ok = runner.invoke(audit_app, ["verify", str(genuine), "--data-dir", str(node)])
    assert ok.exit_code == 0, ok.output
    assert ok.output.count("\n") == 1 and ok.output.startswith("OK: report of a")
    assert "not pinned" not in ok.output
    assert f"key of 'a' pinned from federation 'fed' manifest v0 in {node}" in ok.output
    assert f"(certificate fingerprint {fingerprint})" in ok.output
    # the node's data dir given the usual way, by the environment
    monkeypatch.setenv("FEDWEAVE_DATA_DIR", str(node))
    log_ok = runner.invoke(audit_app, ["verify", str(tmp_path / "real.log")])
    assert log_ok.exit_code == 0 and "pinned from federation 'fed'" in log_ok.output
    monkeypatch.delenv("FEDWEAVE_DATA_DIR")

    # signed by another key than the manifest's: one line, exit 1
    bad = runner.invoke(audit_app, ["verify", str(forged), "--data-dir", str(node)])
    assert bad.exit_code == 1
    assert bad.output.count("\n") == 1
    assert bad.output.startswith("FAIL: report of a: log header: the key is not the pinned key")
    assert fingerprint in bad.output

    # an explicit key overrides the manifest's
    other = f"a={identity('a').public_key.hex()}"
    forced = runner.invoke(
        audit_app, ["verify", str(forged), "--data-dir", str(node), "--key", other]
    )
    assert forced.exit_code == 0 and "key of 'a' pinned from --key" in forced.output

    # no data dir, no key: the old check, saying plainly it is not pinned
    loose = runner.invoke(audit_app, ["verify", str(forged)])
    assert loose.exit_code == 0 and "not pinned" in loose.output and "--data-dir" in loose.output


def test_audit_verify_pins_from_the_member_record_or_says_why_it_cannot(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from org_node.audit.cli import audit_app
    from org_node.initialize import initialize

    node = tmp_path / "a"
    initialize(node, "a", peer_port=9410, admin_port=9411)  # no federation installed yet
    real = EgressLog(OrgIdentity.load(node / "identity"), tmp_path / "a.log")
    send(real, "b", "round.ready", b"k")
    real.sign_head("r", 1)
    runner = CliRunner()
    ok = runner.invoke(audit_app, ["verify", str(tmp_path / "a.log"), "--data-dir", str(node)])
    assert ok.exit_code == 0, ok.output
    assert f"pinned from the member record {node / 'member.json'}" in ok.output
    small_log(tmp_path / "c.log", org="c").close()
    stranger = runner.invoke(
        audit_app, ["verify", str(tmp_path / "c.log"), "--data-dir", str(node)]
    )
    assert stranger.exit_code == 1
    assert stranger.output.strip() == (
        f"error: cannot pin the key of 'c': {node} has no federation installed and its member "
        "record is of 'a' (pass --key c=HEX)"
    )
    empty = runner.invoke(
        audit_app, ["verify", str(tmp_path / "a.log"), "--data-dir", str(tmp_path / "none")]
    )
    assert empty.exit_code == 1 and "no federation manifest and no member record" in empty.output
