"""A pytest plugin for `make test-sanitize` (`-p tests.support.sanitized`): the extension built
with ASan and UBSan in `PHASEWATCH_TEST_NATIVE_DIR` is the one this process imports, ahead of
the normal build. Loaded before any conftest, so before anything imports the extension;
processes the tests start import the normal build."""

from __future__ import annotations

import os

import phasewatch.proxy

SANITIZED_NATIVE = os.environ.get("PHASEWATCH_TEST_NATIVE_DIR")
if SANITIZED_NATIVE:
    phasewatch.proxy.__path__.insert(0, SANITIZED_NATIVE)
