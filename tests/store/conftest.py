"""Fixtures of the store tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.support.databases import PrivatePostgres


@pytest.fixture
def private_postgres() -> Iterator[PrivatePostgres]:
    """A PostgreSQL server of the test's own, which it may stop and start."""
    pg = PrivatePostgres()
    pg.start()
    try:
        yield pg
    finally:
        pg.remove()
