"""Every operation of the OpenAPI spec, fuzzed by schemathesis (valid and invalid
inputs, with an admin token): no 5xx, and every response conforms to the spec (status
code, content type, body schema)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode
from schemathesis.core.result import Ok

from org_node.db.models import Role
from tests.api.conftest import Api, make_api, propose_run

MAX_EXAMPLES = 20


@pytest.fixture
def fuzzed(tmp_path: Path, migrated_sqlite: Path) -> Iterator[Api]:
    """A fresh node per generation mode (fuzzing revokes tokens, creates policies …)."""
    yield from make_api(tmp_path, template=migrated_sqlite)


def _operations(api: Api) -> list[Any]:
    schema = schemathesis.openapi.from_asgi("/openapi.json", api.app)
    operations = []
    for result in schema.get_all_operations():
        assert isinstance(result, Ok), f"invalid OpenAPI operation: {result}"
        operations.append(result.ok())
    return operations


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
def test_no_server_errors_and_responses_match_the_spec(fuzzed: Api, mode: GenerationMode) -> None:
    api = fuzzed
    (api.data_root / "data.csv").write_text("a,b\n1,2\n")
    propose_run(api)
    api.client.post("/v1/policies", json={"name": "base"}, headers=api.h())
    headers = api.h(Role.ADMIN)
    failures: list[str] = []
    skipped = 0
    operations = _operations(api)
    assert len(operations) >= 35
    for operation in operations:

        @given(case=operation.as_strategy(generation_mode=mode))
        @settings(
            max_examples=MAX_EXAMPLES,
            deadline=None,
            database=None,
            derandomize=True,
            suppress_health_check=list(HealthCheck),
        )
        def fuzz(case: Any) -> None:
            case.call_and_validate(headers=headers)

        try:
            fuzz()
        except Unsatisfiable:
            # No invalid input exists (e.g. no parameters at all): nothing to fuzz.
            assert mode is GenerationMode.NEGATIVE, operation.path
            skipped += 1
        except Exception as exc:  # collect every operation's failure, then report all
            failures.append(f"{operation.method.upper()} {operation.path}: {exc}")
        api.clock.now += api.app.state.auth_limiter.window_s
    assert not failures, "\n\n".join(failures)
    assert skipped < len(operations) // 2
