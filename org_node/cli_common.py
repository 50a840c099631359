"""What every ``fedweave`` command shares: one-line errors, and the admin API client.

Client commands reach a running node's admin API (``--url``, default from
``--data-dir``'s config or ``FEDWEAVE_URL``; ``--token`` or ``FEDWEAVE_TOKEN``). Every
failure is one readable line on stderr and a non-zero exit status; the token is never
printed.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, TypeVar

import typer

if TYPE_CHECKING:
    from coordinator_free.manifest import Manifest

__all__ = [
    "ApiClient",
    "ClientDataDir",
    "ClientError",
    "PassphraseFileOpt",
    "RunRef",
    "TokenOpt",
    "UrlOpt",
    "admin_url",
    "client",
    "fmt",
    "guarded",
    "http_client",
    "list_rows",
    "read_chain_file",
    "resolve_run",
    "table",
]

T = TypeVar("T")


# The expected failures, by module: each is caught only once its module is imported (an
# exception of a module never imported cannot be raised), so that a client command does
# not import the node, the engine and the database layer just to name what it catches.
_EXPECTED = (
    ("coordinator_free.errors", "CoordinatorFreeError"),
    ("org_node.config", "ConfigError"),
    ("org_node.db.engine", "DatabaseError"),
    ("org_node.run_config", "EngineError"),
    ("org_node.initialize", "InitError"),
    ("org_node.node", "NodeError"),
    ("org_node.passphrase", "PassphraseError"),
)


def _expected() -> tuple[type[BaseException], ...]:
    found: list[type[BaseException]] = [OSError, ValueError]
    for module, name in _EXPECTED:
        loaded = sys.modules.get(module)
        if loaded is not None:
            found.append(getattr(loaded, name))
    return tuple(found)


@contextmanager
def errors() -> Iterator[None]:
    """Turn every expected failure into one line on stderr and exit status 1."""
    try:
        yield
    except Exception as exc:
        if not isinstance(exc, _expected()):
            raise
        message = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        typer.echo(f"error: {message}", err=True)
        raise typer.Exit(1) from None


def guarded(fn: Callable[[], T]) -> T:
    """Run ``fn``; an expected failure becomes one line on stderr and exit status 1."""
    with errors():
        return fn()


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
RunRef = Annotated[str, typer.Argument(help="Run key, name or unique key prefix.")]
PassphraseFileOpt = Annotated[
    Path | None,
    typer.Option(
        "--passphrase-file",
        help="File holding the passphrase of the node's identity key, recovery secret and "
        "backup (default: FEDWEAVE_PASSPHRASE; none: they are in clear).",
    ),
]


def admin_url(url: str | None, data_dir: Path | None) -> str:
    """``--url`` if given, else ``http://admin_host:admin_port`` of ``data_dir``'s config."""
    if url:
        return url.rstrip("/")
    if data_dir is not None:
        from org_node.config import NodePaths, load_node_network

        _node, network = load_node_network(NodePaths(data_dir).config)
        host = network.admin_host
        host = f"[{host}]" if ":" in host else host
        return f"http://{host}:{network.admin_port}"
    raise ClientError("no node given: pass --url, --data-dir or set FEDWEAVE_URL")


def read_chain_file(path: Path) -> list[Manifest]:
    """Read and verify a node's manifest chain (``federation/chain.json``) as the node
    does, without importing the node: a chain that does not verify is a ValueError."""
    from coordinator_free.errors import ManifestError
    from coordinator_free.manifest import Manifest, load_chain

    try:
        versions = load_chain(Path(path).read_bytes())
        Manifest.verify_chain(versions)
    except (OSError, ManifestError) as exc:
        raise ValueError(f"cannot use the federation manifest {path}: {exc}") from None
    return versions


def http_client(base_url: str, token: str) -> Any:
    """The HTTP client the client commands use (tests swap it for an in-process one):
    :class:`~org_node.cli_http.HttpClient`, on the standard library, since importing
    httpx would cost a short command more than the rest of its run."""
    from org_node.cli_http import HttpClient

    return HttpClient(base_url, {"Authorization": f"Bearer {token}"}, timeout=30.0)


def _transport_error(exc: Exception, base_url: str) -> Exception:
    """The :class:`ClientError` of a request that got no answer; ``exc`` itself if it is
    not that (an httpx-style client swapped in raises httpx's errors)."""
    from org_node.cli_http import ConnectFailed, HttpError, TimedOut

    httpx = sys.modules.get("httpx")
    if isinstance(exc, ConnectFailed) or (httpx and isinstance(exc, httpx.ConnectError)):
        return ClientError(f"no node answers at {base_url}")
    if isinstance(exc, TimedOut) or (httpx and isinstance(exc, httpx.TimeoutException)):
        return ClientError(f"the node at {base_url} did not answer in time")
    if isinstance(exc, HttpError) or (httpx and isinstance(exc, httpx.HTTPError)):
        return ClientError(f"request to {base_url} failed: {exc}")
    return exc


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
        """Send one request; the successful response as it came (status, headers,
        ``content``, ``text``, ``json()``)."""
        try:
            r = self._http.request(method, path, json=json_body, params=params)
        except Exception as exc:
            raise _transport_error(exc, self.base_url) from None
        if r.status_code == 401:
            raise ClientError("authentication failed: check --token")
        if r.status_code >= 400:
            raise ClientError(detail(r))
        return r

    def get(self, path: str, **params: Any) -> Any:
        return self.request("GET", path, params={k: v for k, v in params.items() if v is not None})

    def post(self, path: str, body: Any = None) -> Any:
        return self.request("POST", path, json_body=body)


def detail(r: Any) -> str:
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
def client(url: str | None, token: str | None, data_dir: Path | None) -> Iterator[ApiClient]:
    """An :class:`ApiClient`; any failure is one ``error:`` line on stderr and exit 1."""
    api: ApiClient | None = None
    try:
        with errors():
            try:
                api = ApiClient(admin_url(url, data_dir), token)
                yield api
            except ClientError as exc:
                typer.echo(f"error: {exc}", err=True)
                raise typer.Exit(1) from None
    finally:
        if api is not None:
            api.close()


def table(title: str, columns: list[str], rows: list[list[str]]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title)
    for column in columns:
        table.add_column(column)
    for row in rows:
        table.add_row(*row)
    Console(width=160).print(table)


def list_rows(
    url: str | None,
    token: str | None,
    data_dir: Path | None,
    resource: str,
    columns: list[str],
    row: Callable[[dict[str, Any]], list[str]],
    **params: Any,
) -> None:
    """Print the table of the listing ``/v1/<resource>`` of the admin API, titled
    ``<resource> (count)``, one row per item (``row`` gives its cells)."""
    with client(url, token, data_dir) as api:
        body = api.get(f"/v1/{resource}", **params)
    table(f"{resource} ({body['count']})", columns, [row(item) for item in body["data"]])


def resolve_run(client: ApiClient, run: str) -> dict[str, Any]:
    """The run ``run`` names (its key, name or a unique key prefix; the node resolves it)."""
    try:
        body: dict[str, Any] = client.get(f"/v1/runs/{run}")
        return body
    except ClientError as exc:
        if str(exc).startswith("not found"):
            raise ClientError(f"no run {run!r} at this node") from None
        raise


def fmt(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)
