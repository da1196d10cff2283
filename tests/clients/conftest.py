import pytest

from common.probe_format.files import ProbeRoot
from tests.router.helpers import start_router


@pytest.fixture
async def router(tmp_path):
    """A real router on loopback with no probes loaded, loading probes by path
    from the test's directory; shut down after the test."""
    router = await start_router(None, probe_root=ProbeRoot(tmp_path))
    yield router
    await router.shutdown(grace_period=0)
