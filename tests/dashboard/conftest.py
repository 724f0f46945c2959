"""One headless Chromium per browser-test module (tests/dashboard/cdp.py); skipped only where chromium is absent
after the set-up (`make sandbox` installs Debian's chromium when it can)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
import pytest_asyncio

from tests.dashboard.cdp import Browser, chromium_path


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def browser(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Browser]:
    if chromium_path() is None:
        pytest.skip(
            "chromium is not installed: the set-up (make sandbox, .ci/run) installs Debian's chromium "
            "with apt-get as root; or set CHROMIUM to a Chromium binary"
        )
    b = await Browser.start(tmp_path_factory.mktemp("chromium"))
    try:
        yield b
    finally:
        await b.close()
