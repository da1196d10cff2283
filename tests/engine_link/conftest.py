from __future__ import annotations

import pytest

from engine_service.link import RouterLink, RouterLinkConfig
from tools.router_double import RouterDouble

from .helpers import FAST, MODEL, EventLog


@pytest.fixture
async def routers():
    started: list[RouterDouble] = []

    async def make(name: str = "r", port: int = 0, **kwargs) -> RouterDouble:
        router = await RouterDouble(f"{name}{len(started)}", **kwargs).start(port)
        started.append(router)
        return router

    yield make
    for router in started:
        await router.kill()


@pytest.fixture
async def links():
    made: list[RouterLink] = []

    def make(targets: str, **overrides) -> tuple[RouterLink, EventLog]:
        resolver = overrides.pop("resolver", None)
        events = EventLog()
        config = RouterLinkConfig(targets=targets, engine_id="engine-test", **{**FAST, **overrides})
        kwargs = {"resolver": resolver} if resolver else {}
        link = RouterLink(config, MODEL, events, **kwargs)
        made.append(link)
        return link, events

    yield make
    for link in made:
        await link.close()
