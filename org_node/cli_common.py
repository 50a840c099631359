"""What every ``fedweave`` command shares: one-line errors, and the admin API client.

Client commands reach a running node's admin API (``--url``, default from
``--data-dir``'s config or ``FEDWEAVE_URL``; ``--token`` or ``FEDWEAVE_TOKEN``). Every
failure is one readable line on stderr and a non-zero exit status; the token is never
printed.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, Any, TypeVar

import typer

__all__ = [
    "ApiClient",
    "ClientDataDir",
    "ClientError",
    "TokenOpt",
    "UrlOpt",
    "admin_url",
    "client",
    "fmt",
    "guarded",
    "http_client",
    "resolve_run",
    "table",
]

T = TypeVar("T")


@contextmanager
def errors() -> Iterator[None]:
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


def resolve_run(client: ApiClient, run: str) -> dict[str, Any]:
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


def fmt(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)
