"""``/v1/policies``: what this org requires of every run it joins.

Every enabled policy is checked (:func:`org_node.policy.check_run_against_policy`)
before the org consents to a run and again before it starts. Updates name the version
they change: of two admins updating one policy, one wins and the other gets 409.
"""

from __future__ import annotations

from fastapi import APIRouter, Response, status
from pydantic import BaseModel
from sqlalchemy.exc import IntegrityError
from sqlmodel import Session, col, func, select

from api.deps import CurrentPrincipal, IdempotencyKeyDep, PageDep, SessionDep, require_roles
from api.idempotency import remember, replay, scope_of
from api.routers import ADMIN, ERRORS, READERS, conflict, not_found
from org_node.db.models import (
    PoliciesPublic,
    PolicyCreate,
    PolicyPublic,
    PolicyRecord,
    PolicyUpdate,
    RunSpecModel,
    utcnow,
)
from org_node.db.repo import append_audit_event, update_versioned
from org_node.policy import RunSpec
from org_node.run_store import policy_violations

__all__ = ["PolicyCheck", "PolicyViolation", "router", "violations"]

router = APIRouter(prefix="/v1/policies", tags=["policies"], responses=ERRORS)


class PolicyViolation(BaseModel):
    policy: str
    requirement: str
    message: str


class PolicyCheck(BaseModel):
    allowed: bool
    violations: list[PolicyViolation]


def violations(session: Session, spec: RunSpec) -> list[PolicyViolation]:
    """Every requirement of every enabled policy that ``spec`` breaks."""
    return [
        PolicyViolation(policy=name, requirement=v.requirement, message=v.message)
        for name, v in policy_violations(session, spec)
    ]


@router.post(
    "",
    response_model=PolicyPublic,
    status_code=status.HTTP_201_CREATED,
    dependencies=[require_roles(*ADMIN)],
)
def create(
    body: PolicyCreate,
    session: SessionDep,
    principal: CurrentPrincipal,
    idempotency_key: IdempotencyKeyDep,
) -> Response | PolicyPublic:
    scope = scope_of("policies.create", principal)
    if (earlier := replay(session, scope, idempotency_key, body)) is not None:
        return earlier
    if session.exec(select(PolicyRecord.id).where(PolicyRecord.name == body.name)).first():
        raise conflict(f"a policy named {body.name!r} exists")
    row = PolicyRecord.model_validate(body)
    session.add(row)
    try:
        session.flush()
        public = PolicyPublic.model_validate(row)
        remember(session, scope, idempotency_key, body, 201, public.model_dump(mode="json"))
        append_audit_event(session, stage="admin", kind="policy.create", privacy_class="internal")
        session.commit()
    except IntegrityError:
        session.rollback()
        if (earlier := replay(session, scope, idempotency_key, body)) is not None:
            return earlier
        raise conflict(f"a policy named {body.name!r} exists") from None
    return public


@router.get("", response_model=PoliciesPublic, dependencies=[require_roles(*READERS)])
def list_policies(session: SessionDep, page: PageDep) -> PoliciesPublic:
    count = session.exec(select(func.count()).select_from(PolicyRecord)).one()
    rows = session.exec(
        select(PolicyRecord).order_by(col(PolicyRecord.id)).offset(page.offset).limit(page.limit)
    ).all()
    return PoliciesPublic(data=[PolicyPublic.model_validate(r) for r in rows], count=count)


@router.post("/check", response_model=PolicyCheck, dependencies=[require_roles(*READERS)])
def check(spec: RunSpecModel, session: SessionDep) -> PolicyCheck:
    """Would this org join a run with this spec? Lists every violated requirement."""
    found = violations(session, spec.to_spec())
    return PolicyCheck(allowed=not found, violations=found)


def _get(session: Session, policy_id: int) -> PolicyRecord:
    row = session.get(PolicyRecord, policy_id) if 0 < policy_id < 2**63 else None
    if row is None:
        raise not_found("policy")
    return row


@router.get("/{policy_id}", response_model=PolicyPublic, dependencies=[require_roles(*READERS)])
def read(policy_id: int, session: SessionDep) -> PolicyPublic:
    return PolicyPublic.model_validate(_get(session, policy_id))


@router.patch("/{policy_id}", response_model=PolicyPublic, dependencies=[require_roles(*ADMIN)])
def update(policy_id: int, body: PolicyUpdate, session: SessionDep) -> PolicyPublic:
    """Change a policy. ``version`` must be the current one; a stale version gets 409 and
    changes nothing. A field sent as null is cleared (no requirement)."""
    _get(session, policy_id)
    values = body.model_dump(exclude_unset=True, exclude={"version"})
    if values.get("enabled", True) is None:
        del values["enabled"]
    if values.get("min_participants", 1) is None:
        del values["min_participants"]
    values["updated_at"] = utcnow()
    if not update_versioned(session, PolicyRecord, policy_id, body.version, values):
        session.rollback()
        current = _get(session, policy_id)
        raise conflict(f"policy version is {current.version}, not {body.version}: reload and retry")
    append_audit_event(session, stage="admin", kind="policy.update", privacy_class="internal")
    session.commit()
    session.expire_all()
    return PolicyPublic.model_validate(_get(session, policy_id))


@router.delete(
    "/{policy_id}", status_code=status.HTTP_204_NO_CONTENT, dependencies=[require_roles(*ADMIN)]
)
def delete(policy_id: int, session: SessionDep) -> Response:
    session.delete(_get(session, policy_id))
    append_audit_event(session, stage="admin", kind="policy.delete", privacy_class="internal")
    session.commit()
    return Response(status_code=status.HTTP_204_NO_CONTENT)
