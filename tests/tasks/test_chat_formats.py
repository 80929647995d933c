"""Chat formats: exact rendering, exact prefix extension, new segments when a template rewrites."""

from __future__ import annotations

import pytest
from chat_tokenizers import byte_level_bpe
from tokenizers import Tokenizer, models
from transformers import PreTrainedTokenizerFast

from core.tiny_tokenizer import build_tiny_tokenizer
from tasks.builtin_tools import python, write_file
from tasks.chat import HermesChatFormat, TemplateChatFormat, make_chat_format
from tasks.chat.conversation import Conversation
from tasks.messages import ChatMessage

CALL = '<tool_call>{"name":"python","arguments":{"code":"print(3*(4+5))"}}</tool_call>'

QWEN_LIKE = (
    "{%- if tools %}<|im_start|>system\n"
    "{% if messages[0].role == 'system' %}{{ messages[0].content }}\n{% endif %}"
    "# Tools\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}<|im_end|>\n"
    "{% elif messages[0].role == 'system' %}<|im_start|>system\n{{ messages[0].content }}"
    "<|im_end|>\n{% endif %}"
    "{%- for m in messages %}{% if m.role == 'system' %}"
    "{% elif m.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m.content }}\n"
    "</tool_response><|im_end|>\n"
    "{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# Like templates that drop earlier reasoning: the rendering of a past turn changes later.
DROPS_THINKING = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n"
    "{% if m.role == 'assistant' %}{{ m.content.split('</think>')[-1] }}"
    "{% else %}{{ m.content }}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture(scope="module")
def tiny():
    return build_tiny_tokenizer()


@pytest.fixture(scope="module")
def bpe():
    """A byte-level BPE tokenizer where 'pr' is one token but 'p','r' also exist."""
    return byte_level_bpe("print(3*(4+5)) the answer is 27 tool_call name arguments code",
                          QWEN_LIKE)


def conversation_messages():
    return [ChatMessage("system", "Be brief."), ChatMessage("user", "Compute 3*(4+5).")]


def test_hermes_render_matches_the_tiny_chat_template(tiny):
    fmt = HermesChatFormat(tiny, tool_listing="none")
    messages = conversation_messages() + [ChatMessage("assistant", CALL),
                                          ChatMessage("tool", "27", name="python")]
    as_template = [m.to_dict() for m in messages]
    as_template[-1]["content"] = "<tool_response>27</tool_response>"
    text = tiny.apply_chat_template(as_template, tokenize=False, add_generation_prompt=True)
    assert fmt.render(messages, [python]) == tiny.encode(text, add_special_tokens=False)


def test_template_format_on_tiny_tokenizer_equals_hermes(tiny):
    hermes = HermesChatFormat(tiny, tool_listing="json")
    template = TemplateChatFormat(tiny, tool_listing="json")
    assert not template.native_tools and not template.wraps_responses
    assert isinstance(make_chat_format(tiny), TemplateChatFormat)
    for fmt in (hermes, template):
        conv = Conversation(fmt, conversation_messages(), [python, write_file])
        conv.take_prompt()
        conv.add_sampled(fmt.encode_assistant(CALL))
        assert conv.add_messages([ChatMessage("tool", "27", name="python")])
        conv.take_prompt()
        conv.add_sampled(fmt.encode_assistant("<answer>27</answer>"))
    hermes_ids = Conversation(hermes, conversation_messages(), [python]).token_ids
    template_ids = Conversation(template, conversation_messages(), [python]).token_ids
    assert hermes_ids == template_ids
    assert "write_file" in hermes.decode(Conversation(hermes, conversation_messages(),
                                                      [write_file]).token_ids)


def test_extension_is_exact_and_equals_a_full_render(tiny):
    fmt = HermesChatFormat(tiny)
    conv = Conversation(fmt, conversation_messages(), [python])
    first = conv.take_prompt()
    assert first.context_len == 0 and list(first.token_ids) == conv.token_ids
    sampled = fmt.encode_assistant(CALL)
    before = list(conv.token_ids)
    conv.add_sampled(sampled)
    assert conv.add_messages([ChatMessage("tool", "27", name="python")])
    assert conv.token_ids[:len(before)] == before
    assert conv.token_ids[len(before):len(before) + len(sampled)] == sampled
    full = fmt.render(conv.messages, [python])
    assert conv.token_ids == full
    delta = conv.take_prompt()
    assert delta.context_len == len(before) + len(sampled)
    assert list(delta.token_ids) == full[delta.context_len:]


def test_turn_cut_by_length_has_no_continuation(tiny):
    fmt = HermesChatFormat(tiny)
    ids = fmt.encode_assistant(CALL)[:-1]
    assert fmt.continuation(ids, [], [ChatMessage("tool", "x")], []).kind == "turn_not_ended"
    parsed = fmt.parse(ids, [python])
    assert not parsed.ended and parsed.calls[0].ok


def test_native_template_tools_and_wrapping_are_detected(bpe):
    fmt = TemplateChatFormat(bpe)
    assert fmt.native_tools and fmt.wraps_responses
    text = fmt.render_text(conversation_messages(), [python])
    assert '"name": "python"' in text and text.count("<|im_start|>system") == 1
    assert "<tool_response>\nobs\n</tool_response>" in fmt.render_text(
        [ChatMessage("user", "q"), ChatMessage("assistant", "a"), ChatMessage("tool", "obs")], [])


def test_sampled_ids_are_kept_even_when_they_are_not_the_canonical_encoding(bpe):
    fmt = TemplateChatFormat(bpe)
    split = [bpe.convert_tokens_to_ids("p"), bpe.convert_tokens_to_ids("r")]
    assert bpe.encode("pr", add_special_tokens=False) != split, "fixture lost its point"
    sampled = split + bpe.encode("int(27)", add_special_tokens=False) + [fmt.stop_token_ids[0]]
    conv = Conversation(fmt, conversation_messages(), [])
    conv.take_prompt()
    start = len(conv.token_ids)
    conv.add_sampled(sampled)
    assert conv.add_messages([ChatMessage("user", "again")]), "text-equal history must extend"
    assert conv.token_ids[start:start + len(sampled)] == sampled
    assert fmt.decode(conv.token_ids) == fmt.render_text(conv.messages, [])


def test_template_that_rewrites_history_starts_a_new_segment(tiny):
    tiny_rewrites = build_tiny_tokenizer()
    tiny_rewrites.chat_template = DROPS_THINKING
    fmt = TemplateChatFormat(tiny_rewrites, tool_listing="none")
    conv = Conversation(fmt, [ChatMessage("user", "q")], [python])
    conv.take_prompt()
    conv.add_sampled(fmt.encode_assistant("<think>hmm</think>" + CALL))
    first = list(conv.token_ids)
    assert not conv.add_messages([ChatMessage("tool", "27", name="python")])
    assert conv.segment_index == 1
    assert conv.segments[0].token_ids == first, "the old segment must stay as it was"
    assert conv.token_ids == fmt.render(conv.messages, [python])
    assert "hmm" not in fmt.decode(conv.token_ids)
    delta = conv.take_prompt()
    assert delta.segment == 1 and delta.context_len == 0
    assert sum(conv.segments[1].loss_mask) == 0


def test_plain_turns_without_thinking_still_extend_under_that_template():
    tokenizer = build_tiny_tokenizer()
    tokenizer.chat_template = DROPS_THINKING
    fmt = TemplateChatFormat(tokenizer, tool_listing="none")
    conv = Conversation(fmt, [ChatMessage("user", "q")], [python])
    conv.take_prompt()
    conv.add_sampled(fmt.encode_assistant(CALL))
    assert conv.add_messages([ChatMessage("tool", "27", name="python")])


def test_formats_reject_tokenizers_they_cannot_serve(bpe):
    plain = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(
        {"a": 0, "<unk>": 1}, unk_token="<unk>")), unk_token="<unk>")
    with pytest.raises(ValueError, match="single tokens"):
        HermesChatFormat(plain)
    with pytest.raises(ValueError, match="no chat_template"):
        TemplateChatFormat(plain)
    with pytest.raises(ValueError, match="must each be a single token"):
        TemplateChatFormat(bpe, stop_tokens=["not one token"])
    with pytest.raises(ValueError, match="kind"):
        make_chat_format(bpe, kind="chatml")  # type: ignore[arg-type]
