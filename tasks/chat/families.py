"""Per-family chat formats: a checkpoint's own template plus what the template does not say.

A `ChatFamily` names what `TemplateChatFormat` needs beyond the template text: the stop tokens,
the role tool results take, the native tool-call syntax to parse, whether sampled calls are
handed to the template as structured `tool_calls` (with call ids), whether tool results are
JSON-encoded first, and where the system prompt goes. The template still renders every token.

- `qwen2.5` (Qwen2.5 Instruct/Coder): `<tool_call>` JSON calls; results as a `user` turn with
  `<tool_response>`; append-only in a tool loop.
- `qwen3` (hybrid thinking): as Qwen2.5 after `<think>…</think>`; not append-only after a new
  user message (earlier reasoning is dropped), nor for a turn whose reasoning is empty or not in
  the template's own spacing (`enable_thinking=False` makes every turn such a turn).
- `llama3.1` (Llama 3.1 / 3.2 Instruct): `{"name", "parameters"}` JSON calls, stop on
  `<|eot_id|>` or `<|eom_id|>`; results in the `ipython` role, JSON-quoted by the template; not
  append-only when a sampled turn has whitespace at its ends (the template trims).
- `mistral-v0.3` (Mistral 7B v0.3, v3 tokenizers): a `[TOOL_CALLS]` list with 9-character ids;
  results as `[TOOL_RESULTS]` JSON with `call_id`; not append-only after a new user message
  (the system prompt and the tools move to it) or a call without a valid id.

`detect_family(template)` recognises these templates by markers only they contain.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

FAMILY_NAMES = ("qwen2.5", "qwen3", "llama3.1", "mistral-v0.3")


@dataclass(frozen=True)
class ChatFamily:
    name: str
    calls: str  # a key of tasks.chat.native_calls.PARSERS
    stop_tokens: tuple[str, ...]
    tool_role: str = "tool"
    structured_calls: bool = False  # sampled calls become `tool_calls` with ids for the template
    json_tool_content: bool = False  # tool results JSON-encoded (Mistral's reference encoder)
    system_with_last_user: bool = False  # the system prompt is folded into the last user turn
    # (tool results are passed as they are: each family's template lays them out itself)
    # the keys of a tool's "function" schema the template is given (None: all; Mistral's
    # encoder knows only name, description and parameters, not OpenAI's "strict")
    schema_keys: tuple[str, ...] | None = None
    markers: tuple[str, ...] = ()  # single-token strings the encoder may cut before
    template_kwargs: dict[str, Any] = field(default_factory=dict)


FAMILIES: dict[str, ChatFamily] = {
    "qwen2.5": ChatFamily("qwen2.5", "hermes", ("<|im_end|>",)),
    "qwen3": ChatFamily("qwen3", "hermes", ("<|im_end|>",)),
    "llama3.1": ChatFamily(
        "llama3.1", "llama3", ("<|eot_id|>", "<|eom_id|>"), tool_role="ipython",
        markers=("<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|eom_id|>")),
    "mistral-v0.3": ChatFamily(
        "mistral-v0.3", "mistral", ("</s>",), structured_calls=True, json_tool_content=True,
        system_with_last_user=True, schema_keys=("name", "description", "parameters"),
        markers=("[INST]", "[/INST]", "[TOOL_CALLS]", "[TOOL_RESULTS]", "[/TOOL_RESULTS]",
                 "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]")),
}

_SIGNATURES = (  # (family, strings that must all be in the template), most specific first
    ("mistral-v0.3", ("[TOOL_CALLS]", "[TOOL_RESULTS]", "length != 9")),
    ("llama3.1", ("<|start_header_id|>", "ipython", '"parameters": ')),
    ("qwen3", ("<|im_start|>", "<tool_response>", "</think>", "last_query_index")),
    ("qwen2.5", ("<|im_start|>", "<tool_response>", "<tool_call>", "You are Qwen")),
)


def tool_schema(schema: dict[str, Any], chat_family: ChatFamily | None) -> dict[str, Any]:
    """An OpenAI tool schema as the family's template is given it."""
    keys = chat_family.schema_keys if chat_family else None
    if keys is None:
        return schema
    return {**schema, "function": {k: v for k, v in schema["function"].items() if k in keys}}


def detect_family(template: str | None) -> str | None:
    """The family whose template this is, by markers only it contains; None if unknown."""
    if not template:
        return None
    for name, needles in _SIGNATURES:
        if all(needle in template for needle in needles):
            return name
    return None


def family(name: str) -> ChatFamily:
    try:
        return FAMILIES[name]
    except KeyError:
        raise ValueError(f"unknown chat family {name!r}; one of {', '.join(FAMILIES)}") from None
