"""The egress log: classification, the chain, signed heads, the fsynced file mirror."""

from __future__ import annotations

import hashlib
import json
import os
import re
import stat
from pathlib import Path

import pytest
from coordinator_free.identity import OrgIdentity
from coordinator_free.wire import Envelope
from hypothesis import given, settings
from hypothesis import strategies as st

from org_node.audit.classes import (
    FORBIDDEN_CLASSES,
    ForbiddenClass,
    PrivacyClass,
    UnclassifiedKind,
    classify,
)
from org_node.audit.log import (
    AuditError,
    EgressLog,
    LogFormatError,
    SignedHead,
    canonical,
    entry_hash,
    genesis_hash,
    read_log,
)
from org_node.audit.verify import verify_log

REPO = Path(__file__).resolve().parents[2]
VECTORS = REPO / "tests" / "vectors" / "audit_log.json"


def identity(org: str) -> OrgIdentity:
    return OrgIdentity.generate(org, hashlib.sha256(org.encode()).digest())


class Clock:
    """A deterministic clock: 1.5 s later at each reading."""

    def __init__(self, start: float = 1_800_000_000.0) -> None:
        self.t = start

    def __call__(self) -> float:
        self.t += 1.5
        return self.t


def envelope(
    sender: OrgIdentity,
    recipient: str,
    kind: str,
    payload: bytes,
    *,
    run: str = "run-1",
    round: int = 1,
    seq: int = 1,
) -> tuple[Envelope, bytes]:
    env = Envelope(
        federation="fed",
        run=run,
        round=round,
        stage="s",
        kind=kind,
        sender=sender.org_id,
        recipient=recipient,
        seq=seq,
        sent_at=1_800_000_000.0,
        payload=payload,
    )
    signed = env.with_signature(sender.sign(env.signing_bytes()))
    return signed, signed.to_wire()


# -- classes -------------------------------------------------------------------------------


_FILE_SUFFIXES = (".json", ".key", ".crt", ".log", ".npz", ".toml", ".db", ".py", ".pem")


def _kinds_used_in_coordinator_free() -> set[str]:
    """Every message kind the coordinator-free layer names: its dotted string constants
    (file names aside) and every string literal passed to ``.on(`` or ``.send(``."""
    kinds: set[str] = set()
    for path in (REPO / "coordinator-free").rglob("*.py"):
        text = path.read_text(encoding="utf-8")
        for value in re.findall(r'^[A-Z_]+\s*=\s*"([a-z_]+\.[a-z_.]+)"', text, re.M):
            if not value.endswith(_FILE_SUFFIXES):
                kinds.add(value)
        kinds.update(re.findall(r'\.on\(\s*"([^"]+)"', text))
        kinds.update(re.findall(r'\.send\(\s*\w+,\s*"([^"]+)"', text))
    kinds.discard(".reply")
    return kinds


def test_every_kind_used_in_coordinator_free_is_classified_and_allowed() -> None:
    kinds = _kinds_used_in_coordinator_free()
    assert {"round.ready", "agg.chunk", "swim.ping", "gossip.push", "round.model"} <= kinds
    for kind in sorted(kinds):
        cls = classify(kind)
        assert cls not in FORBIDDEN_CLASSES, kind
        assert classify(kind + ".reply") in (
            PrivacyClass.CONTROL,
            PrivacyClass.MEMBERSHIP,
            PrivacyClass.CHECKPOINT_SHARD,
            PrivacyClass.MASKED_CHUNK,  # round.total: the masked sum of a ring attempt
            PrivacyClass.AGGREGATE_CHUNK,  # round.part: a chunk of the federation's sum
            # the round's pairwise exchanges: the responder's own ready, share, release
            PrivacyClass.PUBLIC_KEY,
            PrivacyClass.ENCRYPTED_SHARE,
            PrivacyClass.RELEASED_SHARE,
        )


@pytest.mark.parametrize(
    "kind, cls",
    [
        ("round.ready", PrivacyClass.ENCRYPTED_SHARE),
        ("secagg.advertise", PrivacyClass.PUBLIC_KEY),
        ("round.share", PrivacyClass.ENCRYPTED_SHARE),
        ("round.unmask", PrivacyClass.RELEASED_SHARE),
        ("agg.chunk", PrivacyClass.MASKED_CHUNK),
        ("ring.reduce", PrivacyClass.MASKED_CHUNK),
        ("ckks.sum", PrivacyClass.CIPHERTEXT),
        ("round.model", PrivacyClass.MODEL_HASH),
        ("model.hash", PrivacyClass.MODEL_HASH),
        ("swim.ping_req", PrivacyClass.MEMBERSHIP),
        ("gossip.push.reply", PrivacyClass.MEMBERSHIP),
        ("agg.chunk.reply", PrivacyClass.CONTROL),
        ("round.total", PrivacyClass.CONTROL),
        ("round.total.reply", PrivacyClass.MASKED_CHUNK),
        ("agg.sum", PrivacyClass.AGGREGATE_CHUNK),
        ("agg.sum.reply", PrivacyClass.CONTROL),
        ("round.part", PrivacyClass.CONTROL),
        ("round.part.reply", PrivacyClass.AGGREGATE_CHUNK),
        # a pairwise exchange's reply carries the responder's own message of the kind
        ("round.ready.reply", PrivacyClass.ENCRYPTED_SHARE),
        ("round.share.reply", PrivacyClass.ENCRYPTED_SHARE),
        ("round.unmask.reply", PrivacyClass.RELEASED_SHARE),
        # relayed ready records: the batch and the reply that carries the responder's own
        ("round.readies", PrivacyClass.ENCRYPTED_SHARE),
        ("round.readies.reply", PrivacyClass.ENCRYPTED_SHARE),
        ("round.seed", PrivacyClass.RELEASED_SHARE),
        ("round.seed.reply", PrivacyClass.CONTROL),
        ("round.permit", PrivacyClass.CONTROL),
        ("round.token", PrivacyClass.CONTROL),
        ("round.commit", PrivacyClass.CONTROL),  # the token's kind in older logs
        ("agg.ping", PrivacyClass.CONTROL),
        ("shard.get.reply", PrivacyClass.CHECKPOINT_SHARD),
        ("shard.put", PrivacyClass.CHECKPOINT_SHARD),
        ("audit.head", PrivacyClass.AUDIT_HEAD),
        ("data.rows", PrivacyClass.RAW_DATA),
        ("labels.y", PrivacyClass.LABELS),
        ("update.plain", PrivacyClass.UNMASKED_UPDATE),
    ],
)
def test_kinds_map_to_their_class(kind: str, cls: PrivacyClass) -> None:
    assert classify(kind) is cls


@pytest.mark.parametrize("kind", ["", "round", "roundx.ready", "agg.chunky", "mystery.reply", "x"])
def test_unknown_kinds_are_refused(kind: str) -> None:
    with pytest.raises(UnclassifiedKind):
        classify(kind)


# -- the chain -----------------------------------------------------------------------------


def test_entries_chain_from_the_header_and_record_the_wire_bytes(tmp_path: Path) -> None:
    a = identity("a")
    log = EgressLog(a, tmp_path / "a.log", clock=Clock())
    env, wire = envelope(a, "b", "round.ready", b"keys")
    first = log.record(env, wire)
    env2, wire2 = envelope(a, "c", "agg.chunk", b"\x01" * 100, seq=2)
    log(env2, wire2)  # the endpoint hook form
    second = log.entries[-1]
    assert first.index == 0 and second.index == 1
    assert first.prev_hash == genesis_hash(log.header) == log.genesis
    assert second.prev_hash == first.entry_hash
    assert first.entry_hash == first.computed_hash()
    assert first.bytes == len(wire) and second.bytes == len(wire2)
    assert first.sha256 == hashlib.sha256(b"keys").hexdigest()
    assert (first.peer, first.kind, first.privacy_class) == ("b", "round.ready", "encrypted_share")
    assert log.header["created"] == "2027-01-15T08:00:01.500000Z"
    assert first.time == "2027-01-15T08:00:03.000000Z"
    records = read_log(tmp_path / "a.log")
    assert records.entries() == [first, second]


def test_an_envelope_of_another_org_is_refused(tmp_path: Path) -> None:
    log = EgressLog(identity("a"), tmp_path / "a.log")
    env, wire = envelope(identity("b"), "a", "round.ready", b"")
    with pytest.raises(AuditError, match="offered to the log"):
        log.record(env, wire)


def test_forbidden_and_unknown_kinds_are_refused_and_remembered(tmp_path: Path) -> None:
    a = identity("a")
    log = EgressLog(a, tmp_path / "a.log")
    for kind, error in (
        ("data.rows", ForbiddenClass),
        ("labels.y", ForbiddenClass),
        ("update.raw", ForbiddenClass),
        ("nobody.knows", UnclassifiedKind),
    ):
        env, wire = envelope(a, "b", kind, b"secret")
        with pytest.raises(error):
            log.record(env, wire)
    assert log.entries == []
    assert [r.kind for r in log.refusals] == ["data.rows", "labels.y", "update.raw", "nobody.knows"]
    assert "never leaves" in log.refusals[0].reason


def test_signed_heads_verify_and_round_trip(tmp_path: Path) -> None:
    a = identity("a")
    log = EgressLog(a, tmp_path / "a.log", clock=Clock())
    empty = log.sign_head("run-1", 0)
    assert empty.index == -1 and empty.head_hash == log.genesis
    env, wire = envelope(a, "b", "round.ready", b"k")
    log.record(env, wire)
    head = log.sign_head("run-1", 1)
    assert head.index == 0 and head.head_hash == log.entries[0].entry_hash
    assert head.verify(a.public_key) and not head.verify(identity("b").public_key)
    assert SignedHead.from_bytes(head.to_bytes()) == head
    forged = SignedHead(**{**head.to_dict(), "index": 1})
    assert not forged.verify(a.public_key)
    with pytest.raises(LogFormatError):
        SignedHead.from_bytes(head.to_bytes().replace(b'{"', b'{ "', 1))
    with pytest.raises(LogFormatError):
        SignedHead.from_bytes(b"[]")


def test_peer_heads_are_checked_before_they_are_held(tmp_path: Path) -> None:
    a, b = identity("a"), identity("b")
    log_a = EgressLog(a, tmp_path / "a.log")
    log_b = EgressLog(b, tmp_path / "b.log")
    head_b = log_b.sign_head("run-1", 1)
    with pytest.raises(AuditError, match="not signed"):
        log_a.hold_peer_head(head_b, a.public_key)
    with pytest.raises(AuditError, match="another org"):
        log_a.hold_peer_head(log_a.sign_head(), a.public_key)
    log_a.hold_peer_head(head_b, b.public_key)
    assert read_log(tmp_path / "a.log").peer_heads() == [head_b]


# -- the file mirror -----------------------------------------------------------------------


def test_the_mirror_is_private_canonical_json_lines(tmp_path: Path) -> None:
    a = identity("a")
    path = tmp_path / "sub" / "a.log"
    log = EgressLog(a, path)
    env, wire = envelope(a, "b", "round.ready", b"k")
    log.record(env, wire)
    log.sign_head("run-1", 1)
    log.close()
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    lines = path.read_bytes().split(b"\n")
    assert lines[-1] == b"" and len(lines) == 4
    for line in lines[:-1]:
        assert canonical(json.loads(line)) == line
    assert [json.loads(line)["type"] for line in lines[:-1]] == ["header", "entry", "head"]


def test_fsync_policy_each_append_or_batched(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[int] = []
    real = os.fsync

    def counting_fsync(fd: int) -> None:
        calls.append(fd)
        real(fd)

    monkeypatch.setattr(os, "fsync", counting_fsync)
    a = identity("a")
    each = EgressLog(a, tmp_path / "each.log")
    base = len(calls)  # the header is synced at once
    for i in range(3):
        env, wire = envelope(a, "b", "round.ready", b"k", seq=i)
        each.record(env, wire)
    assert len(calls) - base == 3
    calls.clear()
    batched = EgressLog(a, tmp_path / "batch.log", fsync_every=4)
    calls.clear()
    for i in range(3):
        env, wire = envelope(a, "b", "round.ready", b"k", seq=i)
        batched.record(env, wire)
    assert calls == []
    batched.flush()
    assert len(calls) == 1
    batched.flush()
    assert len(calls) == 1  # nothing new to sync
    env, wire = envelope(a, "b", "round.ready", b"k", seq=9)
    batched.record(env, wire)
    batched.sign_head()
    assert len(calls) == 2  # a signed head is always synced
    with pytest.raises(ValueError, match="fsync_every"):
        EgressLog(a, tmp_path / "x.log", fsync_every=0)


def test_a_reopened_log_continues_the_chain(tmp_path: Path) -> None:
    a = identity("a")
    path = tmp_path / "a.log"
    with EgressLog(a, path) as log:
        env, wire = envelope(a, "b", "round.ready", b"k")
        log.record(env, wire)
        log.sign_head("run-1", 1)
    again = EgressLog(a, path)
    assert len(again.entries) == 1 and len(again.heads) == 1
    env, wire = envelope(a, "b", "round.share", b"s", seq=2)
    entry = again.record(env, wire)
    again.close()
    assert entry.index == 1 and entry.prev_hash == again.entries[0].entry_hash
    assert verify_log(path).ok
    with pytest.raises(AuditError, match="belongs to"):
        EgressLog(identity("b"), path)
    path.write_bytes(path.read_bytes().replace(b'"round.share"', b'"round.ready"'))
    with pytest.raises(AuditError, match="does not verify"):
        EgressLog(a, path)


def test_an_in_memory_log_needs_no_file() -> None:
    a = identity("a")
    log = EgressLog(a)
    env, wire = envelope(a, "b", "round.ready", b"k")
    log.record(env, wire)
    log.flush()
    log.close()
    assert len(log.entries) == 1 and log.path is None


def test_database_store_copies_each_entry(tmp_path: Path) -> None:
    pytest.importorskip("sqlmodel")
    db = pytest.importorskip("org_node.db.engine")
    models = pytest.importorskip("org_node.db.models")
    from sqlmodel import Session, select

    from org_node.audit.log import DatabaseStore

    engine = db.make_engine(f"sqlite:///{tmp_path / 'node.db'}")
    db.migrate(engine)
    a = identity("a")
    log = EgressLog(a, tmp_path / "a.log", store=DatabaseStore(engine))
    env, wire = envelope(a, "b", "agg.chunk", b"m" * 10)
    entry = log.record(env, wire)
    with Session(engine) as session:
        rows = session.exec(select(models.AuditEvent)).all()
    long_run, wire2 = envelope(a, "b", "agg.chunk", b"m", run="r" * 33)
    with pytest.raises(AuditError, match="longer than 32"):
        log.record(long_run, wire2)
    assert len(log.entries) == 1 and len(read_log(tmp_path / "a.log").entries()) == 1
    (row,) = [r for r in rows if r.kind == "agg.chunk"]
    assert (row.run, row.round, row.peer, row.bytes, row.sha256, row.privacy_class) == (
        "run-1",
        1,
        "b",
        entry.bytes,
        entry.sha256,
        "masked_vector_chunk",
    )


# -- vectors and properties ----------------------------------------------------------------


def _vector_log(tmp: Path) -> EgressLog:
    a = identity("vector-org")
    log = EgressLog(a, tmp / "v.log", clock=Clock())
    for i, (kind, payload) in enumerate(
        [("round.ready", b"k"), ("agg.chunk", b"\x00" * 16), ("round.model", b"\x11" * 32)]
    ):
        env, wire = envelope(a, "peer", kind, payload, seq=i + 1)
        log.record(env, wire)
    log.sign_head("run-1", 1)
    log.close()
    return log


def test_fixed_vector_of_a_log_file(tmp_path: Path) -> None:
    """A byte-exact log file (deterministic key, clock and envelopes)."""
    _vector_log(tmp_path)
    data = (tmp_path / "v.log").read_text(encoding="utf-8")
    if os.environ.get("FEDWEAVE_REGENERATE_VECTORS"):
        VECTORS.write_text(json.dumps({"log": data}, indent=2) + "\n", encoding="utf-8")
    expected = json.loads(VECTORS.read_text(encoding="utf-8"))["log"]
    assert data == expected


@settings(max_examples=60, deadline=None)
@given(
    prev=st.binary(min_size=32, max_size=32),
    run=st.text(max_size=20),
    kind=st.text(max_size=20),
    bytes_=st.integers(0, 2**40),
)
def test_entry_hash_binds_every_field(prev: bytes, run: str, kind: str, bytes_: int) -> None:
    body = {"index": 0, "run": run, "kind": kind, "bytes": bytes_}
    h = entry_hash(prev.hex(), body)
    assert h == entry_hash(prev.hex(), dict(reversed(list(body.items()))))
    assert h != entry_hash(prev.hex(), {**body, "bytes": bytes_ + 1})
    assert h != entry_hash(prev.hex(), {**body, "run": run + "x"})
    assert h != entry_hash(bytes(b ^ 1 for b in prev).hex(), body)


_ALLOWED = [
    "round.ready",
    "round.share",
    "agg.chunk",
    "swim.ping",
    "gossip.push.reply",
    "shard.put",
]


@settings(max_examples=25, deadline=None)
@given(
    messages=st.lists(
        st.tuples(
            st.sampled_from(_ALLOWED),
            st.sampled_from(["b", "c", "d"]),
            st.binary(max_size=64),
            st.booleans(),
        ),
        min_size=1,
        max_size=12,
    ),
    victim=st.integers(0, 11),
)
def test_any_log_verifies_and_any_rewritten_entry_is_caught(
    tmp_path_factory: pytest.TempPathFactory,
    messages: list[tuple[str, str, bytes, bool]],
    victim: int,
) -> None:
    path = tmp_path_factory.mktemp("prop") / "a.log"
    a = identity("a")
    log = EgressLog(a, path, fsync_every=8)
    for seq, (kind, peer, payload, head) in enumerate(messages):
        env, wire = envelope(a, peer, kind, payload, seq=seq)
        log.record(env, wire)
        if head:
            log.sign_head("run-1", seq)
    log.close()
    result = verify_log(path)
    assert result.ok and result.entries == len(messages), result.summary
    assert result.heads == sum(m[3] for m in messages)
    lines = path.read_bytes().split(b"\n")
    entry_lines = [i for i, line in enumerate(lines) if b'"type":"entry"' in line]
    pos = entry_lines[victim % len(entry_lines)]
    record = json.loads(lines[pos])
    record["bytes"] += 1
    lines[pos] = canonical(record)
    path.write_bytes(b"\n".join(lines))
    broken = verify_log(path)
    assert not broken.ok and broken.index == record["index"]


# -- torn records and a full disk (a power cut, ENOSPC) -------------------------------------


def _log_with(path: Path, n: int) -> OrgIdentity:
    a = identity("a")
    with EgressLog(a, path, clock=Clock()) as log:
        for seq in range(1, n + 1):
            env, wire = envelope(a, "b", "round.ready", b"k" * seq, seq=seq)
            log.record(env, wire)
        log.sign_head("run-1", 1)
    return a


@pytest.mark.parametrize("cut", [1, 37, 120])
def test_a_torn_last_record_is_cut_and_the_repair_recorded(tmp_path: Path, cut: int) -> None:
    """``truncate -s -37 audit/egress.jsonl`` (a power cut mid-write) used to stop the
    node for good: the log is cut back to its last whole record, the org signs a repair
    record naming what was cut, and the chain goes on; verification shows the repair."""
    path = tmp_path / "a.log"
    a = _log_with(path, 4)
    whole = path.read_bytes()
    path.write_bytes(whole[:-cut])
    lines_kept = whole[:-cut].count(b"\n")
    log = EgressLog(a, path, clock=Clock())
    (repair,) = log.repairs
    assert repair.after_line == lines_kept and repair.cut_bytes == len(whole[:-cut]) - len(
        whole[:-cut][: whole[:-cut].rfind(b"\n") + 1]
    )
    assert repair.verify(a.public_key)
    env, wire = envelope(a, "b", "round.share", b"s", seq=9)
    log.record(env, wire)
    log.sign_head("run-1", 2)
    log.close()
    result = verify_log(path)
    assert result.ok, result.summary
    assert f"1 repair(s): {repair.cut_bytes} bytes of a torn record cut after line" in (
        result.summary
    )
    assert EgressLog(a, path).repairs == [repair]  # read back, not repaired again


def test_a_forged_repair_record_fails_verification(tmp_path: Path) -> None:
    path = tmp_path / "a.log"
    a = _log_with(path, 2)
    path.write_bytes(path.read_bytes()[:-5])
    EgressLog(a, path).close()
    text = path.read_bytes()
    forged = re.sub(rb'"cut_bytes":\d+', b'"cut_bytes":999', text)
    path.write_bytes(forged)
    result = verify_log(path)
    assert not result.ok and "repair record is not signed" in result.summary


def test_a_full_disk_tears_nothing_and_the_log_heals(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """ENOSPC in the middle of a record: the message is refused (not sent), the bytes
    written are cut off again, the log says why it failed until a write succeeds, and
    once space is back the chain goes on with no repair needed."""
    import errno

    path = tmp_path / "a.log"
    a = _log_with(path, 2)
    log = EgressLog(a, path)
    before = path.read_bytes()
    real_write = os.write
    calls = {"n": 0}

    def full(fd: int, data: bytes) -> int:
        calls["n"] += 1
        if calls["n"] == 1:
            return real_write(fd, data[: len(data) // 2])  # half a record reaches the disk
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "write", full)  # the module calls os.write
    env, wire = envelope(a, "b", "round.share", b"s", seq=7)
    with pytest.raises(AuditError, match="No space left"):
        log.record(env, wire)
    assert path.read_bytes() == before  # nothing torn left behind
    assert log.failure is not None and "No space left" in log.failure
    assert len(log.entries) == 2
    monkeypatch.setattr(os, "write", real_write)
    log.record(env, wire)
    assert log.failure is None
    log.sign_head("run-1", 2)
    log.close()
    result = verify_log(path)
    assert result.ok and "repair" not in result.summary


def test_a_corrupt_record_in_the_middle_is_one_readable_line(tmp_path: Path) -> None:
    path = tmp_path / "a.log"
    a = _log_with(path, 3)
    lines = path.read_bytes().splitlines(keepends=True)
    lines[2] = b'{"type":"entry","index":1,' + lines[2][40:]
    path.write_bytes(b"".join(lines))
    with pytest.raises(AuditError) as info:
        EgressLog(a, path)
    message = str(info.value)
    assert "\n" not in message and message.startswith("line 3:")


def test_group_commit_fsyncs_off_the_writers_thread(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With ``commit_within_s`` the writer (the node's event loop) never fsyncs an entry
    itself: a committer thread makes every entry written meanwhile durable with one
    fsync; a head is still fsynced before ``sign_head`` returns, and close commits all."""
    import threading

    a = identity("a")
    synced_by: list[int] = []
    real = os.fsync

    def fsync(fd: int) -> None:
        synced_by.append(threading.get_ident())
        real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    path = tmp_path / "a.log"
    log = EgressLog(a, path, commit_within_s=0.01)
    synced_by.clear()  # the header's
    me = threading.get_ident()
    for seq in range(1, 21):
        env, wire = envelope(a, "b", "round.ready", b"k", seq=seq)
        log.record(env, wire)
    assert me not in synced_by  # not one fsync on the writer's thread
    for _ in range(500):
        if synced_by:
            break
        threading.Event().wait(0.01)
    assert synced_by and me not in synced_by
    assert len(synced_by) < 20  # grouped: fewer fsyncs than entries
    log.sign_head("run-1", 1)
    assert synced_by[-1] == me  # a head is durable before it is returned (and sent)
    log.close()
    assert verify_log(path).ok
    with pytest.raises(ValueError, match="commit_within_s"):
        EgressLog(a, commit_within_s=0)
