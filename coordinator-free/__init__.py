"""Serverless federation: identity, manifest, transport, gossip membership, rounds.

Imported as ``coordinator_free`` (the directory is ``coordinator-free/``).

What it owns: an org's identity and the federation manifest (``identity``,
``manifest``, ``address``); the wire format, the receive-side guard and the signed
request/reply endpoint (``wire``, ``transport``, ``endpoint``, ``errors``); the
transports, mutual-TLS HTTPS with the server of its peer port (``tls``) and in memory
(``memory``); SWIM membership, signed gossip and the periodic loop both run
(``membership``, ``gossip``, ``periodic``); ring reductions, the leaderless round
engine and its simulator (``ring``, ``rounds``, ``sim``); erasure-coded, sealed shards
and recovery (``erasure``, ``sealed``, ``placement``, ``shards``); the checks shared by
the config dataclasses of this layer and the ones above (``validate``).

What it may import: ``secure_agg``, the standard library (asyncio, sockets and TLS
included), and cryptography, numpy, zfec, httpx/httpcore, starlette and uvicorn (the
last only when a server starts); never ``org_node`` or ``api``, nor torch
(``pyproject.toml``'s import-linter contracts and ``tests/layering.py`` check it).
"""

__all__: list[str] = []
