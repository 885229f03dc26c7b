"""Property-based run over the app's own OpenAPI schema (schemathesis, positive and negative data): whatever
the body, the answer is never a 5xx, and every 4xx carries OpenAI's error object."""
from pathlib import Path

import pytest

schemathesis = pytest.importorskip("schemathesis")

from hypothesis import HealthCheck, settings  # noqa: E402
from schemathesis.checks import not_a_server_error  # noqa: E402
from schemathesis.generation import GenerationMode  # noqa: E402

from opt_serving.service.app import create_app  # noqa: E402
from opt_serving.text.fake import fake_generator  # noqa: E402

GENERATOR = fake_generator(num_slots=4, max_seq_len=64, max_queue=64)
# with a chat template, so that /v1/chat/completions renders whatever messages come
TEMPLATE = (Path(__file__).resolve().parents[1] / "deploy" / "opt-chat-template.jinja").read_text()
schema = schemathesis.openapi.from_asgi("/openapi.json", create_app(GENERATOR, chat_template=TEMPLATE))
schema.config.generation.update(modes=[GenerationMode.POSITIVE, GenerationMode.NEGATIVE])


@pytest.fixture(scope="module", autouse=True)
def _close_generator():
    yield
    GENERATOR.close()


@schema.parametrize()
# derandomized: the same examples every run, so CI is deterministic; raise max_examples locally to explore
@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
def test_no_server_errors(case):
    response = case.call()
    case.validate_response(response, checks=[not_a_server_error])
    assert response.status_code < 500, response.text
    if 400 <= response.status_code < 500:
        err = response.json()["error"]
        assert isinstance(err["message"], str) and err["message"]
