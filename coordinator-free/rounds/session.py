"""The masked-sum session the engine drives, and its adapter over :mod:`secure_agg`.

The engine moves bytes; a :class:`MaskedSum` does the cryptography of one org's side
of one round (Bonawitz et al., CCS'17, §4). :class:`SecAggSession` adapts
:class:`secure_agg.protocol.SecAggPeer` to it; :func:`secagg_sessions` builds one per
round, signed by :func:`endpoint_signer`'s pair.
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import hashlib
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import numpy as np
from coordinator_free.endpoint import Endpoint
from coordinator_free.identity import verify_signature
from coordinator_free.rounds.prepared import PreparedMasks, correction
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

from secure_agg import prg
from secure_agg.codec import FixedPointCodec
from secure_agg.keys import RoundContext
from secure_agg.messages import (
    AdvertiseKeys,
    Header,
    MalformedMessage,
    Message,
    ShareKeys,
    Stage,
    UnmaskShares,
)
from secure_agg.protocol import MaskingSecrets, ProtocolConfig, SecAggPeer, usual_masks
from secure_agg.protocol.unmasking import Mask

__all__ = [
    "ON_LOOP_WORK_BYTES",
    "MaskedSum",
    "Premask",
    "RandomBytes",
    "SecAggSession",
    "SessionContext",
    "SessionFactory",
    "SignFn",
    "VerifyFn",
    "endpoint_signer",
    "run_sized",
    "secagg_sessions",
    "small_work",
]


_R = TypeVar("_R")

ON_LOOP_WORK_BYTES = 1 << 22
"""A session's array work (a copy, mask expansions, a decoding) that touches fewer bytes
than this runs on the node's event loop; larger work runs in a worker thread. 4 MiB of
work is about 0.3 ms as a copy and 0.7 ms as AES-CTR keystream added into a vector
(measured on the 2-core machine), less than a busy loop pays for the hop to a worker
thread and back (``docs/ARCHITECTURE.md``, "Small array work on the loop")."""


def small_work(work_bytes: int) -> bool:
    """Whether work touching ``work_bytes`` bytes runs on the loop (:data:`ON_LOOP_WORK_BYTES`)."""
    return work_bytes < ON_LOOP_WORK_BYTES


async def run_sized(work_bytes: int, job: Callable[..., _R], *args: Any) -> _R:
    """``job(*args)``, which touches ``work_bytes`` bytes of arrays: on the loop when that
    is small work (:func:`small_work`), else in a worker thread."""
    if small_work(work_bytes):
        return job(*args)
    return await asyncio.to_thread(job, *args)


@dataclass(frozen=True)
class Premask:
    """The premask's work (:meth:`MaskedSum.premask`): ``masks`` added to ``target``,
    from ``base`` when it is set (else in place). With ``addend`` (masks prepared before
    the round: ``target`` holds their sum), ``addend`` is added to ``target`` first.
    Calling it does the work; the round engine runs it in a worker thread, or streams
    the masks from the helper process into the ring
    (:mod:`~coordinator_free.rounds.mask_stream`), where ``base`` is ``None``.
    ``prepared``: whether ``target`` holds prepared masks."""

    target: np.ndarray
    masks: list[tuple[bytes, int]]
    base: np.ndarray | None = None
    addend: np.ndarray | None = None
    prepared: bool = False

    @property
    def work_bytes(self) -> int:
        """The bytes the work touches: the target's once per mask, once more for the copy
        from ``base`` or the sum with ``addend``."""
        once = self.base is not None or self.addend is not None
        return self.target.nbytes * (len(self.masks) + once)

    def __call__(self) -> None:
        if self.addend is not None:
            np.add(self.target, self.addend, out=self.target)
        prg.add_masks(self.target, self.masks, base=self.base)


@dataclass(frozen=True)
class SessionContext:
    """What a masked-sum session is built from.

    participants: ``U0``, every org invited to the round, sorted (the same on every
    node: the federation's members); threshold: ``t`` of each org's Shamir sharing;
    vector: this org's input; neighbours: SecAgg+'s ``k`` (``None``: complete graph).
    """

    federation: str
    run: str
    round: int
    org_id: str
    participants: tuple[str, ...]
    threshold: int
    vector: np.ndarray
    neighbours: int | None = None
    masking: MaskingSecrets | None = None


class MaskedSum(Protocol):
    """One org's side of a masked-sum protocol for one round.

    The engine calls the methods in this order and moves their bytes over the
    network; ``receive_*`` raise :class:`~secure_agg.errors.SecAggError` or
    ``ValueError`` on a message they refuse and leave the session as it was, so the
    engine leaves that sender out of its view. The engine hands ``receive_*`` only
    the payload of an envelope whose Ed25519 signature the transport verified, with
    the envelope's sender as ``sender``. :class:`SecAggSession` adapts
    :class:`secure_agg.protocol.SecAggPeer` to it.
    """

    def advertise(self) -> bytes:
        """This org's public keys for the round (carried by ``round.ready``)."""
        ...

    def receive_advert(self, sender: str, data: bytes) -> None:
        """Take another participant's advertisement."""
        ...

    def holders(self, orgs: frozenset[str]) -> frozenset[str]:
        """The orgs among ``orgs`` that hold this org's shares (every other one, or only
        its SecAgg+ neighbours)."""
        ...

    def seal_ahead(self, keys: Mapping[str, bytes]) -> Mapping[str, bytes]:
        """After :meth:`advertise`: this org's shares for each holder in ``keys``, sealed
        to the key (an X25519 public key) the holder advertised in an earlier round."""
        ...

    def open_ahead(self, sender: str, data: bytes, key: X25519PrivateKey) -> None:
        """Take the shares ``sender`` sealed ahead for this org, after its advertisement,
        with the private half of the key they were sealed to."""
        ...

    def share_keys(
        self, participants: frozenset[str], only: Iterable[str] | None = None
    ) -> Mapping[str, bytes]:
        """Given this node's view of the ready orgs, the share message for each one that
        holds this org's shares (:meth:`holders`), or for those of ``only``."""
        ...

    def receive_share(self, sender: str, data: bytes) -> None:
        """Take the share message another participant sent this org."""
        ...

    def settle_participants(self, participants: frozenset[str]) -> None:
        """The members agreed on the participants ``U1``: this org masks with exactly
        its holders among them, so every member knows which pairwise masks its masked
        input carries; raises when it lacks the shares of one of them."""
        ...

    def narrow_participants(self, participants: frozenset[str]) -> None:
        """The members settled on a subset of the participants this org masked with
        (it proposed every member and started its ring before the agreement decided):
        the masked input made from here on carries exactly the pairwise masks of its
        holders among them."""
        ...

    def premask(self, prepared: PreparedMasks | None = None) -> Premask:
        """After :meth:`share_keys`: fix the masks of the usual case (every neighbour
        among the ready orgs shares its keys) and return the work that adds them to the
        input, which the engine runs off its event loop while the shares travel (or
        streams into the ring's first attempt); :meth:`masked_input`, once that work is
        done (or streaming), makes the result exact (it takes
        off the mask of a neighbour whose shares did not come). Nothing masked leaves
        the node before :meth:`masked_input`. With ``prepared`` (this round's masks
        expanded before it, :mod:`~coordinator_free.rounds.prepared`), the work adds
        the input to that array and corrects it by the masks the guess got wrong;
        the result is the same bit for bit."""
        ...

    def masks_for(
        self, round: int, masking: MaskingSecrets, s_pks: Mapping[str, bytes]
    ) -> tuple[list[Mask], np.dtype, int]:
        """The masks this org adds in protocol round ``round`` of the same run and
        members when it advertises ``masking`` and every member is ready with the
        masking key ``s_pks`` gives; and the dtype and length of the ring array they
        are added to (this round's). It reads only what the session was built with:
        the engine calls it in a worker thread, after the round."""
        ...

    def premasked_input(self) -> np.ndarray | None:
        """Once :meth:`premask`'s work is done: this org's masked input when the masks
        that work added are exactly those of the settled participants (the usual case),
        which leaves only bookkeeping, so the engine calls it on its event loop; ``None``
        when a mask remains to add or take off (:meth:`masked_input` does that off the
        loop) or when nothing was premasked."""
        ...

    def masked_input(self) -> np.ndarray:
        """This org's masked input (a ring array), which the engine may sum into in
        place; each later call makes it again, the same bit for bit, in the same
        array (for a ring attempt after one that consumed it). The engine calls it off
        its event loop, at a stage where no message reaches the session."""
        ...

    def unmask(self, survivors: frozenset[str]) -> bytes:
        """The shares this org releases, given the agreed survivors ``U3``."""
        ...

    def receive_release(self, sender: str, data: bytes) -> None:
        """Take the shares another survivor released."""
        ...

    def self_seed(self) -> bytes:
        """After :meth:`unmask` with a survivor set that holds this org: its own
        self-mask seed, which it reveals to the other survivors instead of having its
        holders release shares of it (see :meth:`secure_agg.protocol.SecAggPeer.self_seed`)."""
        ...

    def receive_seed(self, owner: str, seed: bytes) -> bool:
        """Take a survivor's revealed self-mask seed, from whoever relayed it (it is
        checked against the owner's commitment); ``False`` when already held."""
        ...

    def can_finish(self) -> bool:
        """Whether the seeds and releases taken so far suffice for :meth:`unmasked_sum`."""
        ...

    def prepare_unmask(self) -> None:
        """Once :meth:`can_finish`: reconstruct the secrets of the masks to remove. After
        it, :meth:`unmasked_sum`, :meth:`unmask_part` and :meth:`decode` only compute
        over arrays (they touch nothing a message changes): the engine runs them off
        its event loop."""
        ...

    def unmasked_sum(self, masked_sum: np.ndarray) -> np.ndarray:
        """The sum of the survivors' inputs, in a new array, from the ring's sum of
        masked inputs, which it leaves as it is (the engine keeps it, see
        :meth:`~coordinator_free.rounds.sums.SumServer.keep_total`); a decoded sum is
        unmasked and decoded chunk by chunk, with no ring-sized array in between."""
        ...

    def unmask_part(self, masked_part: np.ndarray, offset: int) -> np.ndarray:
        """Elements ``[offset, offset + len(masked_part))`` of the sum, still a ring
        array (see :meth:`decode`), from that part of the masked sum; once
        :meth:`can_finish`, as often as the engine needs (one call per chunk it holds)."""
        ...

    def decode(self, total: np.ndarray) -> np.ndarray:
        """The sum as :meth:`unmasked_sum` returns it, from the ring array that the
        parts of :meth:`unmask_part` make up."""
        ...


SessionFactory = Callable[[SessionContext], MaskedSum]
SignFn = Callable[[bytes], bytes]
VerifyFn = Callable[[str, bytes, bytes], bool]
RandomBytes = Callable[[int], bytes]


class SecAggSession:
    """:class:`MaskedSum` over :class:`secure_agg.protocol.SecAggPeer` (Bonawitz §4).

    The peer's stage machine does the cryptography and refuses anything out of order
    or malformed; this adapter only decodes messages and closes each stage when the
    engine has agreed on it. A float input is encoded with ``codec`` (clip, scale,
    stochastic rounding; ``codec.max_summands`` must cover the participants) and the
    sum decoded back; a ring input (``uint16`` / ``uint32`` / ``uint64``) is summed as it is.

    Memory: the session holds one ring vector, the masked input (a float input is
    encoded and masked in one array; a ring input, the caller's, is masked into a new
    one; with masks prepared before the round, their array becomes the masked input,
    and an encoded input keeps its own array beside it). The engine sums the ring in that array; a later attempt has the session
    make it again (:meth:`masked_input`: the masks once more, and a float input
    encoded again from a copy of the encoding's generator, so the same vector bit for
    bit). The unmasked sum of a float input is decoded chunk by chunk
    (:meth:`~secure_agg.protocol.SecAggPeer.finalize_into`).

    A message whose signer (``msg.sender``) is not the envelope's sender is refused;
    one that is has been authenticated by the envelope's signature over these very
    bytes, so the peer does not verify the message's own signature a second time
    (``authenticated=True``): one Ed25519 verification per message instead of two.
    """

    def __init__(
        self,
        ctx: SessionContext,
        sign: SignFn,
        verify: VerifyFn,
        *,
        codec: FixedPointCodec | None = None,
        rng: RandomBytes | None = None,
        encode_rng: np.random.Generator | None = None,
    ) -> None:
        x = np.asarray(ctx.vector)
        self.codec: FixedPointCodec | None = None
        # what makes the masked input again: the float input and a copy of the
        # encoding's generator as it was before the encoding
        self._source: tuple[np.ndarray, np.random.Generator] | None = None
        self._y: np.ndarray | None = None
        self._premasked: np.ndarray | None = None  # the array premask's work masks
        if np.issubdtype(x.dtype, np.floating):
            if codec is None:
                raise ValueError("a float input needs a FixedPointCodec to enter the ring")
            if codec.max_summands < len(ctx.participants):
                raise ValueError(
                    f"codec.max_summands={codec.max_summands} is below the "
                    f"{len(ctx.participants)} participants: the sum could wrap"
                )
            self.codec = codec
            gen = encode_rng if encode_rng is not None else np.random.default_rng()
            self._source = (x, copy.deepcopy(gen))
            x = codec.encode(x, gen)
            bits = codec.bits
        elif x.dtype in (np.dtype(np.uint16), np.dtype(np.uint32), np.dtype(np.uint64)):
            bits = x.dtype.itemsize * 8
        else:
            raise ValueError(f"inputs are float arrays or ring arrays, not {x.dtype}")
        config = ProtocolConfig(
            ctx=RoundContext(ctx.federation, ctx.run, ctx.round),
            participants=ctx.participants,
            threshold=ctx.threshold,
            vector_length=int(x.shape[0]),
            bits=bits,
            neighbours=ctx.neighbours,
        )
        self._x = x
        self.peer = SecAggPeer(config, ctx.org_id, sign, verify, rng=rng, masking=ctx.masking)

    @staticmethod
    def _decode(kind: type[Message], sender: str, data: bytes) -> Message:
        return SecAggSession._from(sender, kind.from_bytes(data))

    @staticmethod
    def _from(sender: str, msg: Message) -> Message:
        """``msg``, refused unless ``sender`` (the envelope's) signed it."""
        if msg.sender != sender:
            raise ValueError(
                f"a {type(msg).__name__} signed as {msg.sender!r} came from {sender!r}"
            )
        return msg

    def advertise(self) -> bytes:
        return self.peer.advertise_keys().to_bytes()

    def receive_advert(self, sender: str, data: bytes) -> None:
        try:  # the header an honest sender's advertisement has: compared, not parsed
            header = Header(self.peer.config.ctx, Stage.ADVERTISE_KEYS, sender)
        except MalformedMessage:  # no advertisement of that sender reads
            msg = self._decode(AdvertiseKeys, sender, data)
        else:
            msg = self._from(sender, AdvertiseKeys.from_bytes_under(data, header))
        assert isinstance(msg, AdvertiseKeys)
        self.peer.receive_advertise(msg, authenticated=True)

    def holders(self, orgs: frozenset[str]) -> frozenset[str]:
        return (self.peer.neighbours & orgs) - {self.peer.me}

    def seal_ahead(self, keys: Mapping[str, bytes]) -> Mapping[str, bytes]:
        return self.peer.seal_ahead(keys)

    def open_ahead(self, sender: str, data: bytes, key: X25519PrivateKey) -> None:
        self.peer.open_ahead(sender, data, key)

    def share_keys(
        self, participants: frozenset[str], only: Iterable[str] | None = None
    ) -> Mapping[str, bytes]:
        self.peer.close_advertise()
        wanted = participants if only is None else participants & frozenset(only)
        return {o: m.to_bytes() for o, m in self.peer.share_keys(wanted).items()}

    def receive_share(self, sender: str, data: bytes) -> None:
        msg = self._decode(ShareKeys, sender, data)
        assert isinstance(msg, ShareKeys)
        self.peer.receive_shares(msg, authenticated=True)

    def settle_participants(self, participants: frozenset[str]) -> None:
        self.peer.close_shares(participants)

    def narrow_participants(self, participants: frozenset[str]) -> None:
        self.peer.narrow(participants)

    def premask(self, prepared: PreparedMasks | None = None) -> Premask:
        masks = self.peer.premask()
        x = self._x
        if prepared is not None and _fits(prepared.array, x):
            fix = correction(prepared.masks, masks)
            if fix is not None:  # the array is the masked input: the input added to it
                self._premasked = prepared.array
                return Premask(prepared.array, fix, addend=x, prepared=True)
        # an encoded input is this session's own: masked in place; a ring input, the
        # caller's, into a new array
        y, base = (x, None) if self.codec is not None else (np.empty_like(x), x)
        self._premasked = y
        return Premask(y, masks, base)

    def masks_for(
        self, round: int, masking: MaskingSecrets, s_pks: Mapping[str, bytes]
    ) -> tuple[list[Mask], np.dtype, int]:
        config = self.peer.config
        later = dataclasses.replace(config, ctx=dataclasses.replace(config.ctx, round=round))
        masks = usual_masks(later, self.peer.me, masking, s_pks)
        return masks, self._x.dtype, int(self._x.shape[0])

    def premasked_input(self) -> np.ndarray | None:
        if self._premasked is None or self._y is not None:
            return None
        if self.peer.u2 is None:
            self.peer.close_shares()
        return self.masked_input() if self.peer.premask_exact() else None

    def masked_input(self) -> np.ndarray:
        if self._premasked is not None and self._y is None:  # premask's work is done
            if self.peer.u2 is None:
                self.peer.close_shares()
            self._y = self._premasked
            prg.add_masks(self._y, self.peer.settle_premask())  # usually no mask
            return self._y
        if self._y is not None:  # a later attempt: the same masked input, made again
            if self._source is not None:
                source, gen = self._source
                assert self.codec is not None
                self.codec.encode(source, copy.deepcopy(gen), out=self._x)
                return self.peer.masked_again(self._x, out=self._x)
            return self.peer.masked_again(self._x, out=self._y)
        if self.peer.u2 is None:  # no participants were settled: the shares held
            self.peer.close_shares()
        if self.codec is not None:  # the encoded vector is this session's own: mask in place
            self._y = self.peer.masked_input(self._x, out=self._x)
        else:
            self._y = self.peer.masked_input(self._x)
        return self._y

    def unmask(self, survivors: frozenset[str]) -> bytes:
        return self.peer.unmask(survivors).to_bytes()

    def receive_release(self, sender: str, data: bytes) -> None:
        msg = self._decode(UnmaskShares, sender, data)
        assert isinstance(msg, UnmaskShares)
        self.peer.receive_unmask(msg, authenticated=True)

    def self_seed(self) -> bytes:
        return self.peer.self_seed()

    def receive_seed(self, owner: str, seed: bytes) -> bool:
        return self.peer.receive_seed(owner, seed)

    def can_finish(self) -> bool:
        return not self.peer.missing_shares()

    def prepare_unmask(self) -> None:
        self.peer.prepare_finalize()

    def unmasked_sum(self, masked_sum: np.ndarray) -> np.ndarray:
        codec = self.codec
        if codec is None:
            return self.peer.finalize(masked_sum)
        out = np.empty(masked_sum.shape[0], dtype=np.float64)

        def decode(lo: int, part: np.ndarray) -> None:
            codec.decode(part, out=out[lo : lo + part.shape[0]])

        self.peer.finalize_into(masked_sum, decode)
        return out

    def unmask_part(self, masked_part: np.ndarray, offset: int) -> np.ndarray:
        return self.peer.finalize_part(masked_part, offset)

    def decode(self, total: np.ndarray) -> np.ndarray:
        return self.codec.decode(total) if self.codec is not None else total


def endpoint_signer(endpoint: Endpoint) -> tuple[SignFn, VerifyFn]:
    """Sign with the endpoint's org identity; verify against the federation's member keys."""

    def verify(sender: str, data: bytes, signature: bytes) -> bool:
        key = endpoint.guard.members().get(sender)
        return key is not None and verify_signature(key, data, signature)

    return endpoint.identity.sign, verify


def _fits(array: np.ndarray, x: np.ndarray) -> bool:
    """Whether ``array`` is a ring array of ``x``'s dtype and length."""
    return array.dtype == x.dtype and array.shape == x.shape


def secagg_sessions(
    sign: SignFn,
    verify: VerifyFn,
    *,
    codec: FixedPointCodec | None = None,
    seed: int | None = None,
) -> SessionFactory:
    """A :data:`SessionFactory` of :class:`SecAggSession`.

    ``seed`` makes every key, mask seed, Shamir coefficient and rounding draw a
    deterministic function of ``(seed, org, round)``; for test vectors and the
    simulator only, never in a deployment.
    """

    def factory(ctx: SessionContext) -> MaskedSum:
        rng: RandomBytes | None = None
        encode_rng: np.random.Generator | None = None
        if seed is not None:
            material = hashlib.sha256(
                f"{seed}\x00{ctx.run}\x00{ctx.round}\x00{ctx.org_id}".encode()
            ).digest()
            gen = np.random.default_rng(list(material))
            encode_rng = np.random.default_rng(list(material[::-1]))

            def rng(k: int) -> bytes:
                return gen.bytes(k)

        return SecAggSession(ctx, sign, verify, codec=codec, rng=rng, encode_rng=encode_rng)

    return factory
