"""The same persistence paths against a real PostgreSQL server.

Reads ``FEDWEAVE_TEST_POSTGRES_URL`` (``.ci/postgres`` starts a server and prints it).
Each test gets a fresh database, created and dropped here; the tests skip, saying why,
when the variable is unset or no server answers at that URL.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url
from sqlalchemy.exc import OperationalError

from org_node.db.engine import current_revision, head_revision, make_engine, migrate
from tests.api import (
    test_audit_routes,
    test_datasets,
    test_hot_paths,
    test_policies,
    test_runs,
    test_tokens,
)
from tests.api.conftest import Api, make_api
from tests.api.test_migrations import schema_drift

ENV = "FEDWEAVE_TEST_POSTGRES_URL"


@pytest.fixture
def pg_url() -> Iterator[str]:
    """A URL to a new, empty database on the test server (dropped afterwards)."""
    raw = os.environ.get(ENV)
    if not raw:
        pytest.skip(f"{ENV} is not set: no PostgreSQL server to test against")
    url = make_url(raw)
    if url.drivername == "postgresql":
        url = url.set(drivername="postgresql+psycopg")
    admin = create_engine(url, isolation_level="AUTOCOMMIT", connect_args={"connect_timeout": 3})
    name = f"fedweave_test_{uuid.uuid4().hex[:12]}"
    try:
        with admin.connect() as conn:
            conn.execute(text(f'CREATE DATABASE "{name}"'))
    except OperationalError as exc:
        admin.dispose()
        pytest.skip(f"no PostgreSQL server reachable at {ENV} ({type(exc.orig).__name__})")
    try:
        yield url.set(database=name).render_as_string(hide_password=False)
    finally:
        with admin.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


@pytest.fixture
def pg_api(tmp_path: Path, pg_url: str) -> Iterator[Api]:
    yield from make_api(tmp_path, url=pg_url)


def test_migrations_from_an_empty_postgres_database(pg_url: str) -> None:
    engine = make_engine(pg_url)
    try:
        assert current_revision(engine) is None
        migrate(engine)
        assert current_revision(engine) == head_revision()
        assert schema_drift(engine) == []
    finally:
        engine.dispose()


SHARED: list[Callable[[Api], None]] = [
    test_runs.test_full_life_cycle_calls_hooks_and_records_consent,
    test_runs.test_invalid_transition_is_409_naming_the_state,
    test_runs.test_refusing_hook_leaves_nothing_written,
    test_runs.test_two_operators_starting_one_run_one_wins,
    test_runs.test_idempotent_proposal,
    test_runs.test_metrics_by_round,
    test_runs.test_event_stream_follows_progress_until_the_end,
    test_tokens.test_create_shows_secret_once_and_stores_only_its_hash,
    test_tokens.test_every_authentication_failure_is_the_same_401,
    test_tokens.test_revoked_token_stops_working,
    test_datasets.test_register_a_file_and_read_it_back,
    test_datasets.test_duplicate_name_and_versioned_update,
    test_policies.test_two_admins_racing_one_wins,
    test_policies.test_versioned_update_is_atomic_across_sessions,
    test_policies.test_stale_update_is_409_and_changes_nothing,
    test_audit_routes.test_events_filter_and_paginate,
    test_audit_routes.test_report_totals_and_a_sound_chain,
    test_audit_routes.test_report_finds_a_tampered_entry,
    test_audit_routes.test_concurrent_appends_never_fork_the_chain,
    test_audit_routes.test_rolled_back_append_leaves_the_head_alone,
    test_hot_paths.test_a_get_after_a_write_elsewhere_sees_the_write,
    test_hot_paths.test_a_revoked_token_fails_on_the_next_request,
    test_hot_paths.test_last_used_is_written_at_most_once_a_minute,
    test_hot_paths.test_live_token_checks_like_find_token,
    test_hot_paths.test_the_events_listing_answers_the_generic_encoding,
    test_hot_paths.test_reads_stay_off_the_loop_where_they_must,
]


@pytest.mark.parametrize(
    "check", SHARED, ids=lambda f: f"{f.__module__.rsplit('.', 1)[-1]}.{f.__name__}"
)
def test_on_postgres(pg_api: Api, check: Callable[[Api], None]) -> None:
    check(pg_api)
