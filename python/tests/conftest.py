"""Fixtures for the plugin tests (helpers live in cxlkv_testkit)."""

import pytest

from cxlkv_testkit import Sidecar


@pytest.fixture
def sidecar(tmp_path):
    s = Sidecar(tmp_path).start()
    yield s
    s.kill()
