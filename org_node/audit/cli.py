"""The ``fedweave audit`` commands, as a Typer sub-application to mount on the main CLI.

``fedweave audit verify PATH [--peer-log P ...] [--key ORG=HEX ...]`` checks a log or a
report (:func:`org_node.audit.verify.verify_path`) and exits 0 with a one-line summary
or 1 naming the first broken entry. :func:`write_run_report` is what ``fedweave audit
report RUN`` runs once the node has opened its egress log and gathered the run's facts:
it writes the JSON and HTML pair, or exits 1 for a run the log does not know.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from org_node.audit.log import EgressLog
from org_node.audit.report import ReportError, RunFacts, UnknownRun, build_report, save_report
from org_node.audit.verify import main as verify_main

__all__ = ["audit_app", "parse_keys", "write_run_report"]

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
