"""``fedweave harness``: a local multi-org federation with fault injection, and its verdict.

fedweave harness --orgs 3 --rounds 5 --out demo
fedweave harness --orgs 4 --rounds 3 --kill org2@2:reduce --out kill-demo
fedweave harness --orgs 3 --rounds 4 --wipe org3@2 --out wipe-demo
fedweave harness --orgs 3 --rounds 3 --backend ckks --delay-ms 20 --out ckks-demo
fedweave harness --orgs 3 --rounds 5 --compression random-k=0.1,q8 --out compressed-demo
fedweave harness --orgs 3 --rounds 5 --flower-app ./my-flower-app --out flower-demo
fedweave harness --orgs 3 --rounds 5 --data ./hospitals --target diagnosis --out data-demo

An impossible scenario is refused before anything starts (exit status 2, one line).
The run ends by printing where the summary, the plot and the audit reports are; the
exit status is 0 when every check of ``summary.json`` passed, 1 otherwise, with the
reason on the last line; 130 after Ctrl-C, once every node is stopped.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

__all__ = ["harness"]


def harness(
    out: Annotated[Path, typer.Option("--out", help="A new directory for the federation.")],
    orgs: Annotated[int, typer.Option("--orgs", help="Number of orgs (org1 … orgN).")] = 3,
    rounds: Annotated[int, typer.Option("--rounds", help="Training rounds.")] = 5,
    task: Annotated[
        str | None,
        typer.Option("--task", help="A demo task: breast_cancer (default), digits, gpt."),
    ] = None,
    flower_app: Annotated[
        str | None,
        typer.Option(
            "--flower-app",
            help="A Flower .py file (FILE.py[:ATTR]) or App directory, run unchanged at every org.",
        ),
    ] = None,
    data: Annotated[
        Path | None,
        typer.Option("--data", help="A directory holding <org>.csv (or .parquet) per org."),
    ] = None,
    target: Annotated[
        str | None, typer.Option("--target", help="The label column of --data's files.")
    ] = None,
    worker: Annotated[
        str,
        typer.Option("--worker", help="persistent (one local worker per run) or per-round."),
    ] = "persistent",
    backend: Annotated[str, typer.Option("--backend", help="masked or ckks.")] = "masked",
    strategy: Annotated[
        str, typer.Option("--strategy", help="fedavg, fedprox, fedadam or diloco.")
    ] = "fedavg",
    compression: Annotated[
        str,
        typer.Option(
            "--compression",
            help="none, q8, random-k=F or random-k=F,q8 (the run spec's).",
        ),
    ] = "none",
    kill: Annotated[
        list[str] | None,
        typer.Option("--kill", help="ORG@ROUND[:STAGE] (train|reduce): kill -9 there."),
    ] = None,
    wipe: Annotated[
        list[str] | None,
        typer.Option(
            "--wipe",
            help="ORG@ROUND[:hold]: wipe its disk after ROUND, recover, restart "
            "(:hold: the others pause meanwhile, so that it trains again).",
        ),
    ] = None,
    delay_ms: Annotated[
        int, typer.Option("--delay-ms", help="Added latency between nodes, in ms.")
    ] = 0,
    seed: Annotated[int, typer.Option("--seed", help="Seed of model, partitions, batches.")] = 0,
    local_steps: Annotated[
        int, typer.Option("--local-steps", help="Local training steps per round.")
    ] = 3,
    timeout: Annotated[
        float | None, typer.Option("--timeout", help="Seconds the run may take.")
    ] = None,
    quiet: Annotated[bool, typer.Option("--quiet", help="No progress bar.")] = False,
) -> None:
    """Run real nodes on this machine, inject faults, and judge the run (summary.json)."""
    from org_node.harness.scenario import Scenario, ScenarioError, parse_kill, parse_wipe

    try:
        scenario = Scenario(
            orgs=orgs,
            rounds=rounds,
            task=task,
            backend=backend,
            strategy=strategy,
            compression=compression,
            kills=tuple(parse_kill(k) for k in kill or []),
            wipes=tuple(parse_wipe(w) for w in wipe or []),
            delay_ms=delay_ms,
            seed=seed,
            local_steps=local_steps,
            flower_app=flower_app,
            data=None if data is None else str(data),
            target=target,
            worker=worker,
        )
    except ScenarioError as exc:
        typer.echo(f"refused: {exc}", err=True)
        raise typer.Exit(2) from None
    if out.exists() and any(out.iterdir()):
        typer.echo(f"refused: {out} is not empty; choose a new --out directory", err=True)
        raise typer.Exit(2)
    raise typer.Exit(_execute(scenario, out, timeout=timeout, quiet=quiet))


def _execute(scenario: object, out: Path, *, timeout: float | None, quiet: bool) -> int:
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from org_node.harness.nodes import HarnessError, Interrupted, Observation
    from org_node.harness.runner import run_harness
    from org_node.harness.scenario import Scenario
    from org_node.harness.verdict import finish

    assert isinstance(scenario, Scenario)
    console = Console(stderr=True)
    bar = Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
        disable=quiet,
        transient=False,
    )
    task_id = bar.add_task("starting nodes", total=scenario.rounds)

    def progress(obs: Observation) -> None:
        live = [n for n in obs.nodes.values() if not n.down]
        done = min((n.round for n in live), default=0)
        rounds = " ".join(f"{o}:{'x' if n.down else n.round}" for o, n in sorted(obs.nodes.items()))
        bar.update(task_id, completed=done, description=f"rounds [{rounds}]")

    try:
        with bar:
            obs = run_harness(scenario, out, timeout=timeout, progress=progress)
    except Interrupted as exc:
        typer.echo(f"{exc}: every node the harness started is stopped", err=True)
        return 130
    except HarnessError as exc:
        typer.echo(f"error: {exc}", err=True)
        return 1
    summary = finish(obs)
    typer.echo(f"summary: {out / 'summary.json'}")
    typer.echo(f"plot: {summary['plot']}")
    for org, report in sorted(summary["audit_reports"].items()):
        typer.echo(f"audit report of {org}: {report}")
    typer.echo(f"node logs: {out / 'logs'}")
    if summary["ok"]:
        check = summary["harness_check"]
        typer.echo(
            f"ok: {summary['rounds_completed']} rounds, models equal, "
            f"plaintext FedAvg within {check['max_abs_diff']:.2g} (tolerance {check['tolerance']:g})"
        )
        return 0
    typer.echo(f"FAILED: {summary['reason']}")
    return 1
