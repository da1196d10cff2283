"""How `undercurrent generate` lays out text and probe scores."""

import io

from undercurrent_client.cli import _LiveView
from undercurrent_client.events import ProbeScores


def test_live_view_puts_scores_on_their_own_lines_and_names_prompt_tokens():
    out = io.StringIO()
    view = _LiveView(out)
    view.prompt_tokens = 3
    view.text("The")
    view.scores(ProbeScores("p", (1, 3, 4), (0.5, 1.25, 2.0), "r:1"))
    view.text(" fox\n")
    view.scores(ProbeScores("p", (5,), (3.0,), "r:1"))
    assert out.getvalue() == "The\n  [p] p1:0.5 0:1.25 1:2\n fox\n  [p] 2:3\n"
