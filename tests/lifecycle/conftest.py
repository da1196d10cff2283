import pytest

from tools.dev_security import DevSecurity


@pytest.fixture(autouse=True, scope="package")
def client_credentials():
    """The lifecycle commands take TLS files and tokens from the environment
    (common.security.client); the services of tools.processes run with TLS."""
    with pytest.MonkeyPatch.context() as patch:
        for name, value in DevSecurity.ensure().client_env().items():
            patch.setenv(name, value)
        yield
