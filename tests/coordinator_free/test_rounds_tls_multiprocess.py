"""Four org processes run a secure round over mutual TLS on 127.0.0.1; one dies mid-reduce."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from coordinator_free.identity import OrgIdentity
from coordinator_free.tls import write_trust_bundle

from tests.coordinator_free._tls_node import DIE_STATUS, node_input

ROOT = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

ORGS = [f"org-{i}" for i in range(4)]
VICTIM = "org-2"
SURVIVORS = [o for o in ORGS if o != VICTIM]


@pytest.mark.parametrize("ring_first", [True, False], ids=["ring-first", "ring-waits"])
def test_survivors_of_a_node_killed_during_the_reduce_hold_the_sum_of_their_inputs(
    tmp_path: Path, ring_first: bool
) -> None:
    """Killed in the reduce-scatter: no ring completes, the ring runs again without it.
    With the ring first it dies before ``U1`` is settled: the survivors' token, which it
    never answers, leaves it out of the participants, and no key of it is rebuilt.
    With the ring waiting for the token it dies a participant, and its masks are
    removed with its rebuilt key."""
    summaries = _run(tmp_path, ORGS, VICTIM, "reduce.scatter.1", ring_waits=not ring_first)
    expected = np.zeros_like(node_input(ORGS[0]))
    for org in SURVIVORS:
        np.add(expected, node_input(org), out=expected)
    everything = expected + node_input(VICTIM)
    for org in SURVIVORS:
        summary = summaries[org]
        assert {"ready", "share", "reduce", "unmask"} <= summary["stage_times"].keys()
        assert sorted(summary["participants"]) == (SURVIVORS if ring_first else ORGS)
        assert sorted(summary["survivors"]) == SURVIVORS
        assert summary["dropped"] == ([] if ring_first else [VICTIM])
        assert summary["ring_attempts"] == 2
        total = np.load(tmp_path / f"{org}.sum.npy")
        np.testing.assert_array_equal(total, expected)
        assert not np.array_equal(total, everything)


def test_a_node_killed_at_the_last_all_gather_step_leaves_a_completed_ring_that_settles(
    tmp_path: Path,
) -> None:
    """Killed as the all-gather's last step begins, the victim has sent every chunk but
    its last. Its successor misses that chunk, so its ring breaks; its predecessor's
    breaks too unless its last chunk reached the victim before it died; the third
    survivor's completes. That settles the attempt: those whose ring broke take the
    masked sum over TLS (``round.total``) from one whose ring completed, every survivor
    holds the sum of all four inputs, and the ring ran once."""
    summaries = _run(tmp_path, ORGS, VICTIM, "reduce.gather.2")
    everything = np.zeros_like(node_input(ORGS[0]))
    for org in ORGS:
        np.add(everything, node_input(org), out=everything)
    took = {org for org in SURVIVORS if summaries[org]["took_sum_from"]}
    holders = {s for org in took for s in summaries[org]["took_sum_from"]}
    assert 1 <= len(took) <= 2 and holders and holders.isdisjoint(took)
    for org in SURVIVORS:
        summary = summaries[org]
        assert sorted(summary["survivors"]) == ORGS and summary["dropped"] == []
        assert summary["ring_attempts"] == 1
        np.testing.assert_array_equal(np.load(tmp_path / f"{org}.sum.npy"), everything)


def test_owner_unmasking_over_tls_survives_a_node_killed_after_the_agreement(
    tmp_path: Path,
) -> None:
    """Each member unmasks only the chunks it holds. The victim dies as the unmask
    begins, after every member agreed that the reduce-scatter completed: it is a
    survivor (its shares are released like anyone's), its chunk of the sum is
    unmasked by its successor from the copy it holds, and the members whose all-gather
    broke take the chunks they lack over TLS (``round.part``). Every survivor holds the
    sum of all four inputs, after one ring attempt."""
    summaries = _run(tmp_path, ORGS, VICTIM, "unmask", owners=True)
    everything = np.zeros_like(node_input(ORGS[0]))
    for org in ORGS:
        np.add(everything, node_input(org), out=everything)
    for org in SURVIVORS:
        summary = summaries[org]
        assert "gather" in summary["stage_times"]  # the owner path ran
        assert sorted(summary["survivors"]) == ORGS and summary["dropped"] == []
        assert summary["ring_attempts"] == 1
        np.testing.assert_array_equal(np.load(tmp_path / f"{org}.sum.npy"), everything)
    fetched = {s for org in SURVIVORS for s in summaries[org]["took_chunks_from"]}
    assert fetched and VICTIM not in fetched


def test_relayed_readies_carry_the_shares_sealed_ahead_over_tls(tmp_path: Path) -> None:
    """Three rounds of four org processes over mutual TLS with the readies relayed and
    the shares sealed ahead (as from 32 and 33 members on). The first round exchanges
    the shares (no key is known yet); from the second on each org's shares go beside
    its relayed ready record, each blob towards its holder only: no share message and
    no direct ready is sent, and every round's sum is every input's."""
    summaries = _run(tmp_path, ORGS, None, "", relayed=2)
    everything = np.zeros_like(node_input(ORGS[0]))
    for org in ORGS:
        np.add(everything, node_input(org), out=everything)
    for org in ORGS:
        summary = summaries[org]
        assert sorted(summary["survivors"]) == ORGS
        for round_ in (1, 2):
            total = np.load(tmp_path / f"{org}.sum.{round_}.npy")
            np.testing.assert_array_equal(total, everything)
        np.testing.assert_array_equal(np.load(tmp_path / f"{org}.sum.npy"), everything)
        sent = summary["sent"]
        assert _shares(sent["1"]) == len(ORGS) - 1  # one request or reply for each pair
        for key in ("2", "3"):
            assert sent[key].get("round.readies", 0) > 0, sent
            assert _shares(sent[key]) == 0, sent
            assert sent[key].get("round.ready", 0) == 0, sent


def test_masks_from_each_node_s_helper_process_over_tls_with_a_node_killed_in_the_reduce(
    tmp_path: Path,
) -> None:
    """Each org process expands its masks in its own helper process, streamed into the
    ring (``mask_helper = "process"``), with owner unmasking (the all-reduce path is
    the simulator's, ``test_mask_stream.py``); one dies in the reduce-scatter. The
    survivors' second attempt masks its input again itself, and every survivor holds
    the sum of the survivors' inputs."""
    summaries = _run(tmp_path, ORGS, VICTIM, "reduce.scatter.1", True, mask_helper="process")
    expected = np.zeros_like(node_input(ORGS[0]))
    for org in SURVIVORS:
        np.add(expected, node_input(org), out=expected)
    for org in SURVIVORS:
        summary = summaries[org]
        assert summary["mask_helper_starts"] == 1
        assert sorted(summary["survivors"]) == SURVIVORS and summary["ring_attempts"] == 2
        np.testing.assert_array_equal(np.load(tmp_path / f"{org}.sum.npy"), expected)


def _shares(kinds: dict[str, int]) -> int:
    """Share messages sent in a round: requests and replies."""
    return kinds.get("round.share", 0) + kinds.get("round.share.reply", 0)


def _run(
    tmp_path: Path,
    orgs: list[str],
    victim: str | None,
    die_at: str,
    owners: bool = False,
    relayed: int = 0,
    mask_helper: str = "thread",
    ring_waits: bool = False,
) -> dict[str, Any]:
    """Run the four org processes, ``victim`` (if any) dying at ``die_at``; the
    survivors' summaries."""
    survivors = [o for o in orgs if o != victim]
    identities = {
        o: OrgIdentity.generate(o, hashlib.sha256(f"tls-rounds/{o}".encode()).digest())
        for o in orgs
    }
    for org, ident in identities.items():
        ident.save(tmp_path / org)
    write_trust_bundle(tmp_path / "trust.pem", [i.certificate_pem for i in identities.values()])
    (tmp_path / "members.json").write_text(
        json.dumps(
            {
                o: {"public_key": i.public_key.hex(), "fingerprint": i.fingerprint}
                for o, i in identities.items()
            }
        )
    )

    logs = {o: (tmp_path / f"{o}.log").open("wb") for o in orgs}
    procs = {
        o: subprocess.Popen(
            [
                sys.executable,
                "-m",
                "tests.coordinator_free._tls_node",
                "--dir",
                str(tmp_path),
                "--org",
                o,
                "--orgs",
                ",".join(orgs),
                *(["--die-at", die_at] if o == victim else []),
                *(["--owners"] if owners else []),
                *(["--relayed", str(relayed)] if relayed else []),
                "--mask-helper",
                mask_helper,
                *(["--ring-waits"] if ring_waits else []),
            ],
            cwd=ROOT,
            stdout=logs[o],
            stderr=subprocess.STDOUT,
        )
        for o in orgs
    }

    def log(org: str) -> str:
        return (tmp_path / f"{org}.log").read_text(errors="replace")[-3000:]

    try:
        deadline = time.monotonic() + 240
        while not all((tmp_path / f"{o}.json").exists() for o in survivors):
            for o in survivors:
                code = procs[o].poll()
                assert code is None or (tmp_path / f"{o}.json").exists(), (
                    f"{o} exited with {code} before finishing:\n{log(o)}"
                )
            assert time.monotonic() < deadline, "the round did not finish:\n" + "\n".join(
                f"--- {o}\n{log(o)}" for o in orgs
            )
            time.sleep(0.2)
        (tmp_path / "done").touch()
        for o in orgs:
            procs[o].wait(timeout=60)
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=30)
        for f in logs.values():
            f.close()

    # the victim died inside the reduce, as planned
    if victim is not None:
        assert procs[victim].returncode == DIE_STATUS, log(victim)
    for org in survivors:
        assert procs[org].returncode == 0, log(org)
    return {o: json.loads((tmp_path / f"{o}.json").read_text()) for o in survivors}
