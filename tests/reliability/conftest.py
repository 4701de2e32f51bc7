"""Fixtures of the reliability suite: a real PostgreSQL server (`pg_server.PostgresServer`: a temporary
directory, a free loopback port, stopped and removed afterwards) and the shipped CPU profile.

Where no server binaries or no driver exist the PostgreSQL tests fail with the reason (`running_server`):
.ci/run installs both.
"""
from __future__ import annotations

import warnings

import optuna
import pytest
from pg_server import PostgresServer, unavailable_reason
from reliability_helpers import PROFILE, running_server

from skistune.profile import load_profile

optuna.logging.set_verbosity(optuna.logging.WARNING)


@pytest.fixture(scope="session")
def profile():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # measured on this machine's kind, maybe not this machine
        return load_profile(PROFILE)


@pytest.fixture(scope="session")
def postgres():
    """A running PostgreSQL server for the session."""
    yield from running_server("PostgreSQL", unavailable_reason(), PostgresServer)


@pytest.fixture
def pg_url(postgres) -> str:
    """A fresh, empty database on the session's server."""
    return postgres.database()
