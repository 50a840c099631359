"""``fedweave trainers`` and ``fedweave datasets``: what this org trains with, over its
node's admin API.

fedweave trainers install NAME REF [--kind flower-app|flower-clientapp|task] [--sha256 H]
fedweave trainers list | show NAME | remove NAME
fedweave datasets register NAME PATH [--kind K] [--description D]
fedweave datasets list | show NAME | rehash NAME | remove NAME

``install`` takes a Flower App directory, a ``.py`` file holding a ClientApp (``FILE.py``
or ``FILE.py:ATTR``), or ``module:callable`` of a task; the kind is guessed from REF when
not given. Paths are sent as absolute paths: the node reads them on its own host.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from org_node.cli_common import (
    ApiClient,
    ClientDataDir,
    TokenOpt,
    UrlOpt,
    client,
    fmt,
    guarded,
    list_rows,
)

__all__ = ["datasets_app", "guess_kind", "trainers_app"]

trainers_app = typer.Typer(
    help="The trainers this org installed (bundled, config, admin API).", no_args_is_help=True
)
datasets_app = typer.Typer(
    help="This org's registered datasets (they never leave the org).", no_args_is_help=True
)
TrainerName = Annotated[str, typer.Argument(help="The trainer's name.")]
DatasetRef = Annotated[str, typer.Argument(help="The dataset's name or id.")]
_TRAINER_COLUMNS = ["name", "kind", "source", "sha256", "ref", "problem"]
_DATASET_COLUMNS = ["id", "name", "kind", "rows", "columns", "sha256", "path"]


def guess_kind(ref: str) -> tuple[str, str]:
    """``(kind, ref)``: a directory with a pyproject.toml is a Flower App, a ``.py`` file a
    Flower ClientApp, ``module:callable`` a task; paths are made absolute."""
    target, sep, attr = ref.rpartition(":") if ":" in ref else (ref, "", "")
    path = Path(target).expanduser()
    if not sep and path.is_dir():
        return "flower-app", str(path.resolve())
    if target.endswith(".py"):
        resolved = str(path.resolve())
        return "flower-clientapp", f"{resolved}:{attr}" if sep else resolved
    if "/" in target or target.startswith("."):
        raise ValueError(f"no such file or directory: {target}")
    return "task", ref


def _absolute(kind: str, ref: str) -> str:
    if kind == "flower-app":
        return str(Path(ref).expanduser().resolve())
    target, _sep, attr = ref.rpartition(":")
    if target.endswith(".py"):
        return f"{Path(target).expanduser().resolve()}:{attr}"
    if ref.endswith(".py"):
        return str(Path(ref).expanduser().resolve())
    return ref


@trainers_app.command("install")
def trainers_install(
    name: Annotated[str, typer.Argument(help="The name runs will use.")],
    ref: Annotated[
        str, typer.Argument(help="A Flower App directory, FILE.py[:ATTR], or module:callable.")
    ],
    kind: Annotated[
        str | None,
        typer.Option("--kind", help="flower-app, flower-clientapp or task (guessed from REF)."),
    ] = None,
    sha256: Annotated[
        str | None, typer.Option("--sha256", help="Refuse unless the code hashes to this.")
    ] = None,
    description: Annotated[str, typer.Option("--description", help="Shown in lists.")] = "",
    url: UrlOpt = None,
    token: TokenOpt = None,
    data_dir: ClientDataDir = None,
) -> None:
    """Install a trainer (admin token): the node hashes its code and checks it imports."""
    kind, ref = (kind, _absolute(kind, ref)) if kind else guarded(lambda: guess_kind(ref))
    body: dict[str, Any] = {"name": name, "kind": kind, "ref": ref, "description": description}
    if sha256:
        body["sha256"] = sha256
    with client(url, token, data_dir) as api:
        row = api.post("/v1/trainers", body)
    typer.echo(f"installed trainer {row['name']} ({row['kind']}): sha256 {row['sha256']}")


def _trainer_row(t: dict[str, Any]) -> list[str]:
    return [t["name"], t["kind"], t["source"], t["sha256"][:16], t["ref"], fmt(t["problem"])]


@trainers_app.command("list")
def trainers_list(
    url: UrlOpt = None, token: TokenOpt = None, data_dir: ClientDataDir = None
) -> None:
    """Every trainer this org may run, with its code hash."""
    list_rows(url, token, data_dir, "trainers", _TRAINER_COLUMNS, _trainer_row)


@trainers_app.command("show")
def trainers_show(
    name: TrainerName,
    url: UrlOpt = None,
    token: TokenOpt = None,
    data_dir: ClientDataDir = None,
) -> None:
    """One trainer, its full hash included (what a run spec pins)."""
    with client(url, token, data_dir) as api:
        t = api.get(f"/v1/trainers/{name}")
    for key in ("name", "kind", "source", "ref", "sha256", "description", "problem"):
        typer.echo(f"{key}: {fmt(t.get(key))}")


@trainers_app.command("remove")
def trainers_remove(
    name: TrainerName,
    url: UrlOpt = None,
    token: TokenOpt = None,
    data_dir: ClientDataDir = None,
) -> None:
    """Forget an installed trainer (refused while an unfinished run uses it)."""
    with client(url, token, data_dir) as api:
        api.send("DELETE", f"/v1/trainers/{name}")
    typer.echo(f"removed trainer {name}")


# --------------------------------------------------------------------------- datasets


def _dataset(api: ApiClient, name: str) -> dict[str, Any]:
    """The dataset named ``name`` (or whose id it is)."""
    rows = api.get("/v1/datasets", limit=1000)["data"]
    found = [r for r in rows if r["name"] == name or str(r["id"]) == name]
    if not found:
        from org_node.cli_common import ClientError

        raise ClientError(f"no dataset {name!r} at this node")
    return dict(found[0])


@datasets_app.command("register")
def datasets_register(
    name: Annotated[str, typer.Argument(help="The dataset's name at this org.")],
    path: Annotated[Path, typer.Argument(help="The file or directory (under a dataset root).")],
    kind: Annotated[
        str | None, typer.Option("--kind", help="table, image-folder or files (read if unset).")
    ] = None,
    description: Annotated[str, typer.Option("--description", help="Shown in lists.")] = "",
    url: UrlOpt = None,
    token: TokenOpt = None,
    data_dir: ClientDataDir = None,
) -> None:
    """Register a dataset: the node hashes it and reads a table's columns and rows."""
    body: dict[str, Any] = {
        "name": name,
        "path": str(path.expanduser().absolute()),
        "description": description,
    }
    if kind:
        body["kind"] = kind
    with client(url, token, data_dir) as api:
        row = api.post("/v1/datasets", body)
    columns = ", ".join(f"{k}:{v}" for k, v in row["columns"].items())
    typer.echo(f"registered dataset {row['name']} ({row['kind']}, {row['row_count']} rows)")
    if columns:
        typer.echo(f"columns: {columns}")
    typer.echo(f"sha256: {row['content_hash']}")


def _dataset_row(d: dict[str, Any]) -> list[str]:
    return [
        str(d["id"]),
        d["name"],
        d["kind"],
        str(d["row_count"]),
        str(len(d["columns"])),
        d["content_hash"][:16],
        d["path"],
    ]


@datasets_app.command("list")
def datasets_list(
    url: UrlOpt = None, token: TokenOpt = None, data_dir: ClientDataDir = None
) -> None:
    """This org's datasets (metadata only)."""
    list_rows(url, token, data_dir, "datasets", _DATASET_COLUMNS, _dataset_row, limit=1000)


@datasets_app.command("show")
def datasets_show(
    name: DatasetRef,
    url: UrlOpt = None,
    token: TokenOpt = None,
    data_dir: ClientDataDir = None,
) -> None:
    """One dataset: its kind, columns, rows and content hash."""
    with client(url, token, data_dir) as api:
        d = _dataset(api, name)
    for key in ("id", "name", "kind", "row_count", "content_hash", "path", "description"):
        typer.echo(f"{key}: {fmt(d.get(key))}")
    for column, typ in d["columns"].items():
        typer.echo(f"  {column}: {typ}")


@datasets_app.command("rehash")
def datasets_rehash(
    name: DatasetRef,
    url: UrlOpt = None,
    token: TokenOpt = None,
    data_dir: ClientDataDir = None,
) -> None:
    """Hash the content again (refused when it changed under a run it is bound to)."""
    with client(url, token, data_dir) as api:
        d = _dataset(api, name)
        row = api.request(
            "PATCH", f"/v1/datasets/{d['id']}", json_body={"version": d["version"], "rehash": True}
        )
    same = "unchanged" if row["content_hash"] == d["content_hash"] else "changed"
    typer.echo(f"dataset {row['name']}: content {same}, sha256 {row['content_hash']}")


@datasets_app.command("remove")
def datasets_remove(
    name: DatasetRef,
    url: UrlOpt = None,
    token: TokenOpt = None,
    data_dir: ClientDataDir = None,
) -> None:
    """Unregister a dataset (its files stay; refused while a run uses it)."""
    with client(url, token, data_dir) as api:
        d = _dataset(api, name)
        api.send("DELETE", f"/v1/datasets/{d['id']}")
    typer.echo(f"unregistered dataset {d['name']}")
