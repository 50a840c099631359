"""The Alembic revisions of the node's schema, oldest first (``0001`` …).

What it owns: each revision's ``upgrade`` and ``downgrade``: the schema change and the
data migration it needs, kept as written once released. What it may import: Alembic
and SQLAlchemy, and what a data migration must compute as the node does (``0004``
takes the run key from :mod:`org_node.run_config`); never ``api``.
"""
