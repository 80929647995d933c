"""Fixtures for the viewer: `stalewise view` children and a headless Chromium.

Chromium and its driver come from Debian's packages (scripts/setup_browser.sh); nothing is
downloaded at test time.
"""

from __future__ import annotations

import os
import shutil
from typing import Iterator

import pytest
from viewer_support import ARTIFACTS, CHROMIUM_FLAGS, Viewer


@pytest.fixture(scope="module")
def viewer_of() -> Iterator:
    """A function db_url -> Viewer; every viewer started is stopped at the module's end."""
    started: list[Viewer] = []

    def start(db_url: str) -> Viewer:
        started.append(Viewer(db_url))
        return started[-1]

    yield start
    for viewer in started:
        viewer.stop()


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    """Headless Debian Chromium through chromedriver, with a fresh profile."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    chromium = shutil.which("chromium")
    driver = shutil.which("chromedriver")
    if chromium is None or driver is None:
        pytest.fail("chromium and chromedriver are not installed; "
                    "run: bash scripts/setup_browser.sh")
    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for flag in CHROMIUM_FLAGS:
        options.add_argument(flag)
    options.add_argument(f"--user-data-dir={tmp_path_factory.mktemp('chromium-profile')}")
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("SE_OFFLINE", "true")  # selenium must never try to download a driver
    chrome = webdriver.Chrome(service=Service(executable_path=driver), options=options)
    chrome.set_page_load_timeout(60)
    try:
        yield chrome
    finally:
        chrome.quit()
