"""The node's one settings object, read from ``FEDWEAVE_*`` environment variables.

``FEDWEAVE_DATABASE_URL`` selects PostgreSQL; without it the node keeps a SQLite file in
``FEDWEAVE_DATA_DIR``. The admin port binds to loopback unless
``FEDWEAVE_ALLOW_REMOTE_ADMIN=true``; CORS is off unless origins are listed; dataset
paths must lie under one of ``FEDWEAVE_DATASET_ROOTS`` (a JSON list).
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from org_node.config import is_loopback
from org_node.db.engine import default_database_url

__all__ = ["Settings"]


class Settings(BaseSettings):
    """Everything the admin API and the peer port are configured by."""

    model_config = SettingsConfigDict(env_prefix="FEDWEAVE_", extra="forbid", frozen=True)

    environment: Literal["development", "production"] = "production"
    """``development`` relaxes nothing security-relevant; it only marks logs and OpenAPI."""
    data_dir: Path = Path("fedweave-data")
    """The node's data directory (identity, SQLite database, local state)."""
    database_url: str | None = None
    """SQLAlchemy URL; None for ``sqlite:///DATA_DIR/fedweave.db``."""
    admin_host: str = "127.0.0.1"
    admin_port: int = Field(default=8470, ge=1, le=65535)
    allow_remote_admin: bool = False
    """Must be true for ``admin_host`` to be anything but a loopback address."""
    peer_host: str = "0.0.0.0"
    peer_port: int = Field(default=8471, ge=1, le=65535)
    dataset_roots: tuple[Path, ...] = ()
    """Directories under which datasets may be registered (symlinks resolved)."""
    max_request_bytes: int = Field(default=1 << 20, ge=1024, le=1 << 30)
    """Largest request body accepted; larger ones get 413."""
    cors_origins: tuple[str, ...] = ()
    """Origins allowed by CORS; empty turns CORS off."""
    auth_failure_limit: int = Field(default=20, ge=1, le=1_000_000)
    """Failed authentications per client address within the window before 429."""
    auth_failure_window_s: float = Field(default=60.0, gt=0, le=86_400)
    max_page_size: int = Field(default=1000, ge=1, le=100_000)

    @model_validator(mode="after")
    def _check(self) -> Settings:
        if not self.allow_remote_admin and not is_loopback(self.admin_host):
            raise ValueError(
                f"admin_host {self.admin_host!r} is not loopback; "
                "set allow_remote_admin to expose the admin API"
            )
        for root in self.dataset_roots:
            if not root.is_absolute():
                raise ValueError(f"dataset root {str(root)!r} must be an absolute path")
        for origin in self.cors_origins:
            if origin == "*":
                raise ValueError("a wildcard CORS origin is refused; list origins explicitly")
        return self

    @property
    def resolved_database_url(self) -> str:
        """The database URL in use."""
        return self.database_url or default_database_url(self.data_dir)
