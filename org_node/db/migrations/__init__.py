"""The Alembic environment of the node's database (``env.py``, ``script.py.mako``).

What it owns: how a migration runs against the node's engine; the revisions are in
``versions``. What it may import: Alembic, SQLModel and :mod:`org_node.db.models`
(whose tables make the metadata).
"""
