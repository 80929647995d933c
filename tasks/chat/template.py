"""A chat format driven by a checkpoint's own Hugging Face chat template (`apply_chat_template`).

Rendering: the template renders the messages to text, the tokenizer encodes that text, exactly
as `apply_chat_template(..., tokenize=True)` does. Tool schemas are passed with `tools=` when the
template renders them, else listed in the system prompt; tool results are wrapped in
`<tool_response>` unless the template already does it (both detected with a probe render).

Extension guarantee: after a sampled turn, the template renders the whole longer conversation;
the continuation is the part after the sampled turn's stop token, and it is used only if the
text of the history (prompt, sampled ids and earlier continuations, decoded) is exactly the
template's own text up to that point. Templates that rewrite earlier turns (for example ones that
drop past reasoning) fail that check and `continuation` returns None: the agent loop then starts
a new training sample from the full render rather than pretend the old ids are a prefix.

Incremental mode (the default when the template qualifies): the cost of a continuation does not
grow with the conversation. The template renders only the prompt (the messages before the first
assistant turn), the sampled turn and the new messages; the check is that this text starts with
the prompt's own render followed by the sampled turn's text and its stop token, i.e. that the
template reproduces the sampled turn verbatim; the continuation is the encoding of the rest. This
equals the full render's continuation when the template renders each later message regardless of
the ones between it and the prompt, and the tokenizer's encoding is unchanged by a cut right
after the stop token. Both are checked at construction by running a probe conversation (with
reasoning in some turns, observations and later user messages) through both algorithms and
requiring the same answer every turn; a template that fails (or `incremental=False`) re-renders
the whole conversation every turn as above. A template that rewrites the sampled turn itself
(dropping its reasoning) fails the per-turn check in either mode, so a new segment starts; one
that rewrites earlier turns (keeping reasoning only in the last assistant turn) fails the probe.
A template whose rendering changes in ways a short probe cannot show (after N messages, say)
needs `incremental=False`.
Texts are encoded with `tasks.chat.codec.SplitEncoder` (pieces remembered, same ids).

Families (`tasks.chat.families`): with `family=`, the format takes the family's stop tokens, tool
role and native call syntax, hands sampled calls to the template as structured `tool_calls`
with call ids where the family needs it (Mistral), and places the system prompt as the family's
reference encoder does. Without one, calls are Hermes-style and the rest is probed. When the
format cannot extend, `continuation` returns a `SegmentBreak` saying why and where.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from tasks.chat.base import (
    ParsedTurn,
    SegmentBreak,
    Tokenizer,
    ToolListing,
    first_difference,
    single_token_id,
    tool_listing_text,
    with_tool_listing,
)
from tasks.chat.codec import LRU, SplitEncoder, TokenCodec
from tasks.chat.families import ChatFamily, tool_schema
from tasks.chat.native_calls import PARSERS, call_id_for
from tasks.chat.parsing import parse_tool_calls
from tasks.messages import ChatMessage, ToolCallRequest
from tasks.tools import Tool, tool

RESPONSE_OPEN, RESPONSE_CLOSE = "<tool_response>", "</tool_response>"
_MARKERS = ("<|im_start|>", "<|im_end|>", RESPONSE_OPEN, RESPONSE_CLOSE)  # cut here if exact
_PROBE = "zq_probe_tool"


class TemplateChatFormat:
    """Chat format of any HF tokenizer with a chat template; tool calls in Hermes style unless a
    `family` names the model's native syntax (see the module docstring)."""

    def __init__(self, tokenizer: Any, *, tool_listing: ToolListing = "json",
                 stop_tokens: Sequence[str] | None = None, tool_role: str | None = None,
                 template_kwargs: Mapping[str, Any] | None = None,
                 incremental: bool | None = None, family: ChatFamily | None = None) -> None:
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("the tokenizer has no chat_template; set one or use HermesChatFormat")
        self.tokenizer: Tokenizer = tokenizer
        self.family = family
        self.name = family.name if family else "template"
        self.tool_listing: ToolListing = tool_listing
        self.tool_role = tool_role or (family.tool_role if family else "tool")
        self.template_kwargs = {**(family.template_kwargs if family else {}),
                                **(template_kwargs or {})}
        self._parse_calls = PARSERS[family.calls] if family else parse_tool_calls
        if stop_tokens is None and family is not None:
            stop_tokens = family.stop_tokens
        names = list(stop_tokens) if stop_tokens else [tokenizer.eos_token]
        ids = [single_token_id(tokenizer, name) for name in names if name]
        if not ids or any(i is None for i in ids):
            raise ValueError(f"stop tokens {names!r} must each be a single token of the tokenizer")
        self._stop = tuple(int(i) for i in ids if i is not None)
        self.codec = TokenCodec(tokenizer)
        self._stop_text = {stop: self.codec.decode([stop]) for stop in self._stop}
        self.encoder = SplitEncoder(self.codec, (*self._stop_text.values(), *_MARKERS,
                                                 *(family.markers if family else ())))
        self._listings: LRU[tuple[Tool, ...], str] = LRU(64)
        self._schemas: LRU[tuple[Tool, ...], list[dict[str, Any]]] = LRU(64)
        self._prompt_texts: LRU[tuple[tuple[ChatMessage, ...], tuple[Tool, ...]], str] = LRU(1024)
        self.native_tools = self._probe_native_tools()
        # Without a family: wrap tool results in <tool_response> unless the template does.
        self.wraps_responses = self._probe_wraps_responses() if family is None else None
        self._wrap_results = family is None and not self.wraps_responses
        self.incremental = False
        if incremental is not False:
            qualifies = self._probe_incremental()
            if incremental and not qualifies:
                raise ValueError(
                    "this chat template cannot be extended incrementally (its render of a message "
                    "depends on the messages before it, or the tokenizer merges across the stop "
                    "token); pass incremental=None or False to re-render the whole conversation")
            self.incremental = qualifies

    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        return self._stop

    @property
    def wraps_tool_results(self) -> bool:
        """Whether the format wraps tool results in `<tool_response>` (the template does not)."""
        return self._wrap_results

    def render_text(self, messages: Sequence[ChatMessage], tools: Sequence[Tool], *,
                    add_generation_prompt: bool = True) -> str:
        extra: dict[str, Any] = {}
        key = tuple(tools)
        if self.native_tools and tools:
            schemas = self._schemas.get(key)
            if schemas is None:
                schemas = self._schemas.put(key, [tool_schema(t.openai_schema(), self.family)
                                                   for t in key])
            extra["tools"] = schemas
            listed = list(messages)
        else:
            listing = self._listings.get(key)
            if listing is None:
                listing = self._listings.put(key, tool_listing_text(key, self.tool_listing))
            listed = with_tool_listing(messages, listing)
        dicts = self._message_dicts(listed)
        return self.tokenizer.apply_chat_template(  # type: ignore[attr-defined]
            dicts, tokenize=False, add_generation_prompt=add_generation_prompt,
            **extra, **self.template_kwargs)

    def render(self, messages: Sequence[ChatMessage], tools: Sequence[Tool], *,
               add_generation_prompt: bool = True) -> list[int]:
        text = self.render_text(messages, tools, add_generation_prompt=add_generation_prompt)
        return self.encoder.encode(text)

    def continuation(self, history_ids: Sequence[int], messages: Sequence[ChatMessage],
                     new_messages: Sequence[ChatMessage],
                     tools: Sequence[Tool]) -> list[int] | SegmentBreak:
        if not history_ids or int(history_ids[-1]) not in self._stop:
            return SegmentBreak("turn_not_ended", "the sampled turn does not end with a stop "
                                "token of the format")
        if self.incremental:
            return self._local_continuation(int(history_ids[-1]), messages, new_messages, tools)
        return self._full_continuation(history_ids, messages, new_messages, tools)

    def _full_continuation(self, history_ids: Sequence[int], messages: Sequence[ChatMessage],
                           new_messages: Sequence[ChatMessage],
                           tools: Sequence[Tool]) -> list[int] | SegmentBreak:
        """Render everything; use the part after the history's last stop token if the history
        decodes to exactly the template's text before it."""
        history = [int(i) for i in history_ids]
        full = self.render([*messages, *new_messages], tools, add_generation_prompt=True)
        cut = _after_nth_stop(full, self._stop, sum(1 for i in history if i in self._stop))
        rendered = self.decode(full[:cut] if cut is not None else full)
        sampled = self.decode(history)
        if cut is None or rendered != sampled:
            turn_text = messages[-1].content if messages else ""
            turn_starts = len(sampled) - len(turn_text) - len(self._stop_text[history[-1]])
            kind = "turn_rewritten" if _diverge_at(rendered, sampled) >= turn_starts else (
                "history_rewritten")
            return SegmentBreak(kind, first_difference(rendered, sampled))
        return full[cut:]

    def _local_continuation(self, stop_id: int, messages: Sequence[ChatMessage],
                            new_messages: Sequence[ChatMessage],
                            tools: Sequence[Tool]) -> list[int] | SegmentBreak:
        """Render the prompt, the sampled turn and the new messages only; use the part after the
        turn's stop token if the template reproduced the turn verbatim (see module docstring)."""
        prompt = _prompt_of(messages)
        turn = messages[-1] if messages else None
        if turn is None or turn.role != "assistant" or len(prompt) >= len(messages):
            return SegmentBreak("history_rewritten", "no sampled assistant turn to extend")
        key = (prompt, tuple(tools))
        before = self._prompt_texts.get(key)
        if before is None:
            before = self._prompt_texts.put(key, self.render_text(prompt, tools))
        text = self.render_text([*prompt, turn, *new_messages], tools, add_generation_prompt=True)
        sampled = turn.content + self._stop_text[stop_id]
        if not text.startswith(before):
            return SegmentBreak("history_rewritten", first_difference(
                text[:len(before)], before) + " (the prompt renders differently)")
        if not text.startswith(sampled, len(before)):
            return SegmentBreak("turn_rewritten", first_difference(
                text[len(before):len(before) + len(sampled)], sampled))
        return self.encoder.encode(text[len(before) + len(sampled):])

    def parse(self, sampled_ids: Sequence[int], tools: Sequence[Tool]) -> ParsedTurn:
        ids = [int(i) for i in sampled_ids]
        ended = bool(ids) and ids[-1] in self._stop
        text = self.decode(ids[:-1] if ended else ids)
        return ParsedTurn(text=text, calls=self._parse_calls(text, [t.name for t in tools]),
                          ended=ended)

    def assistant_message(self, parsed: ParsedTurn) -> ChatMessage:
        """The sampled text as the message's content; for a family with structured calls, a turn
        whose calls are all well-formed becomes `tool_calls` (ids: the model's own, or one
        generated at render time when it wrote none) so the template writes them itself."""
        calls = parsed.calls
        if not (self.family and self.family.structured_calls and calls
                and all(call.ok for call in calls)):
            return ChatMessage("assistant", parsed.text)
        requests = tuple(ToolCallRequest(call.name or "", json.dumps(
            call.arguments, ensure_ascii=False), call.call_id or "") for call in calls)
        return ChatMessage("assistant", parsed.text, tool_calls=requests)

    def encode_assistant(self, text: str) -> list[int]:
        return self.codec.encode(text) + [self._stop[0]]

    def decode(self, token_ids: Sequence[int]) -> str:
        return self.codec.decode(token_ids)

    def _message_dicts(self, messages: Sequence[ChatMessage]) -> list[dict[str, Any]]:
        """The template's message dicts: tool results wrapped or JSON-encoded as the family
        wants, each paired (in order) with the id of the call it answers, call ids generated
        where the model wrote none, and the system prompt moved if the family moves it."""
        out: list[dict[str, Any]] = []
        pending: list[str] = []  # ids of the last assistant turn's calls not yet answered
        for position, message in enumerate(messages):
            if message.role == "assistant":
                entry = message.to_dict()
                if message.tool_calls:
                    entry["content"] = None  # the sampled text; the template writes the calls
                    for index, call in enumerate(entry["tool_calls"]):
                        call["id"] = call["id"] or call_id_for(position, index)
                    pending = [call["id"] for call in entry["tool_calls"]]
                else:
                    pending = []
                out.append(entry)
            elif message.role == "tool" and self._answers_nothing(out):
                out.append({"role": "user", "content": message.content})
            elif message.role == "tool":
                call_id = pending.pop(0) if pending else call_id_for(position, 0)
                out.append(self._tool_dict(message, call_id))
            else:
                out.append(message.to_dict())
        if self.family and self.family.system_with_last_user:
            out = _system_into_last_user(out)
        return out

    def _answers_nothing(self, out: list[dict[str, Any]]) -> bool:
        """A tool result after an assistant turn without structured calls (a malformed call),
        for a family whose template accepts tool results only after calls (Mistral's): it is
        shown as a user message instead."""
        if not (self.family and self.family.structured_calls):
            return False
        previous = next((d for d in reversed(out) if d["role"] != "tool"), None)
        return previous is not None and previous["role"] in ("assistant", "user") and not (
            previous.get("tool_calls"))

    def _tool_dict(self, message: ChatMessage, call_id: str) -> dict[str, Any]:
        content = message.content
        if self.family and self.family.json_tool_content:
            content = json.dumps(json_or_text(content), ensure_ascii=False)
        elif self._wrap_results:
            content = f"{RESPONSE_OPEN}{content}{RESPONSE_CLOSE}"
        out: dict[str, Any] = {"role": self.tool_role, "content": content,
                               "tool_call_id": call_id}
        if message.name is not None and self.tool_role == "tool":
            out["name"] = message.name
        return out

    def _probe_native_tools(self) -> bool:
        schema = {"type": "function", "function": {
            "name": _PROBE, "description": "probe",
            "parameters": {"type": "object", "properties": {}}}}
        try:
            text = self.tokenizer.apply_chat_template(  # type: ignore[attr-defined]
                [{"role": "user", "content": "x"}], tools=[schema], tokenize=False,
                add_generation_prompt=True, **self.template_kwargs)
        except Exception:  # a template that rejects tools= cannot render them natively
            return False
        return _PROBE in text

    def _probe_wraps_responses(self) -> bool:
        probe = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"},
                 {"role": self.tool_role, "content": _PROBE}]
        try:
            text = self.tokenizer.apply_chat_template(  # type: ignore[attr-defined]
                probe, tokenize=False, add_generation_prompt=True, **self.template_kwargs)
        except Exception as err:
            raise ValueError(
                f"the chat template cannot render a {self.tool_role!r} message ({err}); "
                "pass tool_role='user' or use HermesChatFormat") from err
        return RESPONSE_OPEN in text

    def _probe_incremental(self) -> bool:
        """Whether both continuation algorithms agree (the same ids, or both None) on every turn
        of a probe conversation: a system prompt, calls with varied text and with reasoning,
        observations, later user messages; with and without a tool. After a None the probe goes
        on from a full render, as the agent loop does."""
        turns = [("Let me check.\n", [ChatMessage("tool", "3", name=_PROBE)]),
                 ("<think>a plan</think>Calling.", [ChatMessage("tool", "4", name=_PROBE)]),
                 ("<think>more</think>  two  spaces é", [
                     ChatMessage("tool", "ok\nline", name=_PROBE),
                     ChatMessage("user", "Again, please.")]),
                 ("x", [ChatMessage("tool", "", name=_PROBE)]),
                 ("<think>c</think>y", [ChatMessage("tool", "5", name=_PROBE)]),
                 ("done", [ChatMessage("user", "Thanks.")])]
        for tools in ((), (_probe_tool,)):
            messages = [ChatMessage("system", "Be brief."), ChatMessage("user", "Compute 1+2.")]
            try:
                ids = self.render(messages, tools)
                for text, new_messages in turns:
                    sampled = self.encode_assistant(text)
                    ids += sampled
                    messages.append(self.assistant_message(self.parse(sampled, tools)))
                    full = self._full_continuation(ids, messages, new_messages, tools)
                    local = self._local_continuation(sampled[-1], messages, new_messages, tools)
                    if (local if isinstance(local, list) else None) != (
                            full if isinstance(full, list) else None):
                        return False
                    messages.extend(new_messages)
                    ids = ids + full if isinstance(full, list) else self.render(messages, tools)
            except Exception:  # a template that cannot render the probe: no incremental mode
                return False
        return True


@tool(name=_PROBE)
def _probe_tool(text: str) -> str:
    """A probe tool (never called).

    Args:
        text: any text.
    """
    return text


def _system_into_last_user(dicts: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Mistral's reference encoder: the system prompt opens the last user message."""
    if not dicts or dicts[0]["role"] != "system":
        return dicts
    users = [i for i, d in enumerate(dicts) if d["role"] == "user"]
    if not users:
        return dicts
    out = [dict(d) for d in dicts[1:]]
    last = users[-1] - 1
    out[last]["content"] = f"{dicts[0]['content']}\n\n{out[last]['content']}"
    return out


def json_or_text(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def _diverge_at(a: str, b: str) -> int:
    """The first index where two texts differ (the shorter length if one extends the other)."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def _prompt_of(messages: Sequence[ChatMessage]) -> tuple[ChatMessage, ...]:
    """The messages before the first assistant turn."""
    for index, message in enumerate(messages):
        if message.role == "assistant":
            return tuple(messages[:index])
    return tuple(messages)


def _after_nth_stop(ids: Sequence[int], stops: tuple[int, ...], n: int) -> int | None:
    seen = 0
    for position, token in enumerate(ids):
        if token in stops:
            seen += 1
            if seen == n:
                return position + 1
    return None
