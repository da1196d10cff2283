"""How `undercurrent generate` lays out text and probe scores."""

import io

from undercurrent_client.cli import _LiveView
from undercurrent_client.events import ProbeScores, Verdict


def test_live_view_puts_scores_on_their_own_lines_and_names_prompt_tokens():
    out = io.StringIO()
    view = _LiveView(out)
    view.prompt_tokens = 3
    view.text("The")
    view.scores(ProbeScores("p", (1, 3, 4), (0.5, 1.25, 2.0), "r:1"))
    view.text(" fox\n")
    view.scores(ProbeScores("p", (5,), (3.0,), "r:1"))
    assert out.getvalue() == "The\n  [p] p1:0.5 0:1.25 1:2\n fox\n  [p] 2:3\n"


def test_verdict_line_names_the_probe_or_gives_the_engine_reason():
    out = io.StringIO()
    view = _LiveView(out)
    view.prompt_tokens = 5
    view.text("abc")
    view.verdict(Verdict("guard", 19.7, 11, "scored 19.7 >= 19.5", "127.0.0.1:1"))
    view.verdict(Verdict("", 0.0, 9, "no router reachable for 1.5 s (fail_closed)", ""))
    assert out.getvalue().splitlines() == [
        "abc",
        "verdict: probe guard score 19.7 at token 6 (router 127.0.0.1:1): scored 19.7 >= 19.5",
        "verdict: no router reachable for 1.5 s (fail_closed)",
    ]
