"""Images built from a Dockerfile folder (`SandboxSpec.build`) and scratch dirs: FROM lines
substituted and checked offline, built once per tag, the work dir seeded from the image,
scratch dirs writable by the sandbox user and emptied by reset, the root still read-only."""

from __future__ import annotations

import secrets

import anyio
import pytest

from core.sandbox import ImageBuild, SandboxError, SandboxSpec
from sandboxes.docker_backend import DockerSandbox
from sandboxes.image import ensure_image, from_images, map_from_images


def test_from_lines_are_found_and_mapped():
    dockerfile = ("FROM --platform=linux/amd64 python:3.12-slim AS build\nRUN true\n"
                  "from build\nFROM scratch\nFROM debian:bookworm\n")
    assert from_images(dockerfile) == ["python:3.12-slim", "debian:bookworm"]
    mapped = map_from_images(dockerfile, {"python:3.12-slim": "stalewise-base"})
    assert mapped.splitlines()[0] == "FROM --platform=linux/amd64 stalewise-base AS build"
    assert from_images(mapped) == ["stalewise-base", "debian:bookworm"]
    with pytest.raises(ValueError, match="scratch dir"):
        SandboxSpec(scratch_dirs=("logs",))


@pytest.mark.docker
def test_a_missing_from_image_is_one_line_naming_the_setting(docker_client, tmp_path):
    (tmp_path / "Dockerfile").write_text("FROM nowhere/such-image:1\n")
    build = ImageBuild(context=str(tmp_path), map_setting="[tasks.harbor] base_image_map")
    with pytest.raises(SandboxError) as caught:
        ensure_image(f"stalewise-test-missing:{secrets.token_hex(4)}", build, client=docker_client)
    message = str(caught.value)
    assert "\n" not in message and "FROM image 'nowhere/such-image:1'" in message
    assert '[tasks.harbor] base_image_map = { "nowhere/such-image:1" = "stalewise-base" }' \
        in message


@pytest.mark.docker
def test_built_once_seeded_and_scratch_dirs_behave(docker_client, tmp_path):
    (tmp_path / "Dockerfile").write_text("FROM python:3.12-slim\nWORKDIR /app\n"
                                         "COPY data.txt /app/data.txt\n")
    (tmp_path / "data.txt").write_text("seeded\n")
    tag = f"stalewise-test-build:{secrets.token_hex(6)}"
    build = ImageBuild(context=str(tmp_path), base_image_map={"python:3.12-slim":
                                                              "stalewise-base"},
                       seed_from="/app")
    try:
        assert ensure_image(tag, build, client=docker_client) is True
        assert ensure_image(tag, build, client=docker_client) is False  # cached by tag
        spec = SandboxSpec(image=tag, build=build, workdir="/app", scratch_dirs=("/logs",))

        async def check() -> None:
            async with DockerSandbox(spec, client=docker_client, run_id="pytest-build") as box:
                assert (await box.read_file("data.txt")) == b"seeded\n"
                wrote = await box.exec("echo 1 > /logs/r.txt && stat -c %u /logs/r.txt")
                assert wrote.ok and wrote.stdout.strip() == "1000"
                assert not (await box.exec("touch /etc/x")).ok  # the root stays read-only
                await box.reset()
                assert (await box.exec("ls -A /logs")).stdout == ""
                assert (await box.read_file("data.txt")) == b"seeded\n"
        anyio.run(check)
    finally:
        docker_client.images.remove(tag, force=True)
