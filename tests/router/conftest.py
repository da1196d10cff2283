import pytest

from tests.router.helpers import start_router


@pytest.fixture
async def make_router():
    """Starts routers on loopback; shuts every one down after the test."""
    routers = []

    async def make(probes_dir=None, **config):
        router = await start_router(probes_dir, **config)
        routers.append(router)
        return router

    yield make
    for router in routers:
        await router.shutdown(grace_period=0)
