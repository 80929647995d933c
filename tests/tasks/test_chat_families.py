"""Per-family chat formats against the real templates and tokenizers (fetched, not trained):

- the conformance battery passes for Qwen2.5, Qwen3, Llama 3.1 and Mistral v0.3: every prompt
  the loop would send is exactly the template's tokens; cases the template itself refuses are
  reported as such, and non-append-only places start a new segment with a recorded reason;
- a deliberately wrong format fails with the first differing token;
- the format is recognised from the template;
- Mistral: token for token the same as mistral-common's reference encoder, 9-character call
  ids kept when the model wrote them and generated when it did not;
- the native call parsers (Llama 3 JSON, Mistral [TOOL_CALLS]) on well-formed and broken text.
"""

from __future__ import annotations

import json
import string
from pathlib import Path

import pytest
from chat_tokenizers import FIXTURES_AND_FORMATS, real_tokenizer

from tasks.builtin_tools import python, read_file
from tasks.chat import TemplateChatFormat, detect_family, make_chat_format
from tasks.chat.conformance import BATTERY, check_format
from tasks.chat.conversation import Conversation
from tasks.chat.native_calls import call_id_for, parse_llama3_calls, parse_mistral_calls
from tasks.messages import ChatMessage

# What each real template refuses outright (it raises), by case name.
REFUSED = {"llama3.1": {"parallel calls"}, "mistral-v0.3": {"later user message"}}
# Where a real template is not append-only, and the reason the loop records.
BREAKS = {"qwen3": {"later user message": "turn_rewritten"},
          "mistral-v0.3": {"malformed call": "history_rewritten"}}


@pytest.fixture(scope="module", params=FIXTURES_AND_FORMATS, ids=lambda p: p[0])
def family_and_tokenizer(request):
    directory, family = request.param
    return family, real_tokenizer(directory)


def test_conformance_battery_passes_against_the_real_template(family_and_tokenizer):
    family, tokenizer = family_and_tokenizer
    fmt = make_chat_format(tokenizer, family)
    results = {r.name: r for r in check_format(fmt, tokenizer)}
    assert set(results) == {case.name for case in BATTERY}
    for name, result in results.items():
        if name in REFUSED.get(family, ()):
            assert result.status == "unsupported" and "refuses" in result.note, result
            continue
        assert result.status == "ok", result.as_dict()
        assert result.equal and result.parsed and result.prompts_checked >= 2
        expected_break = BREAKS.get(family, {}).get(name)
        if expected_break is None:
            assert result.append_only, result.as_dict()
        else:
            assert not result.append_only and result.breaks[0].startswith(expected_break)


def test_the_format_is_recognised_from_the_template(family_and_tokenizer):
    family, tokenizer = family_and_tokenizer
    assert detect_family(tokenizer.chat_template) == family
    fmt = make_chat_format(tokenizer)
    assert isinstance(fmt, TemplateChatFormat) and fmt.name == family


def test_a_wrong_format_fails_with_the_first_differing_token():
    tokenizer = real_tokenizer("qwen2.5")
    results = check_format(make_chat_format(tokenizer, "hermes"), tokenizer)
    assert all(r.status == "fail" and not r.equal for r in results)
    single = next(r for r in results if r.name == "single call")
    assert single.difference.startswith("token 13: template 2 '#', format ")


def test_generic_template_format_cannot_read_llama_calls():
    """Llama 3.1's template with Hermes-style parsing: the prompts match, the calls are lost."""
    tokenizer = real_tokenizer("llama3.1")
    results = check_format(make_chat_format(tokenizer, "template"), tokenizer)
    single = next(r for r in results if r.name == "single call")
    assert single.status == "fail" and single.equal and not single.parsed
    assert '"parameters"' in single.note


def test_hermes_is_not_qwen25_layout_for_tool_results():
    """The issue's example: Qwen2.5 renders a tool result as a user turn, Hermes as `tool`."""
    tokenizer = real_tokenizer("qwen2.5")
    messages = [ChatMessage("user", "q"), ChatMessage("assistant", "a"),
                ChatMessage("tool", "42", name="python")]
    qwen = make_chat_format(tokenizer, "qwen2.5", tool_listing="none")
    hermes = make_chat_format(tokenizer, "hermes", tool_listing="none")
    assert "<|im_start|>user\n<tool_response>\n42\n</tool_response>" in qwen.decode(
        qwen.render(messages, []))
    assert "<|im_start|>tool\n<tool_response>42</tool_response>" in hermes.decode(
        hermes.render(messages, []))


def test_qwen3_records_why_a_new_segment_starts():
    tokenizer = real_tokenizer("qwen3")
    fmt = make_chat_format(tokenizer, "qwen3")
    conv = Conversation(fmt, [ChatMessage("user", "Compute 2+2.")], [python])
    conv.take_prompt()
    call = '<tool_call>\n{"name": "python", "arguments": {"code": "print(4)"}}\n</tool_call>'
    conv.add_sampled(fmt.encode_assistant("<think>\nEasy.\n</think>\n\n" + call))
    assert conv.add_messages([ChatMessage("tool", "4", name="python")])
    conv.take_prompt()
    conv.add_sampled(fmt.encode_assistant("<think>\nDone.\n</think>\n\nIt is 4."))
    assert not conv.add_messages([ChatMessage("user", "And 3+3?")])
    reason = conv.segment_breaks[-1]
    assert reason.kind == "history_rewritten" and "<think>" in reason.detail
    assert conv.token_ids == fmt.render(conv.messages, [python])
    assert "Easy." not in fmt.decode(conv.token_ids), "Qwen3 drops earlier reasoning"


# -- Mistral against its reference encoder ------------------------------------------------------


@pytest.fixture(scope="module")
def mistral():
    import mistral_common
    from mistral_common.tokens.tokenizers.mistral import MistralTokenizer

    model = (Path(mistral_common.__file__).parent / "data"
             / "mistral_instruct_tokenizer_240323.model.v3")
    tokenizer = real_tokenizer("mistral-v0.3")
    return MistralTokenizer.from_file(str(model)), make_chat_format(tokenizer, "mistral-v0.3")


def _reference_tokens(reference, system, user, turns, tools):
    from mistral_common.protocol.instruct.messages import (
        AssistantMessage,
        SystemMessage,
        ToolMessage,
        UserMessage,
    )
    from mistral_common.protocol.instruct.request import ChatCompletionRequest
    from mistral_common.protocol.instruct.tool_calls import Function, FunctionCall, Tool, ToolCall

    messages = ([SystemMessage(content=system)] if system else []) + [UserMessage(content=user)]
    for calls, outputs in turns:
        messages.append(AssistantMessage(tool_calls=[
            ToolCall(id=call_id, function=FunctionCall(name=name, arguments=json.dumps(args)))
            for name, args, call_id in calls]))
        messages += [ToolMessage(content=out, tool_call_id=call_id, name=name)
                     for (name, _, call_id), out in zip(calls, outputs)]
    schemas = [t.openai_schema()["function"] for t in tools]
    request = ChatCompletionRequest(messages=messages, tools=[
        Tool(function=Function(name=s["name"], description=s["description"],
                               parameters=s["parameters"])) for s in schemas])
    return reference.encode_chat_completion(request).tokens


@pytest.mark.parametrize("system", ["Be brief.", None])
def test_mistral_format_equals_mistral_common_token_for_token(mistral, system):
    reference, fmt = mistral
    tools = [python, read_file]
    turns = [([("python", {"code": "print(3*(4+5))"}, "a1B2c3D4e")], ["27"]),
             ([("read_file", {"path": "a.txt"}, "Zz9Yy8Xx7"), ("python", {"code": "1"}, "000000001")],
              ["hello world", "{\"ok\": true, \"é\": \"世界\"}"])]
    conv = Conversation(fmt, ([ChatMessage("system", system)] if system else [])
                        + [ChatMessage("user", "Compute 3*(4+5).")], tools)
    assert conv.token_ids == _reference_tokens(reference, system, "Compute 3*(4+5).", [], tools)
    for done in range(1, len(turns) + 1):
        expected = _reference_tokens(reference, system, "Compute 3*(4+5).", turns[:done], tools)
        before = len(conv.token_ids)
        conv.take_prompt()
        stop = expected.index(fmt.stop_token_ids[0], before)
        parsed = conv.add_sampled(expected[before:stop + 1])  # what the model sampled
        calls, outputs = turns[done - 1]
        assert [(c.name, c.arguments, c.call_id) for c in parsed.calls] == calls
        assert conv.add_messages([ChatMessage("tool", out, name=name)
                                  for (name, _, _), out in zip(calls, outputs)])
        assert conv.token_ids == expected


def test_mistral_call_without_an_id_gets_one_and_starts_a_new_segment(mistral):
    _, fmt = mistral
    conv = Conversation(fmt, [ChatMessage("user", "Compute.")], [python])
    conv.take_prompt()
    conv.add_sampled(fmt.encode_assistant(
        '[TOOL_CALLS] [{"name": "python", "arguments": {"code": "print(1)"}}]'))
    assert not conv.add_messages([ChatMessage("tool", "1", name="python")])
    assert conv.segment_breaks[-1].kind == "turn_rewritten"
    text = fmt.decode(conv.token_ids)
    generated = call_id_for(1, 0)
    assert f'"id": "{generated}"' in text and f'"call_id": "{generated}"' in text


def test_generated_call_ids_are_what_mistral_accepts():
    ids = {call_id_for(position, index) for position in range(50) for index in range(4)}
    assert len(ids) == 200
    assert all(len(i) == 9 and set(i) <= set(string.ascii_letters + string.digits) for i in ids)
    assert call_id_for(3, 1) == call_id_for(3, 1)


# -- native call parsers -------------------------------------------------------------------------

NAMES = ["python", "read_file"]


def test_llama3_calls():
    one = parse_llama3_calls('{"name": "python", "parameters": {"code": "print(1)"}}', NAMES)
    assert [(c.name, c.arguments) for c in one] == [("python", {"code": "print(1)"})]
    tagged = parse_llama3_calls('<|python_tag|>{"name": "read_file", "arguments": {"path": '
                                '"a"}}; {"name": "python", "parameters": {"code": "2"}}', NAMES)
    assert [c.name for c in tagged] == ["read_file", "python"] and all(c.ok for c in tagged)
    assert parse_llama3_calls("The answer is 4.", NAMES) == ()
    cut = parse_llama3_calls('{"name": "python", "parameters": {"code": "pri', NAMES)
    assert len(cut) == 1 and "not valid JSON" in cut[0].error
    unknown = parse_llama3_calls('{"name": "rm", "parameters": {}}', NAMES)
    assert "unknown tool 'rm'" in unknown[0].error
    bad = parse_llama3_calls('{"name": "python", "parameters": [1]}', NAMES)
    assert '"parameters" must be a JSON object' in bad[0].error


def test_mistral_calls():
    calls = parse_mistral_calls('[TOOL_CALLS] [{"name": "python", "arguments": {"code": "1"}, '
                                '"id": "abcDEF123"}, {"name": "read_file", "arguments": '
                                '{"path": "x"}, "id": "short"}]', NAMES)
    assert [(c.name, c.call_id) for c in calls] == [("python", "abcDEF123"), ("read_file", None)]
    assert all(c.ok for c in calls)
    assert parse_mistral_calls("Four.", NAMES) == ()
    broken = parse_mistral_calls('[TOOL_CALLS] [{"name": "python"', NAMES)
    assert len(broken) == 1 and "JSON list" in broken[0].error
    empty = parse_mistral_calls("[TOOL_CALLS] []", NAMES)
    assert "non-empty" in empty[0].error


# -- auditing recorded trajectories --------------------------------------------------------------


def _recorded_qwen3_trajectory():
    """A Qwen3 conversation as the loop records it: a tool turn, then a later user message
    (a new segment), then an answer."""
    from tasks.chat.conformance import RecordedCall

    tokenizer = real_tokenizer("qwen3")
    fmt = make_chat_format(tokenizer, "qwen3")
    prompt = [ChatMessage("system", "Be brief."), ChatMessage("user", "Compute 2+2.")]
    conv = Conversation(fmt, prompt, [python])
    call = '<tool_call>\n{"name": "python", "arguments": {"code": "print(4)"}}\n</tool_call>'
    script = [("<think>\nEasy.\n</think>\n\n" + call, [ChatMessage("tool", "4", name="python")]),
              ("<think>\nDone.\n</think>\n\nIt is 4.", [ChatMessage("user", "And 3+3?")]),
              ("<think>\nSix.\n</think>\n\n6", [])]
    calls, results = [], {}
    for turn, (text, new) in enumerate(script):
        delta = conv.take_prompt()
        sampled = fmt.encode_assistant(text)
        conv.add_sampled(sampled)
        calls.append(RecordedCall(turn, delta.segment, delta.context_len, delta.token_ids,
                                  tuple(sampled)))
        if new:
            results[turn] = new
            conv.add_messages(new)
    return fmt, prompt, calls, results


def test_audit_of_a_recorded_trajectory_across_segments():
    from tasks.chat.conformance import RecordedCall, audit_calls

    fmt, prompt, calls, results = _recorded_qwen3_trajectory()
    assert [c.segment for c in calls] == [0, 0, 1]
    audit = audit_calls(fmt, prompt, [python], calls, results)
    assert (audit.status, audit.prompts_checked) == ("exact", 3)

    # a tool result shown to the model that is not what the store says it was
    shown = {0: [ChatMessage("tool", "5", name="python")], 1: results[1]}
    audit = audit_calls(fmt, prompt, [python], calls, shown)
    assert audit.status == "mismatch" and audit.turn == 1
    assert audit.difference.startswith("token ") and "template" in audit.difference

    # sampled ids that spell the same text in other tokens are kept, and counted as such
    first = calls[0]
    text = fmt.decode(first.sampled_ids[:-1])
    split = [i for ch in text for i in fmt.codec.encode(ch)] + [first.sampled_ids[-1]]
    assert split != list(first.sampled_ids) and fmt.decode(split) == fmt.decode(first.sampled_ids)
    respelled = [RecordedCall(0, 0, 0, first.prompt_ids, tuple(split)),
                 RecordedCall(1, 0, first.context_len + len(first.prompt_ids) + len(split),
                              calls[1].prompt_ids, calls[1].sampled_ids), calls[2]]
    audit = audit_calls(fmt, prompt, [python], respelled, results)
    assert audit.status == "sampled_noncanonical" and audit.prompts_checked == 3
