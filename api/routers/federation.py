"""``/v1/federation``: the current manifest, its members, and proposals to add or remove
a member together with this org's signature on them.

There is no federation admin: a proposal becomes the next manifest version once a
quorum of current members has signed it (:mod:`coordinator_free.manifest`). Here the
org's admin proposes a change and signs proposals; the node gossips them.
"""

from __future__ import annotations

from typing import Annotated, Literal

from coordinator_free.errors import ManifestError
from coordinator_free.manifest import Manifest, Member
from fastapi import APIRouter, HTTPException, Path, status
from pydantic import BaseModel, Field

from api.deps import NodeDep, require_roles
from api.routers import ADMIN, ERRORS, READERS, conflict, not_found
from org_node.services import ServiceRefused

__all__ = [
    "ManifestPublic",
    "MemberIn",
    "MemberPublic",
    "MembersPublic",
    "ProposalCreate",
    "ProposalPublic",
    "ProposalsPublic",
    "router",
]

router = APIRouter(prefix="/v1/federation", tags=["federation"], responses=ERRORS)


class MemberPublic(BaseModel):
    org_id: str
    display_name: str
    endpoint: str
    fingerprint: str


class MembersPublic(BaseModel):
    data: list[MemberPublic]
    count: int


class ProposalPublic(BaseModel):
    digest: str
    version: int
    action: str
    org_id: str
    note: str
    created_at: int
    signers: list[str]


class ProposalsPublic(BaseModel):
    data: list[ProposalPublic]
    count: int


class ManifestPublic(BaseModel):
    federation: str
    version: int
    digest: str
    previous: str
    quorum: str
    members: list[MemberPublic]
    proposal: ProposalPublic
    signers: list[str]


class MemberIn(BaseModel):
    """The member record of an org to add (its certificate names its org id and key)."""

    model_config = {"extra": "forbid"}
    org_id: str = Field(min_length=1, max_length=100)
    display_name: str = Field(min_length=1, max_length=200)
    endpoint: str = Field(min_length=1, max_length=500)
    certificate_pem: str = Field(min_length=1, max_length=20_000)
    fingerprint: str = Field(pattern=r"^[0-9a-f]{64}$")
    public_key: str = Field(pattern=r"^[0-9a-f]{64}$", description="Ed25519 key, hex")


class ProposalCreate(BaseModel):
    model_config = {"extra": "forbid"}
    action: Literal["add", "remove"]
    member: MemberIn | None = Field(default=None, description="Required to add.")
    org_id: str | None = Field(default=None, max_length=100, description="Required to remove.")
    note: str = Field(default="", max_length=500)


def _member(m: Member) -> MemberPublic:
    return MemberPublic(
        org_id=m.org_id, display_name=m.display_name, endpoint=m.endpoint, fingerprint=m.fingerprint
    )


def _proposal(m: Manifest) -> ProposalPublic:
    return ProposalPublic(
        digest=m.digest,
        version=m.version,
        action=m.proposal.action,
        org_id=m.proposal.org_id,
        note=m.proposal.note,
        created_at=m.proposal.created_at,
        signers=[org for org, _ in m.signatures],
    )


def _unprocessable(message: str) -> HTTPException:
    return HTTPException(status_code=status.HTTP_422_UNPROCESSABLE_CONTENT, detail=message)


def _current(node: NodeDep) -> Manifest:
    manifest = node.manifest()
    if manifest is None:
        raise not_found("manifest (this org has not joined a federation)")
    return manifest


@router.get("/manifest", response_model=ManifestPublic, dependencies=[require_roles(*READERS)])
def manifest(node: NodeDep) -> ManifestPublic:
    """The current, verified manifest version."""
    m = _current(node)
    return ManifestPublic(
        federation=m.federation,
        version=m.version,
        digest=m.digest,
        previous=m.previous,
        quorum=m.quorum,
        members=[_member(x) for x in m.members],
        proposal=_proposal(m),
        signers=[org for org, _ in m.signatures],
    )


@router.get("/members", response_model=MembersPublic, dependencies=[require_roles(*READERS)])
def members(node: NodeDep) -> MembersPublic:
    data = [_member(x) for x in _current(node).members]
    return MembersPublic(data=data, count=len(data))


@router.get("/proposals", response_model=ProposalsPublic, dependencies=[require_roles(*READERS)])
def proposals(node: NodeDep) -> ProposalsPublic:
    """Proposed next versions not yet carried by a quorum."""
    data = [_proposal(p) for p in node.proposals()]
    return ProposalsPublic(data=data, count=len(data))


@router.post(
    "/proposals",
    response_model=ProposalPublic,
    status_code=status.HTTP_201_CREATED,
    dependencies=[require_roles(*ADMIN)],
)
def propose(body: ProposalCreate, node: NodeDep) -> ProposalPublic:
    """Propose adding or removing a member; this org signs its own proposal."""
    try:
        if body.action == "add":
            if body.member is None or body.org_id is not None:
                raise _unprocessable("to add, send 'member' and no 'org_id'")
            m = body.member
            member = Member(
                org_id=m.org_id,
                display_name=m.display_name,
                endpoint=m.endpoint,
                certificate_pem=m.certificate_pem,
                fingerprint=m.fingerprint,
                public_key=bytes.fromhex(m.public_key),
            )
            return _proposal(node.propose_add(member, body.note))
        if body.org_id is None or body.member is not None:
            raise _unprocessable("to remove, send 'org_id' and no 'member'")
        return _proposal(node.propose_remove(body.org_id, body.note))
    except ManifestError as exc:
        raise _unprocessable(str(exc)) from None
    except ServiceRefused as exc:
        raise conflict(str(exc)) from None


@router.post(
    "/proposals/{digest}/signature",
    response_model=ProposalPublic,
    dependencies=[require_roles(*ADMIN)],
)
def sign(node: NodeDep, digest: Annotated[str, Path(pattern=r"^[0-9a-f]{64}$")]) -> ProposalPublic:
    """Add this org's signature to a pending proposal."""
    if digest not in {p.digest for p in node.proposals()}:
        raise not_found("proposal")
    try:
        return _proposal(node.sign_proposal(digest))
    except ManifestError as exc:
        raise conflict(str(exc)) from None
    except ServiceRefused as exc:
        raise conflict(str(exc)) from None
