"""Hermes-style tool calls parsed from sampled text: every malformed shape gets a clear error."""

from __future__ import annotations

import json

from hypothesis import given
from hypothesis import strategies as st

from tasks.chat.parsing import extract_answer, parse_tool_calls

TOOLS = ["python", "bash"]


def test_well_formed_calls_in_order():
    text = ('thinking <tool_call>{"name":"python","arguments":{"code":"print(1)"}}</tool_call>'
            ' then <tool_call> {"name": "bash", "arguments": "{\\"command\\": \\"ls\\"}"} '
            '</tool_call>')
    calls = parse_tool_calls(text, TOOLS)
    assert [(c.name, c.arguments, c.error) for c in calls] == [
        ("python", {"code": "print(1)"}, None), ("bash", {"command": "ls"}, None)]


def test_missing_arguments_mean_empty_arguments():
    (call,) = parse_tool_calls('<tool_call>{"name":"python"}</tool_call>', TOOLS)
    assert call.ok and call.arguments == {}


def test_malformed_calls_say_what_is_wrong():
    cases = {
        '<tool_call>{"name":"python","arguments":{"code":1}</tool_call>': "not valid JSON",
        '<tool_call>["python"]</tool_call>': "must be a JSON object",
        '<tool_call>{"arguments":{}}</tool_call>': 'needs a "name"',
        '<tool_call>{"name":"rm","arguments":{}}</tool_call>': "unknown tool 'rm'; tools: python",
        '<tool_call>{"name":"python","arguments":[1]}</tool_call>': '"arguments" must be',
        '<tool_call>{"name":"python","arguments":"{oops"}</tool_call>': "arguments string",
        '<tool_call>{"name":"python","arguments":{}}': "never closed",
        'x</tool_call>': "without <tool_call>",
    }
    for text, message in cases.items():
        (call,) = parse_tool_calls(text, TOOLS)
        assert not call.ok and message in call.error, (text, call.error)


def test_half_a_surrogate_pair_in_the_arguments_is_malformed():
    """A JSON escape can make a lone surrogate, which no tool, tokenizer or store can take (the
    store's driver refused the tool's echo of it, and the writer failed the job)."""
    cases = {
        r'{"name":"python","arguments":{"code":"print(\ud800)"}}': "\\ud800",
        r'{"name":"python","arguments":{"x":[{"\uDC01":1}]}}': "\\udc01",
        r'{"name":"python","arguments":"{\"code\": \"\\ud83d\"}"}': "\\ud83d",
    }
    for body, escape in cases.items():
        (call,) = parse_tool_calls(f"<tool_call>{body}</tool_call>", TOOLS)
        assert call.error == (f"arguments hold {escape}, half of a UTF-16 surrogate pair, which "
                              "no text can hold; write the character itself, or both halves of "
                              "its pair"), (body, call.error)
    (whole,) = parse_tool_calls(r'<tool_call>{"name":"python","arguments":{"code":'
                                r'"\ud83d\ude00 \u00e9"}}</tool_call>', TOOLS)
    assert whole.ok and whole.arguments == {"code": "\U0001f600 \u00e9"}


def test_reopened_tag_is_malformed_and_the_later_call_still_parses():
    text = '<tool_call>{"name":"python"<tool_call>{"name":"bash","arguments":{}}</tool_call>'
    first, second = parse_tool_calls(text, TOOLS)
    assert "opened again" in first.error
    assert second.ok and second.name == "bash"


def test_no_calls_in_plain_text():
    assert parse_tool_calls("<answer>4</answer>", TOOLS) == ()


@given(st.lists(st.tuples(st.sampled_from(TOOLS),
                          st.dictionaries(st.text(min_size=1, max_size=5),
                                          st.one_of(st.integers(), st.text(max_size=8)),
                                          max_size=3)),
                max_size=4),
       st.lists(st.text(alphabet="abc <>/\n", max_size=10), min_size=5, max_size=5))
def test_round_trip_of_random_calls(calls, filler):
    text = filler[0].replace("<", "(")
    for (name, arguments), glue in zip(calls, filler[1:]):
        body = json.dumps({"name": name, "arguments": arguments})
        text += f"<tool_call>{body}</tool_call>{glue.replace('<', '(')}"
    parsed = parse_tool_calls(text, TOOLS)
    assert [(c.name, c.arguments) for c in parsed] == [(n, a) for n, a in calls]


def test_extract_answer_takes_the_last_tag():
    assert extract_answer("<answer> 1 </answer> no, <answer>2</answer>") == "2"
    assert extract_answer("no tag") is None
