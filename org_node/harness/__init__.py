"""The local multi-org harness: real ``fedweave run`` processes, fault injection, verdict.

``fedweave harness --orgs N --rounds R --out DIR`` (:mod:`org_node.harness.cli`)
validates a :class:`~org_node.harness.scenario.Scenario`, runs it
(:func:`~org_node.harness.runner.run_harness`), and writes ``DIR/summary.json``
(:func:`~org_node.harness.verdict.build_summary`) and ``DIR/progress.png``
(:func:`~org_node.harness.plot.plot_progress`).
"""

from org_node.harness.scenario import (
    Kill,
    Scenario,
    ScenarioError,
    Wipe,
    parse_kill,
    parse_wipe,
)

__all__ = ["Kill", "Scenario", "ScenarioError", "Wipe", "parse_kill", "parse_wipe"]
