"""The org node's admin REST API and peer endpoints (FastAPI)."""

__all__: list[str] = []
