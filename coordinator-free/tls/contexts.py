"""The SSL side of mutual TLS between members: contexts, the trust bundle, uvicorn's options.

A client context presents the org's certificate and checks the server by its pinned
fingerprint (:mod:`.pinning`), not by a CA; a server context and uvicorn's options
require a client certificate among the members' (the trust bundle). ``ssl`` reads keys
from files only: the identity's key is loaded from a private temporary directory,
encrypted under a one-time passphrase.
"""

from __future__ import annotations

import os
import ssl
import tempfile
from pathlib import Path
from typing import Any

from coordinator_free.identity import (
    CERT_FILE,
    KEY_FILE,
    OrgIdentity,
    key_is_encrypted,
    key_password,
)

__all__ = [
    "client_ssl_context",
    "server_ssl_context",
    "uvicorn_ssl_options",
    "write_trust_bundle",
]


def _load_identity_chain(context: ssl.SSLContext, identity: OrgIdentity) -> None:
    """Load the identity's certificate and key into ``context``.

    ``ssl`` reads keys only from files: the key is written encrypted under a one-time
    random passphrase (which never touches the disk) into a private temporary
    directory, loaded, and deleted.
    """
    one_time = os.urandom(32).hex().encode()
    with tempfile.TemporaryDirectory(prefix="fedweave-tls-") as tmp:
        key_path, cert_path = Path(tmp) / KEY_FILE, Path(tmp) / CERT_FILE
        for path, data in (
            (key_path, identity.private_key_pem(one_time)),
            (cert_path, identity.certificate_pem),
        ):
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                os.write(fd, data)
            finally:
                os.close(fd)
        context.load_cert_chain(cert_path, key_path, password=one_time)


def client_ssl_context(identity: OrgIdentity) -> ssl.SSLContext:
    """Client context: presents the identity; the server is checked by pin, not by CA."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    _load_identity_chain(context, identity)
    return context


def server_ssl_context(identity: OrgIdentity, trusted_certificates: list[bytes]) -> ssl.SSLContext:
    """Server context requiring a client certificate among ``trusted_certificates``."""
    if not trusted_certificates:
        raise ValueError("a server needs at least one trusted certificate")
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.verify_mode = ssl.CERT_REQUIRED
    context.load_verify_locations(cadata=b"".join(trusted_certificates).decode("ascii"))
    _load_identity_chain(context, identity)
    return context


def write_trust_bundle(path: Path, certificates: list[bytes]) -> None:
    """Write the members' PEM certificates as one bundle (uvicorn's ``ssl_ca_certs``)."""
    if not certificates:
        raise ValueError("a trust bundle needs at least one certificate")
    bundle = b"".join(pem if pem.endswith(b"\n") else pem + b"\n" for pem in certificates)
    tmp = Path(path).with_suffix(".tmp")
    tmp.write_bytes(bundle)
    tmp.replace(path)


def uvicorn_ssl_options(
    identity_dir: Path, trust_bundle: Path, passphrase: bytes | None = None
) -> dict[str, Any]:
    """Keyword arguments for ``uvicorn.Config`` serving the peer port with mutual TLS.

    An encrypted key file is opened with the password derived from ``passphrase``
    (:func:`coordinator_free.identity.key_password`)."""
    identity_dir = Path(identity_dir)
    password = None
    if passphrase and key_is_encrypted((identity_dir / KEY_FILE).read_bytes()):
        password = key_password(passphrase, (identity_dir / CERT_FILE).read_bytes()).decode()
    return {
        "ssl_keyfile": str(identity_dir / KEY_FILE),
        "ssl_certfile": str(identity_dir / CERT_FILE),
        "ssl_keyfile_password": password,
        "ssl_ca_certs": str(trust_bundle),
        "ssl_cert_reqs": ssl.CERT_REQUIRED,
    }
