"""Does a chat format give exactly the tokens of the model's own chat template, turn after turn?

`check_format(fmt, tokenizer)` runs a battery of multi-turn tool conversations (`BATTERY`:
parallel calls, empty and multi-line tool output, unicode, a malformed call, a long system
prompt, a later user message) through `Conversation`, the same class the agent loop uses, and
compares every prompt the loop would send with the template's own render of the same
conversation (`apply_chat_template` on OpenAI-style messages with structured `tool_calls`). The
"sampled" turns are the template's own tokens for each assistant message, i.e. what a model
that writes its native syntax canonically samples.

Per case it reports: `equal` (every prompt equals the template's tokens; else the first
differing token with context), `append_only` (no new training segment was needed; else the
format's reason), and whether the format parsed the calls back. A case the template itself
refuses (Llama 3.1 has no parallel calls) is `unsupported`, not a failure. A case conforms when
it is equal and parsed; `require_append_only` makes a segment break a failure too.

The template is given the conversation with structured calls and `tools=`. Where a template has
no place for tools, calls or the wrapping of results (a plain ChatML template such as the tiny
model's), Hermes conventions are part of the content: the tool listing in the system prompt,
`<tool_call>` JSON in the assistant text, `<tool_response>` around results. For a family, the
conversation is given as the family's reference encoder sees it: for Mistral
(`system_with_last_user`, `json_tool_content`) the system prompt opens the last user message
and tool results are JSON-encoded, as mistral-common does (tests compare that with
mistral-common), and the error shown after a malformed call is a user message, since the
template accepts tool results only after parsed calls.
`first_token_difference` is shared with the run audit (`stalewise audit template`).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from tasks.builtin_tools import python, read_file, write_file
from tasks.chat.base import ChatFormat, tool_listing_text
from tasks.chat.conversation import Conversation
from tasks.chat.families import tool_schema
from tasks.chat.native_calls import call_id_for
from tasks.chat.template import json_or_text
from tasks.messages import ChatMessage
from tasks.tools import Tool

TOOLS: tuple[Tool, ...] = (python, read_file, write_file)
Decode = Callable[[Sequence[int]], str]


@dataclass(frozen=True)
class Call:
    name: str
    arguments: dict[str, Any]
    call_id: str


@dataclass(frozen=True)
class Turn:
    """One assistant turn: optional text and reasoning, its calls (or a malformed call text in
    the family's syntax), and the tool outputs that answer it (none after the final answer)."""

    calls: tuple[Call, ...] = ()
    outputs: tuple[str, ...] = ()
    content: str = ""
    malformed: bool = False
    then_user: str | None = None  # a user message after the tool outputs


@dataclass(frozen=True)
class Case:
    name: str
    user: str
    turns: tuple[Turn, ...]
    system: str | None = "You are a careful assistant. Use the tools."


def _call(name: str, index: int, **arguments: Any) -> Call:
    return Call(name, arguments, f"call{index:05d}")


LONG_SYSTEM = " ".join(f"Rule {i}: keep answers short, cite the tool output, never guess."
                       for i in range(60))
ANSWER = Turn(content="The answer is 27.")
BATTERY: tuple[Case, ...] = (
    Case("single call", "Compute 3*(4+5).", (
        Turn((_call("python", 1, code="print(3*(4+5))"),), ("27",)), ANSWER)),
    Case("parallel calls", "Read a.txt and b.txt.", (
        Turn((_call("read_file", 2, path="a.txt"), _call("read_file", 3, path="b.txt")),
             ("alpha", "beta")), ANSWER)),
    Case("empty and multi-line output", "Write then run.", (
        Turn((_call("write_file", 4, path="x.py", content="print(1)\nprint(2)\n"),), ("",)),
        Turn((_call("python", 5, code="for i in range(3):\n    print(i)"),),
             ("0\n1\n2\n\n[exit code 0]",)), ANSWER)),
    Case("unicode", "Échos: 世界 🚀?", (
        Turn((_call("python", 6, code="print('héllo → 世界 🚀')"),), ("héllo → 世界 🚀",),
             content="Je vérifie."), ANSWER)),
    Case("malformed call", "Compute 2+2.", (
        Turn(malformed=True, outputs=("",)),
        Turn((_call("python", 7, code="print(2+2)"),), ("4",)), ANSWER)),
    Case("long system prompt", "Compute 3*(4+5).", (
        Turn((_call("python", 8, code="print(27)"),), ("27",)), ANSWER), system=LONG_SYSTEM),
    Case("no system prompt", "Compute 3*(4+5).", (
        Turn((_call("python", 9, code="print(27)"),), ("27",)), ANSWER), system=None),
    Case("later user message", "Compute 3*(4+5).", (
        Turn((_call("python", 10, code="print(27)"),), ("27",), then_user="Now double it."),
        Turn((_call("python", 11, code="print(54)"),), ("54",)), ANSWER)),
)

THINKING = "I should check with a tool first."
_PROBE_SCHEMA = {"type": "function", "function": {
    "name": "zq_probe_tool", "description": "probe",
    "parameters": {"type": "object", "properties": {}}}}
MALFORMED_TEXT = {  # a call cut off mid-JSON, in each syntax
    "hermes": '<tool_call>\n{"name": "python", "arguments": {"code": "print(2+2)"\n</tool_call>',
    "llama3": '{"name": "python", "parameters": {"code": "print(2+2)"',
    "mistral": '[TOOL_CALLS] [{"name": "python", "arguments": {"code": "print(2+2)"}',
}


@dataclass
class CaseResult:
    name: str
    status: str = "ok"  # ok | fail | unsupported
    equal: bool = True
    append_only: bool = True
    parsed: bool = True
    prompts_checked: int = 0
    breaks: list[str] = field(default_factory=list)
    difference: str | None = None  # the first differing token, with context
    note: str = ""

    def as_dict(self) -> dict[str, Any]:
        return dict(case=self.name, status=self.status, equal=self.equal,
                    append_only=self.append_only, parsed=self.parsed,
                    prompts=self.prompts_checked, breaks=self.breaks,
                    difference=self.difference, note=self.note)


def first_token_difference(expected: Sequence[int], actual: Sequence[int], decode: Decode,
                           context: int = 6) -> str | None:
    """None when equal; else the first position where the ids differ, both ids as text, and
    the text of the few tokens before it."""
    expected, actual = [int(i) for i in expected], [int(i) for i in actual]
    if expected == actual:
        return None
    at = next((i for i, (a, b) in enumerate(zip(expected, actual)) if a != b),
              min(len(expected), len(actual)))

    def token(ids: list[int]) -> str:
        return f"{ids[at]} {decode([ids[at]])!r}" if at < len(ids) else "end"

    before = decode(expected[max(0, at - context):at])
    return (f"token {at}: template {token(expected)}, format {token(actual)}; "
            f"after {before!r} (template {len(expected)} tokens, format {len(actual)})")


def check_format(fmt: ChatFormat, tokenizer: Any, cases: Sequence[Case] = BATTERY, *,
                 require_append_only: bool = False) -> list[CaseResult]:
    return [_check_case(fmt, tokenizer, case, require_append_only) for case in cases]


class _Unsupported(Exception):
    pass


def _check_case(fmt: ChatFormat, tokenizer: Any, case: Case,
                require_append_only: bool) -> CaseResult:
    result = CaseResult(case.name)
    try:
        _run_case(fmt, _Reference(fmt, tokenizer), case, result)
    except _Unsupported as err:
        result.status, result.note = "unsupported", str(err)
        return result
    if not result.equal or not result.parsed or (require_append_only and not result.append_only):
        result.status = "fail"
    return result


def _run_case(fmt: ChatFormat, ref: _Reference, case: Case, result: CaseResult) -> None:
    prompt = ([ChatMessage("system", case.system)] if case.system else []) + [
        ChatMessage("user", case.user)]
    dicts = [message.to_dict() for message in prompt]  # the conversation, OpenAI-style
    conversation = Conversation(fmt, prompt, TOOLS)
    for turn in case.turns:
        expected = ref.ids(dicts, generation_prompt=True)
        result.prompts_checked += 1
        difference = first_token_difference(expected, conversation.token_ids, fmt.decode)
        if difference is not None:
            result.equal, result.difference = False, difference
            return
        conversation.take_prompt()
        assistant = ref.assistant(turn)
        parsed = conversation.add_sampled(ref.sampled_ids(dicts, assistant, expected))
        if not _parsed_as_written(parsed.calls, turn):
            result.parsed = False
            found = [(c.name, c.arguments, c.error) for c in parsed.calls]
            result.note = f"the format parsed {found} from {parsed.text!r}"
            return
        dicts.append(assistant)
        if not turn.outputs:
            return
        outputs = list(turn.outputs)
        if turn.malformed:  # the loop shows the parser's error as the observation
            outputs = [f"Error: {call.error}" for call in parsed.calls]
        names = [call.name for call in turn.calls] or ["python"] * len(outputs)
        ids = [call.call_id for call in turn.calls]
        new = [ChatMessage("tool", text, name=name) for text, name in zip(outputs, names)]
        for text, name in zip(outputs, names):
            if turn.malformed and ref.family and ref.family.structured_calls:
                dicts.append({"role": "user", "content": text})  # no call to answer
                continue
            call_id = ids.pop(0) if ids else call_id_for(len(dicts), 0)
            dicts.append({"role": "tool", "content": text, "name": name,
                          "tool_call_id": call_id})
        if turn.then_user:
            new.append(ChatMessage("user", turn.then_user))
            dicts.append({"role": "user", "content": turn.then_user})
        try:
            extended = conversation.add_messages(new)
        except Exception as err:  # the format's render failed: does the template refuse it?
            ref.ids(dicts, generation_prompt=True)
            result.equal, result.note = False, f"the format failed to render: {err}"
            return
        if not extended:
            result.append_only = False
            result.breaks.append(str(conversation.segment_breaks[-1]))


def _parsed_as_written(calls: Sequence[Any], turn: Turn) -> bool:
    if turn.malformed:
        return bool(calls) and all(not call.ok for call in calls)
    return [(c.name, c.arguments) for c in calls] == [(c.name, c.arguments) for c in turn.calls]


class _Reference:
    """The template's own tokens for a conversation given as OpenAI-style message dicts
    (independent of the format's rendering code)."""

    def __init__(self, fmt: ChatFormat, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.family = getattr(fmt, "family", None)
        self.kwargs = dict(getattr(fmt, "template_kwargs", {}) or {})
        self.schemas = [tool_schema(tool.openai_schema(), self.family) for tool in TOOLS]
        self.stops = set(fmt.stop_token_ids)
        self.calls = self.family.calls if self.family else "hermes"
        self.thinks = bool(self.family and self.family.name == "qwen3")
        # Where the template has no place for them (and no family says otherwise), the tools
        # are listed in the system prompt and results wrapped in <tool_response>, Hermes-style.
        hermes_conventions = self.family is None
        self.listing = tool_listing_text(TOOLS, getattr(fmt, "tool_listing", "json")) if (
            hermes_conventions and not self._renders("zq_probe_tool", tools=[_PROBE_SCHEMA])
        ) else ""
        self.wrap = hermes_conventions and not self._renders("<tool_response>", messages=[
            {"role": "user", "content": "x"}, {"role": "assistant", "content": "y"},
            {"role": "tool", "content": "z", "tool_call_id": "zqprobe01"}])
        self.renders_calls = self._renders("zq_probe_call", messages=[
            {"role": "user", "content": "x"}, {"role": "assistant", "content": "", "tool_calls": [
                {"id": "zqprobe01", "type": "function",
                 "function": {"name": "zq_probe_call", "arguments": {}}}]}])

    def ids(self, dicts: Sequence[dict[str, Any]], *, generation_prompt: bool) -> list[int]:
        try:
            out = self.tokenizer.apply_chat_template(
                self._as_reference_encoder_sees_it(dicts), tools=self.schemas, tokenize=True,
                return_dict=False, add_generation_prompt=generation_prompt, **self.kwargs)
        except Exception as err:  # the template's own raise_exception
            raise _Unsupported(f"the template refuses this conversation: {err}") from err
        return [int(i) for i in out]

    def sampled_ids(self, dicts: Sequence[dict[str, Any]], assistant: dict[str, Any],
                    prompt_ids: Sequence[int]) -> list[int]:
        """The template's tokens for the assistant turn, through its first stop token."""
        full = self.ids([*dicts, assistant], generation_prompt=False)
        if full[:len(prompt_ids)] != list(prompt_ids):
            raise _Unsupported("the template's render with the next assistant turn does not "
                               "start with its render of the prompt")
        rest = full[len(prompt_ids):]
        end = next((i for i, token in enumerate(rest) if token in self.stops), None)
        if end is None:
            raise _Unsupported("the template ends the assistant turn without a stop token")
        return rest[:end + 1]

    def assistant(self, turn: Turn) -> dict[str, Any]:
        entry: dict[str, Any] = {"role": "assistant", "content": turn.content}
        if turn.malformed:
            entry["content"] = MALFORMED_TEXT[self.calls]
        if self.thinks:  # a thinking model reasons in every turn
            entry["reasoning_content"] = THINKING
        if turn.calls and not turn.malformed and not self.renders_calls:
            entry["content"] = turn.content + "".join(
                f"<tool_call>{json.dumps({'name': c.name, 'arguments': c.arguments})}</tool_call>"
                for c in turn.calls)  # a template without call rendering: Hermes-style text
        elif turn.calls and not turn.malformed:
            entry["tool_calls"] = [
                {"id": call.call_id, "type": "function",
                 "function": {"name": call.name, "arguments": call.arguments}}
                for call in turn.calls]
            if self.family and self.family.structured_calls:
                entry["content"] = None
        return entry

    def _renders(self, needle: str, *, messages: list[dict[str, Any]] | None = None,
                 tools: list[dict[str, Any]] | None = None) -> bool:
        """Whether the template's render of a probe conversation contains `needle`."""
        try:
            text = self.tokenizer.apply_chat_template(
                messages or [{"role": "user", "content": "x"}], tools=tools, tokenize=False,
                **self.kwargs)
        except Exception:
            return False
        return needle in text

    def _as_reference_encoder_sees_it(self, dicts: Sequence[dict[str, Any]]
                                      ) -> list[dict[str, Any]]:
        """Mistral: JSON-encoded tool results, the system prompt in the last user message."""
        out = [dict(d) for d in dicts]
        if self.listing and out[0]["role"] == "system":
            out[0]["content"] = f"{out[0]['content']}\n\n{self.listing}"
        elif self.listing:
            out.insert(0, {"role": "system", "content": self.listing})
        if self.wrap:
            for entry in out:
                if entry["role"] == "tool":
                    entry["content"] = f"<tool_response>{entry['content']}</tool_response>"
        if self.family is None:
            return out
        for entry in out:
            if entry["role"] == "tool" and self.family.json_tool_content:
                entry["content"] = json.dumps(json_or_text(entry["content"]), ensure_ascii=False)
        if self.family.system_with_last_user and out[0]["role"] == "system":
            last = max(i for i, d in enumerate(out) if d["role"] == "user")
            out[last]["content"] = f"{out[0]['content']}\n\n{out[last]['content']}"
            out = out[1:]
        return out


# -- auditing recorded trajectories ------------------------------------------------------------


@dataclass(frozen=True)
class RecordedCall:
    """One stored model call: the prompt ids new since the previous call of its segment (all of
    them on a segment's first call) and the sampled ids."""

    turn: int
    segment: int
    context_len: int
    prompt_ids: tuple[int, ...]
    sampled_ids: tuple[int, ...]


@dataclass
class TrajectoryAudit:
    """`status`: `exact` (every prompt is the template's tokens), `sampled_noncanonical` (the
    same text; only sampled ids are tokenized differently from the template's encoding, which
    the loop keeps on purpose), or `mismatch` (what the model saw differs from the template's
    render: `difference` shows the first differing token, in model call `turn`)."""

    status: str = "exact"
    prompts_checked: int = 0
    turn: int | None = None
    difference: str | None = None


def audit_calls(fmt: ChatFormat, prompt: Sequence[ChatMessage], tools: Sequence[Tool],
                calls: Sequence[RecordedCall],
                tool_results: dict[int, list[ChatMessage]]) -> TrajectoryAudit:
    """Rebuild the conversation from the records (prompt, each call's sampled turn, the tool
    results shown after it) and compare every prompt the loop sent with `fmt.render` of the
    conversation so far: the template's own tokens for it."""
    audit = TrajectoryAudit()
    messages = list(prompt)
    segments: dict[int, tuple[list[int], list[bool]]] = {}
    for call in sorted(calls, key=lambda c: c.turn):
        ids, sampled = segments.setdefault(call.segment, ([], []))
        if call.context_len != len(ids):
            return _mismatch(audit, call.turn, f"the call's context_len {call.context_len} is "
                                               f"not its segment's length {len(ids)}")
        ids += call.prompt_ids
        sampled += [False] * len(call.prompt_ids)
        audit.prompts_checked += 1
        expected = fmt.render(messages, tools)
        verdict = _compare(expected, ids, sampled, fmt.decode)
        if verdict is not None:
            if verdict[0] == "mismatch":
                return _mismatch(audit, call.turn, verdict[1])
            audit.status = "sampled_noncanonical"
        ids += call.sampled_ids
        sampled += [True] * len(call.sampled_ids)
        messages.append(fmt.assistant_message(fmt.parse(call.sampled_ids, tools)))
        messages += tool_results.get(call.turn, [])
    return audit


def _compare(expected: list[int], actual: list[int], sampled: list[bool],
             decode: Decode) -> tuple[str, str] | None:
    difference = first_token_difference(expected, actual, decode)
    if difference is None:
        return None
    if decode(expected) == decode(actual):
        at = next((i for i, (a, b) in enumerate(zip(expected, actual)) if a != b), None)
        if at is not None and sampled[at]:
            return "sampled_noncanonical", difference
    return "mismatch", difference


def _mismatch(audit: TrajectoryAudit, turn: int, difference: str) -> TrajectoryAudit:
    audit.status, audit.turn, audit.difference = "mismatch", turn, difference
    return audit
