"""Request ownership by caller (plain logic; the e2e test runs it on an engine)."""

import pytest

from common.errors import NotFound
from engine_service.request.ownership import RequestOwners


def test_a_running_request_is_invisible_to_other_callers_and_freed_when_it_ends():
    owners = RequestOwners()
    with owners.claim("r", "alice"):
        assert owners.owner("r") == "alice"
        assert owners.visible_to("r", "alice") and not owners.visible_to("r", "bob")
        with pytest.raises(NotFound, match="request_id: 'r' not found"):
            with owners.claim("r", "bob"):
                pass
        assert owners.owner("r") == "alice"
    assert owners.owner("r") is None and owners.visible_to("r", "bob") and len(owners) == 0


def test_the_same_callers_second_claim_leaves_the_first_in_place():
    owners = RequestOwners()
    with owners.claim("r", "alice"):
        with owners.claim("r", "alice"):  # the runtime answers ALREADY_EXISTS inside
            pass
        assert owners.owner("r") == "alice"
    assert len(owners) == 0


def test_a_claim_is_released_when_the_stream_fails():
    owners = RequestOwners()
    with pytest.raises(RuntimeError):
        with owners.claim("r", "alice"):
            raise RuntimeError("stream broke")
    assert owners.owner("r") is None
