"""The compose test's verdict on a Generate: what must come back through the stack."""

import re

import pytest

from tools.compose_test import Failure, check_generate
from undercurrent.v1 import undercurrent_pb2 as pb


def seen(tokens=8, positions=range(10, 17), reason=pb.FINISH_REASON_LENGTH, unprobed=0):
    return {
        "text": "x" * tokens, "token_ids": tokens,
        "scores": [(p, 1.5) for p in positions],
        "finished": pb.GenerateFinished(finish_reason=reason, generated_tokens=tokens,
                                        unprobed_tokens=unprobed),
    }


def test_every_fed_generated_token_scored_once_passes():
    assert check_generate(seen(), 8).startswith("8 tokens ('xxxxxxxx'), 7 residual_norm scores")


@pytest.mark.parametrize("result,message", [
    (seen(positions=[]), "scored positions []"),
    (seen(positions=[10, 11, 12, 13, 14, 15, 15]), "expected 7 distinct"),
    (seen(tokens=5), "expected 8 tokens"),
    (seen(reason=pb.FINISH_REASON_STOP), "finish reason FINISH_REASON_STOP"),
    (seen(unprobed=2), "2 tokens went unprobed"),
    ({**seen(), "finished": None}, "without a finished event"),
])
def test_a_missing_or_wrong_part_fails_naming_it(result, message):
    with pytest.raises(Failure, match=re.escape(message)):
        check_generate(result, 8)
