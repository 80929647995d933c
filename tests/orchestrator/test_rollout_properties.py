"""Properties of the agent loop over random conversations (hypothesis, in-memory sandbox).

For random sequences of assistant turns (well-formed calls, malformed calls, answers), sampled
as non-canonical token splits on purpose, and random tool outputs, under both chat formats:
- every training segment equals the concatenation of its recorded prompt deltas and sampled ids;
- every engine request is exactly the segment so far;
- the loss mask is 1 exactly on sampled positions;
- the sampled ids in the segments are the engine's ids, unchanged (never re-encoded), with their
  sampler log-probs at the same positions.
"""

from __future__ import annotations

import json

import anyio
import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from core.engine_api import SamplingParams
from core.tiny_tokenizer import MARKUP_TOKENS, build_tiny_tokenizer
from orchestrator.engines.scripted import ScriptedEngine, ScriptedTurn
from orchestrator.rollout import run_trajectory, start_sandbox
from orchestrator.rollout_types import MemoryRecorder
from tasks import Component, Rubric, TaskInstance, TaskLimits, ToolContext, tool
from tasks.chat import HermesChatFormat, TemplateChatFormat
from tasks.testing import FakeSandbox

TOKENIZER = build_tiny_tokenizer()
FORMATS = [HermesChatFormat(TOKENIZER, tool_listing="names"),
           TemplateChatFormat(TOKENIZER, tool_listing="none")]
TEXT = st.text(alphabet=st.characters(min_codepoint=32, max_codepoint=126), max_size=12)


@tool
async def echo(ctx: ToolContext, text: str) -> str:
    """Echo text.

    Args:
        text: what to echo.
    """
    return (await ctx.sandbox.exec(["echo", text])).stdout


TASK = TaskInstance(prompt="Go.", tools=(echo,), verifier=Rubric(Component("c", lambda c: 1.0)),
                    limits=TaskLimits(max_turns=6, max_malformed_calls=50,
                                      max_tool_calls_per_turn=3, context_length=4096,
                                      max_generated_tokens=4000),
                    key="prop/train/0")


def call(text: str) -> str:
    return "<tool_call>" + json.dumps({"name": "echo", "arguments": {"text": text}}) + "</tool_call>"


turn_text = st.one_of(
    st.lists(TEXT, min_size=1, max_size=3).map(lambda texts: "".join(call(t) for t in texts)),
    TEXT.map(lambda junk: f"<tool_call>{junk}</tool_call>"),
    TEXT.map(lambda words: f"{words}<answer>{words}</answer>"),
)


def split_ids(fmt, text: str, split_markup: bool) -> tuple[int, ...]:
    """The turn's ids; markup tokens spelled out character by character when `split_markup`
    (a valid sampling whose re-encoding would differ)."""
    ids = fmt.encode_assistant(text)
    if not split_markup:
        return tuple(ids)
    markup = {TOKENIZER.convert_tokens_to_ids(m): m for m in MARKUP_TOKENS}
    out: list[int] = []
    for token in ids:
        if token in markup:
            out.extend(TOKENIZER.convert_tokens_to_ids(list(markup[token])))
        else:
            out.append(token)
    return tuple(out)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(turns=st.lists(st.tuples(turn_text, st.booleans()), min_size=1, max_size=6),
       fmt_index=st.sampled_from([0, 1]),
       tool_output=TEXT)
def test_segments_are_exactly_the_recorded_prompts_and_sampled_ids(turns, fmt_index,
                                                                   tool_output):
    fmt = FORMATS[fmt_index]
    scripted = [split_ids(fmt, text, split) for text, split in turns]
    scripted.append(split_ids(fmt, "<answer>done</answer>", True))  # ends scripts that call on
    engine = ScriptedEngine([ScriptedTurn(ids) for ids in scripted])
    sandbox = FakeSandbox(handler=lambda argv, stdin: tool_output + argv[-1])
    recorder = MemoryRecorder()

    async def go():
        return await run_trajectory(task=TASK, engine=engine, chat_format=fmt,
                                    acquire_sandbox=start_sandbox(lambda spec: sandbox),
                                    params=SamplingParams(max_tokens=1000), recorder=recorder)

    outcome = anyio.run(go)
    assert outcome.turns == len(recorder.model_calls) == len(engine.requests) >= 1
    assert outcome.error is None, outcome.error
    sampled_by_call = [r.tokens.token_ids.tolist() for r in recorder.model_calls]
    assert sampled_by_call == [list(ids) for ids in scripted[:outcome.turns]], "re-encoded"
    for segment in outcome.segments:
        records = [(i, r) for i, r in enumerate(recorder.model_calls)
                   if r.segment == segment.index]
        ids: list[int] = []
        mask: list[int] = []
        logprobs: list[float] = []
        for i, record in records:
            assert record.context_len == len(ids)
            ids += record.prompt_token_ids.tolist()
            assert list(engine.requests[i].prompt_token_ids) == ids
            ids += record.tokens.token_ids.tolist()
            mask += [0] * len(record.prompt_token_ids) + [1] * len(record.tokens)
            logprobs += [0.0] * len(record.prompt_token_ids)
            logprobs += record.tokens.sampler_logprobs.tolist()
        assert segment.token_ids.tolist() == ids
        assert segment.loss_mask.tolist() == mask
        assert np.array_equal(segment.sampler_logprobs, np.asarray(logprobs, np.float32))
    assert outcome.sampled_tokens == sum(len(s) for s in sampled_by_call)
