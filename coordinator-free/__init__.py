"""Serverless federation: identity, manifest, transport, gossip membership, rounds."""

__all__: list[str] = []
