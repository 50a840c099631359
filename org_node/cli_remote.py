"""``fedweave runs``, ``peers`` and ``audit events|fetch``: client commands of a running
node's admin API.

fedweave runs list | show RUN | propose --name N --trainer T ... | propose --spec spec.json
fedweave runs accept RUN [--dataset NAME] | decline | start | pause | resume | abort RUN
fedweave peers
fedweave audit events [--run R] [--round N] [--peer P] [--class C]
fedweave audit fetch RUN --out DIR
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Annotated, Any

import typer

from org_node.cli_common import (
    ApiClient,
    ClientDataDir,
    ClientError,
    RunRef,
    TokenOpt,
    UrlOpt,
    client,
    fmt,
    guarded,
    list_rows,
    resolve_run,
    table,
)

__all__ = ["audit_events", "audit_fetch", "peers", "runs_app"]

runs_app = typer.Typer(
    help="Runs at a running node, over its admin API.",
    no_args_is_help=True,
)
_PEER_COLUMNS = ["org", "status", "incarnation", "last seen (s ago)", "latency (ms)"]
_RUN_COLUMNS = ["key", "name", "state", "round", "of", "backend", "participants", "waiting"]


def _run_row(r: dict[str, Any]) -> list[str]:
    return [
        str(r.get("run_key") or r["id"])[:12],
        r["name"],
        r["state"],
        str(r["current_round"]),
        str(r["spec"]["rounds"]),
        r["spec"]["backend"],
        ", ".join(r["spec"]["participants"]),
        _waiting_line(r.get("waiting")),
    ]


@runs_app.command("list")
def runs_list(
    url: UrlOpt = None,
    token: TokenOpt = None,
    data_dir: ClientDataDir = None,
    state: Annotated[str | None, typer.Option("--state", help="Only runs in this state.")] = None,
) -> None:
    """The node's runs, newest first."""
    list_rows(url, token, data_dir, "runs", _RUN_COLUMNS, _run_row, state=state, limit=1000)


def _when(value: Any) -> str:
    """An API timestamp as ``YYYY-MM-DD HH:MM:SS UTC``."""
    text = str(value or "")
    return text[:19].replace("T", " ") + " UTC" if text else "-"


def _waiting_line(waiting: dict[str, Any] | None) -> str:
    if not waiting:
        return ""
    what, orgs = waiting.get("what"), ", ".join(waiting.get("orgs") or [])
    if what == "consent":
        line = f"consent of {orgs}" if orgs else str(waiting.get("detail") or "consent")
        return f"{line} (deadline {_when(waiting.get('until'))})"
    if what == "start":
        return f"start at {_when(waiting.get('until'))}"
    return str(waiting.get("detail") or what)


def _dp_line(dp: dict[str, Any]) -> str:
    """The run's agreed DP mechanism, as ``runs show`` prints it."""
    return (
        f"dp: Skellam noise multiplier {fmt(dp['noise_multiplier'])}, l2 clip "
        f"{fmt(dp['l2_clip'])}, delta {fmt(dp['delta'])}, {dp['frac_bits']} fraction bits, "
        f"noise sized for the {dp['noise_for']} (every participant signed it)"
    )


def _doing_line(waiting: dict[str, Any] | None) -> str:
    """What a run under way does now (``runs show``'s ``now:`` line)."""
    if not waiting:
        return ""
    return f"{waiting.get('detail') or waiting.get('stage')}, since {_when(waiting.get('since'))}"


def _print_run(row: dict[str, Any]) -> None:
    spec = row["spec"]
    typer.echo(f"run {row['name']} (key {row.get('run_key') or '-'})")
    typer.echo(f"state: {row['state']} (version {row['version']})")
    if row.get("state_reason"):
        typer.echo(f"why: {row['state_reason']}")
    waiting = row.get("waiting")
    if waiting and waiting.get("what") == "round":
        label = "waiting for" if waiting.get("orgs") else "now"
        typer.echo(f"{label}: {_doing_line(waiting)}")
    elif waiting:
        typer.echo(f"waiting for: {_waiting_line(waiting)}, since {_when(waiting.get('since'))}")
    typer.echo(f"round: {row['current_round']} of {spec['rounds']}")
    pin = f" (pinned {spec['trainer_hash'][:12]}…)" if spec.get("trainer_hash") else ""
    typer.echo(
        f"spec: trainer {spec['trainer']}{pin}, backend {spec['backend']}, threshold "
        f"{spec['threshold']}, epsilon {fmt(spec.get('epsilon'))}"
    )
    if spec.get("dp"):
        typer.echo(_dp_line(spec["dp"]))
    if spec.get("data"):
        columns = ", ".join(f"{k}:{v}" for k, v in spec["data"].get("columns", {}).items())
        typer.echo(f"data: {spec['data']['kind']}" + (f" ({columns})" if columns else ""))
    if spec.get("config"):
        typer.echo("config: " + ", ".join(f"{k}={v}" for k, v in sorted(spec["config"].items())))
    needed = spec.get("quorum") or len(spec["participants"])
    typer.echo(f"participants: {', '.join(spec['participants'])} ({needed} must consent)")
    if spec.get("quorum_wait_s") is not None:
        typer.echo(f"quorum wait: a round waits up to {fmt(spec['quorum_wait_s'])} s for a quorum")
    if spec.get("compression") not in (None, "none"):
        typer.echo(f"compression: {spec['compression']}")
    if row.get("trainer_hash"):
        typer.echo(f"bound trainer: {spec['trainer']} {row['trainer_hash'][:12]}…")
    if row.get("dataset_name"):
        typer.echo(
            f"bound dataset: {row['dataset_name']} ({row.get('dataset_rows')} rows, "
            f"{str(row.get('dataset_hash'))[:12]}…)"
        )
    origin = f" at {row['origin']}" if row.get("origin") else ""
    typer.echo(
        f"proposed by {row['proposed_by']}{origin}; consent by {_when(row.get('consent_by'))}"
    )
    if row.get("start_at"):
        typer.echo(f"start: {_when(row['start_at'])}")
    decided = {c["org_id"]: c for c in row.get("consents") or []}
    typer.echo("consents:")
    for org in spec["participants"]:
        c = decided.get(org)
        said = (
            f"{c['decision']} at {_when(c['decided_at'])}"
            + (f" ({c['reason']})" if c["reason"] else "")
            if c
            else "no answer yet"
        )
        typer.echo(f"  {org}: {said}")


@runs_app.command("show")
def runs_show(
    run: RunRef,
    url: UrlOpt = None,
    token: TokenOpt = None,
    data_dir: ClientDataDir = None,
) -> None:
    """A run's state, what it waits for (whom, since when), why it failed, the
    participants' consents and its per-round metrics."""
    with client(url, token, data_dir) as api:
        row = resolve_run(api, run)
        metrics = api.get(f"/v1/runs/{row['run_key'] or row['id']}/metrics", limit=1000)["data"]
    _print_run(row)
    if not metrics:
        typer.echo("no round metrics yet")
        return
    names = sorted({m["name"] for m in metrics})
    per_round: dict[int, dict[str, float]] = {}
    for m in metrics:
        per_round.setdefault(int(m["round"]), {})[m["name"]] = m["value"]
    table(
        "metrics per round",
        ["round", *names],
        [[str(r), *(fmt(v.get(n)) for n in names)] for r, v in sorted(per_round.items())],
    )


def _config_values(pairs: list[str]) -> dict[str, Any]:
    """``KEY=VALUE`` pairs; a value that reads as JSON (a number, true/false) is that."""
    out: dict[str, Any] = {}
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        if not sep or not key:
            raise typer.BadParameter(f"{pair!r} is not KEY=VALUE", param_hint="--config")
        try:
            value = json.loads(raw)
        except ValueError:
            value = raw
        out[key] = value if isinstance(value, bool | int | float | str) else raw
    return out


def _columns(pairs: list[str]) -> dict[str, str]:
    out: dict[str, str] = {}
    for pair in pairs:
        name, sep, typ = pair.rpartition(":")
        if not sep or not name:
            raise typer.BadParameter(f"{pair!r} is not NAME:TYPE", param_hint="--column")
        out[name] = typ
    return out


def _data_like(api: ApiClient, name: str) -> dict[str, Any]:
    """The data requirement of a dataset like this org's ``name``: its kind, and its
    columns with numeric types widened to ``number``."""
    rows = api.get("/v1/datasets", limit=1000)["data"]
    found = [r for r in rows if r["name"] == name]
    if not found:
        raise ClientError(f"no dataset {name!r} at this node (for --data-like)")
    columns = {c: "number" if t in ("int", "float") else t for c, t in found[0]["columns"].items()}
    return {"kind": found[0]["kind"], "columns": columns}


def _proposed_spec(
    spec_file: Path | None,
    flags: dict[str, Any],
    data_kind: str | None,
    column: list[str],
    config: list[str],
) -> dict[str, Any]:
    """The run spec of ``runs propose``: the spec file's, with the flags given over it;
    exit 1 when it is not a JSON object or lacks the trainer, rounds or participants."""
    spec: dict[str, Any] = {}
    if spec_file is not None:
        loaded = guarded(lambda: json.loads(spec_file.read_text(encoding="utf-8")))
        if not isinstance(loaded, dict):
            typer.echo(f"error: {spec_file} does not hold a JSON object", err=True)
            raise typer.Exit(1)
        spec = loaded
    spec |= {k: v for k, v in flags.items() if v is not None}
    if data_kind is not None or column:
        spec["data"] = {"kind": data_kind or "table", "columns": _columns(column)}
    if config:
        spec["config"] = dict(spec.get("config") or {}) | _config_values(config)
    missing = [k for k in ("trainer", "rounds", "participants") if k not in spec]
    if missing:
        typer.echo(f"error: the spec lacks {', '.join(missing)} (--spec or flags)", err=True)
        raise typer.Exit(1)
    return spec


@runs_app.command("propose")
def runs_propose(
    name: Annotated[str, typer.Option("--name", help="The run's name (the same at every org).")],
    spec_file: Annotated[
        Path | None, typer.Option("--spec", help="A JSON file holding the run spec.")
    ] = None,
    trainer: Annotated[
        str | None, typer.Option("--trainer", help="The trainer, by its installed name.")
    ] = None,
    trainer_hash: Annotated[
        str | None, typer.Option("--trainer-hash", help="Pin the trainer's code hash.")
    ] = None,
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
    data_kind: Annotated[
        str | None,
        typer.Option("--data", help="The data each org binds: table, image-folder or files."),
    ] = None,
    column: Annotated[
        list[str] | None,
        typer.Option("--column", help="NAME:TYPE of a column the trainer reads (repeat)."),
    ] = None,
    data_like: Annotated[
        str | None,
        typer.Option(
            "--data-like",
            help="Require the columns of this org's registered dataset NAME (numbers as "
            "'number'); only names and types go into the spec.",
        ),
    ] = None,
    config: Annotated[
        list[str] | None, typer.Option("--config", help="KEY=VALUE of the run's config (repeat).")
    ] = None,
    quorum: Annotated[
        int | None,
        typer.Option("--quorum", help="Consents needed to start (default: every participant)."),
    ] = None,
    quorum_wait: Annotated[
        float | None,
        typer.Option(
            "--quorum-wait",
            help="Seconds one round may wait for a quorum before the run fails "
            "(default 3600, at most 86400).",
        ),
    ] = None,
    compression: Annotated[
        str | None,
        typer.Option(
            "--compression",
            help="Compress each org's update before masking: none (default), q8, "
            "random-k=F or random-k=F,q8 (masked backend, no epsilon).",
        ),
    ] = None,
    consent_timeout: Annotated[
        int, typer.Option("--consent-timeout", help="Seconds the participants have to consent.")
    ] = 3600,
    start_delay: Annotated[
        int, typer.Option("--start-delay", help="Seconds from the last consent to the start.")
    ] = 5,
    url: UrlOpt = None,
    token: TokenOpt = None,
    data_dir: ClientDataDir = None,
) -> None:
    """Propose a run to every participant, once: the node signs the proposal and sends it;
    each org accepts or declines it, and the run starts by itself once all have consented
    (a spec file, flags, or a file with flags overriding)."""
    flags = {
        "trainer": trainer,
        "trainer_hash": trainer_hash,
        "rounds": rounds,
        "participants": participant or None,
        "backend": backend,
        "threshold": threshold,
        "epsilon": epsilon,
        "quorum": quorum,
        "quorum_wait_s": quorum_wait,
        "compression": compression,
    }
    spec = _proposed_spec(spec_file, flags, data_kind, column or [], config or [])
    with client(url, token, data_dir) as api:
        if data_like is not None:
            like = _data_like(api, data_like)
            spec["data"] = like | {"columns": like["columns"] | _columns(column or [])}
        body = {
            "name": name,
            "spec": spec,
            "consent_timeout_s": consent_timeout,
            "start_delay_s": start_delay,
        }
        row = api.post("/v1/runs", body)
    typer.echo(
        f"proposed run {row['name']} (key {row['run_key']}) to "
        f"{', '.join(row['spec']['participants'])}; consent by {_when(row.get('consent_by'))}"
    )
    typer.echo(f"each org consents with: fedweave runs accept {row['name']}")


def _action_command(action: str, doc: str) -> None:
    def command(
        run: RunRef,
        reason: Annotated[str, typer.Option("--reason", help="Recorded with the action.")] = "",
        url: UrlOpt = None,
        token: TokenOpt = None,
        data_dir: ClientDataDir = None,
    ) -> None:
        _act(action, run, {"reason": reason} if reason else None, url, token, data_dir)

    command.__doc__ = doc
    command.__name__ = f"runs_{action}"
    runs_app.command(action)(command)


def _act(
    action: str,
    run: str,
    body: dict[str, Any] | None,
    url: str | None,
    token: str | None,
    data_dir: Path | None,
) -> None:
    with client(url, token, data_dir) as api:
        row = resolve_run(api, run)
        new = api.post(f"/v1/runs/{row['run_key'] or row['id']}/{action}", body)
    typer.echo(f"run {new['name']} (key {new.get('run_key') or new['id']}): {new['state']}")
    if new.get("dataset_name"):
        typer.echo(f"bound dataset {new['dataset_name']} ({new.get('dataset_rows')} rows)")
    if new.get("waiting"):
        typer.echo(f"waiting for: {_waiting_line(new['waiting'])}")


@runs_app.command("accept")
def runs_accept(
    run: RunRef,
    dataset: Annotated[
        str | None,
        typer.Option("--dataset", help="This org's registered dataset to bind (runs with data)."),
    ] = None,
    reason: Annotated[str, typer.Option("--reason", help="Recorded with the consent.")] = "",
    key: Annotated[
        str | None,
        typer.Option("--key", help="The run key you reviewed: refused if the run's differs."),
    ] = None,
    url: UrlOpt = None,
    token: TokenOpt = None,
    data_dir: ClientDataDir = None,
) -> None:
    """This org consents to the run: its policies, its installed trainer (and pinned
    hash), and for a run that needs data the dataset named here, bound to the run. The
    consent is signed and sent to every participant."""
    body: dict[str, Any] = {}
    if reason:
        body["reason"] = reason
    if key:
        body["run_key"] = key
    if dataset:
        body["dataset"] = dataset
    _act("accept", run, body or None, url, token, data_dir)


_action_command(
    "decline",
    "This org declines the run (--reason is required); the signed decline reaches every "
    "participant.",
)
_action_command(
    "start",
    "Start an accepted run now, once every consent is in (it also starts by itself at the "
    "agreed time).",
)
_action_command("pause", "Pause a running run after the current round.")
_action_command("resume", "Resume a paused run, or a failed one whose failure is recoverable.")
_action_command("abort", "Abort a run that has not ended.")


def _peer_row(p: dict[str, Any]) -> list[str]:
    return [
        p["org_id"],
        p["status"],
        str(p["incarnation"]),
        fmt(p["last_seen_s_ago"]),
        fmt(p["latency_ms"]),
    ]


def peers(url: UrlOpt = None, token: TokenOpt = None, data_dir: ClientDataDir = None) -> None:
    """The node's live view of the other members."""
    list_rows(url, token, data_dir, "peers", _PEER_COLUMNS, _peer_row)


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
    with client(url, token, data_dir) as api:
        body = api.get(
            "/v1/audit/events",
            run=run,
            round=round,
            peer=peer,
            privacy_class=privacy_class,
            kind=kind,
            limit=limit,
        )
    table(
        f"audit events ({len(body['data'])} of {body['count']})",
        ["time", "stage", "kind", "run", "round", "peer", "class", "bytes"],
        [
            [
                str(e.get("time")),
                str(e.get("stage")),
                str(e.get("kind")),
                fmt(e.get("run")),
                fmt(e.get("round")),
                fmt(e.get("peer")),
                fmt(e.get("privacy_class")),
                fmt(e.get("bytes")),
            ]
            for e in body["data"]
        ],
    )


def audit_fetch(
    run: RunRef,
    out: Annotated[Path, typer.Option("--out", help="Directory for report.json and .html.")],
    url: UrlOpt = None,
    token: TokenOpt = None,
    data_dir: ClientDataDir = None,
) -> None:
    """Have the node generate the run's privacy report, and download it (JSON and HTML)."""
    with client(url, token, data_dir) as api:
        made = api.send("POST", f"/v1/audit/runs/{run}/report")
        html = api.send("GET", f"/v1/audit/runs/{run}/report.html")
        key = str(made.json()["run"]["id"])
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}", key):
            raise typer.BadParameter(f"the node named the run {key!r}: not a file name")
        out.mkdir(parents=True, exist_ok=True)
        json_path = out / f"{key}.audit.json"
        html_path = out / f"{key}.audit.html"
        json_path.write_bytes(made.content)  # the signed bytes, as the node wrote them
        html_path.write_bytes(html.content)
    typer.echo(f"{json_path}\n{html_path}")
