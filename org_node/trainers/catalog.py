"""The trainers an org's node may run: bundled, declared in its config, or installed
through the admin API — each with the content hash of its code, fixed at installation.

:class:`TrainerCatalog` answers which trainers exist (:meth:`~TrainerCatalog.all`),
resolves the one a run spec names (:meth:`~TrainerCatalog.resolve`: a missing name,
or a hash different from the spec's pin, is a :class:`TrainerRefused` saying so), and
installs or removes the API's (the ``trainer`` table). Nothing here imports a
trainer's code in the node's process: hashes are computed by reading files, and
:func:`probe_trainer` imports a trainer being installed in a child process.

The bundled trainers (``tabular``, ``breast_cancer``, ``digits``, ``gpt``) are always
installed. A ``[trainers.NAME]`` table of the node config declares one (``kind``,
``ref``, optionally ``sha256``: the node then refuses to run it if its code hashes
otherwise); its hash is taken when the node first needs it.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Protocol

from sqlmodel import Session, col, select

from org_node.db.models import Run, Trainer, TrainerCreate
from org_node.runs import TERMINAL_STATES
from org_node.trainers.base import TRAINER_KINDS, TrainerRef
from org_node.trainers.code import CodeError, code_hash
from org_node.training.launch import child_env

__all__ = [
    "BUNDLED_TRAINERS",
    "InstalledTrainer",
    "TrainerCatalog",
    "TrainerDeclaration",
    "TrainerRefused",
    "probe_trainer",
]

BUNDLED_TRAINERS = ("tabular", "breast_cancer", "digits", "gpt")
PROBE_TIMEOUT_S = 120.0


class TrainerRefused(Exception):
    """A trainer that is missing, differs from a pin, or cannot be installed (one line)."""


class TrainerDeclaration(Protocol):
    """A ``[trainers.NAME]`` table of the node config."""

    @property
    def kind(self) -> str: ...

    @property
    def ref(self) -> str: ...

    @property
    def sha256(self) -> str: ...

    @property
    def description(self) -> str: ...


@dataclass(frozen=True)
class InstalledTrainer:
    """One trainer this org has, where it came from, and why it cannot run (if so)."""

    name: str
    kind: str
    ref: str
    sha256: str
    source: str
    description: str = ""
    installed_by: str | None = None
    created_at: datetime | None = None
    problem: str | None = None

    @property
    def reference(self) -> TrainerRef:
        return TrainerRef(self.name, self.kind, self.ref, self.sha256)

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "kind": self.kind,
            "ref": self.ref,
            "sha256": self.sha256,
            "source": self.source,
            "description": self.description,
            "installed_by": self.installed_by,
            "created_at": self.created_at,
            "problem": self.problem,
        }


def probe_trainer(kind: str, ref: str, timeout: float = PROBE_TIMEOUT_S) -> str:
    """Import the trainer in a child process and check its kind; what was found.

    TrainerRefused with the child's one-line reason when it cannot be imported or is not
    what ``kind`` says, or when the import runs past ``timeout``.
    """
    cmd = [sys.executable, "-m", "org_node.trainers.worker", "--probe", kind, ref]
    try:
        done = subprocess.run(
            cmd,
            capture_output=True,
            timeout=timeout,
            env=child_env(None, 1),
            stdin=subprocess.DEVNULL,
            check=False,
        )
    except subprocess.TimeoutExpired:
        raise TrainerRefused(f"importing {ref} took more than {timeout:g} s") from None
    lines = [ln for ln in done.stdout.decode(errors="replace").splitlines() if ln.strip()]
    try:
        answer = json.loads(lines[-1]) if lines else {}
    except ValueError:
        answer = {}
    if done.returncode == 0 and answer.get("ok"):
        return str(answer.get("detail", ""))
    reason = (
        answer.get("error")
        or (done.stderr.decode(errors="replace").strip().splitlines() or ["?"])[-1]
    )
    raise TrainerRefused(f"cannot use {ref} as a {kind} trainer: {reason}")


class TrainerCatalog:
    """The org's trainers (see the module docstring); safe to share between threads."""

    def __init__(self, declared: Mapping[str, TrainerDeclaration] | None = None) -> None:
        self._declared = dict(declared or {})
        self._cache: dict[str, InstalledTrainer] = {}
        self._lock = threading.Lock()

    # -- the fixed ones: bundled and config ---------------------------------------------

    def _fixed(self) -> list[InstalledTrainer]:
        with self._lock:
            if not self._cache:
                for name in BUNDLED_TRAINERS:
                    digest = code_hash("bundled", name)
                    self._cache[name] = InstalledTrainer(name, "bundled", name, digest, "bundled")
                for name, d in sorted(self._declared.items()):
                    self._cache[name] = _declared(name, d)
            return list(self._cache.values())

    # -- reading ---------------------------------------------------------------------

    def all(self, session: Session) -> list[InstalledTrainer]:
        """Every trainer, bundled first, then by name."""
        fixed = self._fixed()
        rows = session.exec(select(Trainer).order_by(col(Trainer.name))).all()
        return fixed + [_from_row(r) for r in rows]

    def get(self, session: Session, name: str) -> InstalledTrainer | None:
        for trainer in self._fixed():
            if trainer.name == name:
                return trainer
        row = session.exec(select(Trainer).where(Trainer.name == name)).first()
        return None if row is None else _from_row(row)

    def resolve(self, session: Session, name: str, pinned: str | None = None) -> InstalledTrainer:
        """The trainer a run names; TrainerRefused saying which is missing or differs."""
        trainer = self.get(session, name)
        if trainer is None:
            names = ", ".join(t.name for t in self.all(session))
            raise TrainerRefused(f"this org has no trainer named {name!r} (it has: {names})")
        if trainer.problem:
            raise TrainerRefused(f"trainer {name!r} cannot run here: {trainer.problem}")
        if pinned is not None and pinned != trainer.sha256:
            raise TrainerRefused(
                f"trainer {name!r} here hashes to {trainer.sha256[:12]}…, the run pins "
                f"{pinned[:12]}…: install the same code, or propose the run without the pin"
            )
        return trainer

    def check_unchanged(self, trainer: InstalledTrainer, bound: str | None) -> None:
        """Refuse a trainer whose code on disk no longer hashes to ``bound``."""
        try:
            now = code_hash(trainer.kind, trainer.ref)
        except CodeError as exc:
            raise TrainerRefused(f"trainer {trainer.name!r}: {exc}") from None
        if bound is not None and now != bound:
            raise TrainerRefused(
                f"trainer {trainer.name!r}'s code changed since this org accepted the run "
                f"(hash {bound[:12]}…, now {now[:12]}…)"
            )

    # -- installing --------------------------------------------------------------------

    def install(
        self, session: Session, body: TrainerCreate, installed_by: str, *, probe: bool = True
    ) -> InstalledTrainer:
        """Hash, probe and record a trainer (not committed); TrainerRefused with the reason."""
        if self.get(session, body.name) is not None:
            raise TrainerRefused(f"a trainer named {body.name!r} is installed already")
        try:
            digest = code_hash(body.kind, body.ref)
        except CodeError as exc:
            raise TrainerRefused(str(exc)) from None
        if body.sha256 is not None and body.sha256 != digest:
            raise TrainerRefused(
                f"the code at {body.ref} hashes to {digest}, not the {body.sha256} given"
            )
        if probe:
            probe_trainer(body.kind, body.ref)
        row = Trainer(
            name=body.name,
            kind=body.kind,
            ref=body.ref,
            description=body.description,
            sha256=digest,
            installed_by=installed_by,
        )
        session.add(row)
        session.flush()
        return _from_row(row)

    def remove(self, session: Session, name: str) -> None:
        """Forget an API-installed trainer no unfinished run uses (not committed)."""
        fixed = {t.name: t for t in self._fixed()}
        if name in fixed:
            where = "bundled with fedweave" if fixed[name].source == "bundled" else "in the config"
            raise TrainerRefused(f"trainer {name!r} is {where}; it cannot be removed here")
        row = session.exec(select(Trainer).where(Trainer.name == name)).first()
        if row is None:
            raise LookupError(name)
        terminal = [s.value for s in TERMINAL_STATES]
        for run in session.exec(select(Run).where(col(Run.state).not_in(terminal))).all():
            if run.spec.get("trainer") == name:
                raise TrainerRefused(f"run {run.name!r} ({run.state}) uses trainer {name!r}")
        session.delete(row)


def _from_row(row: Trainer) -> InstalledTrainer:
    return InstalledTrainer(
        row.name,
        row.kind,
        row.ref,
        row.sha256,
        "api",
        row.description,
        row.installed_by,
        row.created_at,
    )


def _declared(name: str, d: TrainerDeclaration) -> InstalledTrainer:
    """A config trainer, hashed now; its problem recorded instead of raised."""
    if d.kind not in TRAINER_KINDS or d.kind == "bundled":
        return InstalledTrainer(
            name, d.kind, d.ref, "", "config", d.description, problem="bad kind"
        )
    try:
        digest = code_hash(d.kind, d.ref)
    except CodeError as exc:
        return InstalledTrainer(name, d.kind, d.ref, "", "config", d.description, problem=str(exc))
    problem = None
    if d.sha256 and d.sha256 != digest:
        problem = f"its code hashes to {digest[:12]}…, the config pins {d.sha256[:12]}…"
    return InstalledTrainer(name, d.kind, d.ref, digest, "config", d.description, problem=problem)
