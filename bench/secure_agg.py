"""Secure aggregation figures, each next to a baseline measured in the same run.

Run::

    python -m bench.secure_agg [--quick] [--json PATH]

Rows (``n`` orgs, ``params`` float32 parameters; quick: n in {5, 10}, 1M params;
full: n in {5, 10, 20}, 1M and 25M params):

- ``mask_vs_prg``: one peer's ``masked_input`` (its self mask and ``n - 1`` pairwise
  masks, key agreement included), written into the peer's outgoing buffer
  (``out=``, as the round engine masks its encoded vector in place) / raw AES-256-CTR
  ``update_into`` producing the same number of mask bytes. Target <= 1.5.
- ``sum_vs_numpy_add``: ``ring_sum`` of ``n`` masked vectors / a plain numpy uint32
  add loop over the same arrays. Target <= 1.3.
- ``wire_bytes_per_param_masked``: marginal payload bytes per parameter of a masked
  vector (``secure_agg.backend.ring_to_bytes``), 32- and 64-bit rings.
- ``round_vs_plain_sum`` (n=10, 1M): a whole in-process round of the masked protocol
  (encode, key advertisement, share exchange, masking, ring sum, share release, every
  peer unmasking, decode) / a plain float sum of the same vectors.
- ``round_vs_flower_secaggplus`` (n=10, 1M): the same round / Flower 1.42's SecAgg+
  workflow and client mod driven in process (:mod:`bench.flower_secaggplus`).
  Target <= 0.25.
- ``ckks_encrypt_vs_tenseal_raw`` (1M): ``ckks_encrypt`` (packing, framing,
  serialization) / raw TenSEAL ``ckks_vector`` + ``serialize`` on the same chunks,
  under the same public context. Target <= 1.2.
- ``wire_bytes_per_param_ckks``: CKKS bundle bytes per parameter. Target <= 32.

Timings are CPU seconds of this process (``time.process_time``; unit ``cpu-s``):
every timed path runs on one thread, and CPU time keeps the load of other processes on
a shared machine out of the figures, which wall-clock time does not. Each figure is the
minimum over repeats, with ours and the baseline interleaved so that cache and memory
contention hit both alike.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable, Sequence

import numpy as np
import tenseal as ts
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

from bench.common import Report, run_main
from bench.flower_secaggplus import FlowerRound, prepare_secaggplus_round, quiet_flower
from secure_agg.backend import ring_to_bytes
from secure_agg.ckks import CkksKeyHolder, CkksParams, CkksPublicContext, ckks_encrypt
from secure_agg.codec import FixedPointCodec
from secure_agg.keys import RoundContext
from secure_agg.prg import expand
from secure_agg.protocol import ProtocolConfig, SecAggPeer, simulate_round
from secure_agg.ring import ring_sum

__all__ = ["main"]

CTX = RoundContext("bench-federation", "bench-run", 1)
MILLION = 1_000_000
_AES_CHUNK = 1 << 20


def _label(params: int) -> str:
    return f"{params // MILLION}M" if params % MILLION == 0 else str(params)


def _orgs(n: int) -> tuple[str, ...]:
    return tuple(f"org-{i:03d}" for i in range(n))


def _threshold(n: int) -> int:
    """The protocol's recommended ``t > n / 2``."""
    return n // 2 + 1


def _timed(fn: Callable[[], object]) -> float:
    """CPU seconds of this process for one call (every timed path is single-threaded)."""
    t0 = time.process_time()
    fn()
    return time.process_time() - t0


def _interleaved(
    ours: Callable[[], object], base: Callable[[], object], repeats: int
) -> tuple[float, float]:
    """Minimum seconds of ``ours`` and ``base``, run alternately ``repeats`` times each."""
    a, b = [], []
    for _ in range(repeats):
        a.append(_timed(ours))
        b.append(_timed(base))
    return min(a), min(b)


# --------------------------------------------------------------------------- peers


def _identities(
    orgs: Sequence[str],
) -> tuple[dict[str, Callable[[bytes], bytes]], Callable[[str, bytes, bytes], bool]]:
    keys = {
        o: Ed25519PrivateKey.from_private_bytes(hashlib.sha256(b"bench/" + o.encode()).digest())
        for o in orgs
    }
    publics = {o: k.public_key() for o, k in keys.items()}

    def verify(sender: str, data: bytes, signature: bytes) -> bool:
        try:
            publics[sender].verify(signature, data)
        except (KeyError, InvalidSignature):
            return False
        return True

    return {o: k.sign for o, k in keys.items()}, verify


def _peers_ready_to_mask(config: ProtocolConfig) -> dict[str, SecAggPeer]:
    """Every peer through key advertisement and share exchange (stage MASKED_INPUT)."""
    signers, verify = _identities(config.participants)
    peers = {
        o: SecAggPeer(config, o, signers[o], verify, rng=np.random.default_rng([11, i]).bytes)
        for i, o in enumerate(config.participants)
    }
    adverts = {o: p.advertise_keys().to_bytes() for o, p in peers.items()}
    for o, p in peers.items():
        for sender, wire in adverts.items():
            if sender != o:
                p.receive(wire)
        p.close_advertise()
    for p in list(peers.values()):
        for recipient, msg in p.share_keys().items():
            peers[recipient].receive(msg.to_bytes())
    for p in peers.values():
        p.close_shares()
    return peers


def _raw_aes_ctr(total_bytes: int, n_keys: int) -> Callable[[], None]:
    """Raw AES-256-CTR keystream with ``update_into``, ``n_keys`` keys, one 1 MiB buffer."""
    zeros = bytes(_AES_CHUNK)
    out = bytearray(_AES_CHUNK + 16)
    keys = [hashlib.sha256(b"bench/aes/%d" % i).digest() for i in range(n_keys)]
    per_key = total_bytes // n_keys

    def run() -> None:
        for key in keys:
            enc = Cipher(algorithms.AES(key), modes.CTR(bytes(16))).encryptor()
            left = per_key
            while left > 0:
                step = min(left, _AES_CHUNK)
                enc.update_into(zeros[:step], out)
                left -= step

    return run


# --------------------------------------------------------------------------- rows


def _mask_rows(report: Report, n: int, params: int, repeats: int) -> None:
    config = ProtocolConfig(CTX, _orgs(n), threshold=_threshold(n), vector_length=params)
    x = expand(hashlib.sha256(b"bench/x").digest(), params, 32)
    y = np.empty_like(x)  # the peer's outgoing buffer, as the round engine provides it
    ready: list[SecAggPeer] = []

    def ours() -> None:
        if not ready:  # each peer masks once per round: take the next, or a fresh round
            ready.extend(_peers_ready_to_mask(config).values())
        ready.pop().masked_input(x, out=y)

    base = _raw_aes_ctr(n * params * 4, n)
    ours()  # warm-up: the first full-size allocations fault their pages in
    base()
    ready.clear()
    ready.extend(_peers_ready_to_mask(config).values())
    t_ours, t_base = _interleaved(ours, base, repeats)
    report.add(
        f"mask_vs_prg[n={n},params={_label(params)}]",
        t_ours,
        "cpu-s",
        t_base,
        target="<= 1.5",
        note=f"1 self + {n - 1} pairwise masks (key agreement included) into the peer's "
        f"outgoing buffer, 32-bit ring, vs raw AES-CTR of {n * params * 4 / 1e6:.0f} MB",
    )


def _sum_rows(report: Report, n: int, params: int, repeats: int) -> None:
    arrays = [expand(hashlib.sha256(b"bench/y%d" % i).digest(), params, 32) for i in range(n)]

    def ours() -> None:
        ring_sum(arrays)

    def base() -> None:
        acc = arrays[0].copy()
        for a in arrays[1:]:
            np.add(acc, a, out=acc)

    expected = arrays[0].copy()
    for a in arrays[1:]:
        np.add(expected, a, out=expected)
    if not np.array_equal(ring_sum(arrays), expected):
        raise AssertionError("ring_sum disagrees with numpy's wrapping uint32 add")
    t_ours, t_base = _interleaved(ours, base, repeats)
    report.add(
        f"sum_vs_numpy_add[n={n},params={_label(params)}]",
        t_ours,
        "cpu-s",
        t_base,
        target="<= 1.3",
        note="secure_agg.ring.ring_sum vs np.add(out=) loop, uint32",
    )


def _wire_rows(report: Report, params: int) -> None:
    for bits, dtype, target in ((32, np.uint32, "<= 4.0"), (64, np.uint64, "<= 8.0")):
        one = len(ring_to_bytes(np.zeros(params, dtype=dtype)))
        two = len(ring_to_bytes(np.zeros(2 * params, dtype=dtype)))
        report.add(
            f"wire_bytes_per_param_masked[bits={bits}]",
            (two - one) / params,
            "B/param",
            target=target,
            note=f"marginal; plus a {2 * one - two}-byte header per payload",
        )


def _round_rows(report: Report, n: int, params: int, repeats: int) -> None:
    rng = np.random.default_rng(5)
    vectors = [rng.uniform(-1.0, 1.0, params).astype(np.float32) for _ in range(n)]
    orgs = _orgs(n)
    t = _threshold(n)
    config = ProtocolConfig(CTX, orgs, threshold=t, vector_length=params)
    codec = FixedPointCodec(bits=32, clip=1.0, max_summands=n)
    result: dict[str, np.ndarray] = {}

    def ours() -> None:
        encoded = {
            o: codec.encode(v, np.random.default_rng(i))
            for i, (o, v) in enumerate(zip(orgs, vectors, strict=True))
        }
        round_ = simulate_round(config, encoded, seed=3)
        result["sum"] = codec.decode(round_.total)

    def plain() -> None:
        result["plain"] = np.asarray(np.sum(vectors, axis=0, dtype=np.float32))

    quiet_flower()
    flower_rounds: list[FlowerRound] = []

    def flower() -> None:
        result["flower"] = flower_rounds[-1].run()

    t_ours, t_plain, t_flower = [], [], []
    for _ in range(repeats):
        flower_rounds.append(prepare_secaggplus_round(vectors, reconstruction_threshold=t))
        t_ours.append(_timed(ours))
        t_plain.append(_timed(plain))
        t_flower.append(_timed(flower))
    error = float(np.max(np.abs(result["sum"] - result["plain"])))
    if error > 1e-3:
        raise AssertionError(f"masked round is off by {error}")
    report.add(
        f"round_vs_plain_sum[n={n},params={_label(params)}]",
        min(t_ours),
        "cpu-s",
        min(t_plain),
        note=f"t={t}, complete graph, every peer unmasks; max error {error:.1e}",
    )
    flower_error = float(np.max(np.abs(result["flower"] * n - result["plain"])))
    if flower_error > 0.1 * n:
        raise AssertionError(f"Flower's round is off by {flower_error}")
    wire = flower_rounds[-1].grid.wire_bytes / (n * params)
    report.add(
        f"round_vs_flower_secaggplus[n={n},params={_label(params)}]",
        min(t_ours),
        "cpu-s",
        min(t_flower),
        target="<= 0.25",
        note=(
            f"Flower SecAggPlusWorkflow + secaggplus_mod in process, num_shares={n}, "
            f"threshold={t}, protobuf-encoded messages, no gRPC; {wire:.1f} B/param/node "
            f"on Flower's wire; max error of Flower's mean x n: {flower_error:.1e}"
        ),
    )


def _ckks_rows(report: Report, params: int, repeats: int) -> None:
    cparams = CkksParams()
    holder = CkksKeyHolder(cparams, threshold=2, participants=_orgs(2))
    public = CkksPublicContext.from_bytes(holder.public_context_bytes())
    x = np.random.default_rng(9).uniform(-1.0, 1.0, params).astype(np.float32)
    slots = cparams.slots
    blobs: dict[str, bytes] = {}

    def ours() -> None:
        blobs["ours"] = ckks_encrypt(public, x, contributor="org-000")

    def raw() -> None:
        x64 = x.astype(np.float64)
        parts = [
            ts.ckks_vector(public.context, x64[i : i + slots]).serialize()
            for i in range(0, params, slots)
        ]
        blobs["raw"] = b"".join(parts)

    t_ours, t_raw = _interleaved(ours, raw, repeats)
    report.add(
        f"ckks_encrypt_vs_tenseal_raw[params={_label(params)}]",
        t_ours,
        "cpu-s",
        t_raw,
        target="<= 1.2",
        note=f"N={cparams.poly_modulus_degree}, chain {cparams.coeff_mod_bit_sizes}, "
        f"scale 2^{cparams.global_scale_bits}; raw = ckks_vector+serialize per {slots}-slot chunk",
    )
    report.add(
        f"wire_bytes_per_param_ckks[params={_label(params)}]",
        len(blobs["ours"]) / params,
        "B/param",
        target="<= 32",
        note=f"raw TenSEAL ciphertexts alone: {len(blobs['raw']) / params:.2f} B/param",
    )


def _body(report: Report) -> None:
    quick = report.quick
    ns = (5, 10) if quick else (5, 10, 20)
    sizes = (MILLION,) if quick else (MILLION, 25 * MILLION)
    for params in sizes:
        repeats = 7 if params == MILLION else 2
        for n in ns:
            _mask_rows(report, n, params, repeats)
            _sum_rows(report, n, params, repeats)
    _wire_rows(report, MILLION)
    _round_rows(report, 10, MILLION, 2 if quick else 3)
    _ckks_rows(report, MILLION, 3)


def main(argv: Sequence[str] | None = None) -> Report:
    """``python -m bench.secure_agg [--quick] [--json PATH]``."""
    return run_main(
        "secure_agg",
        _body,
        argv,
        description="masking, summing, whole rounds vs Flower SecAgg+, and CKKS vs raw TenSEAL",
    )


if __name__ == "__main__":
    main()
