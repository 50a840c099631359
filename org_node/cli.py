"""The `fedweave` command line.

fedweave --version
fedweave init --org-id ORG --data-dir DIR --peer-port P --admin-port A
fedweave federation found --federation FED --member A/member.json --member B/member.json --out m.json
fedweave federation sign --data-dir DIR m.json        (each founder, in turn)
fedweave federation install --data-dir DIR m.json     (each founder)
fedweave run --data-dir DIR                           (api.cli: the composition root)
fedweave status --data-dir DIR
fedweave recover --data-dir NEW_DIR --backup ORG-recovery-backup.json --manifest chain.json
fedweave audit verify LOG_OR_REPORT [--peer-log P] [--key ORG=HEX]
fedweave audit report RUN --data-dir DIR --out DIR  (offline, from the node's data dir)

Client commands over a running node's admin API (``--url``, default from ``--data-dir``'s
config or ``FEDWEAVE_URL``; ``--token`` or ``FEDWEAVE_TOKEN``):

fedweave runs list | show RUN | propose --name N --spec spec.json
fedweave runs accept|decline|start|pause|resume|abort RUN
fedweave peers
fedweave audit events [--run R] [--round N] [--peer P] [--class C]
fedweave audit fetch RUN --out DIR   (the node generates the report; both files downloaded)

Every error is one readable line on stderr and a non-zero exit status.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, Any, TypeVar

import typer

from org_node import __version__
from org_node.audit.cli import audit_app
from org_node.harness.cli import harness

app = typer.Typer(
    name="fedweave",
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
app.command("harness")(harness)
runs_app = typer.Typer(
    help="Runs at a running node, over its admin API.",
    no_args_is_help=True,
)
app.add_typer(runs_app, name="runs")

T = TypeVar("T")
DataDir = typer.Option(..., "--data-dir", help="The node's data directory.")


def _print_version(value: bool) -> None:
    if value:
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


@contextmanager
def _errors() -> Iterator[None]:
    """Turn every expected failure into one line on stderr and exit status 1."""
    from coordinator_free.errors import CoordinatorFreeError

    from org_node.config import ConfigError
    from org_node.db.engine import DatabaseError
    from org_node.engine import EngineError
    from org_node.initialize import InitError
    from org_node.node import NodeError

    try:
        yield
    except (
        ConfigError,
        CoordinatorFreeError,
        DatabaseError,
        EngineError,
        InitError,
        NodeError,
        OSError,
        ValueError,
    ) as exc:
        message = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        typer.echo(f"error: {message}", err=True)
        raise typer.Exit(1) from None


def guarded(fn: Callable[[], T]) -> T:
    """Run ``fn``; an expected failure becomes one line on stderr and exit status 1."""
    with _errors():
        return fn()


@app.command("info")
def info() -> None:
    """Show the installed layers and their versions."""
    import numpy

    import secure_agg

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
    harness: bool = typer.Option(
        False, "--harness", hidden=True, help="Test harnesses only: debug export, fast SWIM."
    ),
) -> None:
    """Create a node: identity, certificate, config, admin token, recovery backup."""
    from org_node.initialize import initialize

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
        )
    )
    typer.echo(f"initialized {org_id} in {result.paths.root}")
    typer.echo(f"certificate fingerprint: {result.fingerprint}")
    typer.echo(f"member record (share with the founding orgs): {result.member_file}")
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
    import httpx
    from sqlmodel import Session, col, select

    from org_node.config import NodeConfig, NodePaths
    from org_node.db.engine import default_database_url, make_engine
    from org_node.db.models import Run
    from org_node.node import read_chain

    def gather() -> dict[str, object]:
        paths = NodePaths(data_dir)
        config = NodeConfig.load(paths.config)
        chain = read_chain(paths.chain) if paths.chain.exists() else []
        url = f"http://{config.network.admin_host}:{config.network.admin_port}/healthz"
        try:
            running = httpx.get(url, timeout=1.0).status_code == 200
        except httpx.HTTPError:
            running = False
        runs = []
        db = paths.root / "fedweave.db"
        if db.exists():
            engine = make_engine(default_database_url(paths.root))
            with Session(engine) as session:
                for row in session.exec(select(Run).order_by(col(Run.created_at).desc())).all():
                    runs.append(
                        f"{row.name} ({row.id[:8]}): {row.state}, round {row.current_round}"
                    )
            engine.dispose()
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
            "org": config.node.org_id,
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
    passphrase_file: Annotated[
        Path | None,
        typer.Option("--passphrase-file", help="File holding the backup's passphrase, if any."),
    ] = None,
    timeout: float = typer.Option(60.0, "--timeout", help="Seconds to wait for the shards."),
) -> None:
    """Rebuild a wiped node from its backup: fetch any k shards from the peers, verify,
    decode, decrypt; `fedweave run` then rejoins the run at the round it had reached."""
    from coordinator_free.endpoint import Endpoint
    from coordinator_free.tls import TlsTransport
    from rich.progress import Progress, SpinnerColumn, TextColumn

    from org_node.initialize import prepare_recovery
    from org_node.node import OrgNode, read_chain, recover_state

    passphrase = passphrase_file.read_bytes().strip() if passphrase_file else None
    paths, token = guarded(
        lambda: prepare_recovery(
            data_dir, backup, manifest, passphrase=passphrase, admin_port=admin_port
        )
    )

    async def fetch() -> Path:
        node = OrgNode.open(paths.root)
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
            return await recover_state(
                endpoint, node.secret, current.member_ids, paths, timeout=timeout
            )
        finally:
            await endpoint.close()
            node.egress.close()

    with Progress(SpinnerColumn(), TextColumn("{task.description}"), transient=True) as bar:
        bar.add_task("fetching checkpoint shards from the peers", total=None)
        state = guarded(lambda: asyncio.run(fetch()))
    typer.echo(f"recovered the private state into {state}")
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
) -> None:
    """Add this org's signature to the founding manifest."""
    from org_node.initialize import sign_manifest

    m = guarded(lambda: sign_manifest(data_dir, manifest, out))
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
) -> None:
    """Verify every founder's signature and install the federation in this node."""
    from org_node.initialize import install_manifest

    m = guarded(lambda: install_manifest(data_dir, manifest, backup_file=backup))
    typer.echo(
        json.dumps({"federation": m.federation, "members": list(m.member_ids), "digest": m.digest})
    )
    typer.echo("the recovery backup now names the federation and peers: move it offline again")


# --------------------------------------------------------------------------- API client


class ClientError(Exception):
    """A request to the admin API failed; the message is the one line to print."""


UrlOpt = Annotated[
    str | None,
    typer.Option(
        "--url",
        envvar="FEDWEAVE_URL",
        help="The node's admin API (default: from --data-dir's config, or FEDWEAVE_URL).",
    ),
]
TokenOpt = Annotated[
    str | None,
    typer.Option(
        "--token",
        envvar="FEDWEAVE_TOKEN",
        show_envvar=True,
        help="A bearer token of the admin API (or FEDWEAVE_TOKEN).",
    ),
]
ClientDataDir = Annotated[
    Path | None,
    typer.Option("--data-dir", help="The node's data directory (gives the default --url)."),
]


def admin_url(url: str | None, data_dir: Path | None) -> str:
    """``--url`` if given, else ``http://admin_host:admin_port`` of ``data_dir``'s config."""
    if url:
        return url.rstrip("/")
    if data_dir is not None:
        from org_node.config import NodeConfig, NodePaths

        config = NodeConfig.load(NodePaths(data_dir).config)
        host = config.network.admin_host
        host = f"[{host}]" if ":" in host else host
        return f"http://{host}:{config.network.admin_port}"
    raise ClientError("no node given: pass --url, --data-dir or set FEDWEAVE_URL")


def http_client(base_url: str, token: str) -> Any:
    """The HTTP client the client commands use (tests swap it for an in-process one)."""
    import httpx

    return httpx.Client(
        base_url=base_url, headers={"Authorization": f"Bearer {token}"}, timeout=30.0
    )


class ApiClient:
    """A thin client of the admin API that turns every failure into :class:`ClientError`.

    401 names the token, 409 passes on the server's message (which names the run's
    current state), an unreachable node names the URL; the token is never printed.
    """

    def __init__(self, base_url: str, token: str | None) -> None:
        if not token:
            raise ClientError("no token: pass --token or set FEDWEAVE_TOKEN")
        self.base_url = base_url
        self._http = http_client(base_url, token)

    def close(self) -> None:
        self._http.close()

    def request(self, method: str, path: str, *, json_body: Any = None, params: Any = None) -> Any:
        """Send one request; the decoded JSON body, or the text for non-JSON answers."""
        r = self.send(method, path, json_body=json_body, params=params)
        if r.headers.get("content-type", "").startswith("application/json"):
            return r.json()
        return r.text

    def send(self, method: str, path: str, *, json_body: Any = None, params: Any = None) -> Any:
        """Send one request; the successful ``httpx.Response`` as it came."""
        import httpx

        try:
            r = self._http.request(method, path, json=json_body, params=params)
        except httpx.ConnectError:
            raise ClientError(f"no node answers at {self.base_url}") from None
        except httpx.TimeoutException:
            raise ClientError(f"the node at {self.base_url} did not answer in time") from None
        except httpx.HTTPError as exc:
            raise ClientError(f"request to {self.base_url} failed: {exc}") from None
        if r.status_code == 401:
            raise ClientError("authentication failed: check --token")
        if r.status_code >= 400:
            raise ClientError(_detail(r))
        return r

    def get(self, path: str, **params: Any) -> Any:
        return self.request("GET", path, params={k: v for k, v in params.items() if v is not None})

    def post(self, path: str, body: Any = None) -> Any:
        return self.request("POST", path, json_body=body)


def _detail(r: Any) -> str:
    """The server's one-line message of an error answer."""
    try:
        detail = r.json().get("detail")
    except ValueError:
        detail = None
    if isinstance(detail, list):  # FastAPI's field errors
        detail = "; ".join(
            f"{'.'.join(str(x) for x in d.get('loc', ())[1:])}: {d.get('msg', '')}" for d in detail
        )
    text = str(detail) if detail else (r.text.strip() or r.reason_phrase)
    prefix = {403: "forbidden: ", 404: "not found: "}.get(r.status_code, "")
    return f"{prefix}{text.splitlines()[0] if text else r.status_code}"


@contextmanager
def _client(url: str | None, token: str | None, data_dir: Path | None) -> Iterator[ApiClient]:
    """An :class:`ApiClient`; any failure is one ``error:`` line on stderr and exit 1."""
    client: ApiClient | None = None
    try:
        with _errors():
            try:
                client = ApiClient(admin_url(url, data_dir), token)
                yield client
            except ClientError as exc:
                typer.echo(f"error: {exc}", err=True)
                raise typer.Exit(1) from None
    finally:
        if client is not None:
            client.close()


def _table(title: str, columns: list[str], rows: list[list[str]]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title)
    for column in columns:
        table.add_column(column)
    for row in rows:
        table.add_row(*row)
    Console(width=160).print(table)


def _resolve_run(client: ApiClient, run: str) -> dict[str, Any]:
    """The run whose id is ``run``, or whose name or id prefix alone matches it."""
    try:
        body: dict[str, Any] = client.get(f"/v1/runs/{run}")
        return body
    except ClientError as exc:
        if not str(exc).startswith("not found"):
            raise
    rows = client.get("/v1/runs", limit=1000)["data"]
    found = [r for r in rows if r["name"] == run] or [r for r in rows if r["id"].startswith(run)]
    if len(found) == 1:
        return dict(found[0])
    if found:
        raise ClientError(f"{run!r} names {len(found)} runs: give the run id")
    raise ClientError(f"no run {run!r} at this node")


def _fmt(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


@runs_app.command("list")
def runs_list(
    url: UrlOpt = None,
    token: TokenOpt = None,
    data_dir: ClientDataDir = None,
    state: Annotated[str | None, typer.Option("--state", help="Only runs in this state.")] = None,
) -> None:
    """The node's runs, newest first."""
    with _client(url, token, data_dir) as client:
        body = client.get("/v1/runs", state=state, limit=1000)
    rows = [
        [
            r["id"],
            r["name"],
            r["state"],
            str(r["current_round"]),
            str(r["spec"]["rounds"]),
            r["spec"]["backend"],
            ", ".join(r["spec"]["participants"]),
        ]
        for r in body["data"]
    ]
    _table(
        f"runs ({body['count']})",
        ["id", "name", "state", "round", "of", "backend", "participants"],
        rows,
    )


@runs_app.command("show")
def runs_show(
    run: Annotated[str, typer.Argument(help="Run id, id prefix or name.")],
    url: UrlOpt = None,
    token: TokenOpt = None,
    data_dir: ClientDataDir = None,
) -> None:
    """A run's status and its per-round metrics."""
    with _client(url, token, data_dir) as client:
        row = _resolve_run(client, run)
        metrics = client.get(f"/v1/runs/{row['id']}/metrics", limit=1000)["data"]
    spec = row["spec"]
    typer.echo(f"run {row['name']} ({row['id']})")
    typer.echo(f"state: {row['state']} (version {row['version']})")
    typer.echo(f"round: {row['current_round']} of {spec['rounds']}")
    typer.echo(
        f"spec: task {spec['task']}, backend {spec['backend']}, threshold {spec['threshold']}"
        f", epsilon {_fmt(spec.get('epsilon'))}"
    )
    typer.echo(f"participants: {', '.join(spec['participants'])}")
    typer.echo(f"proposed by {row['proposed_by']}")
    if row.get("decided_by"):
        reason = f" ({row['decision_reason']})" if row.get("decision_reason") else ""
        typer.echo(f"decided by {row['decided_by']} at {row['decided_at']}{reason}")
    if not metrics:
        typer.echo("no round metrics yet")
        return
    names = sorted({m["name"] for m in metrics})
    per_round: dict[int, dict[str, float]] = {}
    for m in metrics:
        per_round.setdefault(int(m["round"]), {})[m["name"]] = m["value"]
    _table(
        "metrics per round",
        ["round", *names],
        [[str(r), *(_fmt(v.get(n)) for n in names)] for r, v in sorted(per_round.items())],
    )


@runs_app.command("propose")
def runs_propose(
    name: Annotated[str, typer.Option("--name", help="The run's name (the same at every org).")],
    spec_file: Annotated[
        Path | None, typer.Option("--spec", help="A JSON file holding the run spec.")
    ] = None,
    task: Annotated[str | None, typer.Option("--task", help="Task name.")] = None,
    rounds: Annotated[int | None, typer.Option("--rounds", help="Number of rounds.")] = None,
    participant: Annotated[
        list[str] | None, typer.Option("--participant", help="A participating org (repeat).")
    ] = None,
    backend: Annotated[str | None, typer.Option("--backend", help="masked or ckks.")] = None,
    threshold: Annotated[
        int | None, typer.Option("--threshold", help="Secure-aggregation threshold t.")
    ] = None,
    epsilon: Annotated[
        float | None, typer.Option("--epsilon", help="Org-level DP budget (masked only).")
    ] = None,
    url: UrlOpt = None,
    token: TokenOpt = None,
    data_dir: ClientDataDir = None,
) -> None:
    """Propose a run at this node (a spec file, flags, or a file with flags overriding)."""
    spec: dict[str, Any] = {}
    if spec_file is not None:
        loaded = guarded(lambda: json.loads(spec_file.read_text(encoding="utf-8")))
        if not isinstance(loaded, dict):
            typer.echo(f"error: {spec_file} does not hold a JSON object", err=True)
            raise typer.Exit(1)
        spec = loaded
    flags = {
        "task": task,
        "rounds": rounds,
        "participants": participant or None,
        "backend": backend,
        "threshold": threshold,
        "epsilon": epsilon,
    }
    spec |= {k: v for k, v in flags.items() if v is not None}
    missing = [k for k in ("task", "rounds", "participants") if k not in spec]
    if missing:
        typer.echo(f"error: the spec lacks {', '.join(missing)} (--spec or flags)", err=True)
        raise typer.Exit(1)
    with _client(url, token, data_dir) as client:
        row = client.post("/v1/runs", {"name": name, "spec": spec})
    typer.echo(f"proposed run {row['name']} ({row['id']}): {row['state']}")


def _action_command(action: str, doc: str) -> None:
    def command(
        run: Annotated[str, typer.Argument(help="Run id, id prefix or name.")],
        reason: Annotated[str, typer.Option("--reason", help="Recorded with the action.")] = "",
        url: UrlOpt = None,
        token: TokenOpt = None,
        data_dir: ClientDataDir = None,
    ) -> None:
        with _client(url, token, data_dir) as client:
            row = _resolve_run(client, run)
            body = {"reason": reason} if reason else None
            new = client.post(f"/v1/runs/{row['id']}/{action}", body)
        typer.echo(f"run {new['name']} ({new['id']}): {new['state']}")

    command.__doc__ = doc
    command.__name__ = f"runs_{action}"
    runs_app.command(action)(command)


_action_command("accept", "This org consents to the run (checked against its policies).")
_action_command("decline", "This org declines the run; the decision is recorded.")
_action_command("start", "Start an accepted run.")
_action_command("pause", "Pause a running run after the current round.")
_action_command("resume", "Resume a paused run.")
_action_command("abort", "Abort a run that has not ended.")


@app.command("peers")
def peers(url: UrlOpt = None, token: TokenOpt = None, data_dir: ClientDataDir = None) -> None:
    """The node's live view of the other members."""
    with _client(url, token, data_dir) as client:
        body = client.get("/v1/peers")
    _table(
        f"peers ({body['count']})",
        ["org", "status", "incarnation", "last seen (s ago)", "latency (ms)"],
        [
            [
                p["org_id"],
                p["status"],
                str(p["incarnation"]),
                _fmt(p["last_seen_s_ago"]),
                _fmt(p["latency_ms"]),
            ]
            for p in body["data"]
        ],
    )


@audit_app.command("events")
def audit_events(
    run: Annotated[str | None, typer.Option("--run", help="Only events of this run.")] = None,
    round: Annotated[int | None, typer.Option("--round", help="Only this round.")] = None,
    peer: Annotated[str | None, typer.Option("--peer", help="Only events to this peer.")] = None,
    privacy_class: Annotated[
        str | None, typer.Option("--class", help="Only this privacy class.")
    ] = None,
    kind: Annotated[str | None, typer.Option("--kind", help="Only this kind.")] = None,
    limit: Annotated[int, typer.Option("--limit", help="At most this many events.")] = 100,
    url: UrlOpt = None,
    token: TokenOpt = None,
    data_dir: ClientDataDir = None,
) -> None:
    """The node's audit events, filtered (auditor or admin token)."""
    with _client(url, token, data_dir) as client:
        body = client.get(
            "/v1/audit/events",
            run=run,
            round=round,
            peer=peer,
            privacy_class=privacy_class,
            kind=kind,
            limit=limit,
        )
    _table(
        f"audit events ({len(body['data'])} of {body['count']})",
        ["time", "stage", "kind", "run", "round", "peer", "class", "bytes"],
        [
            [
                str(e.get("time")),
                str(e.get("stage")),
                str(e.get("kind")),
                _fmt(e.get("run")),
                _fmt(e.get("round")),
                _fmt(e.get("peer")),
                _fmt(e.get("privacy_class")),
                _fmt(e.get("bytes")),
            ]
            for e in body["data"]
        ],
    )


@audit_app.command("fetch")
def audit_fetch(
    run: Annotated[str, typer.Argument(help="The run id.")],
    out: Annotated[Path, typer.Option("--out", help="Directory for report.json and .html.")],
    url: UrlOpt = None,
    token: TokenOpt = None,
    data_dir: ClientDataDir = None,
) -> None:
    """Have the node generate the run's privacy report, and download it (JSON and HTML)."""
    with _client(url, token, data_dir) as client:
        made = client.send("POST", f"/v1/audit/runs/{run}/report")
        html = client.send("GET", f"/v1/audit/runs/{run}/report.html")
        key = str(made.json()["run"]["id"])
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}", key):
            raise typer.BadParameter(f"the node named the run {key!r}: not a file name")
        out.mkdir(parents=True, exist_ok=True)
        json_path = out / f"{key}.audit.json"
        html_path = out / f"{key}.audit.html"
        json_path.write_bytes(made.content)  # the signed bytes, as the node wrote them
        html_path.write_bytes(html.content)
    typer.echo(f"{json_path}\n{html_path}")


def main() -> None:
    """Console-script entry point."""
    app()


if __name__ == "__main__":
    main()
