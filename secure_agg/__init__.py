"""Pure cryptographic core of fedweave: codecs, masks, secret sharing, CKKS, DP noise.

Imports numpy, cryptography and tenseal only: no I/O, no torch, no networking.
"""

__all__: list[str] = []
