"""``docs/OPERATIONS.md``, "Three organizations by hand", runs as it stands.

Every ``bash`` block of that section, in order and unchanged, runs as one script under
``set -euo pipefail`` in a fresh directory that holds a link to the repository's
``examples/`` (the walkthrough runs from the repository's root), with this
environment's ``fedweave`` first on the PATH. Three real ``fedweave run`` processes
over mutual TLS on 127.0.0.1 found a federation, train the hospitals' own trainer on
their own tables, survive a wiped-and-recovered node and a killed-and-restarted one,
and each hospital's privacy report verifies with its manifest's keys.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

ROOT = Path(__file__).resolve().parents[2]
SECTION = "## Three organizations by hand"


def walkthrough() -> str:
    """The section's ``bash`` blocks, joined in order."""
    text = (ROOT / "docs" / "OPERATIONS.md").read_text(encoding="utf-8")
    start = text.index(SECTION)
    end = text.index("\n## ", start + len(SECTION))
    blocks = re.findall(r"```bash\n(.*?)```", text[start:end], re.S)
    return "\n".join(blocks)


def test_the_section_holds_every_step_of_an_admins_day() -> None:
    script = walkthrough()
    for step in (
        "fedweave init ",
        "fedweave federation found ",
        "fedweave federation sign ",
        "fedweave federation install ",
        "fedweave run ",
        "fedweave datasets register ",
        "fedweave trainers install ",
        "fedweave runs propose ",
        "fedweave runs accept ",
        "fedweave runs show ",
        "fedweave audit fetch ",
        "fedweave audit verify ",
        "kill -9 $(cat hosp3.pid)",
        "fedweave recover ",
    ):
        assert step in script, step


def test_each_node_process_logs_to_a_file_of_its_own() -> None:
    """Waiting for ``ready`` in a log an earlier process wrote could pass before the new
    process has started (its shell redirect truncates the file only once it forks), so
    every ``fedweave run`` of the walkthrough writes a log no other one wrote."""
    logs: list[str] = []
    for line in walkthrough().splitlines():
        found = re.search(r"fedweave run --data-dir (\S+) > (\S+) 2>&1", line)
        if found is None:
            continue
        node, log = found.groups()
        if "$i" in node:  # the loop that starts all three
            logs += [log.replace("$i", str(i)) for i in (1, 2, 3)]
        else:
            logs.append(log)
    assert len(logs) == 5
    assert len(set(logs)) == len(logs), logs


def test_three_organizations_by_hand_runs_verbatim(tmp_path: Path) -> None:
    (tmp_path / "examples").symlink_to(ROOT / "examples", target_is_directory=True)
    (tmp_path / "walkthrough.sh").write_text("set -euo pipefail\n" + walkthrough())
    env = dict(os.environ)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    for name in ("FEDWEAVE_TOKEN", "FEDWEAVE_URL", "FEDWEAVE_DATA_DIR"):
        env.pop(name, None)
    proc = subprocess.Popen(
        ["bash", "walkthrough.sh"],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=840)
    finally:
        with contextlib.suppress(ProcessLookupError):  # any node left by a failed step
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 0, out[-6000:]
    # every hospital's report verifies, its key pinned and its peers' consents checked
    for org in ("hosp1", "hosp2", "hosp3"):
        line = next(x for x in out.splitlines() if x.startswith(f"OK: report of {org} "))
        assert "2 signed consent(s) of other participants valid" in line, line
        assert f"key of '{org}' pinned from federation 'hospitals'" in line, line
        (report,) = (tmp_path / "reports" / org).glob("*.audit.json")
        doc = json.loads(report.read_text())
        assert doc["run"]["spec"]["rounds"] == 150
        rounds = [r["round"] for r in doc["rounds"]]
        assert rounds and rounds[-1] == 150
    # the wiped node was rebuilt from its peers' shards, waited for its trainer, rejoined
    assert "recovered run " in (tmp_path / "hosp2-recover.txt").read_text()
    assert "why: waiting to resume at hosp2: this org has no trainer named 'risk-model'" in out
    # the killed node dropped out of its peers' view (and the script waited for it to
    # take part in a round again after its restart)
    seen = [x for x in out.splitlines() if re.search(r"\bhosp3\b", x) and "│" in x]
    assert any("suspect" in x or "dead" in x for x in seen), seen
