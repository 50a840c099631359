"""A full disk and a torn log do not brick a node: it starts after a power cut tore its
egress log's last record, says why it is not ready while it cannot write its log, and
the admin API answers a write it cannot store with 507 and the reason, nothing written.
A log corrupt in the middle stops the start with one readable line."""

from __future__ import annotations

import errno
import sqlite3
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from sqlalchemy.exc import OperationalError
from sqlmodel import Session

from api.app import create_app, disk_full
from api.settings import Settings
from org_node.audit import read_log
from org_node.db.models import Role
from org_node.db.repo import create_token
from org_node.initialize import initialize
from org_node.node import NodeError, OrgNode


def _node_dir(tmp_path: Path) -> Path:
    initialize(tmp_path / "n", "org-n", peer_port=9300, admin_port=9301)
    OrgNode.open(tmp_path / "n").egress.close()  # the log exists, with its header
    return tmp_path / "n"


def test_a_node_starts_after_a_power_cut_tore_its_log(tmp_path: Path) -> None:
    data = _node_dir(tmp_path)
    log = data / "audit" / "egress.jsonl"
    log.write_bytes(log.read_bytes() + b'{"type":"entry","ind')  # cut mid-record
    node = OrgNode.open(data)
    assert len(node.egress.repairs) == 1
    node.egress.close()
    assert len(read_log(log).repairs()) == 1


def test_a_log_corrupt_in_the_middle_stops_the_start_in_one_line(tmp_path: Path) -> None:
    data = _node_dir(tmp_path)
    log = data / "audit" / "egress.jsonl"
    log.write_bytes(log.read_bytes() + b"{not json}\n" + log.read_bytes().splitlines()[0] + b"\n")
    with pytest.raises(NodeError) as info:
        OrgNode.open(data)
    message = str(info.value)
    assert "\n" not in message
    assert "cannot be continued: line 2:" in message and "fedweave audit" in message


def test_a_node_that_cannot_write_its_log_is_not_ready_until_it_can(tmp_path: Path) -> None:
    node = OrgNode.open(_node_dir(tmp_path))
    node.chain = [object()]  # type: ignore[list-item]  # as if a federation were installed
    assert node.health().ready
    node.egress.failure = "the egress log cannot be written: No space left on device"
    health = node.health()
    assert not health.ready
    assert health.checks["egress log"] == node.egress.failure
    node.egress.failure = None
    assert node.health().ready


def test_a_write_the_disk_cannot_take_is_507_and_writes_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    data = _node_dir(tmp_path)
    node = OrgNode.open(data)
    with Session(node.db) as s:
        _, token = create_token(s, "admin", Role.ADMIN)
        s.commit()
    app = create_app(Settings(data_dir=data), node, engine=node.db)
    client = TestClient(
        app, headers={"Authorization": f"Bearer {token}"}, raise_server_exceptions=False
    )
    before = client.get("/v1/tokens").json()["count"]

    def full(self: Session) -> None:
        raise OperationalError("INSERT", {}, sqlite3.OperationalError("database or disk is full"))

    monkeypatch.setattr(Session, "commit", full)
    r = client.post("/v1/tokens", json={"name": "ci", "role": "operator"})
    assert r.status_code == 507
    assert "disk is full" in r.json()["detail"] and "nothing was written" in r.json()["detail"]
    monkeypatch.undo()
    assert client.get("/v1/tokens").json()["count"] == before
    node.egress.close()


@pytest.mark.parametrize(
    ("exc", "full"),
    [
        (OSError(errno.ENOSPC, "No space left on device"), True),
        (OSError(errno.EACCES, "Permission denied"), False),
        (ValueError("x"), False),
    ],
)
def test_disk_full_is_told_apart(exc: BaseException, full: bool) -> None:
    assert (disk_full(exc) is not None) is full
