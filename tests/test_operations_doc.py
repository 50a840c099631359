"""docs/OPERATIONS.md and README.md cannot drift from the code.

Every ``fedweave`` command the docs show (in ``bash``/``sh``/``console``/plain fenced
blocks, and inline code spans in prose) is resolved in the Typer app's click tree: its
subcommand path must exist, each ``--flag`` must be an option of that command, and it
may not pass more positional arguments than the command takes. Every admin API route
the docs name (``POST /v1/runs``, ``GET /v1/runs/{id}/metrics``, ``.../accept`` after a
full route in the same sentence) must be a route of the admin app, with that method
when one is given. Each failure names the doc line and what does not exist.

The shell reading is deliberately small: ``\\`` continuations, ``$ `` prompts, ``#``
comments, quotes, ``$(...)``, redirections, ``|``/``&&``/``;``/``&`` lists, ``for ...; do
...; done`` loops, ``VAR=value`` prefixes, ``sudo``/``env`` wrappers, ``sh -c "..."``
and launchers (``docker``, ``kubectl``, ``$C``) that run ``fedweave`` in a container.
Doc notation is understood too: ``a|b`` without spaces lists alternatives (each must
exist; a real pipe has spaces around it), ``...`` stands for more arguments, and
``[--opt X]`` marks an optional part.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import click
import pytest
import typer

from api import dashboard
from api.app import ROUTERS
from api.cli import app as cli_app

ROOT = Path(__file__).resolve().parents[1]
DOCS = ("docs/OPERATIONS.md", "README.md")

SHELL_FENCES = frozenset({"", "bash", "sh", "shell", "console", "shell-session", "zsh"})
"""Fenced-block languages whose lines are shell commands (``console``: the ``$ `` lines)."""

# --------------------------------------------------------------------------- markdown


@dataclass(frozen=True)
class Block:
    """A fenced code block: its language, its lines with their line numbers, and the
    section (the text under one heading) it is in."""

    lang: str
    lines: tuple[tuple[int, str], ...]
    section: int


@dataclass(frozen=True)
class Span:
    """An inline code span in prose, with the line it starts on."""

    line: int
    text: str
    section: int
    paragraph: int
    sentence: int
    """Index of the sentence of its paragraph that holds it."""
    method_before: str | None
    """An HTTP method written right before the span, outside it (``POST `/v1/runs```)."""


_FENCE = re.compile(r"^(\s*)(`{3,}|~{3,})\s*([\w+-]*)")
_HEADING = re.compile(r"^#{1,6}\s")
_SPAN = re.compile(r"`([^`]+)`")
_SENTENCE_END = re.compile(r"[.!?](?=\s|$)")
_METHODS = ("GET", "POST", "PUT", "PATCH", "DELETE")
_METHOD_BEFORE = re.compile(r"\b(" + "|".join(_METHODS) + r")\s*$")


def parse_markdown(text: str) -> tuple[list[Block], list[Span]]:
    """The fenced blocks and the prose's inline code spans of a Markdown text."""
    blocks: list[Block] = []
    spans: list[Span] = []
    paragraph: list[tuple[int, str]] = []
    paragraphs = section = 0
    fence: tuple[str, str, str] | None = None  # (indent, marker, lang)
    body: list[tuple[int, str]] = []

    def end_paragraph() -> None:
        nonlocal paragraph, paragraphs
        if paragraph:
            spans.extend(_paragraph_spans(paragraph, section, paragraphs))
            paragraph, paragraphs = [], paragraphs + 1

    for number, line in enumerate(text.splitlines(), start=1):
        if fence is not None:
            indent, marker, lang = fence
            stripped = line.strip()
            if stripped.startswith(marker) and not stripped.strip(marker[0]):
                blocks.append(Block(lang, tuple(body), section))
                fence, body = None, []
            else:
                body.append((number, line[len(indent) :] if line.startswith(indent) else line))
            continue
        m = _FENCE.match(line)
        if m:
            end_paragraph()
            fence = (m.group(1), m.group(2), m.group(3).lower())
        elif _HEADING.match(line):
            end_paragraph()
            section += 1
        elif line.strip():
            paragraph.append((number, line))
        else:
            end_paragraph()
    end_paragraph()
    assert fence is None, f"unclosed code fence {fence[1]}{fence[2]}"
    return blocks, spans


def _paragraph_spans(paragraph: Sequence[tuple[int, str]], section: int, index: int) -> list[Span]:
    first = paragraph[0][0]
    text = "\n".join(line for _, line in paragraph)
    masked = _SPAN.sub(lambda m: "x" * len(m.group(0)), text)
    ends = [m.start() for m in _SENTENCE_END.finditer(masked)]
    out = []
    for m in _SPAN.finditer(text):
        before = _METHOD_BEFORE.search(masked[: m.start()])
        out.append(
            Span(
                line=first + text.count("\n", 0, m.start()),
                text=" ".join(m.group(1).split()),
                section=section,
                paragraph=index,
                sentence=sum(1 for e in ends if e < m.start()),
                method_before=before.group(1) if before else None,
            )
        )
    return out


# ------------------------------------------------------------------------------ shell


class ShellSyntaxError(ValueError):
    """A line this reader cannot split into words (an unclosed quote or ``$(``)."""


_OPS = ("&&", "||", ";;", "|&", ";", "|", "&", "(", ")")
_REDIR = "redir"
_OP = "op"
_WORD = "word"


def logical_lines(lines: Sequence[tuple[int, str]], *, console: bool) -> Iterator[tuple[int, str]]:
    """Join ``\\``-continued lines (numbered by their first line) and drop ``$ `` prompts;
    in a ``console`` block only prompted lines are commands (the rest is output)."""
    pending: list[str] = []
    start = 0
    for number, line in lines:
        if not pending:
            start = number
            stripped = line.lstrip()
            if stripped.startswith("$ ") or stripped == "$":
                line = stripped[2:]
            elif console:
                continue
        trailing = len(line) - len(line.rstrip("\\"))
        if trailing % 2 == 1:
            pending.append(line[:-1])
            continue
        pending.append(line)
        yield start, " ".join(pending)
        pending = []
    if pending:
        yield start, " ".join(pending)


def _close_paren(line: str, i: int) -> int:
    """Index of the ``)`` closing the ``(`` at ``i``."""
    depth = 0
    for j in range(i, len(line)):
        if line[j] == "(":
            depth += 1
        elif line[j] == ")":
            depth -= 1
            if depth == 0:
                return j
    raise ShellSyntaxError("unclosed $(")


def tokenize(line: str) -> list[tuple[str, str]]:
    """Split one shell line into ``(kind, text)`` tokens: words, operators, redirections.

    Quotes are removed from words; ``$(...)`` stays whole inside its word; ``#`` at the
    start of a word begins a comment; ``a|b`` with no space on either side is one word
    (doc notation for alternatives), a spaced ``|`` is a pipe."""
    out: list[tuple[str, str]] = []
    word: list[str] = []
    in_word = False
    i, n = 0, len(line)

    def flush() -> None:
        nonlocal word, in_word
        if in_word:
            out.append((_WORD, "".join(word)))
        word, in_word = [], False

    while i < n:
        c = line[i]
        if c in " \t":
            flush()
            i += 1
        elif c == "#" and not in_word:
            break
        elif c == "\\":
            word.append(line[i + 1 : i + 2])
            in_word = True
            i += 2
        elif c == "'":
            j = line.find("'", i + 1)
            if j < 0:
                raise ShellSyntaxError("unclosed '")
            word.append(line[i + 1 : j])
            in_word = True
            i = j + 1
        elif c == '"':
            j = i + 1
            buf: list[str] = []
            while j < n and line[j] != '"':
                if line[j] == "\\" and j + 1 < n:
                    buf.append(line[j + 1])
                    j += 2
                elif line.startswith("$(", j):
                    k = _close_paren(line, j + 1)
                    buf.append(line[j : k + 1])
                    j = k + 1
                else:
                    buf.append(line[j])
                    j += 1
            if j >= n:
                raise ShellSyntaxError('unclosed "')
            word.append("".join(buf))
            in_word = True
            i = j + 1
        elif line.startswith("$(", i):
            k = _close_paren(line, i + 1)
            word.append(line[i : k + 1])
            in_word = True
            i = k + 1
        elif c in "<>" or line.startswith("&>", i):
            if in_word and "".join(word).isdigit():  # `2>&1`: the fd is part of it
                word, in_word = [], False
            flush()
            j = i + 1
            while j < n and line[j] in "<>&":
                j += 1
            out.append((_REDIR, line[i:j]))
            i = j
        elif c == "|" and in_word and i + 1 < n and line[i + 1] not in " \t|&":
            word.append(c)
            i += 1
        else:
            op = next((o for o in _OPS if line.startswith(o, i)), None)
            if op is None:
                word.append(c)
                in_word = True
                i += 1
            else:
                flush()
                out.append((_OP, op))
                i += len(op)
    flush()
    return out


def simple_commands(line: str) -> list[list[str]]:
    """The simple commands of a shell line, as word lists (redirections dropped)."""
    commands: list[list[str]] = [[]]
    skip_target = False
    for kind, text in tokenize(line):
        if kind == _OP:
            commands.append([])
        elif kind == _REDIR:
            skip_target = True
        elif skip_target:
            skip_target = False
        else:
            commands[-1].append(text)
    return [c for c in commands if c]


_ASSIGNMENT = re.compile(r"^[A-Za-z_]\w*=")
_LEADING_KEYWORDS = frozenset({"do", "then", "else", "elif", "if", "while", "until", "!", "{"})
_NOT_COMMANDS = frozenset({"for", "case", "select", "done", "fi", "esac", "}", "function"})
_PLAIN_WRAPPERS = frozenset({"nohup", "exec", "command", "time"})
_SUDO_VALUE_OPTS = frozenset({"-u", "-g", "-C", "-D", "-h", "-p", "-r", "-t", "-U"})
_LAUNCHERS = frozenset({"docker", "podman", "kubectl", "ssh", "docker-compose"})
"""Commands that run another command (in a container, a pod, a host) among their words."""


def is_fedweave(word: str) -> bool:
    """``fedweave`` itself or an executable path to it (``.venv/bin/fedweave``), not a
    directory or a resource that happens to be named so (``/var/lib/fedweave``)."""
    return word == "fedweave" or word.endswith("bin/fedweave")


def fedweave_argv(words: Sequence[str], depth: int = 0) -> list[list[str]]:
    """The ``fedweave`` invocations one simple command makes: the arguments after
    ``fedweave`` of each (several through ``sh -c "a && b"``)."""
    rest = list(words)
    while rest and (rest[0] in _LEADING_KEYWORDS or _ASSIGNMENT.match(rest[0])):
        rest.pop(0)
    if not rest or rest[0] in _NOT_COMMANDS:
        return []
    head = rest[0]
    if is_fedweave(head):
        return [rest[1:]]
    if head in _PLAIN_WRAPPERS:
        return fedweave_argv(rest[1:], depth)
    if head in ("sudo", "env"):
        i = 1
        while i < len(rest) and (rest[i].startswith("-") or _ASSIGNMENT.match(rest[i])):
            i += 2 if head == "sudo" and rest[i] in _SUDO_VALUE_OPTS else 1
        return fedweave_argv(rest[i:], depth)
    if head in ("sh", "bash") and len(rest) > 2 and rest[1] == "-c" and depth < 3:
        return [a for c in simple_commands(rest[2]) for a in fedweave_argv(c, depth + 1)]
    if head in _LAUNCHERS or head.startswith("$"):
        for i, word in enumerate(rest[1:], start=1):
            if is_fedweave(word) or (word in ("sh", "bash") and rest[i + 1 : i + 2] == ["-c"]):
                return fedweave_argv(rest[i:], depth)
    return []


# ---------------------------------------------------------------------------- commands


@dataclass(frozen=True)
class Invocation:
    """One ``fedweave ARGS`` found in a doc."""

    where: str
    """``FILE:LINE``."""
    source: str
    """The doc's line (continuations joined), for the failure message."""
    argv: tuple[str, ...]
    inline: bool
    """From an inline code span: a bare group (``fedweave runs``) is prose, not an error."""
    section: int = 0


@dataclass(frozen=True)
class FlagMention:
    """A prose span that starts with a flag (``--data-like DATASET``): it must be an
    option of a command the same section shows."""

    where: str
    source: str
    flag: str
    section: int


def _clip(text: str, limit: int = 140) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def cli_root() -> click.Group:
    command = typer.main.get_command(cli_app)
    assert isinstance(command, click.Group)
    return command


_SUBCOMMAND_WORD = re.compile(r"^[a-z][a-z-]*(\|[a-z][a-z-]*)*$")


def _groups(root: click.Group) -> frozenset[str]:
    return frozenset(
        n for n in _subcommand_names(root) if isinstance(_subcommand(root, n), click.Group)
    )


def invocations_in(
    name: str, text: str, groups: frozenset[str] | None = None
) -> tuple[list[Invocation], list[FlagMention], list[str]]:
    """Every ``fedweave`` invocation in a Markdown text, the flags its prose names, and
    the command lines it could not read.

    Inline spans count as invocations when they start with ``fedweave ARG`` or with a
    command group and a subcommand word (``runs accept RUN --dataset NAME``; ``groups``:
    the CLI's command groups)."""
    if groups is None:
        groups = _groups(cli_root())
    blocks, spans = parse_markdown(text)
    found: list[Invocation] = []
    flags: list[FlagMention] = []
    unreadable: list[str] = []
    for block in blocks:
        if block.lang not in SHELL_FENCES:
            continue
        for number, line in logical_lines(block.lines, console=block.lang == "console"):
            where = f"{name}:{number}"
            try:
                commands = simple_commands(line)
            except ShellSyntaxError as exc:
                if re.search(r"(^|[\s/])fedweave\s", line):
                    unreadable.append(f"{where}: `{_clip(line)}`: {exc}")
                continue
            for words in commands:
                argvs = fedweave_argv(words)
                if not argvs and _names_a_command(words):
                    unreadable.append(
                        f"{where}: `{_clip(line)}`: runs `fedweave` in a way this test does "
                        "not read (teach fedweave_argv its launcher)"
                    )
                for argv in argvs:
                    found.append(Invocation(where, line, tuple(argv), False, block.section))
    for span in spans:
        where = f"{name}:{span.line}"
        words = span.text.split()
        if words[0].startswith("--") and len(words[0]) > 2:  # `--data DIR --target COL`
            for word in words:
                flag = word.split("=", 1)[0].strip("[],.;:()")
                if flag.startswith("--") and len(flag) > 2:
                    flags.append(FlagMention(where, span.text, flag, span.section))
            continue
        short = len(words) > 1 and words[0] in groups and _SUBCOMMAND_WORD.match(words[1])
        line = f"fedweave {span.text}" if short else span.text
        try:
            commands = simple_commands(line)
        except ShellSyntaxError as exc:
            if line.startswith("fedweave "):
                unreadable.append(f"{where}: `{_clip(span.text)}`: {exc}")
            continue
        for cmd in commands:
            for argv in fedweave_argv(cmd):
                if argv:  # a bare `fedweave` in prose is the program's name
                    found.append(Invocation(where, span.text, tuple(argv), True, span.section))
    return found, flags, unreadable


def _names_a_command(words: Sequence[str]) -> bool:
    """Whether ``words`` hold ``fedweave SUBCOMMAND`` (so that a launcher this test does
    not know is reported rather than its command skipped)."""
    return any(
        is_fedweave(w) and _SUBCOMMAND_WORD.match(n) is not None
        for w, n in itertools.pairwise(words)
    )


def resolve(argv: Sequence[str], root: click.Group) -> list[click.Command]:
    """The commands ``fedweave ARGV`` runs (several for ``a|b``); [] if none resolves."""
    command: click.Command = root
    for token in argv:
        if not isinstance(command, click.Group) or token.startswith("-"):
            break
        subs = [_subcommand(command, n) for n in _unwrap(token).split("|")]
        found = [c for c in subs if c is not None]
        if len(found) < len(subs):
            return []
        if len(found) > 1:
            return found
        command = found[0]
    return [command]


def _path_of(argv: Sequence[str]) -> str:
    path = ["fedweave"]
    for token in argv[:2]:
        if not _SUBCOMMAND_WORD.match(token):
            break
        path.append(token)
    return " ".join(path)


def check_flag_mention(
    mention: FlagMention, invocations: Sequence[Invocation], root: click.Group
) -> list[str]:
    """A prose flag must be an option of a command its section shows; a section that
    shows no command is not checked."""
    shown = [inv for inv in invocations if inv.section == mention.section]
    if not shown:
        return []
    if any(mention.flag in _options(c) for inv in shown for c in resolve(inv.argv, root)):
        return []
    names = sorted({_path_of(inv.argv) for inv in shown})
    return [
        f"{mention.where}: `{_clip(mention.source)}`: {mention.flag} is no option of the "
        f"commands this section shows ({', '.join(names)})"
    ]


def _subcommand(group: click.Group, name: str) -> click.Command | None:
    """``group``'s subcommand ``name``, through click's own lookup (so that lazily
    loaded commands are found too)."""
    return group.get_command(click.Context(group), name)


def _subcommand_names(group: click.Group) -> list[str]:
    return sorted(group.list_commands(click.Context(group)))


def _options(command: click.Command) -> dict[str, click.Option]:
    opts: dict[str, click.Option] = {}
    for param in command.params:
        if isinstance(param, click.Option):
            for opt in (*param.opts, *param.secondary_opts):
                opts[opt] = param
    return opts


def _takes_value(option: click.Option, flag: str) -> bool:
    return not (option.is_flag or option.count or flag in option.secondary_opts)


def _max_positionals(command: click.Command) -> int | None:
    """How many positional arguments ``command`` takes; None for any number."""
    total = 0
    for param in command.params:
        if isinstance(param, click.Argument):
            if param.nargs < 0:
                return None
            total += param.nargs
    return total


def _unwrap(token: str) -> str:
    """``[--peer-log`` -> ``--peer-log``: optional parts in doc notation."""
    return token.strip("[]") or token


def check_invocation(inv: Invocation, root: click.Group | None = None) -> list[str]:
    """What in ``inv`` does not exist in the CLI (empty when everything does)."""
    root = root or cli_root()
    argv = [_unwrap(t) for t in inv.argv]
    where = f"{inv.where}: `{_clip(inv.source)}`"
    command: click.Command = root
    path = ["fedweave"]
    i = 0
    while isinstance(command, click.Group) and i < len(argv):
        token = argv[i]
        if token.startswith("-"):
            group_opts = _options(command)
            flag = token.split("=", 1)[0]
            if flag != "--help" and flag not in group_opts:
                return [f"{where}: `{' '.join(path)}` has no option {flag}"]
            if flag in group_opts and "=" not in token and _takes_value(group_opts[flag], flag):
                i += 1
            i += 1
            if flag in ("--help", "--version"):
                return []
            continue
        names = token.split("|")
        subs = {n: _subcommand(command, n) for n in names}
        found = {n: c for n, c in subs.items() if c is not None}
        missing = [n for n in names if n not in found]
        if missing:
            known = ", ".join(_subcommand_names(command))
            return [
                f"{where}: `{' '.join(path)}` has no subcommand {', '.join(map(repr, missing))}"
                f" (it has: {known})"
            ]
        i += 1
        if len(names) > 1:  # `runs accept|decline RUN`: the rest must fit one of them
            return _check_leaf(where, path, list(found.values()), names, argv[i:])
        path.append(token)
        command = found[token]
    if isinstance(command, click.Group):
        if inv.inline:
            return []
        known = ", ".join(_subcommand_names(command))
        return [f"{where}: `{' '.join(path)}` needs a subcommand (it has: {known})"]
    return _check_leaf(where, path[:-1], [command], [path[-1]], argv[i:])


def _check_leaf(
    where: str,
    parent: list[str],
    commands: list[click.Command],
    names: list[str],
    args: list[str],
) -> list[str]:
    shown = " ".join([*parent, "|".join(names)])
    problems: list[str] = []
    options = [_options(c) for c in commands]
    positionals = 0
    counted = len(commands) == 1
    i = 0
    while i < len(args):
        token = args[i]
        i += 1
        if token == "--":
            positionals += len(args) - i
            break
        if token.startswith("-") and len(token) > 1 and not token[1:2].isdigit():
            flag = token.split("=", 1)[0]
            if flag == "--help":
                return problems
            owner = next((o[flag] for o in options if flag in o), None)
            if owner is None:
                known = sorted({k for o in options for k in o if k.startswith("--")})
                problems.append(
                    f"{where}: `{shown}` has no option {flag} (its options: {', '.join(known)})"
                )
                counted = False  # whether it took a value is unknown: don't count positionals
            elif "=" not in token and _takes_value(owner, flag):
                i += 1
        elif token.endswith("..."):
            counted = False
        else:
            positionals += 1
    limit = _max_positionals(commands[0])
    if counted and limit is not None and positionals > limit:
        problems.append(
            f"{where}: `{shown}` takes {limit} positional argument(s), the doc passes {positionals}"
        )
    return problems


# ------------------------------------------------------------------------------ routes


@dataclass(frozen=True)
class RouteRef:
    """One admin API route named in a doc."""

    where: str
    source: str
    method: str | None
    path: str
    """A full path (``/v1/runs/{id}``) or a resolved suffix's candidates, ``|``-joined."""
    suffix: str | None = None
    """For ``.../accept``: the suffix as written."""
    base: str | None = None
    """For a suffix: the full route it was resolved against."""


_URL_HOST = re.compile(r"https?://[^/\s\"'`]+")
_ROUTE = re.compile(
    r"(?:\b(?P<method>" + "|".join(_METHODS) + r")\s+)?"
    r"(?<![\w./-])(?P<path>(?:/v1|\.\.\.)(?:/[\w{}<>.:-]+)+"
    r"|/(?:metrics|healthz|readyz|dashboard)(?![\w/-]))"
)


def _routes_in(text: str) -> Iterator[tuple[str | None, str]]:
    for m in _ROUTE.finditer(_URL_HOST.sub(" ", text)):
        path = m.group("path").split("?", 1)[0]
        if any(set(seg) == {"."} for seg in path.split("/")[1:]):
            continue  # `/v1/...`: an elided path, not a route
        yield m.group("method"), path.rstrip(".:")


def _suffix_candidates(base: str, suffix: str) -> list[str]:
    """Where ``.../suffix`` can be, said after ``base``: below it, below one of its items
    (``/v1/runs`` then ``.../accept``: ``/v1/runs/{}/accept``), or beside it
    (``.../report`` then ``.../report.html``)."""
    parent = base.rsplit("/", 1)[0]
    return [base + suffix, base + "/{}" + suffix, parent + suffix]


def routes_in(name: str, text: str) -> tuple[list[RouteRef], list[str]]:
    """Every route named in a Markdown text, and suffix mentions with no full route
    before them in their sentence (skipped)."""
    blocks, spans = parse_markdown(text)
    refs: list[RouteRef] = []
    skipped: list[str] = []
    for block in blocks:
        for number, line in block.lines:
            base: str | None = None
            for method, path in _routes_in(line):
                where = f"{name}:{number}"
                if path.startswith("..."):
                    if base is None:
                        skipped.append(f"{where}: {path}")
                        continue
                    cands = _suffix_candidates(base, path[3:])
                    refs.append(RouteRef(where, line, method, "|".join(cands), path, base))
                else:
                    base = path
                    refs.append(RouteRef(where, line, method, path))
    last: tuple[int, int, str] | None = None  # (paragraph, sentence, route) of the last route
    for span in spans:
        for method, path in _routes_in(span.text):
            method = method or span.method_before
            where = f"{name}:{span.line}"
            if path.startswith("..."):
                if last is None or last[:2] != (span.paragraph, span.sentence):
                    skipped.append(f"{where}: {path}")
                    continue
                cands = _suffix_candidates(last[2], path[3:])
                refs.append(RouteRef(where, span.text, method, "|".join(cands), path, last[2]))
            else:
                last = (span.paragraph, span.sentence, path)
                refs.append(RouteRef(where, span.text, method, path))
    return refs, skipped


def normalize(path: str) -> str:
    """``/v1/runs/{run_id}`` and ``/v1/runs/<id>`` -> ``/v1/runs/{}``."""
    path = re.sub(r"\{[^}]*\}|<[^>]*>", "{}", path)
    return path.rstrip("/") or "/"


def route_table(app_routes: Sequence[object]) -> dict[str, frozenset[str]]:
    """Normalized path -> allowed methods, from an app's (or routers') routes."""
    table: dict[str, set[str]] = {}
    for route in app_routes:
        path = getattr(route, "path", None)
        if isinstance(path, str):
            methods = getattr(route, "methods", None) or set()
            table.setdefault(normalize(path), set()).update(methods)
    return {k: frozenset(v) for k, v in table.items()}


def check_route(ref: RouteRef, table: Mapping[str, frozenset[str]]) -> list[str]:
    """What in ``ref`` does not exist in the admin API (empty when it all does)."""
    where = f"{ref.where}: `{_clip(ref.source)}`"
    candidates = ref.path.split("|")
    found = [c for c in candidates if normalize(c) in table]
    shown = f"{ref.suffix} (after {ref.base})" if ref.suffix else ref.path
    if not found:
        tried = " or ".join(normalize(c) for c in candidates)
        return [f"{where}: the admin API has no route {shown} (no {tried})"]
    if ref.method is not None:
        allowed = set().union(*(table[normalize(c)] for c in found))
        if ref.method not in allowed:
            return [
                f"{where}: {ref.method} {shown} is not allowed "
                f"(the route allows {', '.join(sorted(allowed))})"
            ]
    return []


def admin_routes() -> list[object]:
    """Every route of the admin app: the routers ``create_app`` includes
    (:data:`api.app.ROUTERS`, and the dashboard's page). Read from the routers
    themselves: FastAPI 0.138's ``app.routes`` wraps each included router lazily."""
    return [route for router in (*ROUTERS, dashboard.page_router) for route in router.routes]


@pytest.fixture(scope="module")
def routes() -> dict[str, frozenset[str]]:
    return route_table(admin_routes())


# ------------------------------------------------------------------------------- tests


def _read(name: str) -> str:
    return (ROOT / name).read_text(encoding="utf-8")


def test_every_documented_command_exists() -> None:
    root = cli_root()
    problems: list[str] = []
    checked: dict[str, int] = {}
    flags = 0
    for name in DOCS:
        found, mentions, unreadable = invocations_in(name, _read(name))
        problems += unreadable
        checked[name] = len(found)
        flags += len(mentions)
        for inv in found:
            problems += check_invocation(inv, root)
        for mention in mentions:
            problems += check_flag_mention(mention, found, root)
    assert not problems, "the docs show commands the CLI does not have:\n" + "\n".join(problems)
    assert checked["docs/OPERATIONS.md"] >= 30, checked
    assert checked["README.md"] >= 5, checked
    assert flags >= 10, flags


def test_every_documented_route_exists(routes: dict[str, frozenset[str]]) -> None:
    problems: list[str] = []
    checked = 0
    for name in DOCS:
        refs, _skipped = routes_in(name, _read(name))
        checked += len(refs)
        for ref in refs:
            problems += check_route(ref, routes)
    assert not problems, "the docs name routes the admin API does not have:\n" + "\n".join(problems)
    assert checked >= 10, checked


SYNTHETIC = """\
# Doc

```bash
fedweave runs show cohort-1 --data-dir /srv/fedweave   # good
fedweave runs show cohort-1 --no-such-flag             # an unknown flag
fedweave runs frobnicate cohort-1                      # an unknown subcommand
FEDWEAVE_TOKEN=$(cat t) .venv/bin/fedweave runs start r1 --data-dir d && fedweave peers | tee x
for i in 1 2; do fedweave runs start r$i --data-dir n$i --bogus; done
fedweave trainers show a b \\
    --data-dir d                                       # two positionals, it takes one
sudo -u fedweave /opt/x/.venv/bin/fedweave status --data-dir /var/lib/fedweave
useradd --system --home-dir /var/lib/fedweave --shell /usr/sbin/nologin fedweave
$C run --rm org1 sh -c "fedweave federation sign m.json --data-dir /data --quorum 2"
fedweave runs accept|declines RUN
fedweave run --data-dir d > run.log 2>&1 &
podman-compose run --rm org1 fedweave status --data-dir /data
```

```console
$ fedweave --version
fedweave --not-a-command-this-is-output
```

```toml
fedweave = "--not-a-command"
```

The admin API (`POST /v1/runs`, `.../accept`, `.../nope`) and
`GET /v1/runs/{id}/metrics` work; `POST /v1/runs/{id}/metrics` is wrong, `GET /v1/nope`
does not exist, `fedweave runs show` prints it, `fedweave runs shw` does not. A
`.../start` here has no route before it in its sentence. Short forms:
`runs accept RUN --datasett NAME` (a typo), `--reason TEXT` (an option of a command
shown above), `--nope` (of none), `federation merge` (good), `runs` alone (prose).

## A section that shows no command

`--anything` is not checked here.
"""
"""A doc with known good and bad lines: the checkers must flag exactly the bad ones."""


def _at(marker: str) -> str:
    """``synthetic.md:N``, N the first line of :data:`SYNTHETIC` that holds ``marker``."""
    for number, line in enumerate(SYNTHETIC.splitlines(), start=1):
        if marker in line:
            return f"synthetic.md:{number}"
    raise AssertionError(marker)


def test_the_checkers_flag_exactly_the_bad_lines(routes: dict[str, frozenset[str]]) -> None:
    found, mentions, unreadable = invocations_in("synthetic.md", SYNTHETIC)
    assert unreadable == [
        f"{_at('podman-compose')}: `podman-compose run --rm org1 fedweave status --data-dir "
        "/data`: runs `fedweave` in a way this test does not read (teach fedweave_argv its "
        "launcher)"
    ]
    argvs = {(inv.where, inv.argv) for inv in found}
    assert (_at("FEDWEAVE_TOKEN="), ("runs", "start", "r1", "--data-dir", "d")) in argvs
    assert (_at("FEDWEAVE_TOKEN="), ("peers",)) in argvs
    assert (_at("sudo -u"), ("status", "--data-dir", "/var/lib/fedweave")) in argvs
    assert (_at("run.log"), ("run", "--data-dir", "d")) in argvs
    assert (_at("$ fedweave --version"), ("--version",)) in argvs
    assert (_at("`federation merge`"), ("federation", "merge")) in argvs
    wheres = {inv.where for inv in found}
    for not_a_command in ("useradd", "this-is-output", '"--not-a-command"'):
        assert _at(not_a_command) not in wheres, not_a_command
    assert not any(inv.argv in ((), ("runs",)) for inv in found)

    problems = {p for inv in found for p in check_invocation(inv)}
    flagged = {p.split(": ", 1)[0] for p in problems}
    assert flagged == {
        _at("--no-such-flag"),
        _at("frobnicate"),
        _at("--bogus"),
        _at("trainers show a b"),
        _at("--quorum"),
        _at("accept|declines"),
        _at("runs shw"),
        _at("--datasett"),
    }, sorted(problems)
    text = "\n".join(sorted(problems))
    for needle in (
        "`fedweave runs show` has no option --no-such-flag",
        "`fedweave runs` has no subcommand 'frobnicate'",
        "`fedweave runs start` has no option --bogus",
        "`fedweave trainers show` takes 1 positional argument(s), the doc passes 2",
        "`fedweave federation sign` has no option --quorum",
        "`fedweave runs` has no subcommand 'declines'",
        "`fedweave runs` has no subcommand 'shw'",
        "`fedweave runs accept` has no option --datasett",
    ):
        assert needle in text, text

    assert [m.flag for m in mentions] == ["--reason", "--nope", "--anything"]
    flag_problems = [p for m in mentions for p in check_flag_mention(m, found, cli_root())]
    assert len(flag_problems) == 1, flag_problems
    assert flag_problems[0].startswith(
        f"{_at('`--nope`')}: `--nope`: --nope is no option of the commands this section shows ("
    ), flag_problems

    refs, skipped = routes_in("synthetic.md", SYNTHETIC)
    assert skipped == [f"{_at('`.../start`')}: .../start"]
    assert len(refs) == 6
    route_problems = [p for ref in refs for p in check_route(ref, routes)]
    assert route_problems == [
        f"{_at('.../nope')}: `.../nope`: the admin API has no route .../nope (after /v1/runs)"
        " (no /v1/runs/nope or /v1/runs/{}/nope or /v1/nope)",
        f"{_at('`POST /v1/runs/{id}/metrics`')}: `POST /v1/runs/{{id}}/metrics`: POST "
        "/v1/runs/{id}/metrics is not allowed (the route allows GET)",
        f"{_at('`GET /v1/nope`')}: `GET /v1/nope`: the admin API has no route /v1/nope "
        "(no /v1/nope)",
    ]
