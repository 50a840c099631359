"""Finding 6 (issue 20): temporary files of interrupted atomic writes (``.shard.*.tmp``
among them) and a killed worker's plaintext work files are removed when the node
starts; a dataset root and the node's real files are never touched."""

from __future__ import annotations

import asyncio
from pathlib import Path

from org_node.config import NodePaths
from org_node.initialize import initialize
from org_node.node import OrgNode
from org_node.node.leftovers import clean_leftovers


def _touch(path: Path, data: bytes = b"x") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return path


def _litter(paths: NodePaths) -> tuple[list[Path], list[Path]]:
    """Leftovers a crash leaves, and files that must stay."""
    shard_dir = paths.shards / "ab" / "cd" / "3"
    worker = paths.runs / ("k" * 32) / "worker"
    leftovers = [
        _touch(shard_dir / ".0.shard.4242.deadbeef.tmp"),
        _touch(paths.root / "audit" / ".egress.jsonl.4242.0badf00d.tmp"),
        _touch(paths.root / "audit" / "reports" / "run-a.json.tmp"),
        _touch(paths.runs / ("k" * 32) / "rounds.tmp"),
        _touch(paths.identity_dir / ".recovery.secret.7.aa.tmp"),
        _touch(paths.root / ".fedweave.toml.7.bb.tmp"),
        _touch(worker / "req-000003" / "global.npz"),
        _touch(worker / "req-000003" / "update.npz"),
        _touch(worker / "round-000002" / "checkpoints" / "step-4" / "x.distcp"),
        _touch(worker / ".request.json.k2j3x9"),
    ]
    kept = [
        _touch(shard_dir / "0.shard"),
        _touch(shard_dir / "manifest.json"),
        _touch(worker / "worker.log"),
        _touch(worker / "worker.json"),
        _touch(paths.runs / ("k" * 32) / "state.json"),
        _touch(paths.datasets / "cohort.tmp"),  # a dataset named *.tmp is the org's data
        _touch(paths.datasets / "runs" / "round-000001" / "x"),
    ]
    return leftovers, kept


def test_finding_6_stale_temporary_and_work_files_are_removed_at_start(tmp_path: Path) -> None:
    result = initialize(tmp_path / "n", "org-a", peer_port=9500, admin_port=9501)
    leftovers, kept = _litter(result.paths)
    node = OrgNode.open(result.paths.root)
    try:
        asyncio.run(node.start())  # no federation yet: it cleans, migrates and waits
    finally:
        node.db.dispose()
        node.egress.close()
    assert [p for p in leftovers if p.exists()] == []
    assert [p for p in kept if not p.exists()] == []
    assert (result.paths.root / "fedweave.db").exists()


def test_clean_leftovers_never_enters_a_dataset_root_inside_the_node(tmp_path: Path) -> None:
    paths = NodePaths(tmp_path / "n")
    root = paths.runs / "data"  # an odd but possible root: inside a searched directory
    data = _touch(root / "part.tmp")
    stale = _touch(paths.runs / "x" / "a.tmp")
    assert clean_leftovers(paths, [str(root)]) == 1
    assert data.exists() and not stale.exists()
    assert clean_leftovers(paths, [str(root)]) == 0
