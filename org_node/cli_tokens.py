"""``fedweave tokens``: the admin API's bearer tokens, over a running node's admin API
(an admin token).

fedweave tokens create --name NAME --role admin|operator|auditor
fedweave tokens list
fedweave tokens revoke ID

``create`` prints the new token's secret once (the node keeps only its hash); ``list``
never shows a secret; ``revoke`` takes a token's id, or a unique prefix of its key id
(the ``fw_<key id>_`` part of the secret, shown by ``list``).
"""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated, Any

import typer

from org_node.cli_common import (
    ApiClient,
    ClientDataDir,
    ClientError,
    TokenOpt,
    UrlOpt,
    client,
    list_rows,
)

__all__ = ["Role", "resolve_token", "tokens_app"]

tokens_app = typer.Typer(
    help="The admin API's bearer tokens (admin token): create, list, revoke.",
    no_args_is_help=True,
)
_TOKEN_COLUMNS = ["id", "key id", "name", "role", "created", "revoked", "last used"]


class Role(StrEnum):
    """The roles of the admin API (as ``org_node.db.models.Role``, without its import)."""

    ADMIN = "admin"
    OPERATOR = "operator"
    AUDITOR = "auditor"


def _when(value: Any) -> str:
    """A timestamp of the API to the second, ``-`` for none."""
    if not value:
        return "-"
    return str(value).replace("T", " ")[:19]


@tokens_app.command("create")
def tokens_create(
    name: Annotated[str, typer.Option("--name", help="What the token is for (shown in lists).")],
    role: Annotated[Role, typer.Option("--role", help="admin, operator or auditor.")],
    url: UrlOpt = None,
    token: TokenOpt = None,
    data_dir: ClientDataDir = None,
) -> None:
    """Create a token; its secret is printed once, here, and never again."""
    with client(url, token, data_dir) as api:
        row = api.post("/v1/tokens", {"name": name, "role": role.value})
    typer.echo(f"created token {row['id']} ({row['name']}, {row['role']}, key id {row['key_id']})")
    typer.echo(f"token (shown once, store it safely): {row['token']}")


def _token_row(t: dict[str, Any]) -> list[str]:
    return [
        str(t["id"]),
        t["key_id"],
        t["name"],
        t["role"],
        _when(t.get("created_at")),
        _when(t.get("revoked_at")),
        _when(t.get("last_used_at")),
    ]


@tokens_app.command("list")
def tokens_list(url: UrlOpt = None, token: TokenOpt = None, data_dir: ClientDataDir = None) -> None:
    """Every token, revoked ones included, newest first (never a secret)."""
    list_rows(url, token, data_dir, "tokens", _TOKEN_COLUMNS, _token_row, limit=1000)


def resolve_token(api: ApiClient, ref: str) -> dict[str, Any]:
    """The token whose id is ``ref``, or whose key id alone starts with ``ref``."""
    if ref.startswith("fw_"):  # a secret given by mistake: never echo it
        raise ClientError("give the token's id or key id (`fedweave tokens list`), not its secret")
    rows: list[dict[str, Any]] = api.get("/v1/tokens", limit=1000)["data"]
    found = [r for r in rows if str(r["id"]) == ref]
    if not found and ref:
        found = [r for r in rows if str(r["key_id"]).startswith(ref)]
    if len(found) == 1:
        return found[0]
    if found:
        raise ClientError(f"{ref!r} names {len(found)} tokens: give the token id")
    raise ClientError(f"no token {ref!r} at this node (give its id or key id)")


@tokens_app.command("revoke")
def tokens_revoke(
    ref: Annotated[str, typer.Argument(metavar="ID", help="Token id, or a key id prefix.")],
    url: UrlOpt = None,
    token: TokenOpt = None,
    data_dir: ClientDataDir = None,
) -> None:
    """Revoke a token: it stops working at once (the last live admin token cannot be)."""
    with client(url, token, data_dir) as api:
        row = resolve_token(api, ref)
        revoked = api.request("DELETE", f"/v1/tokens/{row['id']}")
    typer.echo(
        f"revoked token {revoked['id']} ({revoked['name']}, {revoked['role']}) "
        f"at {_when(revoked.get('revoked_at'))}"
    )
