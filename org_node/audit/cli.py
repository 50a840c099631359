"""The ``fedweave audit`` commands, as a Typer sub-application to mount on the main CLI.

``fedweave audit verify PATH [--data-dir DIR] [--peer-log P ...] [--key ORG=HEX ...]``
checks a log or a report (:func:`org_node.audit.verify.verify_path`) and exits 0 with a
one-line summary or 1 naming the first broken entry. With ``--data-dir`` (or
``FEDWEAVE_DATA_DIR``) the members' keys are pinned from the node's installed federation
manifest (:func:`manifest_keys`), and the line names the org and the certificate
fingerprint of the key it pinned; ``--key`` overrides; with neither the key is the one
the file carries, and the line says it is not pinned. :func:`write_run_report` is what ``fedweave audit
report RUN --data-dir DIR --out DIR`` runs once it has opened the node's egress log and
gathered the run's facts from the node's database (:mod:`org_node.audit.facts`, offline:
the node need not run): it writes the JSON and HTML pair, or exits 1 for a run the node
does not know.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from org_node.cli_common import TokenOpt, UrlOpt

if TYPE_CHECKING:
    from org_node.audit.log import EgressLog
    from org_node.audit.records import SignedHead
    from org_node.audit.report import RunFacts

# The log, report and verify modules are imported by the commands that use them: the
# report pulls in the DP accountant (scipy), which ``fedweave runs list`` must not load.

__all__ = [
    "Pin",
    "audit_app",
    "manifest_keys",
    "org_of",
    "parse_keys",
    "report",
    "write_run_report",
]

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


@dataclass(frozen=True)
class Pin:
    """Where the key of the org whose log or report is verified came from."""

    org: str
    source: str
    fingerprint: str = ""

    def line(self) -> str:
        what = f"key of {self.org!r} pinned from {self.source}"
        return what + (f" (certificate fingerprint {self.fingerprint})" if self.fingerprint else "")


def org_of(path: Path) -> str | None:
    """The org a log (its header) or a report names; None when the file says nothing
    readable (verification then names what is wrong with it)."""
    try:
        data = path.read_bytes()
    except OSError:
        return None
    first = data.split(b"\n", 1)[0]
    try:
        doc = json.loads(first if b'"type":"header"' in first else data)
    except (ValueError, UnicodeDecodeError, RecursionError):
        return None
    org = doc.get("org") if isinstance(doc, dict) else None
    return org if isinstance(org, str) and org else None


def manifest_keys(data_dir: Path, org: str | None) -> tuple[dict[str, bytes], Pin | None]:
    """The members' keys of the federation installed at ``data_dir`` (every version of its
    verified chain, the newest record of each org winning; the node's own ``member.json``
    when no federation is installed), and where the key of ``org`` comes from.

    ValueError, naming the reason, when ``org``'s key is not there to pin.
    """
    from coordinator_free.errors import ManifestError
    from coordinator_free.manifest import Member

    from org_node.cli_common import read_chain_file
    from org_node.config import NodePaths

    paths = NodePaths(data_dir)
    chain = read_chain_file(paths.chain) if paths.chain.exists() else []
    members: dict[str, tuple[Member, str]] = {}
    for manifest in chain:
        where = f"federation {manifest.federation!r} manifest v{manifest.version} in {data_dir}"
        for m in manifest.members:
            members[m.org_id] = (m, where)
    if paths.member.exists():
        try:
            own = Member.from_obj(json.loads(paths.member.read_bytes()))
        except (OSError, ValueError, ManifestError) as exc:
            raise ValueError(f"{paths.member} is not a valid member record: {exc}") from None
        members.setdefault(own.org_id, (own, f"the member record {paths.member}"))
    if not members:
        raise ValueError(
            f"{data_dir} holds no federation manifest and no member record to pin a key from"
        )
    keys = {o: m.public_key for o, (m, _) in members.items()}
    if org is None:
        return keys, None
    if org not in members:
        where = (
            f"not a member of federation {chain[-1].federation!r} in {data_dir}"
            if chain
            else f"{data_dir} has no federation installed and its member record is of "
            f"{', '.join(repr(o) for o in members)}"
        )
        raise ValueError(f"cannot pin the key of {org!r}: {where} (pass --key {org}=HEX)")
    member, where = members[org]
    return keys, Pin(org, where, member.fingerprint)


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
    data_dir: Annotated[
        Path | None,
        typer.Option(
            "--data-dir",
            envvar="FEDWEAVE_DATA_DIR",
            help="A node's data directory: pin the members' keys from its installed "
            "federation manifest (--key overrides).",
        ),
    ] = None,
    from_peers: Annotated[
        bool,
        typer.Option(
            "--from-peers",
            help="Ask the running node (--url or --data-dir, and --token) for the heads of "
            "this org's log its peers hold now, and check the log against them.",
        ),
    ] = False,
    url: UrlOpt = None,
    token: TokenOpt = None,
) -> None:
    """Check the chain, every signature, forbidden classes, and the peers' signed heads.

    With --data-dir the org's key is pinned from the node's federation manifest (or
    its member record) and the line names it; without it or --key it is not pinned.
    With --from-peers, entries cut from the end of the log (or a log rewritten) after
    the last head the peers hold fail, and the line says how many entries no peer's
    head covers yet."""
    from org_node.audit.verify import verify_path
    from org_node.cli_common import guarded

    explicit = parse_keys(key or [])
    org = org_of(path)
    keys: dict[str, bytes] = {}
    pin: Pin | None = None
    if data_dir is not None:
        keys, pin = guarded(lambda: manifest_keys(data_dir, None if org in explicit else org))
    keys |= explicit
    if org is not None and org in explicit:
        pin = Pin(org, "--key")
    fetched = guarded(lambda: _peer_heads(url, token, data_dir)) if from_peers else []
    result = verify_path(
        path, trusted_keys=keys or None, peer_logs=peer_log or [], peer_heads=fetched
    )
    summary = result.summary
    if pin is not None:
        summary += f"; {pin.line()}"
    elif result.ok and org not in keys:
        summary += "; pass --data-dir DIR or --key ORG=HEX to pin it"
    typer.echo(summary)
    raise typer.Exit(result.exit_code)


def write_run_report(log: EgressLog, facts: RunFacts, out_dir: Path) -> int:
    """Build, sign and save the report of ``facts.run``; print the paths; return the exit code."""
    from org_node.audit.report import ReportError, UnknownRun, build_report, save_report

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
    passphrase_file: Annotated[
        Path | None,
        typer.Option(
            "--passphrase-file",
            help="File holding the node's passphrase (default: FEDWEAVE_PASSPHRASE).",
        ),
    ] = None,
) -> None:
    """Write the run's signed privacy report from the node's data directory (offline)."""
    from coordinator_free.errors import CoordinatorFreeError
    from coordinator_free.identity import OrgIdentity

    from org_node.audit.facts import UnknownRunId, node_run_facts
    from org_node.audit.log import EgressLog
    from org_node.audit.report import ReportError
    from org_node.config import ConfigError, NodeConfig, NodePaths
    from org_node.db.engine import (
        DB_FILENAME,
        DatabaseError,
        default_database_url,
        make_engine,
    )
    from org_node.passphrase import PassphraseError, read_passphrase, with_hint

    paths = NodePaths(data_dir)
    try:
        config = NodeConfig.load(paths.config)
        identity = OrgIdentity.load(paths.identity_dir, read_passphrase(passphrase_file))
    except (ConfigError, CoordinatorFreeError, OSError, PassphraseError) as exc:
        typer.echo(
            f"error: {data_dir} is not a usable node data directory: {with_hint(str(exc))}",
            err=True,
        )
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


def _peer_heads(url: str | None, token: str | None, data_dir: Path | None) -> list[SignedHead]:
    """The heads of the node's log its peers hold, through its admin API."""
    from org_node.audit.records import SignedHead
    from org_node.cli_common import client

    with client(url, token, data_dir) as api:
        body = api.get("/v1/audit/peer-heads")
    return [SignedHead.from_dict(h) for h in body["data"]]
