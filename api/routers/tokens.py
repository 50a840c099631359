"""``/v1/tokens``: create (the secret is shown once), list, revoke. Admin only."""

from __future__ import annotations

from fastapi import APIRouter, HTTPException, status
from sqlmodel import col, func, select

from api.deps import CurrentPrincipal, IdempotencyKeyDep, PageDep, SessionDep, require_roles
from api.idempotency import request_hash, scope_of
from api.routers import ADMIN, ERRORS, conflict, not_found
from org_node.db.models import (
    ApiToken,
    IdempotencyRecord,
    Role,
    TokenCreate,
    TokenCreated,
    TokenPublic,
    TokensPublic,
    utcnow,
)
from org_node.db.repo import append_audit_event, create_token

__all__ = ["router"]

router = APIRouter(
    prefix="/v1/tokens",
    tags=["tokens"],
    responses=ERRORS,
    dependencies=[require_roles(*ADMIN)],
)


@router.post("", response_model=TokenCreated, status_code=status.HTTP_201_CREATED)
def create(
    body: TokenCreate,
    session: SessionDep,
    principal: CurrentPrincipal,
    idempotency_key: IdempotencyKeyDep,
) -> TokenCreated:
    """Create a token. Its secret is in this answer only; a retry with the same
    Idempotency-Key gets 409, since the secret is not kept."""
    scope = scope_of("tokens.create", principal)
    if idempotency_key is not None:
        seen = session.exec(
            select(IdempotencyRecord).where(
                IdempotencyRecord.scope == scope, IdempotencyRecord.key == idempotency_key
            )
        ).first()
        if seen is not None:
            raise conflict(
                f"token {seen.response.get('id')} was already created with this "
                "Idempotency-Key; its secret was shown once"
            )
    row, secret = create_token(session, body.name, body.role)
    public = TokenPublic.model_validate(row)
    if idempotency_key is not None:
        session.add(
            IdempotencyRecord(
                scope=scope,
                key=idempotency_key,
                request_hash=request_hash(body),
                status_code=201,
                response={"id": public.id},
            )
        )
    append_audit_event(session, stage="admin", kind="token.create", privacy_class="internal")
    session.commit()
    return TokenCreated(**public.model_dump(), token=secret)


@router.get("", response_model=TokensPublic)
def list_tokens(session: SessionDep, page: PageDep) -> TokensPublic:
    """Every token, revoked ones included, newest first; secrets are never listed."""
    count = session.exec(select(func.count()).select_from(ApiToken)).one()
    rows = session.exec(
        select(ApiToken).order_by(col(ApiToken.id).desc()).offset(page.offset).limit(page.limit)
    ).all()
    return TokensPublic(data=[TokenPublic.model_validate(r) for r in rows], count=count)


@router.delete("/{token_id}", response_model=TokenPublic)
def revoke(token_id: int, session: SessionDep) -> TokenPublic:
    """Revoke a token (it stops working at once). The last live admin token cannot be
    revoked: the node would have no administrator left."""
    if not 0 < token_id < 2**63:
        raise not_found("token")
    row = session.get(ApiToken, token_id)
    if row is None:
        raise not_found("token")
    if row.revoked_at is not None:
        raise conflict(f"token {token_id} is already revoked")
    if row.role == Role.ADMIN.value:
        admins = session.exec(
            select(func.count())
            .select_from(ApiToken)
            .where(ApiToken.role == Role.ADMIN.value, col(ApiToken.revoked_at).is_(None))
        ).one()
        if admins <= 1:
            raise HTTPException(
                status_code=status.HTTP_409_CONFLICT,
                detail="cannot revoke the last live admin token",
            )
    row.revoked_at = utcnow()
    session.add(row)
    append_audit_event(session, stage="admin", kind="token.revoke", privacy_class="internal")
    session.commit()
    session.refresh(row)
    return TokenPublic.model_validate(row)
