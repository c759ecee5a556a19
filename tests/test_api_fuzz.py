"""The API's schema describes the API (issue 18 item 10): schemathesis generates requests for
every operation in /openapi.json, valid and invalid, against a real daemon on the fake engine.
No server error, no response that breaks its documented schema, no undocumented status code,
content type or header. Bounded (a few dozen examples per operation): slow, ~1-2 min."""

from __future__ import annotations

import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, settings
from schemathesis.checks import (
    content_type_conformance,
    not_a_server_error,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from tests.conftest import start_daemon

pytestmark = pytest.mark.slow

CHECKS = [
    not_a_server_error,
    status_code_conformance,
    response_schema_conformance,
    content_type_conformance,
    response_headers_conformance,
]


@pytest.fixture(scope="module")
def fuzzed_daemon(tmp_path_factory):
    from clawd.engines.fake import Engine

    d = start_daemon(tmp_path_factory.mktemp("clawd-home"), Engine(n_ctx=512))
    yield d
    d.stop()


@pytest.fixture(scope="module")
def api_schema(fuzzed_daemon):
    return schemathesis.openapi.from_url(fuzzed_daemon.url + "/openapi.json")


schema = schemathesis.pytest.from_fixture("api_schema")


@schema.parametrize()
@settings(
    max_examples=25,
    deadline=None,
    derandomize=True,  # the same examples every run: a failure here is reproducible
    suppress_health_check=list(HealthCheck),
    phases=[Phase.explicit, Phase.generate],
)
def test_every_operation_answers_as_documented(case, fuzzed_daemon):
    token = fuzzed_daemon.state.token
    case.call_and_validate(
        base_url=fuzzed_daemon.url, headers={"Authorization": f"Bearer {token}"}, checks=CHECKS, timeout=30
    )
