"""Serverless federation: identity, manifest, transport, gossip membership, rounds.

Imported as ``coordinator_free`` (the directory is ``coordinator-free/``).

What it owns: an org's identity and the federation manifest (``identity``,
``manifest``, ``address``); the wire format, the receive-side guard and the signed
request/reply endpoint (``wire``, ``transport``, ``endpoint``, ``errors``); the
transports, mutual-TLS HTTPS with the server of its peer port (the ``tls`` package) and
in memory (``memory``); SWIM membership (the ``membership`` package), signed gossip and
the periodic loop both run (``gossip``, ``periodic``); ring reductions (the ``ring``
package), the leaderless round engine (the ``rounds`` package) and its simulator
(``sim``); erasure-coded, sealed shards and their checkpoints across peers (the
``erasure`` and ``checkpoints`` packages, ``sealed``, ``placement``); files written
all-or-nothing and kept private (``files``); the checks shared by the config
dataclasses of this layer and the ones above (``validate``). Each package's docstring
lists its modules and the order in which they may import each other.

What it may import: ``secure_agg``, the standard library (asyncio, sockets and TLS
included), and cryptography, numpy, zfec, httpx/httpcore, starlette and uvicorn (the
last only when a server starts); never ``org_node`` or ``api``, nor torch
(``pyproject.toml``'s import-linter contracts and ``tests/layering.py`` check it).
"""

__all__: list[str] = []
