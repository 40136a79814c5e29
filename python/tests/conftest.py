"""Shared fixtures: a fresh random generator per test (seed printed, and settable through
PAGEDATTN_TEST_SEED to replay a failure) and the framework parametrization."""

from __future__ import annotations

import os
import secrets

import numpy as np
import pytest

import pagedattn
from frameworks import FRAMEWORKS, make_framework


@pytest.fixture
def rng(request):
    seed = int(os.environ.get("PAGEDATTN_TEST_SEED", secrets.randbits(32)))
    print(f"{request.node.nodeid}: PAGEDATTN_TEST_SEED={seed}")
    return np.random.default_rng(seed)


@pytest.fixture(params=FRAMEWORKS)
def fw(request):
    return make_framework(request.param)


@pytest.fixture
def hnd_layout():
    """Caches and backends created inside the test use the HND layout."""
    pagedattn.set_kv_cache_layout("HND")
    yield
    pagedattn.set_kv_cache_layout(None)
