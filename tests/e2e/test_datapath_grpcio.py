"""test_datapath's tests again with Sluice's port served by grpc.aio (``serve --grpc-stack
grpcio``) instead of its own HTTP/2 server (``extproc.wire.h2grpc``, the default): the
same answers, holds and settles whichever stack carries the ext_proc stream."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.e2e.harness import Stack, running
from tests.e2e.test_datapath import *  # noqa: F403 - the same tests, collected again here

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    with running(Stack(tmp_path_factory.mktemp("grpcio"), extproc_args=["--grpc-stack", "grpcio"])) as s:
        yield s


def test_the_serving_stack(stack: Stack) -> None:  # test_datapath's, with the other stack
    log = (stack.workdir / "extproc.log").read_text()
    assert f"gRPC 127.0.0.1:{stack.grpc_port} (grpcio)" in log
