"""The node's config file, ``DATA_DIR/fedweave.toml``: typed, strict, written by ``init``.

One :class:`NodeConfig` holds one dataclass per TOML table::

    [node]        org_id, display_name, federation
    [network]     peer_host, peer_port, admin_host, admin_port, advertise_url, ...
    [training]    the local job (org_node.engine.TrainingConfig)
    [engine]      rounds, strategy, DP (org_node.engine.EngineConfig)
    [checkpoint]  erasure code k, m, retention, shard quota
    [membership]  SWIM timing: period, ping timeout floor and cap, local health, ...
    [datasets]    roots under which datasets may be registered
    [trainers.N]  a trainer the org installs by config (kind, ref, sha256)
    [debug]       harness (test harnesses only)

Unknown tables or keys and invalid values are refused with :class:`ConfigError`, whose
``field`` (and message) names the offending ``table.key``. :meth:`NodeConfig.to_toml`
writes a file that :meth:`NodeConfig.load` reads back to an equal config.
"""

from __future__ import annotations

import ipaddress
import math
import tomllib
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from coordinator_free.membership import SwimConfig
from coordinator_free.validate import check_integer, check_keys

from org_node.run_config import EngineConfig, EngineError, TrainingConfig

__all__ = [
    "CONFIG_FILE",
    "CheckpointSection",
    "ConfigError",
    "DatasetsSection",
    "DebugSection",
    "NetworkSection",
    "NodeConfig",
    "NodePaths",
    "NodeSection",
    "TrainerSection",
    "is_loopback",
    "load_node_network",
]

CONFIG_FILE = "fedweave.toml"
NONE = "none"
"""How an unset optional value (None) is written in the file."""
_ORG_ID_CHARS = set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_.")


class ConfigError(ValueError):
    """An unreadable config file, an unknown key, or an invalid value (``field`` names it)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}" if field else message)
        self.field = field


def _keys(cls: type[Any], values: Any, table: str) -> dict[str, Any]:
    if not isinstance(values, Mapping):
        raise ConfigError(table, "must be a table")
    return check_keys(cls, values, table, ConfigError)


def _port(table: str, name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 65535:
        raise ConfigError(f"{table}.{name}", f"expected a port 1..65535, got {value!r}")


def _host(table: str, name: str, value: Any) -> None:
    if not isinstance(value, str) or not value:
        raise ConfigError(f"{table}.{name}", "expected a host name or address")


def is_loopback(host: str) -> bool:
    """Whether ``host`` is ``localhost`` or a loopback address."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


@dataclass(frozen=True)
class NodeSection:
    """Who this node is.

    org_id: the org's id (letters, digits, ``-``, ``_``, ``.``); the certificate's CN.
    display_name: a human-readable name in the federation manifest.
    federation: the federation id, set when a founding manifest is installed.
    """

    org_id: str
    display_name: str = ""
    federation: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.org_id, str) or not self.org_id:
            raise ConfigError("node.org_id", "must be a non-empty string")
        if self.org_id.startswith("_") or not set(self.org_id) <= _ORG_ID_CHARS:
            raise ConfigError(
                "node.org_id", "letters, digits, '-', '_' and '.' only, not starting with '_'"
            )
        if len(self.org_id) > 100:
            raise ConfigError("node.org_id", "at most 100 characters")
        for name in ("display_name", "federation"):
            if not isinstance(getattr(self, name), str):
                raise ConfigError(f"node.{name}", "must be a string")


@dataclass(frozen=True)
class NetworkSection:
    """Where the node listens.

    peer_host / peer_port: the peer port (mutual TLS, other orgs' nodes).
    advertise_url: the peer URL other orgs reach (``https://host:port``); by default
        ``https://peer_host:peer_port``.
    admin_host / admin_port: the admin API (bearer tokens); loopback unless
        ``allow_remote_admin``.
    """

    peer_host: str = "127.0.0.1"
    peer_port: int = 8471
    admin_host: str = "127.0.0.1"
    admin_port: int = 8470
    advertise_url: str = ""
    allow_remote_admin: bool = False

    def __post_init__(self) -> None:
        _host("network", "peer_host", self.peer_host)
        _host("network", "admin_host", self.admin_host)
        _port("network", "peer_port", self.peer_port)
        _port("network", "admin_port", self.admin_port)
        if self.peer_port == self.admin_port:
            raise ConfigError("network.admin_port", "must differ from network.peer_port")
        if not isinstance(self.allow_remote_admin, bool):
            raise ConfigError("network.allow_remote_admin", "expected true or false")
        if not self.allow_remote_admin and not is_loopback(self.admin_host):
            raise ConfigError(
                "network.admin_host",
                f"{self.admin_host!r} is not loopback; set allow_remote_admin = true to expose it",
            )
        if not isinstance(self.advertise_url, str):
            raise ConfigError("network.advertise_url", "must be a string")
        if self.advertise_url and not self.advertise_url.startswith("https://"):
            raise ConfigError("network.advertise_url", "must start with https://")

    @property
    def peer_url(self) -> str:
        """The peer URL published in this org's member record."""
        if self.advertise_url:
            return self.advertise_url
        host = "127.0.0.1" if self.peer_host in ("0.0.0.0", "::") else self.peer_host
        return f"https://{host}:{self.peer_port}"


@dataclass(frozen=True)
class CheckpointSection:
    """Erasure-coded checkpoints of the private state and of the global-model history.

    k / m: data and parity shards (any ``k`` of ``k + m`` rebuild a checkpoint).
    retention: checkpoint versions kept on peers.
    quota_mb: bytes (in MiB) this node holds for each other org.
    """

    k: int = 2
    m: int = 1
    retention: int = 2
    quota_mb: int = 256

    def __post_init__(self) -> None:
        for name, low in (("k", 1), ("m", 0), ("retention", 1), ("quota_mb", 1)):
            check_integer(f"checkpoint.{name}", getattr(self, name), ConfigError, low=low)


@dataclass(frozen=True)
class DatasetsSection:
    """Where this org's datasets may be registered (``/v1/datasets``).

    roots: absolute directories; a dataset's real path (symlinks followed) must lie
        under one of them. ``fedweave init`` writes ``DATA_DIR/datasets``.
    """

    roots: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if isinstance(self.roots, str) or not isinstance(self.roots, list | tuple):
            raise ConfigError("datasets.roots", "expected a list of absolute directories")
        for root in self.roots:
            if not isinstance(root, str) or not Path(root).is_absolute():
                raise ConfigError("datasets.roots", f"{root!r} is not an absolute path")
        object.__setattr__(self, "roots", tuple(self.roots))


TRAINER_KINDS_BY_CONFIG = ("task", "flower-clientapp", "flower-app")


@dataclass(frozen=True)
class TrainerSection:
    """A trainer this org installs in its config (``[trainers.NAME]``).

    kind: ``task`` (``module:callable`` or ``file.py:callable`` returning a Task),
        ``flower-clientapp`` (``module:app`` or ``file.py:app``) or ``flower-app``
        (a Flower App directory).
    ref: the code (see kind).
    sha256: optional; the code's hash the admin expects (the node refuses to run the
        trainer if its code hashes otherwise).
    description: shown in ``fedweave trainers list``.
    """

    kind: str
    ref: str
    sha256: str = ""
    description: str = ""

    def __post_init__(self) -> None:
        if self.kind not in TRAINER_KINDS_BY_CONFIG:
            raise ConfigError(
                "trainers.kind", f"expected one of {', '.join(TRAINER_KINDS_BY_CONFIG)}"
            )
        if not isinstance(self.ref, str) or not self.ref.strip():
            raise ConfigError("trainers.ref", "expected the trainer's code reference")
        sha = self.sha256
        if sha and (len(sha) != 64 or any(c not in "0123456789abcdef" for c in sha)):
            raise ConfigError("trainers.sha256", "expected 64 lowercase hex digits")


@dataclass(frozen=True)
class DebugSection:
    """Test-harness switches; never for a deployment.

    harness: allows ``FEDWEAVE_HARNESS_DEBUG_EXPORT=DIR`` to write each round's
        plaintext update to DIR (a harness recomputes plain FedAvg from them).
    fast_membership: short SWIM periods for tests on one host.
    """

    harness: bool = False
    fast_membership: bool = False

    def __post_init__(self) -> None:
        for name in ("harness", "fast_membership"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"debug.{name}", "expected true or false")


@dataclass(frozen=True)
class NodeConfig:
    """The whole config file (see the module docstring)."""

    node: NodeSection
    network: NetworkSection = field(default_factory=NetworkSection)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    checkpoint: CheckpointSection = field(default_factory=CheckpointSection)
    membership: SwimConfig = field(default_factory=SwimConfig)
    datasets: DatasetsSection = field(default_factory=DatasetsSection)
    trainers: Mapping[str, TrainerSection] = field(default_factory=dict)
    debug: DebugSection = field(default_factory=DebugSection)

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any]) -> NodeConfig:
        """Build from parsed TOML; every error names ``table.key``."""
        tables = _keys(cls, values, "config")
        if "node" not in tables:
            raise ConfigError("node", "the [node] table is required")
        sections: dict[str, Any] = {}
        simple: dict[str, type[Any]] = {
            "node": NodeSection,
            "network": NetworkSection,
            "checkpoint": CheckpointSection,
            "datasets": DatasetsSection,
            "debug": DebugSection,
        }
        try:
            for name, cls_ in simple.items():
                if name in tables:
                    sections[name] = cls_(**_keys(cls_, tables[name], name))
            if "trainers" in tables:
                sections["trainers"] = _trainers(tables["trainers"])
            if "training" in tables:
                sections["training"] = TrainingConfig.from_mapping(_table(tables, "training"))
            if "engine" in tables:
                sections["engine"] = EngineConfig.from_mapping(_table(tables, "engine"))
            if "membership" in tables:
                sections["membership"] = _membership(tables["membership"])
        except EngineError as exc:
            raise ConfigError(exc.field, str(exc).removeprefix(f"{exc.field}: ")) from None
        except TypeError as exc:
            raise ConfigError("config", str(exc)) from None
        return cls(**sections)

    @classmethod
    def loads(cls, text: str) -> NodeConfig:
        try:
            values = tomllib.loads(text)
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError("", f"not valid TOML: {exc}") from None
        return cls.from_mapping(values)

    @classmethod
    def load(cls, path: Path) -> NodeConfig:
        """Read ``path`` (a ``fedweave.toml``)."""
        try:
            text = Path(path).read_text(encoding="utf-8")
        except OSError as exc:
            raise ConfigError("", f"cannot read the config file {path}: {exc.strerror}") from None
        return cls.loads(text)

    def to_dict(self) -> dict[str, Any]:
        return {
            "node": asdict(self.node),
            "network": asdict(self.network),
            "training": asdict(self.training),
            "engine": asdict(self.engine),
            "checkpoint": asdict(self.checkpoint),
            "membership": asdict(self.membership),
            "datasets": {"roots": list(self.datasets.roots)},
            "debug": asdict(self.debug),
        }

    def to_toml(self) -> str:
        """The config as TOML (``None`` values are left out: they are the defaults)."""
        lines = ["# fedweave node configuration (see docs/OPERATIONS.md, 'Run a node')."]
        defaults = NodeConfig(node=self.node).to_dict()
        for table, values in self.to_dict().items():
            lines.append("")
            lines.append(f"[{table}]")
            nested: list[tuple[str, Mapping[str, Any]]] = []
            for key, value in values.items():
                if value is None:
                    if defaults[table].get(key) is not None:
                        lines.append(f'{key} = "{NONE}"')
                    continue
                if isinstance(value, Mapping):
                    nested.append((key, value))
                    continue
                lines.append(f"{key} = {_toml_value(value)}")
            for key, value in nested:
                lines.append(
                    f"{key} = {{ {', '.join(f'{_toml_key(k)} = {_toml_value(v)}' for k, v in value.items())} }}"
                )
        for name, trainer in sorted(self.trainers.items()):
            lines += ["", f"[trainers.{_toml_key(name)}]"]
            lines += [f"{k} = {_toml_value(v)}" for k, v in asdict(trainer).items() if v != ""]
        return "\n".join(lines) + "\n"

    def save(self, path: Path) -> None:
        from coordinator_free.sealed import atomic_write

        atomic_write(Path(path), self.to_toml().encode("utf-8"), mode=0o600)

    def replace(self, **sections: Any) -> NodeConfig:
        """A copy with some sections replaced."""
        values = {f.name: getattr(self, f.name) for f in fields(self)} | sections
        return NodeConfig(**values)


def load_node_network(path: Path) -> tuple[NodeSection, NetworkSection]:
    """The ``[node]`` and ``[network]`` tables of the config file at ``path``, checked as
    :meth:`NodeConfig.load` checks them, the other tables left unread.

    What the client commands need (the org id, the admin address): checking
    ``[training]`` and ``[engine]`` would import the training stack (torch, numpy).
    """
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError("", f"cannot read the config file {path}: {exc.strerror}") from None
    try:
        tables = _keys(NodeConfig, tomllib.loads(text), "config")
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError("", f"not valid TOML: {exc}") from None
    if "node" not in tables:
        raise ConfigError("node", "the [node] table is required")
    try:
        node = NodeSection(**_keys(NodeSection, tables["node"], "node"))
        network = NetworkSection(**_keys(NetworkSection, tables.get("network", {}), "network"))
    except TypeError as exc:
        raise ConfigError("config", str(exc)) from None
    return node, network


def _table(tables: Mapping[str, Any], name: str) -> dict[str, Any]:
    """A table's values; the string ``"none"`` stands for an unset optional value
    (TOML has no null), e.g. ``local_steps = "none"`` to train on a time budget alone."""
    value = tables[name]
    if not isinstance(value, Mapping):
        raise ConfigError(name, "must be a table")
    return {k: None if v == NONE else v for k, v in value.items()}


def _membership(values: Any) -> SwimConfig:
    """The ``[membership]`` table: :class:`SwimConfig`, its errors named ``membership.KEY``."""
    values = _keys(SwimConfig, values, "membership")
    try:
        return SwimConfig(**values)
    except (TypeError, ValueError) as exc:
        message = str(exc).replace("SwimConfig.", "membership.")
        key = next((k for k in sorted(values) if message.startswith(f"membership.{k}")), "")
        field = f"membership.{key}" if key else "membership"
        raise ConfigError(field, message.removeprefix(f"{field}: ")) from None


def _trainers(values: Any) -> dict[str, TrainerSection]:
    if not isinstance(values, Mapping):
        raise ConfigError("trainers", "must be a table of [trainers.NAME] tables")
    out: dict[str, TrainerSection] = {}
    for name, table in values.items():
        if not isinstance(name, str) or not name or not set(name) <= _ORG_ID_CHARS:
            raise ConfigError(f"trainers.{name}", "a trainer name: letters, digits, '-', '_', '.'")
        try:
            out[name] = TrainerSection(**_keys(TrainerSection, table, f"trainers.{name}"))
        except ConfigError as exc:
            raise ConfigError(
                exc.field.replace("trainers.", f"trainers.{name}.", 1),
                str(exc).split(": ", 1)[-1],
            ) from None
    return out


def _toml_key(name: str) -> str:
    return name if all(c.isalnum() or c in "-_" for c in name) else _toml_value(name)


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ConfigError("config", f"cannot write the non-finite number {value!r}")
        return repr(value)
    if isinstance(value, str):
        escaped = value.replace("\\", "\\\\").replace('"', '\\"')
        return f'"{escaped}"'
    if isinstance(value, list | tuple):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    raise ConfigError("config", f"cannot write a value of type {type(value).__name__}")


@dataclass(frozen=True)
class NodePaths:
    """Where a node keeps its files under its data directory."""

    root: Path

    @property
    def config(self) -> Path:
        return self.root / CONFIG_FILE

    @property
    def identity_dir(self) -> Path:
        """``identity.key`` (0600), ``identity.crt``, ``recovery.secret`` (0600)."""
        return self.root / "identity"

    @property
    def secret(self) -> Path:
        return self.identity_dir / "recovery.secret"

    @property
    def member(self) -> Path:
        """This org's member record, to share with the founding orgs."""
        return self.root / "member.json"

    @property
    def chain(self) -> Path:
        """The verified federation manifest chain."""
        return self.root / "federation" / "chain.json"

    @property
    def trust_bundle(self) -> Path:
        return self.root / "federation" / "trust.pem"

    @property
    def egress_log(self) -> Path:
        return self.root / "audit" / "egress.jsonl"

    @property
    def shards(self) -> Path:
        """Shards this node holds for other orgs."""
        return self.root / "shards"

    @property
    def runs(self) -> Path:
        return self.root / "runs"

    @property
    def datasets(self) -> Path:
        """The default dataset root ``fedweave init`` creates."""
        return self.root / "datasets"

    def run_dir(self, run_key: str) -> Path:
        """A run's engine state and local-job work directory."""
        return self.runs / run_key
