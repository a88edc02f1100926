"""LMCache's own L2 adapter interface tests (tests/v1/distributed/
test_mock_l2_adapter.py from the lmcache 0.5.6 sdist), re-pointed at
CxlKvL2Adapter backed by a real `cxlkv serve`.

Deliberately excluded: TestCloseInterface and TestBandwidthSimulation, which
construct MockL2Adapter directly and test the mock's bandwidth simulation; our
close() is covered in test_adapter.py."""

from __future__ import annotations

import importlib.util

import pytest

from cxlkv_testkit import LMCACHE_TESTS, make_adapter

_path = LMCACHE_TESTS / "v1" / "distributed" / "test_mock_l2_adapter.py"
if not _path.exists():
    raise RuntimeError(f"LMCache upstream tests not found at {_path}; run scripts/setup-python.sh")
_spec = importlib.util.spec_from_file_location("lmcache_upstream_mock_l2_tests", _path)
upstream = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(upstream)

TestEventFdInterface = upstream.TestEventFdInterface
TestStoreInterface = upstream.TestStoreInterface
TestLookupAndLockInterface = upstream.TestLookupAndLockInterface
TestUnlockInterface = upstream.TestUnlockInterface
TestLoadInterface = upstream.TestLoadInterface
TestEndToEndWorkflow = upstream.TestEndToEndWorkflow
TestEvictionInterface = upstream.TestEvictionInterface


@pytest.fixture
def adapter(sidecar):
    a = make_adapter(sidecar.socket)
    yield a
    a.close()
