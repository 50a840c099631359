"""The `fedweave` command line.

fedweave --version
fedweave init --org-id ORG --data-dir DIR --peer-port P --admin-port A [--dataset-root D ...]
              [--passphrase-file FILE]   (or FEDWEAVE_PASSPHRASE; run, federation sign
              and install, recover and audit report read it the same way)
fedweave federation found --federation FED --member A/member.json --member B/member.json --out m.json
fedweave federation sign --data-dir DIR m.json        (each founder, in turn)
fedweave federation install --data-dir DIR m.json     (each founder)
fedweave run --data-dir DIR                           (api.cli: the composition root)
fedweave status --data-dir DIR
fedweave recover --data-dir NEW_DIR --backup ORG-recovery-backup.json --manifest chain.json
fedweave audit verify LOG_OR_REPORT [--data-dir DIR] [--peer-log P] [--key ORG=HEX]
fedweave audit report RUN --data-dir DIR --out DIR  (offline, from the node's data dir)

Client commands over a running node's admin API (``--url``, default from ``--data-dir``'s
config or ``FEDWEAVE_URL``; ``--token`` or ``FEDWEAVE_TOKEN``):

fedweave runs list | show RUN | propose --name N --spec spec.json
fedweave runs accept|decline|start|pause|resume|abort RUN
fedweave peers
fedweave audit events [--run R] [--round N] [--peer P] [--class C]
fedweave audit fetch RUN --out DIR   (the node generates the report; both files downloaded)
fedweave tokens create --name N --role admin|operator|auditor | list | revoke ID

A client command imports nothing heavy (no torch, numpy, database layer or web
framework): the commands that need those import them when they run.

Every error is one readable line on stderr and a non-zero exit status.
"""

from __future__ import annotations

import contextlib
import importlib
import json
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, ClassVar

import click
import typer
from typer.core import TyperGroup

from org_node.audit.cli import audit_app
from org_node.cli_catalog import datasets_app, trainers_app
from org_node.cli_common import (
    ApiClient,
    ClientError,
    PassphraseFileOpt,
    TokenOpt,
    admin_url,
    guarded,
    read_chain_file,
)
from org_node.cli_remote import audit_events, audit_fetch, peers, runs_app
from org_node.cli_tokens import tokens_app

if TYPE_CHECKING:
    from coordinator_free.manifest import Manifest

__all__ = ["ApiClient", "ClientError", "DataDir", "admin_url", "app", "culprit_line", "guarded"]


class _Commands(TyperGroup):
    """The root command group. A command in ``LAZY`` is imported only when it is run or
    listed in the help: the harness pulls in the whole node, which a client command
    must not pay for at start."""

    LAZY: ClassVar[dict[str, tuple[str, str]]] = {"harness": ("org_node.harness.cli", "harness")}

    def list_commands(self, ctx: click.Context) -> list[str]:
        return [*self.LAZY, *(n for n in super().list_commands(ctx) if n not in self.LAZY)]

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name in self.LAZY and cmd_name not in self.commands:
            module, attr = self.LAZY[cmd_name]
            one = typer.Typer(add_completion=False)
            one.command(cmd_name)(getattr(importlib.import_module(module), attr))
            self.add_command(typer.main.get_command(one), cmd_name)
        return super().get_command(ctx, cmd_name)

    def resolve_command(
        self, ctx: click.Context, args: list[str]
    ) -> tuple[str | None, click.Command | None, list[str]]:
        if args and args[0] not in self.commands:  # a lazy one, or a typo to suggest for
            for name in self.LAZY:
                self.get_command(ctx, name)
        return super().resolve_command(ctx, args)


app = typer.Typer(
    name="fedweave",
    cls=_Commands,
    help=(
        "fedweave: federated training across organizations with no central server.\n\n"
        "Each institution runs one org node. Nodes find each other over a signed gossip "
        "overlay, add their updates by peer-to-peer secure aggregation, and rebuild a "
        "wiped org from erasure-coded shards held by its peers."
    ),
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
federation_app = typer.Typer(
    help="Found a federation: build, sign and install its founding manifest.",
    no_args_is_help=True,
)
app.add_typer(federation_app, name="federation")
app.add_typer(audit_app, name="audit")
app.add_typer(runs_app, name="runs")
app.add_typer(trainers_app, name="trainers")
app.add_typer(datasets_app, name="datasets")
app.add_typer(tokens_app, name="tokens")
app.command("peers")(peers)
audit_app.command("events")(audit_events)
audit_app.command("fetch")(audit_fetch)

DataDir = typer.Option(..., "--data-dir", help="The node's data directory.")


def _print_version(value: bool) -> None:
    if value:
        from org_node import __version__

        typer.echo(f"fedweave {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(
        False,
        "--version",
        help="Print the version and exit.",
        callback=_print_version,
        is_eager=True,
    ),
) -> None:
    """fedweave: federated training with no central server."""


@app.command("info")
def info() -> None:
    """Show the installed layers and their versions."""
    import numpy

    import secure_agg
    from org_node import __version__

    typer.echo(f"fedweave {__version__}")
    typer.echo(f"numpy {numpy.__version__}")
    typer.echo(f"secure_agg exports: {', '.join(secure_agg.__all__) or '(none yet)'}")


@app.command("init")
def init(
    org_id: str = typer.Option(..., "--org-id", help="This org's id (the certificate's CN)."),
    data_dir: Path = DataDir,
    peer_port: int = typer.Option(8471, "--peer-port", help="Port of the mutual-TLS peer API."),
    admin_port: int = typer.Option(8470, "--admin-port", help="Port of the admin API."),
    display_name: str = typer.Option("", "--display-name", help="Name shown to other orgs."),
    peer_host: str = typer.Option("127.0.0.1", "--peer-host", help="Address the peer API binds."),
    advertise_url: str = typer.Option(
        "", "--advertise-url", help="Peer URL other orgs reach (default https://HOST:PORT)."
    ),
    backup: Annotated[
        Path | None, typer.Option("--backup", help="Where to write the recovery backup file.")
    ] = None,
    dataset_root: Annotated[
        list[Path] | None,
        typer.Option(
            "--dataset-root",
            help="A directory datasets may be registered under (repeatable; created if "
            "missing; default DATA_DIR/datasets).",
        ),
    ] = None,
    harness: bool = typer.Option(
        False, "--harness", hidden=True, help="Test harnesses only: debug export, fast SWIM."
    ),
    passphrase_file: PassphraseFileOpt = None,
) -> None:
    """Create a node: identity, certificate, config, admin token, recovery backup.

    With --passphrase-file (or FEDWEAVE_PASSPHRASE) the identity key, the recovery secret
    and the backup are encrypted; without, they are written in clear (with a warning)."""
    from org_node.initialize import initialize
    from org_node.passphrase import read_passphrase

    passphrase = guarded(lambda: read_passphrase(passphrase_file))
    result = guarded(
        lambda: initialize(
            data_dir,
            org_id,
            peer_port=peer_port,
            admin_port=admin_port,
            display_name=display_name,
            peer_host=peer_host,
            advertise_url=advertise_url,
            backup_file=backup,
            harness=harness,
            dataset_roots=dataset_root or None,
            passphrase=passphrase,
        )
    )
    if passphrase is None:
        typer.echo(
            "warning: no passphrase given: the identity key, the recovery secret and the "
            "backup are stored unencrypted (use --passphrase-file or FEDWEAVE_PASSPHRASE)",
            err=True,
        )
    typer.echo(f"initialized {org_id} in {result.paths.root}")
    typer.echo(f"certificate fingerprint: {result.fingerprint}")
    typer.echo(f"member record (share with the founding orgs): {result.member_file}")
    typer.echo(f"dataset roots: {', '.join(result.dataset_roots)}")
    typer.echo(
        f"recovery backup: {result.backup_file}\n"
        "  -> move it OFFLINE now; with it and the manifest chain a wiped node recovers"
    )
    typer.echo(f"admin token (shown once, store it safely): {result.admin_token}")


def culprit_line(node: dict[str, Any]) -> str:
    """``GET /v1/node``'s likely culprit as one line: who, score, round, evidence."""
    suspect = node.get("culprit")
    if not suspect:
        return "none"
    evidence = "; ".join(str(e) for e in suspect.get("evidence", [])) or "no evidence listed"
    return (
        f"{suspect['org']} (score {float(suspect['score']):.2f}, round {suspect['round']}): "
        f"{evidence}"
    )


@app.command("status")
def status(data_dir: Path = DataDir, token: TokenOpt = None) -> None:
    """The node's identity, federation, runs, whether it is running, and (with a token)
    the peer it blames for a recent slow or failed round."""
    from org_node.cli_http import HttpClient, HttpError
    from org_node.config import NodePaths, load_node_network

    def gather() -> dict[str, object]:
        paths = NodePaths(data_dir)
        node, network = load_node_network(paths.config)
        chain: list[Manifest] = read_chain_file(paths.chain) if paths.chain.exists() else []
        host = network.admin_host
        host = f"[{host}]" if ":" in host else host
        try:
            health = HttpClient(f"http://{host}:{network.admin_port}", timeout=1.0)
            running = health.request("GET", "/healthz").status_code == 200
        except HttpError:
            running = False
        runs = _local_runs(paths.root / "fedweave.db")
        culprit = "(pass --token to ask the running node)" if running else "(node not running)"
        if running and token:
            try:
                api = ApiClient(admin_url(None, data_dir), token)
                try:
                    culprit = culprit_line(api.get("/v1/node"))
                finally:
                    api.close()
            except ClientError as exc:
                culprit = f"(could not ask the node: {exc})"
        return {
            "org": node.org_id,
            "federation": chain[-1].federation if chain else "(none installed)",
            "members": list(chain[-1].member_ids) if chain else [],
            "manifest_version": chain[-1].version if chain else None,
            "node": "running" if running else "not running",
            "culprit": culprit,
            "runs": runs,
        }

    info = guarded(gather)
    for key, value in info.items():
        if isinstance(value, list):
            typer.echo(f"{key}:")
            for item in value:
                typer.echo(f"  {item}")
        else:
            typer.echo(f"{key}: {value}")


def _local_runs(db: Path) -> list[str]:
    """The runs in the node's SQLite database, newest first, one line each (read with the
    standard library: ``status`` loads no database layer)."""
    import sqlite3

    if not db.exists():
        return []
    try:
        with contextlib.closing(sqlite3.connect(db, timeout=10.0)) as c:
            rows = c.execute(
                "SELECT name, id, state, current_round FROM run ORDER BY created_at DESC"
            ).fetchall()
    except sqlite3.Error as exc:
        return [f"(cannot read the runs from {db.name}: {exc})"]
    return [f"{name} ({rid[:8]}): {state}, round {rnd}" for name, rid, state, rnd in rows]


@app.command("recover")
def recover_cmd(
    data_dir: Annotated[Path, typer.Option("--data-dir", help="An empty directory for the node.")],
    backup: Annotated[Path, typer.Option("--backup", help="The offline recovery backup file.")],
    manifest: Annotated[
        Path, typer.Option("--manifest", help="The federation's manifest chain (from any member).")
    ],
    admin_port: Annotated[
        int | None, typer.Option("--admin-port", help="Port of the admin API.")
    ] = None,
    passphrase_file: PassphraseFileOpt = None,
    timeout: float = typer.Option(60.0, "--timeout", help="Seconds to wait for the shards."),
) -> None:
    """Rebuild a wiped node from its backup: fetch any k shards of every run's state from
    the peers, verify, decode, decrypt; `fedweave run` then rejoins the run in progress at
    the round it had reached."""
    import asyncio

    from coordinator_free.endpoint import Endpoint
    from coordinator_free.tls import TlsTransport
    from rich.progress import Progress, SpinnerColumn, TextColumn

    from org_node.initialize import prepare_recovery
    from org_node.node import OrgNode, RecoveredRun, read_chain, recover_runs
    from org_node.passphrase import read_passphrase

    passphrase = guarded(lambda: read_passphrase(passphrase_file))
    paths, token = guarded(
        lambda: prepare_recovery(
            data_dir, backup, manifest, passphrase=passphrase, admin_port=admin_port
        )
    )

    async def fetch() -> tuple[list[RecoveredRun], dict[str, str]]:
        node = OrgNode.open(paths.root, passphrase=passphrase)
        chain = read_chain(paths.chain)
        current = chain[-1]
        transport = TlsTransport(node.org_identity, current.peer_addresses)
        endpoint = Endpoint(
            node.org_identity,
            current.federation,
            transport,
            current.public_keys,
            on_egress=node.egress,
        )
        try:
            return await recover_runs(
                endpoint, node.secret, current.member_ids, paths, timeout=timeout
            )
        finally:
            await endpoint.close()
            node.egress.close()

    with Progress(SpinnerColumn(), TextColumn("{task.description}"), transient=True) as bar:
        bar.add_task("fetching checkpoint shards from the peers", total=None)
        runs, lost = guarded(lambda: asyncio.run(fetch()))
    for run in runs:
        doing = "in progress" if run.status == "running" else run.status
        typer.echo(f"recovered run {run.run_key} at round {run.round} ({doing}) into {run.path}")
    for set_id, why in sorted(lost.items()):
        typer.echo(f"could not recover {set_id}: {why}", err=True)
    if not runs:
        raise typer.Exit(1)
    typer.echo(f"new admin token (shown once): {token}")
    typer.echo(f"start the node with: fedweave run --data-dir {paths.root}")


@federation_app.command("found")
def federation_found(
    federation: Annotated[str, typer.Option("--federation", help="The new federation's id.")],
    member: Annotated[list[Path], typer.Option("--member", help="A founder's member.json.")],
    out: Annotated[Path, typer.Option("--out", help="Where to write the unsigned manifest.")],
    quorum: str = typer.Option("majority", "--quorum", help="majority, two_thirds or all."),
) -> None:
    """Make the unsigned founding manifest from the founders' member records."""
    from org_node.initialize import found_manifest

    m = guarded(lambda: found_manifest(federation, member, out, quorum=quorum))
    typer.echo(f"wrote {out}: federation {m.federation}, members {', '.join(m.member_ids)}")
    typer.echo("every founder must now run: fedweave federation sign --data-dir DIR " + str(out))


@federation_app.command("sign")
def federation_sign(
    manifest: Annotated[Path, typer.Argument(help="The founding manifest file.")],
    data_dir: Path = DataDir,
    out: Annotated[Path | None, typer.Option("--out", help="Write the signed copy here.")] = None,
    passphrase_file: PassphraseFileOpt = None,
) -> None:
    """Add this org's signature to the founding manifest."""
    from org_node.initialize import sign_manifest
    from org_node.passphrase import read_passphrase

    passphrase = guarded(lambda: read_passphrase(passphrase_file))
    m = guarded(lambda: sign_manifest(data_dir, manifest, out, passphrase=passphrase))
    signers = [org for org, _ in m.signatures]
    missing = sorted(set(m.member_ids) - set(signers))
    typer.echo(f"signed; signatures: {', '.join(signers)}")
    typer.echo(f"still to sign: {', '.join(missing)}" if missing else "every founder has signed")


@federation_app.command("merge")
def federation_merge(
    copies: Annotated[list[Path], typer.Argument(help="Signed copies of one manifest.")],
    out: Annotated[Path, typer.Option("--out", help="Where to write the merged manifest.")],
) -> None:
    """Join the signatures of copies signed separately."""
    from org_node.initialize import merge_signatures

    m = guarded(lambda: merge_signatures(copies, out))
    typer.echo(f"wrote {out} with signatures of {', '.join(o for o, _ in m.signatures)}")


@federation_app.command("install")
def federation_install(
    manifest: Annotated[
        Path, typer.Argument(help="The founding manifest, signed by every founder.")
    ],
    data_dir: Path = DataDir,
    backup: Annotated[
        Path | None, typer.Option("--backup", help="Where to rewrite the backup.")
    ] = None,
    passphrase_file: PassphraseFileOpt = None,
) -> None:
    """Verify every founder's signature and install the federation in this node."""
    from org_node.initialize import install_manifest
    from org_node.passphrase import read_passphrase

    passphrase = guarded(lambda: read_passphrase(passphrase_file))
    m = guarded(
        lambda: install_manifest(data_dir, manifest, backup_file=backup, passphrase=passphrase)
    )
    typer.echo(
        json.dumps({"federation": m.federation, "members": list(m.member_ids), "digest": m.digest})
    )
    typer.echo("the recovery backup now names the federation and peers: move it offline again")


def main() -> None:
    """Console-script entry point."""
    app()


if __name__ == "__main__":
    main()
