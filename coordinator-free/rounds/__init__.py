"""The round engine: leaderless secure-aggregation rounds among the federation's orgs.

What the package owns: one org's side of a round, from the ``ready`` exchange to the
unmasked sum (``docs/ARCHITECTURE.md``, "A round", and the map of this package in
"The rounds package"), and the one interface through which the run engine sums a
round whatever the backend (:class:`SecureSum`: the masked sum over
:class:`RoundEngine`, or the CKKS sum of :mod:`coordinator_free.rounds.ckks`, which
is imported on demand: it loads TenSEAL).

What it may import: :mod:`secure_agg` (the cryptography: sessions, codecs, CKKS) and
the modules of :mod:`coordinator_free` below it (endpoint, wire, ring, errors,
identity); never ``org_node``, ``api`` or torch.

Its modules, in the order of a round:

- :mod:`.config`, :mod:`.results` — :class:`RoundConfig`; :class:`RoundResult`,
  :class:`RoundProgress`, :class:`RoundObservation`, :class:`RoundFailed`.
- :mod:`.session` — the :class:`MaskedSum` session and :class:`SecAggSession`, its
  adapter over :class:`secure_agg.protocol.SecAggPeer`.
- :mod:`.wire` — message kinds, :class:`View`, the agreement token, :func:`view_hash`.
- :mod:`.inbox`, :mod:`.state`, :mod:`.messenger`, :mod:`.context` — a round's
  messages, its state, how the engine sends and reports, the stage context.
- :mod:`.exchange` — the pairwise exchange (ready, shares, releases).
- :mod:`.agreement`, :mod:`.token`, :mod:`.early` — the view agreement; the agreement
  token; ``U1`` pending while the ring runs before it is settled.
- :mod:`.ready`, :mod:`.share`, :mod:`.reduce`, :mod:`.unmask` — the stages;
  :mod:`.sums` — the sums the reduce serves and fetches when a ring breaks.
- :mod:`.model_hash` — the next model's hash, compared after each round.
- :mod:`.engine` — :class:`RoundEngine`, the pipeline of the stages.
- :mod:`.secure_sum`, :mod:`.ckks` — :class:`SecureSum` and its two implementations.
"""

from __future__ import annotations

from coordinator_free.rounds.config import RoundConfig, StageHook
from coordinator_free.rounds.engine import RoundEngine
from coordinator_free.rounds.exchange import initiator
from coordinator_free.rounds.model_hash import ModelHashes
from coordinator_free.rounds.results import (
    MASKS_PREPARED,
    OBSERVATION_KINDS,
    ModelHashMismatch,
    RoundFailed,
    RoundObservation,
    RoundObserver,
    RoundProgress,
    RoundResult,
)
from coordinator_free.rounds.secure_sum import MaskedSecureSum, SecureSum, SumResult
from coordinator_free.rounds.session import (
    MaskedSum,
    SecAggSession,
    SessionContext,
    SessionFactory,
    endpoint_signer,
    secagg_sessions,
)
from coordinator_free.rounds.state import Counters
from coordinator_free.rounds.wire import (
    KIND_LEAVE,
    KIND_MODEL,
    KIND_PART,
    KIND_PERMIT,
    KIND_READY,
    KIND_SEED,
    KIND_SHARE,
    KIND_TOKEN,
    KIND_TOTAL,
    KIND_UNMASK,
    KIND_VIEW,
    Token,
    View,
    view_hash,
)

# the names tests reached before the engine became a package
_Token = Token
_Counters = Counters
_initiator = initiator

__all__ = [
    "KIND_LEAVE",
    "KIND_MODEL",
    "KIND_PART",
    "KIND_PERMIT",
    "KIND_READY",
    "KIND_SEED",
    "KIND_SHARE",
    "KIND_TOKEN",
    "KIND_TOTAL",
    "KIND_UNMASK",
    "KIND_VIEW",
    "MASKS_PREPARED",
    "OBSERVATION_KINDS",
    "MaskedSecureSum",
    "MaskedSum",
    "ModelHashMismatch",
    "ModelHashes",
    "RoundConfig",
    "RoundEngine",
    "RoundFailed",
    "RoundObservation",
    "RoundObserver",
    "RoundProgress",
    "RoundResult",
    "SecAggSession",
    "SecureSum",
    "SessionContext",
    "SessionFactory",
    "StageHook",
    "SumResult",
    "View",
    "endpoint_signer",
    "secagg_sessions",
    "view_hash",
]
