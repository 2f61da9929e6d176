"""test_datapath's tests again, with ``response_processing: streamed``: every response
chunk through extproc, as before usage_trailers became the default."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.e2e.harness import Stack, running
from tests.e2e.test_datapath import *  # noqa: F403 - the same tests, collected again here

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    with running(Stack(tmp_path_factory.mktemp("streamed"), gateway={"response_processing": "streamed"})) as s:
        yield s


def test_streamed_path_sends_every_chunk_to_extproc(stack: Stack) -> None:
    text = stack.metrics_text()
    assert 'sluice_extproc_phase_seconds_count{phase="response_body"}' in text
    assert 'phase="response_trailers"' not in text
