"""Fast encoding paths give exactly the tokenizer's ids; the incremental template is exact and flat.

- `TokenCodec` equals `tokenizer.encode(text, add_special_tokens=False)` / `tokenizer.decode`,
  straight through the Rust backend only while the wrapper would add nothing;
- `SplitEncoder` equals encoding the whole text, and refuses to cut before a marker whose cut
  would change the ids (a marker that swallows the whitespace before it);
- the incremental template continuation gives the same segments as re-rendering the whole
  conversation, renders a bounded number of messages per turn however long the conversation,
  and is refused for a template whose render of a message depends on the messages before it.
"""

from __future__ import annotations

import string

import pytest
from chat_tokenizers import byte_level_bpe
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from core.tiny_tokenizer import CHAT_TEMPLATE, build_tiny_tokenizer
from tasks.builtin_tools import python
from tasks.chat import HermesChatFormat, TemplateChatFormat
from tasks.chat.codec import SplitEncoder, TokenCodec
from tasks.chat.conversation import Conversation
from tasks.messages import ChatMessage

MARKERS = ["<|im_start|>", "<|im_end|>", "<tool_response>", "</tool_response>", "<tool_call>"]
TEXT = st.lists(st.one_of(st.sampled_from(MARKERS), st.text(
    alphabet=string.ascii_letters + string.digits + " \n\t{}\":,.()é", max_size=12)),
    max_size=8).map("".join)
QWEN_LIKE = (
    "{%- for m in messages %}{% if m.role == 'tool' %}<|im_start|>user\n<tool_response>\n"
    "{{ m.content }}\n</tool_response><|im_end|>\n"
    "{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
DROPS_THINKING = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n"
    "{% if m.role == 'assistant' %}{{ m.content.split('</think>')[-1] }}"
    "{% else %}{{ m.content }}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
NUMBERED = (  # a tool or user message's render depends on how many came before it
    "{% for m in messages %}{{ '<|im_start|>' + m.role }}"
    "{% if m.role != 'assistant' %}{{ ' ' + loop.index|string }}{% endif %}"
    "{{ '\\n' + m.content + '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


def tiny_with(template: str) -> PreTrainedTokenizerFast:
    tokenizer = build_tiny_tokenizer()
    tokenizer.chat_template = template
    return tokenizer


def bpe_tokenizer() -> PreTrainedTokenizerFast:
    return byte_level_bpe("print(3*(4+5)) the answer is 27 tool_call name arguments", QWEN_LIKE)


def greedy_tokenizer() -> PreTrainedTokenizerFast:
    """Characters, with `<|im_start|>` swallowing the whitespace before it (lstrip)."""
    chars = list(string.printable.replace("\x0b", "").replace("\x0c", "").replace("\r", ""))
    vocab = {token: i for i, token in enumerate(["<unk>", "<|im_start|>", "<|im_end|>"] + chars)}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("(?m)."), behavior="isolated")
    core.decoder = decoders.Fuse()
    core.add_special_tokens([AddedToken("<|im_start|>", lstrip=True, special=True),
                             AddedToken("<|im_end|>", special=True)])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<|im_end|>",
                                        unk_token="<unk>")
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


TINY, BPE = build_tiny_tokenizer(), bpe_tokenizer()


ENCODERS = [(tokenizer, SplitEncoder(TokenCodec(tokenizer), MARKERS)) for tokenizer in (TINY, BPE)]


@settings(max_examples=100, deadline=None)
@given(text=TEXT)
def test_codec_and_split_encoder_equal_the_tokenizer(text):
    for tokenizer, encoder in ENCODERS:
        expected = tokenizer.encode(text, add_special_tokens=False)
        assert encoder.codec.encode(text) == expected
        assert encoder.encode(text) == expected
        assert encoder.encode(text) == expected, "again, from the remembered pieces"
        assert encoder.codec.decode(expected) == tokenizer.decode(expected,
                                                                  skip_special_tokens=False)
    assert len(ENCODERS[0][1].markers) == 5, "the tiny tokenizer's markers are all cut at"


def test_codec_goes_direct_only_while_the_wrapper_adds_nothing():
    tokenizer = build_tiny_tokenizer()
    codec = TokenCodec(tokenizer)
    assert codec.direct
    tokenizer.clean_up_tokenization_spaces = True
    assert codec.decode(codec.encode("a , b")) == tokenizer.decode(
        tokenizer.encode("a , b", add_special_tokens=False), skip_special_tokens=False)
    tokenizer.backend_tokenizer.enable_truncation(max_length=3)
    assert codec.encode("abcdef") == tokenizer.encode("abcdef", add_special_tokens=False)
    assert len(codec.encode("abcdef")) == 6, "the wrapper's encode switches truncation off"

    class Custom(type(tokenizer)):  # type: ignore[misc]
        def encode(self, text, add_special_tokens=True, **kwargs):
            return [0]

    custom = Custom(tokenizer_object=tokenizer.backend_tokenizer, eos_token="<|im_end|>")
    assert not TokenCodec(custom).direct and TokenCodec(custom).encode("abc") == [0]


def test_a_marker_that_swallows_whitespace_is_not_cut_at():
    tokenizer = greedy_tokenizer()
    text = "x \n<|im_start|>user\nhi<|im_end|>\n"
    assert tokenizer.encode(text, add_special_tokens=False) != (
        tokenizer.encode("x \n", add_special_tokens=False)
        + tokenizer.encode("<|im_start|>user\nhi<|im_end|>\n", add_special_tokens=False)), \
        "the fixture lost its point"
    fmt = HermesChatFormat(tokenizer, tool_listing="names")
    assert "<|im_start|>" not in fmt.encoder.markers and "<|im_end|>" in fmt.encoder.markers
    messages = [ChatMessage("system", "Be brief. "), ChatMessage("user", "Compute 1+2 \n")]
    text = tokenizer.apply_chat_template([m.to_dict() for m in messages], tokenize=False,
                                         add_generation_prompt=True)
    assert fmt.render(messages, []) == tokenizer.encode(text, add_special_tokens=False)


def run_conversation(fmt, turns):
    """Drive a Conversation through (assistant text, new messages) turns; return its segments."""
    conversation = Conversation(fmt, [ChatMessage("system", "Be brief."),
                                      ChatMessage("user", "Compute 3*(4+5).")], [python])
    for text, new_messages in turns:
        conversation.take_prompt()
        conversation.add_sampled(fmt.encode_assistant(text))
        conversation.add_messages(new_messages)
    return [(s.token_ids, s.loss_mask, s.sampled_spans) for s in conversation.segments]


TURNS = st.lists(st.tuples(
    st.one_of(TEXT, st.just("<think>hm</think>ok")),
    st.lists(st.one_of(st.builds(lambda t: ChatMessage("tool", t, name="python"), TEXT),
                       st.builds(lambda t: ChatMessage("user", t), TEXT)),
             min_size=1, max_size=2)), min_size=1, max_size=5)


FORMAT_PAIRS = {name: (TemplateChatFormat(tokenizer, tool_listing="json"),
                       TemplateChatFormat(tokenizer, tool_listing="json", incremental=False))
                for name, tokenizer in [("tiny", TINY), ("bpe-qwen-like", BPE),
                                        ("drops-thinking", tiny_with(DROPS_THINKING))]}


@pytest.mark.parametrize("name", sorted(FORMAT_PAIRS))
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(turns=TURNS)
def test_incremental_template_equals_the_full_render(name, turns):
    incremental, full = FORMAT_PAIRS[name]
    assert incremental.incremental and not full.incremental
    assert run_conversation(incremental, turns) == run_conversation(full, turns)


def test_incremental_template_renders_a_bounded_number_of_messages_per_turn():
    sizes = {}
    for mode in (True, False):
        tokenizer = tiny_with(CHAT_TEMPLATE)
        fmt = TemplateChatFormat(tokenizer, tool_listing="none", incremental=mode)
        rendered: list[int] = []
        render = tokenizer.apply_chat_template

        def counting(conversation, *args, _render=render, _rendered=rendered, **kwargs):
            _rendered.append(len(conversation))
            return _render(conversation, *args, **kwargs)

        tokenizer.apply_chat_template = counting
        turns = [(f"call {i}", [ChatMessage("tool", f"out {i}", name="python")])
                 for i in range(30)]
        run_conversation(fmt, turns)
        sizes[mode] = rendered
    assert max(sizes[True]) <= 4, "prompt (2) + the sampled turn + one new message"
    assert max(sizes[False]) > 60, "the full render grows with the conversation"


def test_a_template_that_numbers_messages_is_not_extended_incrementally():
    tokenizer = tiny_with(NUMBERED)
    fmt = TemplateChatFormat(tokenizer, tool_listing="none")
    assert not fmt.incremental
    with pytest.raises(ValueError, match="incremental=None or False"):
        TemplateChatFormat(tokenizer, tool_listing="none", incremental=True)
    turns = [("a", [ChatMessage("tool", "1", name="python")]),
             ("b", [ChatMessage("tool", "2", name="python")])]
    ((ids, _, spans),) = run_conversation(fmt, turns)
    assert len(spans) == 2, "the full render still extends exactly"
    assert fmt.decode(ids).endswith(
        "<|im_start|>tool 6\n<tool_response>2</tool_response><|im_end|>\n<|im_start|>assistant\n")


def test_the_static_system_prompt_and_scaffolding_are_encoded_once():
    fmt = HermesChatFormat(build_tiny_tokenizer(), tool_listing="json")
    encoded: list[str] = []
    encode = fmt.codec.encode
    def recording(text: str) -> list[int]:
        encoded.append(text)
        return encode(text)

    fmt.codec.encode = recording  # type: ignore[method-assign]
    first = fmt.render([ChatMessage("user", "Compute 1+2.")], [python])
    fmt.continuation(first + fmt.encode_assistant("x"), [], [ChatMessage("tool", "3")], [python])
    encoded.clear()
    second = fmt.render([ChatMessage("user", "Compute 4*5.")], [python])
    more = fmt.continuation(second + [fmt.im_end_id], [], [ChatMessage("tool", "20")], [python])
    assert encoded == ["<|im_start|>user\nCompute 4*5.", "<tool_response>20"]
    tokenizer = fmt.tokenizer
    text = tokenizer.apply_chat_template(
        [{"role": "system", "content": fmt._listing([python])},
         {"role": "user", "content": "Compute 4*5."}], tokenize=False, add_generation_prompt=True)
    assert second == tokenizer.encode(text, add_special_tokens=False)
    assert more == tokenizer.encode("\n<|im_start|>tool\n<tool_response>20</tool_response>"
                                    "<|im_end|>\n<|im_start|>assistant\n",
                                    add_special_tokens=False)


KEEPS_LAST_REASONING = (  # earlier assistant turns lose their reasoning once a later one exists
    "{% set ns = namespace(last=-1) %}{% for m in messages %}{% if m.role == 'assistant' %}"
    "{% set ns.last = loop.index0 %}{% endif %}{% endfor %}"
    "{% for m in messages %}{{ '<|im_start|>' + m.role + '\\n' }}"
    "{% if m.role == 'assistant' and loop.index0 != ns.last %}"
    "{{ m.content.split('</think>')[-1] }}{% else %}{{ m.content }}{% endif %}"
    "{{ '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


def test_a_template_that_rewrites_earlier_turns_is_not_extended_incrementally():
    fmt = TemplateChatFormat(tiny_with(KEEPS_LAST_REASONING), tool_listing="none")
    assert not fmt.incremental
    turns = [("<think>a</think>x", [ChatMessage("tool", "1", name="python")]),
             ("<think>b</think>y", [ChatMessage("tool", "2", name="python")])]
    segments = run_conversation(fmt, turns)
    assert len(segments) == 2, "the second turn drops the first one's reasoning: a new segment"
    assert run_conversation(fmt, turns) == run_conversation(
        TemplateChatFormat(tiny_with(KEEPS_LAST_REASONING), tool_listing="none",
                           incremental=False), turns)
