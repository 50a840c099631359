"""Pure cryptographic core of fedweave: codecs, masks, secret sharing, CKKS, DP noise.

Imports numpy, cryptography and tenseal only: no I/O, no torch, no networking.

The masked-sum path::

    codec = FixedPointCodec(bits=32, clip=1.0, max_summands=n)
    peer = SecAggPeer(ProtocolConfig(ctx, participants, threshold, len(x)), me, sign, verify)
    ... advertise_keys / share_keys / masked_input(codec.encode(x, rng)) / unmask / finalize

The masked-sum protocol is the package :mod:`secure_agg.protocol` (its docstring lists
its modules). The CKKS path lives in :mod:`secure_agg.ckks` (imported on demand: it
loads TenSEAL), and :mod:`secure_agg.backend` puts both behind one
``AggregationBackend`` interface. Nothing here imports a fedweave layer above it
(``coordinator_free``, ``org_node``, ``api``).
"""

from secure_agg.codec import FixedPointCodec
from secure_agg.dp import DistributedSkellam, add_signed, clip_l2
from secure_agg.errors import (
    ConfigError,
    DecryptionError,
    ProtocolError,
    RingError,
    SecAggError,
    ShareError,
)
from secure_agg.keys import RoundContext
from secure_agg.protocol import ProtocolConfig, RoundResult, SecAggPeer, run_round, simulate_round
from secure_agg.ring import check_ring, ring_add, ring_dtype, ring_sub, ring_sum

__all__ = [
    "ConfigError",
    "DecryptionError",
    "DistributedSkellam",
    "FixedPointCodec",
    "ProtocolConfig",
    "ProtocolError",
    "RingError",
    "RoundContext",
    "RoundResult",
    "SecAggError",
    "SecAggPeer",
    "ShareError",
    "add_signed",
    "check_ring",
    "clip_l2",
    "ring_add",
    "ring_dtype",
    "ring_sub",
    "ring_sum",
    "run_round",
    "simulate_round",
]
