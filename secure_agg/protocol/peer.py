"""The state machine of one participant of a masked-sum round: :class:`SecAggPeer`.

Its stages, calls and messages are those of the package docstring
(:mod:`secure_agg.protocol`). The peer moves through the stages; what it holds
and the checks every call makes first are its base, :class:`~.state.PeerState`; what
it seals, opens and checks of the shares in transit is :mod:`.shares`; what finalize
reconstructs and removes is :mod:`.unmasking`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

import numpy as np
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

from secure_agg import prg, shamir
from secure_agg.errors import ConfigError, RingError
from secure_agg.keys import generate_keypair
from secure_agg.messages import (
    AdvertiseKeys,
    MalformedMessage,
    Message,
    ShareKeys,
    Stage,
    UnmaskShares,
    decode,
)
from secure_agg.protocol.config import (
    SEED_BYTES,
    ProtocolConfig,
    ShareKind,
    usable_public_key,
)
from secure_agg.protocol.errors import (
    BadVector,
    DoubleRelease,
    DuplicateMessage,
    InconsistentView,
    InvalidShare,
    OutOfStage,
    UnknownSender,
    WrongRecipient,
)
from secure_agg.protocol.prepared import pairwise_masks
from secure_agg.protocol.shares import check_release, open_shares, seal_shares
from secure_agg.protocol.state import OwnSecrets, PeerState
from secure_agg.protocol.unmasking import (
    CannotUnmask,
    Mask,
    UnmaskPlan,
    agreed_views,
    plan_unmasking,
    removal_masks,
    unremovable,
)
from secure_agg.ring import check_ring
from secure_agg.shamir import Share

__all__ = ["STREAM_CHUNK", "SecAggPeer"]

#: Elements per chunk of :meth:`SecAggPeer.finalize_into`: 8 MiB of a 64-bit ring.
STREAM_CHUNK = 1 << 20


class SecAggPeer(PeerState):
    """The state machine of one participant ``me`` (package docstring: stages and calls).

    sign: signs bytes with ``me``'s identity key.
    verify: ``verify(sender, data, signature)`` checks a participant's signature.
    rng: ``rng(k) -> k random bytes`` for keys, seeds, Shamir coefficients and nonces;
        default ``os.urandom``. Pass a deterministic one only for test vectors.
    masking: the ``s`` pair and ``b`` of this round drawn ahead
        (:class:`~.prepared.MaskingSecrets`), which :meth:`advertise_keys` takes
        instead of drawing its own; give one to one peer of one round only.
    """

    # ---------------------------------------------------------------- dispatch

    def receive(self, msg: Message | bytes) -> None:
        """Take in one message (decoded or raw bytes); ProtocolError leaves the state unchanged."""
        if isinstance(msg, bytes | bytearray | memoryview):
            msg = decode(bytes(msg))
        if isinstance(msg, AdvertiseKeys):
            self.receive_advertise(msg)
        elif isinstance(msg, ShareKeys):
            self.receive_shares(msg)
        elif isinstance(msg, UnmaskShares):
            self.receive_unmask(msg)
        else:
            raise MalformedMessage(f"expected a protocol message, got {type(msg).__name__}")

    # ---------------------------------------------------------------- stage 0

    def advertise_keys(self) -> AdvertiseKeys:
        """Round 0: draw the round's c and s key pairs and the self-mask seed b (s and b
        are the :class:`~.prepared.MaskingSecrets` drawn ahead, when the peer has them);
        advertise."""
        self._require_stage(Stage.ADVERTISE_KEYS, action="advertise_keys()")
        if self._secrets is not None:
            raise OutOfStage(f"{self.me} already advertised its keys this round")
        c = generate_keypair(self._rand(SEED_BYTES))
        if self._masking is not None:  # drawn ahead: the masks may be expanded already
            s, b = self._masking.s, self._masking.b
        else:
            s = generate_keypair(self._rand(SEED_BYTES))
            b = self._rand(SEED_BYTES)
        if c.public == s.public:
            raise ConfigError("rng returned the same bytes for both key pairs")
        msg = AdvertiseKeys(
            self._header(Stage.ADVERTISE_KEYS),
            c_pk=c.public,
            s_pk=s.public,
            b_commitment=shamir.commitment(b),
        ).signed(self._sign)
        self._secrets = OwnSecrets(c=c, s=s, b=b)
        self._adverts[self.me] = msg
        return msg

    def receive_advertise(self, msg: AdvertiseKeys, *, authenticated: bool = False) -> None:
        self._authenticate(msg, authenticated)
        self._require_stage(Stage.ADVERTISE_KEYS, action="receiving AdvertiseKeys")
        if msg.sender in self._adverts:
            raise DuplicateMessage(f"second AdvertiseKeys from {msg.sender!r}")
        if msg.sender in self.neighbours:  # the keys this peer agrees with before finalize
            for name, key in (("c_pk", msg.c_pk), ("s_pk", msg.s_pk)):
                if not usable_public_key(key):
                    raise MalformedMessage(f"{name} of {msg.sender!r} is not a usable X25519 key")
        self._adverts[msg.sender] = msg

    def close_advertise(self) -> frozenset[str]:
        """The AdvertiseKeys deadline passed: fix U1 (every advertiser, this peer included)."""
        self._require_stage(Stage.ADVERTISE_KEYS, action="close_advertise()")
        self._own()
        u1 = frozenset(self._adverts)
        holders = self.config.graph.closed(self.me) & u1
        self._need_threshold(len(holders), f"of {self.me}'s share holders advertised keys")
        self._u1 = u1
        self._stage = Stage.SHARE_KEYS
        return u1

    # ---------------------------------------------------------------- stage 1

    def _holders(self) -> list[str]:
        assert self._u1 is not None
        return sorted(self.config.graph.neighbours(self.me) & self._u1)

    def _split(self) -> tuple[list[Share], list[Share]]:
        """b and s_sk Shamir-shared t-of-(this peer's neighbours in U0), once per round:
        the shares :meth:`seal_ahead` and :meth:`share_keys` seal are the same ones."""
        if self._splits is None:
            own, cfg = self._own(), self.config
            top = max(cfg.index(h) for h in [*self.neighbours, self.me]) + 1
            s_sk = own.s.private.private_bytes_raw()
            b_shares = shamir.split(own.b, cfg.threshold, top, rng=self._rand)
            s_shares = shamir.split(s_sk, cfg.threshold, top, rng=self._rand)
            mine = cfg.index(self.me)
            self._held[self.me] = (b_shares[mine], s_shares[mine])
            self._splits = (b_shares, s_shares)
        return self._splits

    def _seal(self, holder: str, c_pk: bytes, *, ahead: bool) -> bytes:
        cfg, own = self.config, self._own()
        b_shares, s_shares = self._split()
        i = cfg.index(holder)
        pair = (b_shares[i], s_shares[i])
        return seal_shares(
            cfg, self.me, holder, own.c.private, c_pk, pair, self._rand(12), ahead=ahead
        )

    def seal_ahead(self, keys: Mapping[str, bytes]) -> dict[str, bytes]:
        """Round 0, shares sealed ahead: after :meth:`advertise_keys`, the ciphertext of
        this peer's two shares for each neighbour in ``keys`` (holder -> an X25519 public
        key the holder advertised in an earlier round and keeps), under the agreement
        of this round's ``c`` key with it, so that they travel with this peer's
        advertisement, before U1. A key that is not a usable X25519 key is skipped."""
        self._require_stage(Stage.ADVERTISE_KEYS, action="seal_ahead()")
        holders = sorted(h for h in self.neighbours & keys.keys() if usable_public_key(keys[h]))
        return {h: self._seal(h, keys[h], ahead=True) for h in holders}

    def open_ahead(self, sender: str, ciphertext: bytes, key: X25519PrivateKey) -> None:
        """Round 0: take the shares ``sender`` sealed ahead for this peer
        (:meth:`seal_ahead`), given the private half of the key they were sealed to;
        after ``sender``'s AdvertiseKeys. :class:`InvalidShare` when they do not open."""
        self._require_stage(Stage.ADVERTISE_KEYS, action="open_ahead()")
        if sender not in self._adverts or sender not in self.neighbours:
            raise UnknownSender(f"{sender!r} is no neighbour of {self.me} that advertised keys")
        if sender in self._held:
            raise DuplicateMessage(f"second shares from {sender!r}")
        c_pk = self._adverts[sender].c_pk
        self._held[sender] = open_shares(
            self.config, sender, self.me, key, c_pk, ciphertext, ahead=True
        )

    def share_keys(self, only: Iterable[str] | None = None) -> dict[str, ShareKeys]:
        """Round 1: Shamir-share b and s_sk t-of-(holders), encrypt each pair to its holder
        (every holder in U1, or those of ``only``: the others hold them sealed ahead)."""
        self._require_stage(Stage.SHARE_KEYS, action="share_keys()")
        if self._shared:
            raise OutOfStage(f"{self.me} already sent its shares this round")
        holders = self._holders()
        if only is not None:
            wanted = frozenset(only)
            holders = [h for h in holders if h in wanted]
        self._split()
        out: dict[str, ShareKeys] = {}
        for h in holders:
            blob = self._seal(h, self._adverts[h].c_pk, ahead=False)
            out[h] = ShareKeys(self._header(Stage.SHARE_KEYS), recipient=h, ciphertext=blob).signed(
                self._sign
            )
        self._shared = True
        return out

    def receive_shares(self, msg: ShareKeys, *, authenticated: bool = False) -> None:
        self._authenticate(msg, authenticated)
        self._require_stage(Stage.SHARE_KEYS, action="receiving ShareKeys")
        sender = msg.sender
        assert self._u1 is not None
        if sender not in self._u1:
            raise UnknownSender(
                f"{sender!r} did not advertise keys before the deadline (not in U1)"
            )
        if sender not in self.neighbours:
            raise UnknownSender(f"{sender!r} is not a neighbour of {self.me} in the SecAgg+ graph")
        if msg.recipient != self.me:
            raise WrongRecipient(
                f"ShareKeys from {sender!r} is addressed to {msg.recipient!r}, not {self.me}"
            )
        if sender in self._held:
            raise DuplicateMessage(f"second ShareKeys from {sender!r}")
        own = self._own()
        c_pk = self._adverts[sender].c_pk
        self._held[sender] = open_shares(
            self.config, sender, self.me, own.c.private, c_pk, msg.ciphertext
        )

    def close_shares(self, participants: Iterable[str] | None = None) -> frozenset[str]:
        """The ShareKeys deadline passed: fix U2, the orgs whose shares this peer holds.

        ``participants``: the set the members agreed after the shares (``U1`` of the
        round engine), when there is one. U2 is then this peer's neighbourhood among
        them, exactly, so that every member knows which pairwise masks this peer's
        masked input carries without being told: a participant whose shares this peer
        does not hold raises :class:`InconsistentView` (nothing changes), and shares
        of orgs outside them are neither masked with nor released.
        """
        self._require_stage(Stage.SHARE_KEYS, action="close_shares()")
        if not self._shared:
            raise OutOfStage("share_keys() must be called before close_shares()")
        u2 = frozenset(self._held)
        agreed = None
        if participants is not None:
            agreed = frozenset(participants)
            assert self._u1 is not None
            strangers = sorted(agreed - self._u1)
            if strangers or self.me not in agreed:
                raise InconsistentView(
                    f"participants {sorted(agreed)} are not a set of U1 orgs with {self.me}"
                )
            lacking = sorted((self.neighbours & agreed) - u2)
            if lacking:
                raise InconsistentView(
                    f"{self.me} holds no shares of participants {lacking}: its masked input "
                    "would carry other masks than the participants know of"
                )
            u2 &= agreed
        self._need_threshold(len(u2), f"orgs of {self.me}'s neighbourhood shared keys")
        self._u2 = u2
        self._participants = agreed
        self._stage = Stage.MASKED_INPUT
        return u2

    def narrow(self, participants: Iterable[str]) -> frozenset[str]:
        """The members settled on fewer participants than :meth:`close_shares` was
        given: U2 narrows to this peer's neighbourhood among them, and the masked input
        made from here on (:meth:`masked_input`, :meth:`masked_again`) carries exactly
        their pairwise masks. For a caller that masked with the participants it
        proposed and sent that input before the agreement settled a subset (the round
        engine's ring started first): the two inputs differ only by the pairwise
        masks with the orgs left out, whose shares this peer never releases
        (``docs/SECURITY.md``, "A ring started before the participants are settled").
        Only in ``MASKED_INPUT``, after :meth:`close_shares` with participants; a set
        that is not a subset holding this peer raises :class:`InconsistentView`
        (nothing changes), a neighbourhood below the threshold aborts the round.
        """
        self._require_stage(Stage.MASKED_INPUT, action="narrow()")
        if self._participants is None or self._u2 is None:
            raise OutOfStage("close_shares() with the participants must come before narrow()")
        agreed = frozenset(participants)
        if not agreed <= self._participants or self.me not in agreed:
            raise InconsistentView(
                f"participants {sorted(agreed)} are not a subset of {sorted(self._participants)} "
                f"with {self.me}"
            )
        u2 = self._u2 & agreed
        self._need_threshold(len(u2), f"orgs of {self.me}'s neighbourhood shared keys")
        self._u2 = u2
        self._participants = agreed
        return u2

    # ---------------------------------------------------------------- stage 2

    def masked_input(self, x: np.ndarray, *, out: np.ndarray | None = None) -> np.ndarray:
        """Round 2: ``y = x + PRG(b) + sum_j sign PRG(s_ij)`` over neighbours j in U2.

        ``y`` is a new array unless ``out`` is given: a C-contiguous, writeable ring
        array of ``x``'s dtype and length (``x`` itself masks in place), which receives
        ``y`` and is returned. A caller that owns its encoded vector (the round engine
        does) saves the allocation and first-touch of a vector-sized array that way.
        """
        self._require_stage(Stage.MASKED_INPUT, action="masked_input()")
        if self._masked or self._premasked is not None:
            raise OutOfStage(f"{self.me} already produced its masked input this round")
        in_place = _masks_in_place(self.me, self.config, x, out)
        y = np.empty_like(x) if out is None else out
        prg.add_masks(y, self._input_masks(), base=None if in_place else x)
        self._masked = True
        return y

    def masked_again(self, x: np.ndarray, *, out: np.ndarray | None = None) -> np.ndarray:
        """The masked input of :meth:`masked_input` once more, from the same ``x``: the
        same masks, so the same ``y``, bit for bit.

        For a caller that summed its masked input in place (a ring that broke) and must
        send it again over the survivors: regenerating ``y`` costs one more mask
        expansion, holding it costs a vector. Allowed only after :meth:`masked_input`
        and before the unmask stage; ``out`` as there.
        """
        self._require_stage(Stage.MASKED_INPUT, action="masked_again()")
        if not self._masked:
            raise OutOfStage("masked_input() must be called before masked_again()")
        in_place = _masks_in_place(self.me, self.config, x, out)
        y = np.empty_like(x) if out is None else out
        prg.add_masks(y, self._input_masks(), base=None if in_place else x)
        return y

    def premask(self) -> list[Mask]:
        """The masks :meth:`masked_input` adds when every neighbour in U1 shares its keys
        (the usual case), handed out in ``SHARE_KEYS``, before U2 is fixed: a caller may
        expand them into its input while the shares travel (nothing masked leaves the
        caller before :meth:`settle_premask`), then take :meth:`settle_premask`'s
        masks, which make the vector exactly :meth:`masked_input`'s ``y``. Once per
        round, and instead of :meth:`masked_input`."""
        self._require_stage(Stage.SHARE_KEYS, action="premask()")
        if self._premasked is not None or self._masked:
            raise OutOfStage(f"{self.me} already masked its input this round")
        assert self._u1 is not None
        self._premasked = (self.neighbours & self._u1) - {self.me}
        return [(self._own().b, 1), *self._pairwise(self._premasked, 1)]

    def settle_premask(self) -> list[Mask]:
        """After :meth:`close_shares`: the masks that turn the input :meth:`premask`'s
        masks were added to into :meth:`masked_input`'s ``y``: the pairwise mask of each
        premasked neighbour outside U2 taken off again (none in the usual case). The
        input counts as masked from here on (:meth:`masked_again` may follow)."""
        self._require_stage(Stage.MASKED_INPUT, action="settle_premask()")
        if self._premasked is None or self._masked:
            raise OutOfStage(f"{self.me} has no premasked input to settle")
        assert self._u2 is not None
        # U2 is the neighbours in U1 whose shares came: never more than premask took
        assert self._u2 - {self.me} <= self._premasked
        self._masked = True
        return self._pairwise(self._premasked - self._u2, -1)

    def premask_exact(self) -> bool:
        """After :meth:`close_shares`: whether the masks :meth:`premask` handed out are
        exactly those of U2 (the usual case), so :meth:`settle_premask` has none to return."""
        return (
            self._premasked is not None
            and self._u2 is not None
            and not self._masked
            and self._premasked == self._u2 - {self.me}
        )

    def _input_masks(self) -> list[Mask]:
        """``(seed, sign)`` of this peer's self mask and of its pairwise mask with each
        neighbour in U2."""
        assert self._u2 is not None
        return [(self._own().b, 1), *self._pairwise(self._u2 - {self.me}, 1)]

    def _pairwise(self, others: frozenset[str], sign: int) -> list[Mask]:
        """``(seed, sign * s_ij)`` of this peer's pairwise mask with each of ``others``."""
        s_pks = {j: self._adverts[j].s_pk for j in others}
        return pairwise_masks(self.config, self.me, self._own().s, s_pks, others, sign)

    # ---------------------------------------------------------------- stage 3

    def unmask(
        self, survivors: Iterable[str], views: Mapping[str, Iterable[str]] | None = None
    ) -> UnmaskShares:
        """Round 4: release b-shares of survivors U3 and s_sk-shares of dropped holders-of-shares.

        ``views``: the survivors' agreed U2 views (each survivor's own, as its masked
        input committed to it): which dropped orgs' pairwise masks each masked input
        carries. Without them, when :meth:`close_shares` was given the agreed
        participants, each survivor's view is its neighbourhood among them. With
        either, a dropped org whose masks fewer than ``t`` survivors hold shares to
        remove aborts the round here, naming it, before anything is released; without
        either, only the views the releases report are known (see :meth:`finalize`).

        May be called again in UNMASK with a revised survivor set; it then refuses
        (:class:`DoubleRelease`) to release the other kind of share for any org.
        """
        self._require_stage(Stage.MASKED_INPUT, Stage.UNMASK, action="unmask()")
        cfg = self.config
        u3 = frozenset(survivors)
        assert self._u1 is not None and self._u2 is not None
        unknown = sorted(u3 - self._u1)
        if unknown:
            raise InconsistentView(f"survivors {unknown} never advertised keys (not in U1)")
        if self.me in u3:
            if not self._masked:
                raise InconsistentView(
                    f"{self.me} is listed as a survivor but produced no masked input"
                )
            missing = sorted((u3 & self.neighbours) - self._u2)
            if missing:
                raise InconsistentView(
                    f"survivors {missing} sent no shares to {self.me}: their masks with it would not cancel"
                )
        agreed = self._agreed_views(u3, views)
        if self._seeds and u3 != self._u3:
            raise DoubleRelease(
                f"{self.me} refuses another survivor set: the self-mask seeds of "
                f"{sorted(self._seeds)} were revealed for the agreed one"
            )
        t = cfg.threshold
        release: dict[str, ShareKind] = {}
        for owner in self._u2:
            release[owner] = "b" if owner in u3 else "s"
        for owner, kind in release.items():
            earlier = self._released.get(owner)
            if earlier is not None and earlier != kind:
                raise DoubleRelease(
                    f"{self.me} refuses to release the {'b' if kind == 'b' else 's_sk'}-share of {owner!r}: "
                    f"its {'b' if earlier == 'b' else 's_sk'}-share was already released"
                )
        if len(u3) < t:
            raise self._abort(
                f"only {len(u3)} survivors, threshold is {t}: the sum would expose too few orgs"
            )
        stuck = None if agreed is None else unremovable(cfg, u3, agreed)
        if stuck is not None:
            raise self._abort(stuck)
        msg = UnmaskShares(
            self._header(Stage.UNMASK),
            survivors=tuple(sorted(u3)),
            received_from=tuple(sorted(self._u2)),
            b_shares=tuple((o, self._held[o][0]) for o in sorted(release) if release[o] == "b"),
            s_shares=tuple((o, self._held[o][1]) for o in sorted(release) if release[o] == "s"),
        ).signed(self._sign)
        self._released.update(release)
        if self._u3 != u3:
            self._unmasks = {}
        self._u3 = u3
        self._views = agreed
        self._unmasks[self.me] = msg
        self._stage = Stage.UNMASK
        return msg

    def _agreed_views(
        self, u3: frozenset[str], views: Mapping[str, Iterable[str]] | None
    ) -> dict[str, frozenset[str]] | None:
        """The survivors' agreed U2 views for ``u3`` (see :meth:`unmask`), checked;
        :class:`InconsistentView` when they do not fit this peer's round."""
        assert self._u1 is not None and self._u2 is not None
        if views is None and self._participants is not None:
            outside = sorted(u3 - self._participants)
            if outside:
                raise InconsistentView(f"survivors {outside} are not among the participants")
            graph, agreed_set = self.config.graph, self._participants
            views = {j: graph.closed(j) & agreed_set for j in u3}
        if views is None:
            return None
        agreed = agreed_views(self.config, self._u1, u3, views)
        if self.me in u3 and agreed[self.me] != self._u2:
            raise InconsistentView(
                f"the agreed U2 view of {self.me} is not the set whose shares it masked with"
            )
        if self._u3 == u3 and agreed != self._views:
            raise InconsistentView("other U2 views for the survivor set already answered")
        return agreed

    def receive_unmask(self, msg: UnmaskShares, *, authenticated: bool = False) -> None:
        self._authenticate(msg, authenticated)
        self._require_stage(Stage.UNMASK, action="receiving UnmaskShares")
        assert self._u1 is not None and self._u3 is not None
        check_release(
            self.config, msg, u1=self._u1, u3=self._u3, heard=self._unmasks, views=self._views
        )
        self._unmasks[msg.sender] = msg

    def self_seed(self) -> bytes:
        """This survivor's own self-mask seed ``b``, to reveal to the other survivors.

        Bonawitz et al. reconstruct ``b_i`` of every survivor from ``t`` released
        shares; the owner revealing ``b_i`` itself gives every survivor the same value
        (checked against the commitment advertised in round 0) for one message instead
        of ``t``, and no reconstruction. It is allowed only in UNMASK, after
        :meth:`unmask` fixed a survivor set that contains this peer: from then on no
        honest holder releases this peer's ``s_sk``-share, and :meth:`unmask` refuses
        any other survivor set (:class:`DoubleRelease`), so ``b_i`` and ``s_sk_i`` are
        never both known, as with released shares.
        """
        self._require_stage(Stage.UNMASK, action="self_seed()")
        assert self._u3 is not None
        if self.me not in self._u3:
            raise InconsistentView(f"{self.me} is not a survivor: its self mask is not removed")
        b = self._own().b
        self._seeds[self.me] = b
        return b

    def receive_seed(self, owner: str, seed: bytes) -> bool:
        """Take a survivor's revealed self-mask seed; ``False`` when already held.

        The seed may come relayed by any survivor: it is checked against the
        commitment ``owner`` advertised in round 0 (:class:`InvalidShare` otherwise),
        which binds it. Raises :class:`InconsistentView` for an owner that is not a
        survivor. A refused seed changes nothing.
        """
        self._require_stage(Stage.UNMASK, action="receiving a self-mask seed")
        assert self._u3 is not None
        if not isinstance(seed, bytes) or len(seed) != SEED_BYTES:
            raise MalformedMessage(f"a self-mask seed is {SEED_BYTES} bytes")
        if owner not in self._u3:
            raise InconsistentView(f"a self-mask seed of {owner!r}, which is not a survivor")
        held = self._seeds.get(owner)
        if held is not None:
            if held != seed:
                raise InvalidShare(f"a second, different self-mask seed of {owner!r}")
            return False
        if shamir.commitment(seed) != self._adverts[owner].b_commitment:
            raise InvalidShare(f"the self-mask seed of {owner!r} does not match its commitment")
        self._seeds[owner] = seed
        return True

    @property
    def seeds(self) -> Mapping[str, bytes]:
        """The survivors' self-mask seeds held so far (revealed, never reconstructed)."""
        return dict(self._seeds)

    def _plan(self) -> UnmaskPlan:
        """Which secrets to reconstruct and which (survivor, dropped) masks to remove."""
        assert self._u3 is not None
        assert self._u1 is not None
        return plan_unmasking(
            self.config,
            self.me,
            self._u3,
            self._unmasks,
            self._seeds,
            agreed=self._views,
            u1=self._u1,
        )

    def missing_shares(self) -> dict[str, int]:
        """Per org whose secret finalize needs: how many more shares must still arrive."""
        self._require_stage(Stage.UNMASK, action="missing_shares()")
        return self._plan().missing(self.config.threshold)

    def finalize(self, masked_sum: np.ndarray, *, in_place: bool = False) -> np.ndarray:
        """Remove every mask from the sum of the survivors' masked inputs; return sum x over U3.

        Takes b_j for j in U3 as revealed (:meth:`receive_seed`) or reconstructs it,
        and s_sk_k for each dropped k some survivor masked with, checks them against
        the advertised commitment and public key, then
        subtracts ``PRG(b_j)`` and each dangling ``sign PRG(s_jk)`` with
        :func:`secure_agg.prg.add_masks` (chunked, no full-size temporary). A missing
        share or a reconstruction that fails its check aborts the round.
        """
        self._require_stage(Stage.UNMASK, action="finalize()")
        self._check_sum(masked_sum)
        masks = self._removal()
        if in_place:
            z = masked_sum
            prg.add_masks(z, masks)
        else:  # one pass from the sum into a fresh array: no copy first
            z = np.empty_like(masked_sum)
            prg.add_masks(z, masks, base=masked_sum)
        self._stage = Stage.DONE
        return z

    def _check_sum(self, masked_sum: np.ndarray) -> None:
        """A masked sum is a ring vector of this round's length (:class:`BadVector`)."""
        cfg = self.config
        try:
            check_ring(masked_sum, cfg.bits, cfg.vector_length)
        except RingError as exc:
            raise BadVector(f"masked sum: {exc}") from None

    def finalize_into(
        self,
        masked_sum: np.ndarray,
        sink: Callable[[int, np.ndarray], None],
        *,
        chunk: int = STREAM_CHUNK,
    ) -> None:
        """:meth:`finalize`, streamed: the unmasked sum goes to ``sink(offset, part)``
        chunk by chunk, ``part`` being elements ``[offset, offset + len(part))`` in one
        scratch buffer of ``chunk`` elements that the next call overwrites (the sink
        copies or decodes what it keeps). ``masked_sum`` is left as it is, and no
        vector-sized array is made: the masks of each chunk are expanded from its
        offset on (:func:`secure_agg.prg.add_masks`), so the parts are exactly those of
        :meth:`finalize`, whatever ``chunk``.
        """
        self._require_stage(Stage.UNMASK, action="finalize_into()")
        self._check_sum(masked_sum)
        if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
            raise ConfigError(f"chunk must be a positive int, got {chunk!r}")
        masks = self._removal()
        length = masked_sum.shape[0]
        scratch = np.empty(min(chunk, length), dtype=masked_sum.dtype)
        for lo in range(0, length, chunk):
            hi = min(length, lo + chunk)
            part = scratch[: hi - lo]
            prg.add_masks(part, masks, base=masked_sum[lo:hi], offset=lo)
            sink(lo, part)
        self._stage = Stage.DONE

    def finalize_part(self, masked_part: np.ndarray, offset: int) -> np.ndarray:
        """Elements ``[offset, offset + len(masked_part))`` of the unmasked sum, a new array.

        The same masks as :meth:`finalize` removes, expanded from ``offset`` on only
        (:func:`secure_agg.prg.add_masks`), so each org of a ring can unmask the chunk
        of the masked sum it holds for ``len / n`` of the work of the whole vector and
        the plain chunks travel on (``coordinator_free.rounds``). It may be called for
        several parts, before or after :meth:`finalize`; the secrets are reconstructed
        once, from the releases taken by the first call.
        """
        self._require_stage(Stage.UNMASK, Stage.DONE, action="finalize_part()")
        cfg = self.config
        if isinstance(offset, bool) or not isinstance(offset, int) or offset < 0:
            raise BadVector(f"offset must be a non-negative int, got {offset!r}")
        try:
            check_ring(masked_part, cfg.bits)
        except RingError as exc:
            raise BadVector(f"masked part: {exc}") from None
        if offset + masked_part.shape[0] > cfg.vector_length:
            raise BadVector(
                f"part [{offset}, {offset + masked_part.shape[0]}) runs past the "
                f"vector's {cfg.vector_length} elements"
            )
        z = np.empty_like(masked_part)
        prg.add_masks(z, self._removal(), base=np.ascontiguousarray(masked_part), offset=offset)
        return z

    def prepare_finalize(self) -> None:
        """Reconstruct, from the releases and seeds taken so far, every secret the masks
        to remove need (once per round; :meth:`finalize` would at its first call).
        After it the ``finalize*`` methods only expand masks and read nothing that a
        later message changes, so a caller may run them off its event loop while it
        goes on taking messages. Raises as :meth:`finalize` does."""
        self._require_stage(Stage.UNMASK, Stage.DONE, action="prepare_finalize()")
        self._removal()

    def _removal(self) -> list[Mask]:
        """The ``(seed, sign)`` of every mask the sum still carries, reconstructed from
        the releases taken so far and checked; computed once per round."""
        if self._removal_masks is not None:
            return self._removal_masks
        known = dict(self._seeds)
        if self._u3 is not None and self.me in self._u3:
            known[self.me] = self._own().b
        try:
            masks = removal_masks(self.config, self._plan(), known, self._adverts)
        except (InconsistentView, CannotUnmask) as exc:
            raise self._abort(str(exc)) from None
        self._removal_masks = masks
        return masks


def _masks_in_place(me: str, config: ProtocolConfig, x: np.ndarray, out: np.ndarray | None) -> bool:
    """Check ``masked_input``'s input and ``out`` (:class:`BadVector`); whether ``out``
    is ``x`` itself, so that the masks are added in place."""
    try:
        check_ring(x, config.bits, config.vector_length)
        if out is not None:
            check_ring(out, config.bits, config.vector_length)
    except RingError as exc:
        raise BadVector(f"input of {me}: {exc}") from None
    if out is None:
        return False
    if out.dtype != x.dtype or not out.flags.c_contiguous or not out.flags.writeable:
        raise BadVector(f"out for {me} must be a C-contiguous, writeable {x.dtype} array")
    in_place = out is x or (
        out.__array_interface__["data"][0] == x.__array_interface__["data"][0]
        and out.strides == x.strides
    )
    if not in_place and np.may_share_memory(out, x):
        raise BadVector(f"out for {me} overlaps the input without being it")
    return in_place
