"""Fixtures for sandbox tests: a connected engine with the base image, and a setuid test image."""

from __future__ import annotations

import textwrap
import uuid
from typing import Any, Iterator

import pytest

TASK_IMAGE = "stalewise-test-task:latest"


@pytest.fixture(scope="session")
def docker_client() -> Any:
    """A client for the real engine, with stalewise-base built (cached after the first time)."""
    from sandboxes.engine import connect
    from sandboxes.image import build_base

    client = connect()
    build_base(client=client, log=lambda line: None)
    return client


@pytest.fixture(scope="session")
def task_image(docker_client: Any, tmp_path_factory: pytest.TempPathFactory) -> str:
    """A task image FROM stalewise-base: a setuid-root copy of python3, and seed files."""
    from sandboxes.image import build_image

    context = tmp_path_factory.mktemp("task-image")
    (context / "Dockerfile").write_text(textwrap.dedent("""\
        FROM stalewise-base:latest
        USER root
        RUN cp "$(readlink -f /usr/bin/python3)" /usr/local/bin/suid-python \\
            && chmod 4755 /usr/local/bin/suid-python
        COPY seed /opt/stalewise/seed
        USER 1000:1000
        """))
    (context / "seed" / "pkg").mkdir(parents=True)
    (context / "seed" / "pkg" / "task.py").write_text("ANSWER = 42\n")
    build_image(context, TASK_IMAGE, client=docker_client)
    return TASK_IMAGE


@pytest.fixture
def isolated_installation(monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """A private installation id, so cleanup tests never touch other users' containers."""
    installation = f"test-{uuid.uuid4().hex[:12]}"
    monkeypatch.setenv("STALEWISE_INSTALLATION_ID", installation)
    yield installation
    from sandboxes.cleanup import remove_all

    remove_all(installation=installation)
