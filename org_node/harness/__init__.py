"""The local multi-org harness: real ``fedweave run`` processes, fault injection, verdict.

``fedweave harness --orgs N --rounds R --out DIR`` (:mod:`org_node.harness.cli`)
validates a :class:`~org_node.harness.scenario.Scenario`, runs it
(:func:`~org_node.harness.runner.run_harness`), and writes ``DIR/summary.json``
(:func:`~org_node.harness.verdict.build_summary`) and ``DIR/progress.png``
(:func:`~org_node.harness.plot.plot_progress`).

What it owns: scenarios and their faults (``scenario``), the node processes and what
the harness observes of them (``nodes``), creating the federation and its run
(``setup``), following it and injecting faults (``runner``), the added latency
(``proxy``), the verdict (``verdict``), the plot (``plot``) and the command (``cli``).

What it may import: the rest of ``org_node`` (initialization, config, engine state,
strategies, tasks, the audit), ``coordinator_free`` (identities, manifests), httpx to
reach the nodes' APIs, rich and typer; never ``api``: it drives the nodes it starts as
processes, through their REST APIs.
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
