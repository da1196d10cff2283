import pytest

from tests.router.helpers import start_router


@pytest.fixture
async def router(tmp_path):
    """A real router on loopback with no probes loaded; shut down after the test."""
    router = await start_router(None)
    yield router
    await router.shutdown(grace_period=0)
