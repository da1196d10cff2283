"""Labelled prompt files: every bad line is refused naming the file, line and field."""

from __future__ import annotations

import json

import pytest

from probe_lifecycle.examples import InputError, check_examples, read_examples


def write(tmp_path, *lines: str):
    path = tmp_path / "examples.jsonl"
    path.write_text("".join(line + "\n" for line in lines))
    return path


GOOD = [json.dumps({"text": "a b", "label": 1, "id": "p"}), json.dumps({"text": "c d", "label": 0})]


def test_a_good_file_streams_examples_with_stable_ids(tmp_path):
    path = write(tmp_path, GOOD[0], "", GOOD[1], json.dumps({"text": "e", "label": True, "id": 7}))
    examples = list(read_examples(path))
    assert [(e.id, e.label, e.line) for e in examples] == [("p", 1, 1), ("line-3", 0, 3), ("7", 1, 4)]
    summary = check_examples(path)
    assert (summary.examples, summary.positives, summary.negatives) == (3, 2, 1)
    assert len(summary.sha256) == 64


@pytest.mark.parametrize("line, message", [
    ('{"text": "a", "label": 1', ":3: not valid JSON"),
    ('{"text": "a"}', ":3: label: missing"),
    ('{"label": 1}', ":3: text: missing"),
    ('{"text": "", "label": 1}', ":3: text: expected a non-empty string"),
    ('{"text": "a", "label": 2}', ":3: label: 2 is not 0, 1, false or true"),
    ('{"text": "a", "label": "yes"}', ":3: label: 'yes' is not 0, 1, false or true"),
    ('{"text": "a", "label": [1]}', ":3: label: [1] is not 0, 1, false or true"),
    ('{"text": "a", "label": 1, "lable": 0}', ":3: unknown field(s) ['lable']"),
    ('{"text": "a", "label": 1, "id": "p"}', ":3: id: 'p' was already used on line 1"),
    ('["a", 1]', ":3: expected a JSON object, got list"),
])
def test_a_bad_line_is_refused_naming_line_and_field(tmp_path, line, message):
    path = write(tmp_path, *GOOD, line)
    with pytest.raises(InputError) as refused:
        check_examples(path)
    assert f"{path}{message}" in str(refused.value)


def test_a_file_with_one_class_is_refused(tmp_path):
    path = write(tmp_path, GOOD[0])
    with pytest.raises(InputError, match="label: no negative"):
        check_examples(path)
