"""What ``fedweave init``, ``fedweave federation ...`` and ``fedweave recover`` do on disk.

``init`` makes a node's data directory (:class:`~org_node.config.NodePaths`): the
Ed25519 identity and its self-signed certificate (mode 0600 in a 0700 directory), the
recovery secret (the key, the secret and the backup encrypted under a passphrase when
one is given: :mod:`org_node.passphrase`), the config file, the database with its first admin token (returned
once, stored hashed), this org's **member record** (``member.json``: org id, endpoint,
fingerprint, key, certificate) to share with the other founding orgs, and the
**recovery backup file** (identity, recovery secret) that the admin must move offline.

Founding a federation (``coordinator-free/manifest.py``): :func:`found_manifest` makes
an unsigned version 0 from the founders' member records; each founder signs it with
:func:`sign_manifest` (the file travels from founder to founder, or each signs a copy and
:func:`merge_signatures` joins them); :func:`install_manifest` verifies that *every*
founder signed, installs it, and rewrites the backup with the federation and the peers.

``recover`` (:func:`prepare_recovery`) rebuilds a wiped node's data directory from the
backup file and the manifest chain; the state itself comes from the peers' shards
(:func:`org_node.node.recover_state`).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from coordinator_free.errors import CoordinatorFreeError, ManifestError
from coordinator_free.identity import KEY_FILE, OrgIdentity, key_is_encrypted
from coordinator_free.manifest import Manifest, Member
from coordinator_free.sealed import RecoveryBackup, RecoverySecret, atomic_write
from coordinator_free.tls import write_trust_bundle

from org_node.config import (
    ConfigError,
    DatasetsSection,
    NetworkSection,
    NodeConfig,
    NodePaths,
    NodeSection,
)
from org_node.db.engine import default_database_url, make_engine
from org_node.db.repo import init_database
from org_node.node.files import NodeError, load_secret, read_chain, save_secret, write_chain
from org_node.passphrase import with_hint

__all__ = [
    "InitError",
    "InitResult",
    "found_manifest",
    "initialize",
    "install_manifest",
    "merge_signatures",
    "prepare_recovery",
    "sign_manifest",
]

RandBytes = Callable[[int], bytes]


class InitError(Exception):
    """The data directory, a member record or a manifest cannot be used (says why)."""


@dataclass(frozen=True)
class InitResult:
    """What ``init`` made: the paths to tell the admin about, and the token (shown once)."""

    paths: NodePaths
    admin_token: str
    member_file: Path
    backup_file: Path
    fingerprint: str
    dataset_roots: tuple[str, ...] = ()
    """The config's ``[datasets] roots``."""


def _empty_or_absent(data_dir: Path) -> None:
    if data_dir.exists() and any(data_dir.iterdir()):
        raise InitError(f"{data_dir} is not empty; refusing to overwrite a node")


def dataset_root(path: Path) -> Path:
    """``path`` made absolute, if it is a directory or one ``init`` can create (checked
    without creating anything); InitError naming the path otherwise."""
    root = Path(os.path.abspath(Path(path).expanduser()))
    if root.exists():
        if not root.is_dir():
            raise InitError(f"dataset root {root} is not a directory")
        return root
    parent = root.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        raise InitError(f"dataset root {root} cannot be created: {parent} is not a directory")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise InitError(f"dataset root {root} cannot be created: {parent} is not writable")
    return root


def initialize(
    data_dir: Path,
    org_id: str,
    *,
    peer_port: int,
    admin_port: int,
    display_name: str = "",
    peer_host: str = "127.0.0.1",
    advertise_url: str = "",
    backup_file: Path | None = None,
    harness: bool = False,
    dataset_roots: Sequence[Path] | None = None,
    passphrase: bytes | None = None,
    randbytes: RandBytes = os.urandom,
) -> InitResult:
    """Create a node's data directory (see the module docstring).

    ``dataset_roots``: the directories datasets may be registered under (made absolute,
    created if missing); by default ``DATA_DIR/datasets``.
    ``passphrase``: encrypts the identity key, the recovery secret and the backup
    (:mod:`org_node.passphrase`); without one they are written in clear.
    """
    data_dir = Path(data_dir)
    _empty_or_absent(data_dir)
    roots = [dataset_root(r) for r in dataset_roots] if dataset_roots else None
    try:
        config = NodeConfig(
            node=NodeSection(org_id, display_name or org_id),
            network=NetworkSection(
                peer_host=peer_host,
                peer_port=peer_port,
                admin_port=admin_port,
                advertise_url=advertise_url,
            ),
            datasets=DatasetsSection(
                tuple(dict.fromkeys(str(r) for r in roots))
                if roots
                else (str(NodePaths(data_dir.resolve()).datasets),)
            ),
        )
        if harness:
            from org_node.config import DebugSection

            config = config.replace(debug=DebugSection(harness=True, fast_membership=True))
    except ConfigError as exc:
        raise InitError(str(exc)) from None
    paths = NodePaths(data_dir)
    data_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    for root in roots or [paths.datasets]:
        root.mkdir(mode=0o700, parents=True, exist_ok=True)
    identity = OrgIdentity.generate(org_id, randbytes(32))
    identity.save(paths.identity_dir, passphrase)
    secret = RecoverySecret.generate(randbytes)
    save_secret(paths.secret, secret, passphrase)
    config.save(paths.config)
    member = Member.from_identity(identity, config.node.display_name, config.network.peer_url)
    atomic_write(paths.member, json.dumps(member.to_obj(), indent=2).encode() + b"\n", mode=0o644)
    token = init_database(make_engine(default_database_url(data_dir)), randbytes=randbytes)
    if token is None:  # pragma: no cover - a fresh database has no token
        raise InitError("the database already holds tokens")
    backup = backup_file or data_dir / f"{org_id}-recovery-backup.json"
    RecoveryBackup.create(identity, "", secret, passphrase=passphrase).save(backup, passphrase)
    return InitResult(
        paths, token, paths.member, backup, identity.fingerprint, config.datasets.roots
    )


def read_member(path: Path) -> Member:
    try:
        return Member.from_obj(json.loads(Path(path).read_bytes()))
    except OSError as exc:
        raise InitError(f"cannot read the member record {path}: {exc.strerror}") from None
    except (ValueError, ManifestError) as exc:
        raise InitError(f"{path} is not a valid member record: {exc}") from None


def read_manifest(path: Path) -> Manifest:
    try:
        return Manifest.from_json(Path(path).read_bytes())
    except OSError as exc:
        raise InitError(f"cannot read the manifest {path}: {exc.strerror}") from None
    except (ValueError, ManifestError) as exc:
        raise InitError(f"{path} is not a manifest version: {exc}") from None


def _write_manifest(path: Path, manifest: Manifest) -> None:
    atomic_write(Path(path), manifest.to_json() + b"\n", mode=0o644)


def found_manifest(
    federation: str,
    member_files: Sequence[Path],
    out: Path,
    *,
    quorum: str = "majority",
    created_at: int | None = None,
) -> Manifest:
    """Write the unsigned founding version made from the founders' member records."""
    members = [read_member(p) for p in member_files]
    if len(members) < 2:
        raise InitError("a federation needs at least two founding members")
    ids = [m.org_id for m in members]
    if len(set(ids)) != len(ids):
        raise InitError(f"duplicate member records: {sorted(ids)}")
    try:
        manifest = Manifest.found(
            federation,
            members,
            created_at=int(time.time()) if created_at is None else created_at,
            quorum=quorum,
        )
    except ManifestError as exc:
        raise InitError(str(exc)) from None
    _write_manifest(out, manifest)
    return manifest


def _identity(paths: NodePaths, passphrase: bytes | None) -> tuple[OrgIdentity, bytes | None]:
    """The node's identity, and the passphrase its files are encrypted under (None when
    its key is in clear, whatever was given)."""
    try:
        identity = OrgIdentity.load(paths.identity_dir, passphrase)
        encrypted = key_is_encrypted((paths.identity_dir / KEY_FILE).read_bytes())
    except CoordinatorFreeError as exc:
        raise InitError(with_hint(str(exc))) from None
    return identity, passphrase if encrypted else None


def sign_manifest(
    data_dir: Path,
    manifest_file: Path,
    out: Path | None = None,
    *,
    passphrase: bytes | None = None,
) -> Manifest:
    """Add this org's signature to a founding version (in place unless ``out``)."""
    paths = NodePaths(Path(data_dir))
    identity, _ = _identity(paths, passphrase)
    manifest = read_manifest(manifest_file)
    if identity.org_id not in manifest.member_ids:
        raise InitError(f"{identity.org_id} is not a member of this manifest")
    own = next(m for m in manifest.members if m.org_id == identity.org_id)
    if own.fingerprint != identity.fingerprint:
        raise InitError("the manifest lists another certificate for this org")
    signed = manifest.sign(identity)
    _write_manifest(out or manifest_file, signed)
    return signed


def merge_signatures(files: Sequence[Path], out: Path) -> Manifest:
    """Join the signatures of several signed copies of one version."""
    copies = [read_manifest(p) for p in files]
    if not copies:
        raise InitError("no manifest copies given")
    if len({c.digest for c in copies}) != 1:
        raise InitError("the copies are of different manifest versions")
    merged = copies[0]
    for c in copies[1:]:
        merged = merged.with_signatures(dict(c.signatures))
    _write_manifest(out, merged)
    return merged


def install_manifest(
    data_dir: Path,
    manifest_file: Path,
    *,
    backup_file: Path | None = None,
    passphrase: bytes | None = None,
) -> Manifest:
    """Verify the founding version (every founder signed it) and install it here.

    Also writes the peer port's trust bundle and refreshes the recovery backup with the
    federation id and the peers' addresses (move the new backup offline again),
    encrypted as the node's own files are.
    """
    paths = NodePaths(Path(data_dir))
    identity, passphrase = _identity(paths, passphrase)
    try:
        secret = load_secret(paths.secret, passphrase)
    except NodeError as exc:
        raise InitError(str(exc)) from None
    manifest = read_manifest(manifest_file)
    try:
        manifest.verify_genesis()
    except ManifestError as exc:
        raise InitError(f"the manifest is not ready to install: {exc}") from None
    if identity.org_id not in manifest.member_ids:
        raise InitError(f"{identity.org_id} is not a member of this federation")
    if paths.chain.exists():
        raise InitError("a federation is already installed in this data directory")
    config = NodeConfig.load(paths.config)
    config = config.replace(
        node=NodeSection(config.node.org_id, config.node.display_name, manifest.federation)
    )
    paths.chain.parent.mkdir(parents=True, exist_ok=True)
    write_chain(paths.chain, [manifest])
    write_trust_bundle(paths.trust_bundle, manifest.certificates())
    config.save(paths.config)
    peers = {o: a for o, a in manifest.peer_addresses().items() if o != identity.org_id}
    backup = backup_file or paths.root / f"{identity.org_id}-recovery-backup.json"
    RecoveryBackup.create(
        identity,
        manifest.federation,
        secret,
        peers=peers,
        manifest_digest=manifest.digest,
        passphrase=passphrase,
    ).save(backup, passphrase)
    return manifest


def prepare_recovery(
    data_dir: Path,
    backup_file: Path,
    chain_file: Path,
    *,
    passphrase: bytes | None = None,
    admin_port: int | None = None,
    randbytes: RandBytes = os.urandom,
) -> tuple[NodePaths, str]:
    """Rebuild a wiped node's data directory from its backup and the manifest chain.

    Returns the paths and a new admin token (the old database is gone). The node's
    private state is then fetched from the peers (:func:`org_node.node.recover_state`).
    A passphrase-protected backup needs ``passphrase``, and the rebuilt node's identity
    key and recovery secret are encrypted under it again.
    """
    data_dir = Path(data_dir)
    _empty_or_absent(data_dir)
    try:
        backup = RecoveryBackup.load(Path(backup_file), passphrase)
        identity = backup.identity(passphrase)
    except CoordinatorFreeError as exc:
        raise InitError(with_hint(str(exc))) from None
    passphrase = passphrase if backup.encrypted else None
    chain = read_chain(Path(chain_file))
    current = chain[-1]
    if identity.org_id not in current.member_ids:
        raise InitError(f"{identity.org_id} is not a member of the federation in {chain_file}")
    if backup.federation and backup.federation != current.federation:
        raise InitError(
            f"the backup is of federation {backup.federation!r}, the chain of {current.federation!r}"
        )
    member = current.member(identity.org_id)
    if member.fingerprint != identity.fingerprint:
        raise InitError("the federation lists another certificate for this org")
    import httpx

    url = httpx.URL(member.endpoint)
    paths = NodePaths(data_dir)
    data_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    identity.save(paths.identity_dir, passphrase)
    save_secret(paths.secret, backup.secret, passphrase)
    port = url.port or 443
    config = NodeConfig(
        node=NodeSection(identity.org_id, member.display_name, current.federation),
        network=NetworkSection(
            peer_port=port,
            admin_port=admin_port or (port + 1 if port < 65535 else port - 1),
            advertise_url=member.endpoint,
        ),
        datasets=DatasetsSection((str(paths.datasets.resolve()),)),
    )
    paths.datasets.mkdir(mode=0o700, exist_ok=True)
    config.save(paths.config)
    atomic_write(paths.member, json.dumps(member.to_obj(), indent=2).encode() + b"\n", mode=0o644)
    paths.chain.parent.mkdir(parents=True, exist_ok=True)
    write_chain(paths.chain, chain)
    write_trust_bundle(paths.trust_bundle, current.certificates())
    from org_node.audit import EgressLog

    # the log begins anew, saying so: the peers' heads of the lost one are not a rewrite
    EgressLog(identity, paths.egress_log, recovered=True).close()
    token = init_database(make_engine(default_database_url(data_dir)), randbytes=randbytes)
    return paths, token or ""
