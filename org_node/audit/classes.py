"""Privacy classes of outbound messages, and the message-kind → class mapping.

Every message an org sends is put in one :class:`PrivacyClass` before it leaves
(``docs/SECURITY.md``, "Privacy audit"). The class says what the bytes can reveal:
a public key, a Shamir share encrypted to its holder, a chunk of a *masked* vector, a
chunk of the federation's *sum* (every survivor's update added together: what the
round gives every participant, never one org's update), a CKKS ciphertext, a model hash, membership/gossip state, a checkpoint shard (encrypted
with the owner's key before coding), or protocol control (views of agreed sets,
aborts, acknowledgements).

Three classes are **forbidden**: raw data, labels and an unmasked update must never
leave an org (DESIGN, threat model: "nothing raw leaves an org"). The egress hook
refuses them, and verification flags any that got into a log. An **unknown** kind is
refused too: a message is only sent once someone has decided what it reveals (fail
closed).

Replies (``KIND.reply``) carry the request's digest and the handler's answer: a reply
to a membership or gossip message carries membership updates and is classed
``membership``, a reply to a shard request (``shard.get``) carries shards and is
classed ``checkpoint_shard``, a reply to ``round.total`` (a member whose ring broke
asking one whose ring completed for the masked sum) carries that masked sum and is
classed ``masked_vector_chunk``, a reply to ``round.part`` (a member asking a chunk's
holder for its unmasked chunk of the sum) is classed ``aggregate_chunk``. The round's
pairwise exchanges answer a peer's message with the responder's own of the same kind
(one request per pair instead of two), so a reply to ``round.ready`` is classed
``encrypted_share``, to ``round.share`` ``encrypted_share`` and to ``round.unmask``
``released_share``, like the requests; every other reply is an acknowledgement
(``control``).

A ready (``round.ready``, and the relayed records of ``round.readies``) carries the
org's public keys and, from 33 members on, its Shamir shares sealed a round ahead
(``coordinator_free.rounds.ahead``), so it is classed by the more sensitive of the
two, ``encrypted_share``. Logs written before the shares rode with the readies class
it ``public_key``; :data:`FORMER_CLASSES` lists that, and verification accepts it.
The reply to an unknown kind is refused like the kind itself.
"""

from __future__ import annotations

from collections.abc import Mapping
from enum import StrEnum
from types import MappingProxyType

__all__ = [
    "FORBIDDEN_CLASSES",
    "FORMER_CLASSES",
    "KIND_CLASSES",
    "REPLY_SUFFIX",
    "ClassificationError",
    "ForbiddenClass",
    "PrivacyClass",
    "UnclassifiedKind",
    "classify",
    "former_classes",
    "is_head_message",
]

REPLY_SUFFIX = ".reply"


class PrivacyClass(StrEnum):
    """What an outbound message can reveal (values are the names written in logs)."""

    PUBLIC_KEY = "public_key"
    ENCRYPTED_SHARE = "encrypted_share"
    RELEASED_SHARE = "released_share"
    MASKED_CHUNK = "masked_vector_chunk"
    AGGREGATE_CHUNK = "aggregate_chunk"
    CIPHERTEXT = "ciphertext"
    MODEL_HASH = "model_hash"
    MEMBERSHIP = "membership"
    CHECKPOINT_SHARD = "checkpoint_shard"
    AUDIT_HEAD = "audit_head"
    CONTROL = "control"
    RAW_DATA = "raw_data"
    LABELS = "labels"
    UNMASKED_UPDATE = "unmasked_update"


FORBIDDEN_CLASSES: frozenset[PrivacyClass] = frozenset(
    {PrivacyClass.RAW_DATA, PrivacyClass.LABELS, PrivacyClass.UNMASKED_UPDATE}
)
"""Classes that must never leave an org."""

_RULES: dict[str, PrivacyClass] = {
    # membership and gossip (coordinator_free.membership, coordinator_free.gossip)
    "swim.": PrivacyClass.MEMBERSHIP,
    "gossip.": PrivacyClass.MEMBERSHIP,
    # the round engine (coordinator_free.rounds): round.ready carries AdvertiseKeys
    # (Bonawitz et al. §4 round 0) and the Shamir shares sealed a round ahead,
    # round.share the encrypted Shamir shares (round 1) of the pairs that did not
    # seal theirs ahead, round.unmask the shares released for unmasking (round 4)
    "round.ready": PrivacyClass.ENCRYPTED_SHARE,
    # round.readies: signed ready records relayed in batches (from 32 members on)
    "round.readies": PrivacyClass.ENCRYPTED_SHARE,
    "round.share": PrivacyClass.ENCRYPTED_SHARE,
    "round.unmask": PrivacyClass.RELEASED_SHARE,
    # round.seed: survivors' self-mask seeds, revealed by their owners once the
    # survivors are agreed: the very secret t released b-shares reconstruct
    "round.seed": PrivacyClass.RELEASED_SHARE,
    "round.permit": PrivacyClass.CONTROL,  # the hash of the survivors: seeds may go
    "round.view": PrivacyClass.CONTROL,
    "round.token": PrivacyClass.CONTROL,  # the agreement token
    # the agreement token's kind before it was named round.token: older logs hold it,
    # and verifying them classifies every entry again
    "round.commit": PrivacyClass.CONTROL,
    "round.leave": PrivacyClass.CONTROL,
    "round.total": PrivacyClass.CONTROL,  # (attempt, lo, hi): its reply is the sum piece
    "round.part": PrivacyClass.CONTROL,  # (attempt, chunk, lo, hi): its reply, of the sum
    "round.model": PrivacyClass.MODEL_HASH,
    # the ring reduce over masked vectors (coordinator_free.ring)
    "agg.chunk": PrivacyClass.MASKED_CHUNK,
    # the all-gather of the unmasked sum, after each member unmasked the chunks it holds
    "agg.sum": PrivacyClass.AGGREGATE_CHUNK,
    "agg.abort": PrivacyClass.CONTROL,
    "agg.ping": PrivacyClass.CONTROL,
    "ring.": PrivacyClass.MASKED_CHUNK,
    # secure_agg message names carried directly
    "secagg.advertise": PrivacyClass.PUBLIC_KEY,
    "secagg.share": PrivacyClass.ENCRYPTED_SHARE,
    "secagg.masked": PrivacyClass.MASKED_CHUNK,
    "secagg.unmask": PrivacyClass.RELEASED_SHARE,
    "ckks.": PrivacyClass.CIPHERTEXT,
    "shard.": PrivacyClass.CHECKPOINT_SHARD,
    "model.hash": PrivacyClass.MODEL_HASH,
    "audit.head": PrivacyClass.AUDIT_HEAD,
    "audit.heads": PrivacyClass.CONTROL,  # asks a peer for the heads it holds of the asker
    # forbidden: named so that a mistake is caught by name, not only as "unknown"
    "data.": PrivacyClass.RAW_DATA,
    "raw.": PrivacyClass.RAW_DATA,
    "labels.": PrivacyClass.LABELS,
    "update.": PrivacyClass.UNMASKED_UPDATE,
}

_REPLY_CARRIES = frozenset({PrivacyClass.MEMBERSHIP, PrivacyClass.CHECKPOINT_SHARD})
"""Classes whose replies carry data of the same class (membership updates, shards)."""

_REPLY_ANSWERS: Mapping[str, PrivacyClass] = MappingProxyType(
    {
        "round.total": PrivacyClass.MASKED_CHUNK,
        "round.part": PrivacyClass.AGGREGATE_CHUNK,
        "round.ready": PrivacyClass.ENCRYPTED_SHARE,
        "round.readies": PrivacyClass.ENCRYPTED_SHARE,
        "round.share": PrivacyClass.ENCRYPTED_SHARE,
        "round.unmask": PrivacyClass.RELEASED_SHARE,
        "audit.heads": PrivacyClass.AUDIT_HEAD,
    }
)
"""Kinds whose replies carry something of another class than the request."""

FORMER_CLASSES: Mapping[str, frozenset[PrivacyClass]] = MappingProxyType(
    {
        "round.ready": frozenset({PrivacyClass.PUBLIC_KEY}),
        "round.readies": frozenset({PrivacyClass.PUBLIC_KEY}),
    }
)
"""Classes a kind (and its reply) had in logs written before its content grew: a
ready was ``public_key`` before the shares rode with it."""


def former_classes(kind: str) -> frozenset[PrivacyClass]:
    """The classes ``kind`` had in older logs (empty for most kinds)."""
    return FORMER_CLASSES.get(kind.removesuffix(REPLY_SUFFIX), frozenset())


KIND_CLASSES: Mapping[str, PrivacyClass] = MappingProxyType(_RULES)
"""The mapping: a key ending in ``.`` is a prefix, any other key an exact kind or a
prefix followed by ``.`` (``round.ready`` covers ``round.ready.v2``)."""


class ClassificationError(Exception):
    """A message that the egress policy does not let out."""

    def __init__(self, kind: str, detail: str) -> None:
        super().__init__(detail)
        self.kind = kind


class UnclassifiedKind(ClassificationError):
    """No privacy class is known for this message kind; it is not sent."""

    def __init__(self, kind: str) -> None:
        super().__init__(kind, f"message kind {kind!r} has no privacy class: not sent")


class ForbiddenClass(ClassificationError):
    """The kind is of a forbidden class (raw data, labels, unmasked update)."""

    def __init__(self, kind: str, privacy_class: PrivacyClass) -> None:
        super().__init__(
            kind, f"message kind {kind!r} is {privacy_class.value}, which never leaves the org"
        )
        self.privacy_class = privacy_class


def _lookup(kind: str) -> PrivacyClass | None:
    best: tuple[int, PrivacyClass] | None = None
    for key, cls in _RULES.items():
        if key.endswith("."):
            hit = kind.startswith(key)
        else:
            hit = kind == key or kind.startswith(key + ".")
        if hit and (best is None or len(key) > best[0]):
            best = (len(key), cls)
    return None if best is None else best[1]


def classify(kind: str) -> PrivacyClass:
    """The privacy class of a message ``kind``; the longest matching rule wins.

    Raises :class:`UnclassifiedKind` for a kind no rule covers. Forbidden classes are
    returned, not raised: the egress hook refuses them, verification reports them.
    """
    if not isinstance(kind, str) or not kind:
        raise UnclassifiedKind(str(kind))
    if kind.endswith(REPLY_SUFFIX):
        request = kind[: -len(REPLY_SUFFIX)]
        base = _lookup(request)
        if base is None:
            raise UnclassifiedKind(kind)
        if request in _REPLY_ANSWERS:
            return _REPLY_ANSWERS[request]
        return base if base in _REPLY_CARRIES else PrivacyClass.CONTROL
    found = _lookup(kind)
    if found is None:
        raise UnclassifiedKind(kind)
    return found


def is_head_message(kind: str) -> bool:
    """Whether ``kind`` is a signed log head sent to a peer, or the reply to one: an
    ``audit.head`` message carries no data of the run it names."""
    return kind in ("audit.head", "audit.head" + REPLY_SUFFIX)
