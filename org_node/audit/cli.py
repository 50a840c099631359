"""The ``fedweave audit`` commands, as a Typer sub-application to mount on the main CLI.

``fedweave audit verify PATH [--peer-log P ...] [--key ORG=HEX ...]`` checks a log or a
report (:func:`org_node.audit.verify.verify_path`) and exits 0 with a one-line summary
or 1 naming the first broken entry. :func:`write_run_report` is what ``fedweave audit
report RUN --data-dir DIR --out DIR`` runs once it has opened the node's egress log and
gathered the run's facts from the node's database (:mod:`org_node.audit.facts`, offline:
the node need not run): it writes the JSON and HTML pair, or exits 1 for a run the node
does not know.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from org_node.audit.log import EgressLog
from org_node.audit.report import ReportError, RunFacts, UnknownRun, build_report, save_report
from org_node.audit.verify import main as verify_main

__all__ = ["audit_app", "parse_keys", "report", "write_run_report"]

audit_app = typer.Typer(
    name="audit",
    help="Privacy audit: verify egress logs and run reports.",
    no_args_is_help=True,
    add_completion=False,
)


@audit_app.callback()
def _audit() -> None:
    """Privacy audit: verify egress logs and run reports."""


def parse_keys(values: list[str]) -> dict[str, bytes]:
    """``ORG=HEX`` pairs (32-byte Ed25519 public keys) as a mapping; BadParameter otherwise."""
    keys: dict[str, bytes] = {}
    for value in values:
        org, sep, hexkey = value.partition("=")
        try:
            key = bytes.fromhex(hexkey)
        except ValueError:
            key = b""
        if not sep or not org or len(key) != 32:
            raise typer.BadParameter(f"{value!r} is not ORG=<64 hex digits>", param_hint="--key")
        keys[org] = key
    return keys


@audit_app.command("verify")
def verify(
    path: Annotated[Path, typer.Argument(help="An egress log (JSON lines) or a report (JSON).")],
    peer_log: Annotated[
        list[Path] | None,
        typer.Option(
            "--peer-log", help="A peer's egress log; the heads it holds of this org are checked."
        ),
    ] = None,
    key: Annotated[
        list[str] | None,
        typer.Option("--key", help="ORG=HEX: pin an org's Ed25519 public key (repeatable)."),
    ] = None,
) -> None:
    """Check the chain, every signature, forbidden classes, and the peers' signed heads."""
    keys = parse_keys(key or [])
    raise typer.Exit(verify_main(path, peer_logs=peer_log or [], keys=keys or None))


def write_run_report(log: EgressLog, facts: RunFacts, out_dir: Path) -> int:
    """Build, sign and save the report of ``facts.run``; print the paths; return the exit code."""
    try:
        report = build_report(log, facts)
        json_path, html_path = save_report(report, out_dir)
    except UnknownRun as exc:
        typer.echo(f"unknown run: {exc}", err=True)
        return 1
    except ReportError as exc:
        typer.echo(f"cannot report run {facts.run!r}: {exc}", err=True)
        return 1
    typer.echo(f"{json_path}\n{html_path}")
    return 0


@audit_app.command("report")
def report(
    run: Annotated[str, typer.Argument(help="The run id (as `fedweave runs list` shows it).")],
    data_dir: Annotated[Path, typer.Option("--data-dir", help="The node's data directory.")],
    out: Annotated[Path, typer.Option("--out", help="Directory for the JSON and HTML pair.")],
) -> None:
    """Write the run's signed privacy report from the node's data directory (offline)."""
    from coordinator_free.errors import CoordinatorFreeError
    from coordinator_free.identity import OrgIdentity

    from org_node.audit.facts import UnknownRunId, node_run_facts
    from org_node.config import ConfigError, NodeConfig, NodePaths
    from org_node.db.engine import (
        DB_FILENAME,
        DatabaseError,
        default_database_url,
        make_engine,
    )

    paths = NodePaths(data_dir)
    try:
        config = NodeConfig.load(paths.config)
        identity = OrgIdentity.load(paths.identity_dir)
    except (ConfigError, CoordinatorFreeError, OSError) as exc:
        typer.echo(f"error: {data_dir} is not a usable node data directory: {exc}", err=True)
        raise typer.Exit(1) from None
    if not (paths.root / DB_FILENAME).exists():
        typer.echo(f"unknown run: no run {run!r} at this node (no database yet)", err=True)
        raise typer.Exit(1)
    db = make_engine(default_database_url(paths.root))
    try:
        facts = node_run_facts(db, paths.root, run, org_id=identity.org_id, config=config.engine)
    except UnknownRunId as exc:
        typer.echo(f"unknown run: {exc}", err=True)
        raise typer.Exit(1) from None
    except (ReportError, DatabaseError, ValueError) as exc:
        typer.echo(f"cannot report run {run!r}: {exc}", err=True)
        raise typer.Exit(1) from None
    finally:
        db.dispose()
    log = EgressLog(identity, paths.egress_log)
    try:
        code = write_run_report(log, facts, out)
    finally:
        log.close()
    raise typer.Exit(code)
