"""API fuzzing of `batchspec serve` with schemathesis: requests generated from the server's own `/openapi.json` —
bodies that fit the schema and bodies that do not, for every operation — must never get a 5xx. Bounded examples,
derandomized (the same cases on every run)."""

from __future__ import annotations

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis.checks import not_a_server_error
from schemathesis.generation.modes import GenerationMode
from test_server import MODEL, server, tiny_target  # noqa: F401 (fixtures: a tetris server on tiny models)

EXAMPLES = 150  # per generation mode, across all operations


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
def test_generated_requests_never_get_a_server_error(server, mode):  # noqa: F811
    schema = schemathesis.openapi.from_url(server.url + "/openapi.json")
    seen = []

    def served_model(case):  # a random model name only ever reaches the 404: name the served one
        if isinstance(case.body, dict) and isinstance(case.body.get("model"), str):
            case.body["model"] = MODEL
        return case

    @given(case=schema.as_strategy(generation_mode=mode).map(served_model))
    @settings(max_examples=EXAMPLES, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
    def fuzz(case):
        seen.append(case.call_and_validate(base_url=server.url, checks=[not_a_server_error]).status_code)

    fuzz()
    assert len(seen) >= EXAMPLES // 2 and all(status < 500 for status in seen)
