"""The harness scenario: what ``fedweave harness`` will run, validated before anything starts.

A :class:`Scenario` names the orgs (``org1`` … ``orgN``), the rounds, the task, the
aggregation backend, the strategy, and the faults to inject:

* ``--kill ORG@ROUND[:STAGE]``: ``kill -9`` the org's node during round ``ROUND``
  (1-based) at ``STAGE`` — ``train`` (as soon as the org starts the round) or
  ``reduce`` (once its update is packed, with the other orgs already in the round's
  secure sum: the harness-only debug export holds the org there until it is killed,
  so it never sends any of that round). The org stays down for the rest of the run.
* ``--wipe ORG@ROUND[:hold]``: once the org has finished round ``ROUND``, ``kill -9``
  it, delete its data directory, rebuild it with ``fedweave recover`` from its offline
  backup and a peer's manifest chain, and start it again; it rejoins the run. With
  ``:hold`` every org's operator pauses the run (``POST /v1/runs/{id}/pause``, which
  acts between rounds) while round ``ROUND`` is in its secure sum, so that the round
  ends with everyone and none is in flight when the org is wiped; the others resume
  once the org is back with that round's state and all of them see each other alive,
  so that every later round has it again (without ``:hold`` the others go on, and may
  finish the run before the org is back).
* ``--delay-ms D``: every byte between two nodes' peer ports passes a loopback proxy
  that holds it ``D`` ms.

What the orgs train (one of):

* ``--task NAME``: a bundled demo task on a Dirichlet(alpha) share of its data
  (``breast_cancer``, the default, ``digits``, ``gpt``);
* ``--flower-app PATH[:ATTR]``: a Flower ``.py`` file (its ``ClientApp``) or a Flower
  App directory, installed at every org through its own API (``POST /v1/trainers``)
  and run unchanged, with ``partition-id`` / ``num-partitions`` in its ``node_config``;
* ``--data DIR --target COLUMN``: the bundled ``tabular`` trainer on each org's own
  ``DIR/<org>.csv`` (or ``.parquet``), registered through that org's API and bound when
  it accepts (with ``--flower-app``, the Flower app gets the bound file instead).

:func:`Scenario.validate` (called by the constructor) refuses a scenario that cannot
succeed, with :class:`ScenarioError` carrying one line that says why: fewer than two
orgs, ``R < 1``, an unknown org name, task, backend or strategy, a fault outside the
run, more orgs down than the secure sum's threshold allows, or a fault the chosen
backend or strategy cannot survive (a CKKS round needs every participant,
``coordinator_free.rounds.ckks.CkksAggregator``; a wiped org rejoins by adopting the
federation's model, ``RunEngine.try_catch_up``, which a strategy with server state
cannot do).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

__all__ = [
    "BACKENDS",
    "KILL_STAGES",
    "MAX_ORGS",
    "STRATEGIES",
    "TASKS",
    "Kill",
    "Scenario",
    "ScenarioError",
    "Wipe",
    "default_threshold",
    "org_names",
    "parse_kill",
    "parse_wipe",
]

TASKS: dict[str, str] = {"breast_cancer": "breast_cancer", "digits": "digits", "gpt": "gpt"}
"""CLI task names -> :data:`org_node.tasks.BUILTIN_TASKS` names."""
BACKENDS = ("masked", "ckks")
STRATEGIES = ("fedavg", "fedprox", "fedadam", "diloco")
STATEFUL_STRATEGIES = frozenset({"fedadam", "diloco"})
"""Strategies whose server state (moments, outer momentum) is not in the model, so an
org that missed rounds cannot catch up (``RunEngine.try_catch_up``)."""
KILL_STAGES = ("train", "reduce")
WORKERS = ("persistent", "per-round")
FLOWER_TRAINER = "flower-app"
"""The name under which the harness installs ``--flower-app`` at every org."""
MAX_ORGS = 16
MAX_DELAY_MS = 5000
_FAULT = re.compile(r"^(?P<org>[^@:\s]+)@(?P<round>[^@:\s]+)(?::(?P<stage>[^@:\s]*))?$")


class ScenarioError(ValueError):
    """A scenario that cannot run; the message is the one line to print."""


def org_names(n: int) -> tuple[str, ...]:
    """``("org1", …, "orgN")``."""
    return tuple(f"org{i}" for i in range(1, n + 1))


def default_threshold(n: int) -> int:
    """The secure sum's threshold ``t`` for ``n`` orgs: a strict majority, at least 2."""
    return max(2, n // 2 + 1)


@dataclass(frozen=True)
class Kill:
    """``kill -9`` of ``org`` during round ``round`` (1-based) at ``stage``."""

    org: str
    round: int
    stage: str = "train"

    def __str__(self) -> str:
        return f"{self.org}@{self.round}:{self.stage}"


@dataclass(frozen=True)
class Wipe:
    """After ``org`` finished round ``round``: kill, wipe, ``fedweave recover``, restart.

    ``hold``: every org pauses the run after round ``round``, the others resume it once
    the org is back, so that it takes part in every round after its recovery.
    """

    org: str
    round: int
    hold: bool = False

    def __str__(self) -> str:
        return f"{self.org}@{self.round}" + (":hold" if self.hold else "")


def _round(text: str, what: str) -> int:
    if not text.isdigit():
        raise ScenarioError(f"{what}: the round must be a positive integer, not {text!r}")
    return int(text)


def parse_kill(text: str) -> Kill:
    """``ORG@ROUND[:STAGE]`` (stage ``train`` by default)."""
    m = _FAULT.match(text.strip())
    if m is None:
        raise ScenarioError(f"--kill {text!r}: expected ORG@ROUND[:STAGE], e.g. org2@3:reduce")
    stage = m.group("stage") or "train"
    if stage not in KILL_STAGES:
        raise ScenarioError(
            f"--kill {text}: unknown stage {stage!r}; choose one of {', '.join(KILL_STAGES)}"
        )
    return Kill(m.group("org"), _round(m.group("round"), f"--kill {text}"), stage)


def parse_wipe(text: str) -> Wipe:
    """``ORG@ROUND[:hold]``."""
    m = _FAULT.match(text.strip())
    if m is None or m.group("stage") not in (None, "hold"):
        raise ScenarioError(f"--wipe {text!r}: expected ORG@ROUND[:hold], e.g. org3@2")
    hold = m.group("stage") == "hold"
    return Wipe(m.group("org"), _round(m.group("round"), f"--wipe {text}"), hold)


@dataclass(frozen=True)
class Scenario:
    """A validated harness scenario (see the module docstring).

    orgs: number of orgs, named ``org1`` … ``orgN``.
    rounds: training rounds of the run (``R >= 1``).
    task: ``breast_cancer``, ``digits`` or ``gpt`` (:data:`TASKS`).
    backend: ``masked`` (pairwise masks, Shamir shares) or ``ckks``.
    strategy: ``fedavg``, ``fedprox``, ``fedadam`` or ``diloco``.
    kills / wipes: the faults (:class:`Kill`, :class:`Wipe`).
    delay_ms: added latency on every peer connection, in ms.
    seed: seeds the model, the non-IID partition and the local batches.
    threshold: the secure sum's ``t``; None picks :func:`default_threshold`.
    local_steps / batch_size / dirichlet_alpha: each org's local job per round and its
        label-skew partition of the task's data (Dirichlet(alpha)).
    flower_app / data / target: what the orgs train instead of a demo task (see the
        module docstring).
    worker: ``persistent`` (one local worker per org for the run) or ``per-round``.
    compression: the run spec's ``compression`` (:mod:`org_node.compression`).
    """

    orgs: int
    rounds: int
    task: str | None = None
    backend: str = "masked"
    strategy: str = "fedavg"
    kills: tuple[Kill, ...] = ()
    wipes: tuple[Wipe, ...] = ()
    delay_ms: int = 0
    seed: int = 0
    threshold: int | None = None
    local_steps: int = 3
    batch_size: int = 16
    dirichlet_alpha: float = 0.5
    flower_app: str | None = None
    data: str | None = None
    target: str | None = None
    worker: str = "persistent"
    compression: str = "none"
    names: tuple[str, ...] = field(init=False)

    def __post_init__(self) -> None:
        for name in ("orgs", "rounds", "delay_ms", "seed", "local_steps", "batch_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ScenarioError(f"{name} must be an integer, not {value!r}")
        if self.orgs < 2:
            raise ScenarioError(f"--orgs {self.orgs}: a federation needs at least 2 orgs")
        if self.orgs > MAX_ORGS:
            raise ScenarioError(f"--orgs {self.orgs}: the harness runs at most {MAX_ORGS} orgs")
        object.__setattr__(self, "names", org_names(self.orgs))
        if self.threshold is None:
            object.__setattr__(self, "threshold", default_threshold(self.orgs))
        self.validate()

    @property
    def t(self) -> int:
        """The threshold (never None after construction)."""
        assert self.threshold is not None
        return self.threshold

    @property
    def task_ref(self) -> str:
        """The demo task's name in :data:`org_node.tasks.BUILTIN_TASKS`."""
        return TASKS[self.task or "breast_cancer"]

    @property
    def demo_task(self) -> bool:
        """Whether the orgs train a bundled demo task (not a Flower app or their data)."""
        return self.flower_app is None and self.data is None

    @property
    def trainer(self) -> str:
        """The trainer the run spec names."""
        if self.flower_app is not None:
            return FLOWER_TRAINER
        return "tabular" if self.data is not None else self.task_ref

    def data_file(self, org: str) -> Path:
        """``DIR/<org>.csv`` or ``DIR/<org>.parquet`` of ``--data DIR``."""
        assert self.data is not None
        for suffix in (".csv", ".parquet"):
            path = Path(self.data) / f"{org}{suffix}"
            if path.is_file():
                return path.resolve()
        raise ScenarioError(f"--data {self.data}: no {org}.csv or {org}.parquet there")

    def flower_path(self) -> Path:
        """The Flower app's file or directory (without ``:ATTR``)."""
        assert self.flower_app is not None
        target, sep, _attr = self.flower_app.rpartition(":")
        return Path(target if sep and target.endswith(".py") else self.flower_app)

    @property
    def strategy_options(self) -> dict[str, object]:
        """The strategy's options: DiLoCo's inner loop runs ``local_steps`` steps (its
        default ``H = 500`` is for real training, not for a harness round)."""
        return {"inner_steps": self.local_steps} if self.strategy == "diloco" else {}

    def validate(self) -> None:
        """Refuse an impossible scenario with one line saying why."""
        n, r = self.orgs, self.rounds
        if r < 1:
            raise ScenarioError(f"--rounds {r}: a run needs at least 1 round")
        if self.task is not None and self.task not in TASKS:
            raise ScenarioError(f"--task {self.task}: choose one of {', '.join(TASKS)}")
        self._validate_trainer()
        if self.worker not in WORKERS:
            raise ScenarioError(f"--worker {self.worker}: choose one of {', '.join(WORKERS)}")
        if self.backend not in BACKENDS:
            raise ScenarioError(f"--backend {self.backend}: choose one of {', '.join(BACKENDS)}")
        if self.strategy not in STRATEGIES:
            raise ScenarioError(
                f"--strategy {self.strategy}: choose one of {', '.join(STRATEGIES)}"
            )
        if not 0 <= self.delay_ms <= MAX_DELAY_MS:
            raise ScenarioError(f"--delay-ms {self.delay_ms}: expected 0..{MAX_DELAY_MS}")
        if self.seed < 0:
            raise ScenarioError(f"--seed {self.seed}: expected an integer >= 0")
        if self.local_steps < 1 or self.batch_size < 1:
            raise ScenarioError("local_steps and batch_size must be >= 1")
        if not self.dirichlet_alpha > 0:
            raise ScenarioError(f"dirichlet_alpha {self.dirichlet_alpha}: must be > 0")
        t = self.t
        if isinstance(t, bool) or not isinstance(t, int) or not 2 <= t <= n:
            raise ScenarioError(f"threshold {t}: must be in 2..{n} for {n} orgs")
        known = set(self.names)
        seen: set[str] = set()
        faults: list[Kill | Wipe] = [*self.kills, *self.wipes]
        for fault in faults:
            flag = "--kill" if isinstance(fault, Kill) else "--wipe"
            if fault.org not in known:
                raise ScenarioError(
                    f"{flag} {fault}: unknown org {fault.org!r}; the orgs are org1..org{n}"
                )
            if fault.org in seen:
                raise ScenarioError(f"{flag} {fault}: {fault.org} already has a fault")
            seen.add(fault.org)
        for kill in self.kills:
            if not 1 <= kill.round <= r:
                raise ScenarioError(f"--kill {kill}: round {kill.round} is outside 1..{r}")
        for wipe in self.wipes:
            if not 1 <= wipe.round < r:
                raise ScenarioError(
                    f"--wipe {wipe}: round {wipe.round} is outside 1..{r - 1} "
                    "(the org must have a round left to rejoin)"
                )
        down = len(self.kills) + len(self.wipes)
        if n - down < t:
            raise ScenarioError(
                f"{down} of {n} orgs killed or wiped leaves {n - down}, below the "
                f"threshold t={t} of the secure sum"
            )
        if self.backend == "ckks" and (self.kills or self.wipes):
            raise ScenarioError(
                "--backend ckks: a CKKS round needs every participant (no dropout "
                "recovery), so kills and wipes need --backend masked"
            )
        self._validate_compression()
        if self.wipes and self.strategy in STATEFUL_STRATEGIES:
            raise ScenarioError(
                f"--wipe with --strategy {self.strategy}: a wiped org rejoins by adopting "
                "the federation's model, and this strategy's server state is not in the model"
            )
        if self.wipes and n - 1 - len(self.kills) < 2:
            raise ScenarioError(
                "--wipe: a recovering org needs two other live orgs that agree on the "
                f"model to rejoin; {n} orgs with {len(self.kills)} killed have too few"
            )

    def _validate_compression(self) -> None:
        from org_node.compression import Compression, CompressionError

        try:
            compression = Compression.parse(self.compression)
            compression.check_run(participants=self.orgs, backend=self.backend, epsilon=None)
        except CompressionError as exc:
            raise ScenarioError(f"--compression: {exc}") from None
        object.__setattr__(self, "compression", str(compression))
        if self.wipes and compression.q8:
            raise ScenarioError(
                f"--wipe with --compression {compression}: a wiped org rejoins by adopting "
                "the federation's model, and q8's agreed ranges are not in the model"
            )

    def _validate_trainer(self) -> None:
        if self.task is not None and not self.demo_task:
            raise ScenarioError(
                "--task names a demo task: leave it out with --flower-app or --data"
            )
        if self.flower_app is not None:
            path = self.flower_path()
            if not (path.is_dir() and (path / "pyproject.toml").is_file()) and not (
                path.is_file() and path.suffix == ".py"
            ):
                raise ScenarioError(
                    f"--flower-app {self.flower_app}: not a .py file or a Flower App directory "
                    "(a directory with pyproject.toml)"
                )
        if self.data is not None:
            if not Path(self.data).is_dir():
                raise ScenarioError(f"--data {self.data}: not a directory")
            for org in self.names:
                self.data_file(org)
            if self.flower_app is None and not self.target:
                raise ScenarioError("--data: name the label column with --target")
        elif self.target is not None:
            raise ScenarioError("--target names a column of --data: give --data DIR too")

    def to_dict(self) -> dict[str, object]:
        """The scenario as JSON-ready values (written to ``summary.json``)."""
        return {
            "orgs": list(self.names),
            "rounds": self.rounds,
            "task": self.task or ("breast_cancer" if self.demo_task else None),
            "trainer": self.trainer,
            "flower_app": self.flower_app,
            "data": self.data,
            "target": self.target,
            "worker": self.worker,
            "backend": self.backend,
            "strategy": self.strategy,
            "compression": self.compression,
            "threshold": self.t,
            "kills": [str(k) for k in self.kills],
            "wipes": [str(w) for w in self.wipes],
            "delay_ms": self.delay_ms,
            "seed": self.seed,
            "local_steps": self.local_steps,
            "batch_size": self.batch_size,
            "dirichlet_alpha": self.dirichlet_alpha,
        }
