"""A node rebuilt after a wipe begins its egress log anew and says so in the log's
header (``recovered``): the heads of the lost log that peers hold then prove how much was
lost, instead of failing verification as a rewrite; a rewrite is still caught."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from coordinator_free.identity import OrgIdentity
from coordinator_free.wire import Envelope

from org_node.audit.log import EgressLog
from org_node.audit.records import SignedHead
from org_node.audit.verify import verify_log

KEY = {"org-a": OrgIdentity.generate("org-a", hashlib.sha256(b"org-a").digest()).public_key}


class Clock:
    def __init__(self, start: float) -> None:
        self.t = start

    def __call__(self) -> float:
        self.t += 1.0
        return self.t


def _identity() -> OrgIdentity:
    return OrgIdentity.generate("org-a", hashlib.sha256(b"org-a").digest())


def _send(log: EgressLog, n: int, run: str = "r") -> None:
    for i in range(n):
        env = Envelope("fed", run, 1, "s", "round.ready", "org-a", "org-b", i + 1, 1.8e9, b"x")
        env = env.with_signature(log.identity.sign(env.signing_bytes()))
        log.record(env, env.to_wire())


def _lost_log(tmp_path: Path) -> list[SignedHead]:
    """The log the wipe destroyed: 30 entries and the heads the peers keep of it."""
    old = EgressLog(_identity(), tmp_path / "old.jsonl", clock=Clock(1.8e9))
    heads = []
    for _ in range(3):
        _send(old, 10)
        heads.append(old.sign_head("r", 1))
    old.close()
    return heads


def _new_log(tmp_path: Path, *, recovered: bool) -> tuple[EgressLog, Path]:
    path = tmp_path / "new.jsonl"
    log = EgressLog(_identity(), path, clock=Clock(1.8e9 + 3600), recovered=recovered)
    _send(log, 5)
    return log, path


def test_finding_9_a_recovered_log_declares_its_loss_and_the_peers_heads_prove_it(
    tmp_path: Path,
) -> None:
    held = _lost_log(tmp_path)
    log, path = _new_log(tmp_path, recovered=True)
    held.append(log.sign_head("r", 2))
    log.close()
    assert json.loads(path.read_text().splitlines()[0])["recovered"]
    result = verify_log(path, trusted_keys=KEY, peer_heads=held)
    assert result.ok, result.summary
    assert "begun anew at" in result.summary and "at least 30 entries" in result.summary
    assert "agrees with 1 head(s) held by peers" in result.summary


def test_finding_9_without_the_declaration_the_lost_log_is_a_rewrite(tmp_path: Path) -> None:
    held = _lost_log(tmp_path)
    log, path = _new_log(tmp_path, recovered=False)
    log.close()
    result = verify_log(path, trusted_keys=KEY, peer_heads=held)
    assert not result.ok
    assert "rewritten" in result.summary or "removed" in result.summary


def test_a_head_signed_after_the_recovery_still_catches_a_rewrite(tmp_path: Path) -> None:
    held = _lost_log(tmp_path)
    log, path = _new_log(tmp_path, recovered=True)
    held.append(log.sign_head("r", 2))
    log.close()
    lines = path.read_text().splitlines()
    # cut the last 3 entries and the head: the peers' head after the recovery covers them
    path.write_text("\n".join(lines[:-4]) + "\n")
    result = verify_log(path, trusted_keys=KEY, peer_heads=held)
    assert not result.ok and "were removed" in result.summary


def test_the_declaration_cannot_be_added_afterwards(tmp_path: Path) -> None:
    """``recovered`` is in the header, which the chain's genesis hashes: a log that adds it
    later to pass as recovered no longer links to its own signed heads."""
    held = _lost_log(tmp_path)
    log, path = _new_log(tmp_path, recovered=False)
    log.sign_head("r", 2)
    log.close()
    lines = path.read_text().splitlines()
    header = json.loads(lines[0])
    header["recovered"] = header["created"]
    lines[0] = json.dumps(header, sort_keys=True, separators=(",", ":"))
    path.write_text("\n".join(lines) + "\n")
    result = verify_log(path, trusted_keys=KEY, peer_heads=held)
    assert not result.ok and "prev_hash" in result.summary
