"""Chunked ring all-reduce (reduce-scatter, then all-gather) over an :class:`Endpoint`.

The classic bandwidth-optimal ring all-reduce (Patarasuk & Yuan, "Bandwidth optimal
all-reduce algorithms for clusters of workstations", JPDC 2009; the algorithm of
Horovod and NCCL rings): the vector is cut into ``n`` chunks; in ``n - 1``
reduce-scatter steps each node passes one chunk to its successor, which adds it to its
own, until node ``p`` holds the complete sum of chunk ``(p + 1) mod n``; in ``n - 1``
all-gather steps the finished chunks travel once more around the ring. Each node sends
``2 (n - 1) / n`` times the vector's bytes, whatever ``n`` is, instead of the ``n - 1``
times of an all-to-all exchange or the star's ``n - 1`` times at its centre.

Arithmetic is modulo ``2^b`` on ``np.uint16`` / ``np.uint32`` / ``np.uint64`` arrays (the ring of
:mod:`secure_agg.ring`), so partial sums of masked vectors wrap exactly like the
secure-aggregation masks expect. A missing, late or malformed chunk, an unreachable
successor or an abort from any ring member ends the call with :class:`RingBroken`,
naming the suspect when one is known; the node then sends an abort that names whom it
blames to every member that must stop, so those stop at once and learn the suspects
(a node stopped by an abort sends none). In the reduce-scatter and at the
all-gather's first step that is every member. Later in the all-gather it is only the
members the failure cuts off (:func:`.steps.all_gather`): a node whose send fails
there keeps receiving and completes. The caller (the round engine) decides who
dropped, and takes the sum from a member whose ring completed or runs the ring again
over the survivors.

Two variants share the message format (``agg.chunk``: a header with the phase, step,
chunk, frame, element count and a 16-byte ring id binding the ordered members and the
attempt, then the little-endian elements): a **chain** for vectors too short to be
worth ``n`` chunks (reduce along the ring order, then pass the total on: ``2 (n - 1)``
messages in all; a long wait pings the sender to tell a dead one from a slow one), and
the **star** through one hub, the baseline of ``bench/overlay.py``. A chunk larger than
:data:`~.wire.MAX_FRAME_BYTES` travels in several frames.

Modules, each importing only those listed before it (besides numpy, asyncio and
``coordinator_free``'s errors, envelope and endpoint; nothing of ``secure_agg``, of the
round engine or of the layers above):

* :mod:`.wire`: the message kinds, the chunk header, ``ring_order``, ``ring_id``,
  ``chunk_bounds``.
* :mod:`.link`: one member's frames sent and received for one ring run, the pings of
  a silent sender, ``RingBroken`` and ``RingStats``.
* :mod:`.steps`: the steps of each variant (reduce-scatter, all-gather, chain, star).
* :mod:`.reducer`: ``RingReducer``: the handlers, the open rounds, the variants and
  their keyword options (``RingCall``), the abort of a broken ring.
"""

from coordinator_free.endpoint import Endpoint as RingEndpoint
from coordinator_free.ring.link import LIVENESS_POLL_S, RingBroken, RingStats
from coordinator_free.ring.reducer import (
    GatherOptions,
    RingCall,
    RingOptions,
    RingReducer,
    Scattered,
    StarOptions,
)
from coordinator_free.ring.wire import (
    KIND_ABORT,
    KIND_CHUNK,
    KIND_PING,
    KIND_SUM,
    MAX_FRAME_BYTES,
    chunk_bounds,
    ring_id,
    ring_order,
)

__all__ = [
    "KIND_ABORT",
    "KIND_CHUNK",
    "KIND_PING",
    "KIND_SUM",
    "LIVENESS_POLL_S",
    "MAX_FRAME_BYTES",
    "GatherOptions",
    "RingBroken",
    "RingCall",
    "RingEndpoint",
    "RingOptions",
    "RingReducer",
    "RingStats",
    "Scattered",
    "StarOptions",
    "chunk_bounds",
    "ring_id",
    "ring_order",
]
