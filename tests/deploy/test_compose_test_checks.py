"""The compose test's verdicts on what comes back through the stack, and the
deploy command it shares with the docs."""

import re

import pytest

from tests.conftest import REPO
from tools.aborts import ABORT_LATENCY_BOUND
from tools.compose_stack import DEPLOY_IN_STACK
from tools.compose_test import check_abort_latencies, check_generate
from tools.docker_host import Failure
from undercurrent.v1 import engine_pb2 as engine_pb
from undercurrent.v1 import types_pb2 as types_pb


def seen(tokens=8, positions=range(10, 17), reason=types_pb.FINISH_REASON_LENGTH, unprobed=0):
    return {
        "text": "x" * tokens, "token_ids": tokens,
        "scores": [(p, 1.5) for p in positions],
        "finished": engine_pb.GenerateFinished(finish_reason=reason, generated_tokens=tokens,
                                        unprobed_tokens=unprobed),
    }


def test_every_fed_generated_token_scored_once_passes():
    assert check_generate(seen(), 8).startswith("8 tokens ('xxxxxxxx'), 7 residual_norm scores")


@pytest.mark.parametrize("result,message", [
    (seen(positions=[]), "scored positions []"),
    (seen(positions=[10, 11, 12, 13, 14, 15, 15]), "expected 7 distinct"),
    (seen(tokens=5), "expected 8 tokens"),
    (seen(reason=types_pb.FINISH_REASON_STOP), "finish reason FINISH_REASON_STOP"),
    (seen(unprobed=2), "2 tokens went unprobed"),
    ({**seen(), "finished": None}, "without a finished event"),
])
def test_a_missing_or_wrong_part_fails_naming_it(result, message):
    with pytest.raises(Failure, match=re.escape(message)):
        check_generate(result, 8)


def test_aborts_within_the_bound_at_the_median_pass_and_late_ones_fail_naming_the_bound():
    assert check_abort_latencies([0, 1, 0, 30, 0]).startswith("5 aborts, tokens after the trigger: median 0, max 30")
    with pytest.raises(Failure, match=re.escape(f"the median is over the bound of {ABORT_LATENCY_BOUND}")):
        check_abort_latencies([0, 40, 41, 50, 1])


def test_the_deployment_docs_give_the_deploy_command_the_compose_test_runs():
    assert DEPLOY_IN_STACK in (REPO / "docs" / "deployment.md").read_text()
