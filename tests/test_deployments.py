"""Static checks of deployments/ and of docs/OPERATIONS.md: every YAML file parses (and
has the shape its tool needs), and every ``fedweave`` command line they show names a
command and flags that exist in the Typer app (checked against the app itself)."""

from __future__ import annotations

import re
import shlex
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import click
import pytest
import typer
import yaml

from api.cli import app

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deployments"
OPERATIONS = ROOT / "docs" / "OPERATIONS.md"
YAML_FILES = sorted([*DEPLOY.rglob("*.yml"), *DEPLOY.rglob("*.yaml")])
TEXT_FILES = sorted(
    p for p in DEPLOY.rglob("*") if p.is_file() and p.suffix not in (".yml", ".yaml")
)
_INVOCATION = re.compile(r"(?:^|[\s\"'(]|bin/)fedweave((?:[ \t]+[^\s`|;&#)]+)+)")
"""``fedweave ARGS`` as a command word or a ``.../bin/fedweave`` path, not as a
directory name (``/var/lib/fedweave --shell ...`` is ``useradd``'s line)."""


def _root() -> click.Group:
    command = typer.main.get_command(app)
    assert isinstance(command, click.Group)
    return command


def check_invocation(tokens: list[str]) -> None:
    """Resolve ``fedweave TOKENS``: each subcommand and each ``--flag`` must exist."""
    ctx_cmd: click.Command = _root()
    path = ["fedweave"]
    rest = list(tokens)
    while isinstance(ctx_cmd, click.Group) and rest and not rest[0].startswith("-"):
        name = rest.pop(0)
        sub = ctx_cmd.get_command(click.Context(ctx_cmd), name)  # lazily loaded ones too
        assert sub is not None, f"`{' '.join(path)} {name}`: no such command"
        path.append(name)
        ctx_cmd = sub
    opts = {"--help"}
    for param in ctx_cmd.params:
        if isinstance(param, click.Option):
            opts.update(param.opts)
            opts.update(param.secondary_opts)
    for token in rest:
        if token.startswith("--"):
            flag = token.split("=", 1)[0]
            assert flag in opts, f"`{' '.join(path)}` has no option {flag}"


def _code_lines(text: str, markdown: bool) -> Iterator[str]:
    """Lines that hold commands: fenced blocks and inline code in Markdown, every line
    elsewhere; backslash continuations joined, shell comments dropped."""
    if markdown:
        chunks: list[str] = []
        fenced = False
        for line in text.splitlines():
            if line.lstrip().startswith("```"):
                fenced = not fenced
                continue
            if fenced:
                chunks.append(line)
            else:
                chunks.extend(re.findall(r"`([^`]+)`", line))
        text = "\n".join(chunks)
    joined = re.sub(r"\\\n\s*", " ", text)
    for line in joined.splitlines():
        code = line.split(" #", 1)[0]
        if code.lstrip().startswith("#"):
            continue
        yield code


def invocations_in_text(text: str, *, markdown: bool) -> list[list[str]]:
    found = []
    for line in _code_lines(text, markdown):
        for m in _INVOCATION.finditer(line):
            try:
                tokens = shlex.split(m.group(1))
            except ValueError:
                tokens = m.group(1).split()
            if tokens and (tokens[0].startswith("-") or tokens[0].isidentifier()):
                found.append(tokens)
    return found


def _lists(node: Any) -> Iterator[list[str]]:
    """Every ``command``/``args``/``entrypoint`` list or string in a YAML document."""
    if isinstance(node, dict):
        for key, value in node.items():
            if key in ("command", "args", "entrypoint"):
                if isinstance(value, list) and all(isinstance(v, str) for v in value):
                    yield value
                elif isinstance(value, str):
                    yield [value]
            yield from _lists(value)
    elif isinstance(node, list):
        for item in node:
            yield from _lists(item)


def invocations_in_yaml(path: Path) -> list[list[str]]:
    found = []
    for doc in yaml.safe_load_all(path.read_text()):
        for argv in _lists(doc):
            if argv and argv[0] == "fedweave":
                found.append(argv[1:])
            for item in argv:  # shell scripts passed to `sh -c`
                found.extend(invocations_in_text(item, markdown=False))
    # an argv list ["fedweave", ...] is also seen by the text scan of its items
    unique = {tuple(t) for t in found}
    return [list(t) for t in sorted(unique)]


def test_there_are_deployment_files() -> None:
    names = {p.relative_to(DEPLOY).as_posix() for p in DEPLOY.rglob("*") if p.is_file()}
    assert {
        "Dockerfile",
        "docker-compose.yml",
        "k8s/org-node.yaml",
        "k8s/init-job.yaml",
        "k8s/pytorchjob.yaml",
        "systemd/fedweave.service",
        "README.md",
    } <= names


@pytest.mark.parametrize("path", YAML_FILES, ids=lambda p: p.relative_to(DEPLOY).as_posix())
def test_yaml_parses(path: Path) -> None:
    docs = [d for d in yaml.safe_load_all(path.read_text()) if d is not None]
    assert docs, f"{path.name} is empty"
    for doc in docs:
        assert isinstance(doc, dict)
        if path.parent.name == "k8s":
            assert {"apiVersion", "kind", "metadata"} <= set(doc), path.name


def test_compose_has_three_orgs_each_with_a_volume() -> None:
    doc = yaml.safe_load((DEPLOY / "docker-compose.yml").read_text())
    services = doc["services"]
    assert sorted(services) == ["org1", "org2", "org3"]
    for name, svc in services.items():
        assert f"{name}-data:/data" in svc["volumes"]
        assert svc["command"][:2] == ["fedweave", "run"]
    assert {f"org{i}-data" for i in (1, 2, 3)} <= set(doc["volumes"])


def test_kubernetes_statefulset_services_and_training_job() -> None:
    kinds: dict[str, list[dict[str, Any]]] = {}
    for path in (DEPLOY / "k8s").glob("*.yaml"):
        for doc in yaml.safe_load_all(path.read_text()):
            kinds.setdefault(doc["kind"], []).append(doc)
    (sts,) = kinds["StatefulSet"]
    assert sts["spec"]["replicas"] == 1
    assert sts["spec"]["volumeClaimTemplates"][0]["metadata"]["name"] == "data"
    ports = {p["targetPort"] for svc in kinds["Service"] for p in svc["spec"]["ports"]}
    assert ports == {"admin", "peer"}
    container_ports = {p["name"] for p in sts["spec"]["template"]["spec"]["containers"][0]["ports"]}
    assert ports <= container_ports
    (job,) = kinds["PyTorchJob"]
    assert set(job["spec"]["pytorchReplicaSpecs"]) == {"Master", "Worker"}


def test_the_systemd_unit_runs_the_node() -> None:
    text = (DEPLOY / "systemd" / "fedweave.service").read_text()
    sections = re.findall(r"^\[(\w+)\]$", text, flags=re.M)
    assert sections == ["Unit", "Service", "Install"]
    (exec_start,) = re.findall(r"^ExecStart=(.+)$", text, flags=re.M)
    assert exec_start.split()[1:3] == ["run", "--data-dir"]


def _all_invocations() -> list[tuple[str, list[str]]]:
    out: list[tuple[str, list[str]]] = []
    for path in YAML_FILES:
        out += [(path.relative_to(ROOT).as_posix(), t) for t in invocations_in_yaml(path)]
    for path in [*TEXT_FILES, OPERATIONS]:
        md = path.suffix == ".md"
        out += [
            (path.relative_to(ROOT).as_posix(), t)
            for t in invocations_in_text(path.read_text(), markdown=md)
        ]
    return out


def test_commands_are_found_in_every_kind_of_file() -> None:
    where = {w for w, _ in _all_invocations()}
    assert {
        "deployments/Dockerfile",
        "deployments/docker-compose.yml",
        "deployments/k8s/org-node.yaml",
        "deployments/k8s/init-job.yaml",
        "deployments/systemd/fedweave.service",
        "docs/OPERATIONS.md",
    } <= where
    commands = {t[0] for _, t in _all_invocations() if t}
    assert {"init", "run", "recover", "federation"} <= commands


@pytest.mark.parametrize(
    ("where", "tokens"), _all_invocations(), ids=lambda v: v if isinstance(v, str) else None
)
def test_every_fedweave_command_and_flag_exists(where: str, tokens: list[str]) -> None:
    check_invocation(tokens)


@pytest.mark.parametrize(
    ("tokens", "message"),
    [
        (["nonsense"], "no such command"),
        (["federation", "found", "--fed", "x"], "has no option --fed"),
        (["run", "--data-dir", "/d", "--turbo"], "has no option --turbo"),
    ],
)
def test_the_checker_catches_unknown_commands_and_flags(tokens: list[str], message: str) -> None:
    with pytest.raises(AssertionError, match=message):
        check_invocation(tokens)


def test_the_scanner_reads_continuations_inline_code_and_yaml_lists() -> None:
    text = (
        "Run `fedweave status --data-dir D` now.\n"
        "```bash\n"
        "fedweave init --org-id a \\\n    --data-dir /d   # comment --bogus\n"
        "useradd --home-dir /var/lib/fedweave --shell /bin/false fedweave\n"
        ".venv/bin/fedweave --version\n"
        "```\n"
        "the fedweave.toml file\n"
    )
    assert invocations_in_text(text, markdown=True) == [
        ["status", "--data-dir", "D"],
        ["init", "--org-id", "a", "--data-dir", "/d"],
        ["--version"],
    ]
