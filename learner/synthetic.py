"""Synthetic data for smoke runs, tests and the benchmark.

- `tool_call_demonstrations`: short multi-turn tool-using chats rendered with the checkpoint's
  chat template, as (token_ids, loss_mask) pairs with the mask on the assistant's tokens
  (content and its end-of-turn token) only. The task suites' generators replace these for real
  warm starts; this keeps the learner testable on its own.
- `sample_rl_batch`: groups of completions sampled from a policy with torch, recording the
  processed distribution's log-prob of every sampled token (and its top-k) exactly as an
  engine does, scored by a reward function of the completion text.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from learner.batch import TrainingSample

SYSTEM = "You solve tasks with tools. Call a tool, read its result, then answer."


def _calc_chat(rng: random.Random) -> list[dict[str, str]]:
    a, b = rng.randint(2, 99), rng.randint(2, 99)
    op, word = rng.choice([("+", "Add"), ("-", "Subtract"), ("*", "Multiply")])
    value = {"+": a + b, "-": a - b, "*": a * b}[op]
    question = f"{word} {a} and {b}." if op != "-" else f"{word} {b} from {a}."
    call = json.dumps({"name": "calc", "arguments": {"expr": f"{a}{op}{b}"}})
    return [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": question},
        {"role": "assistant", "content": f"<tool_call>{call}</tool_call>"},
        {"role": "user", "content": f"<tool_response>{value}</tool_response>"},
        {"role": "assistant", "content": f"<answer>{value}</answer>"},
    ]


def _file_chat(rng: random.Random) -> list[dict[str, str]]:
    name = rng.choice(["notes.txt", "todo.md", "data.csv", "log.txt"])
    word = rng.choice(["apple", "river", "seven", "cobalt", "maple", "orbit"])
    call = json.dumps({"name": "shell", "arguments": {"cmd": f"cat {name}"}})
    return [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": f"What word is in {name}?"},
        {"role": "assistant", "content": f"<tool_call>{call}</tool_call>"},
        {"role": "user", "content": f"<tool_response>{word}\n</tool_response>"},
        {"role": "assistant", "content": f"<answer>{word}</answer>"},
    ]


def render_chat(tokenizer: Any, messages: Sequence[dict[str, str]]) -> tuple[list[int], list[int]]:
    """Token ids of the chat in the Hermes/Qwen template and a mask on assistant turns."""
    im_start, im_end = "<|im_start|>", "<|im_end|>"
    ids: list[int] = []
    mask: list[int] = []

    def add(text: str, trained: bool) -> None:
        piece = tokenizer.encode(text, add_special_tokens=False)
        ids.extend(piece)
        mask.extend([int(trained)] * len(piece))

    for message in messages:
        assistant = message["role"] == "assistant"
        add(f"{im_start}{message['role']}\n", False)
        add(message["content"] + im_end, assistant)
        add("\n", False)
    return ids, mask


def tool_call_demonstrations(
    tokenizer: Any, count: int, seed: int = 0
) -> list[tuple[list[int], list[int]]]:
    rng = random.Random(seed)
    builders: list[Callable[[random.Random], list[dict[str, str]]]] = [_calc_chat, _file_chat]
    return [render_chat(tokenizer, rng.choice(builders)(rng)) for _ in range(count)]


def digit_reward(text: str) -> float:
    """A learnable toy reward: the share of digits among the completion's characters."""
    return sum(ch.isdigit() for ch in text) / max(len(text), 1)


@torch.no_grad()
def sample_rl_batch(
    model: torch.nn.Module,
    tokenizer: Any,
    prompts: Sequence[str],
    group_size: int,
    max_new_tokens: int = 16,
    temperature: float = 1.0,
    topk: int = 0,
    reward_fn: Callable[[str], float] = digit_reward,
    seed: int = 0,
    version: int = 0,
) -> list[TrainingSample]:
    """`group_size` completions per prompt, sampled at `temperature` without a KV cache."""
    generator = torch.Generator().manual_seed(seed)
    device = next(model.parameters()).device
    samples: list[TrainingSample] = []
    model.eval()
    for p, prompt in enumerate(prompts):
        prompt_ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True
        )
        if isinstance(prompt_ids, dict) or hasattr(prompt_ids, "input_ids"):
            prompt_ids = prompt_ids["input_ids"]
        ids = torch.tensor([list(prompt_ids)] * group_size, device=device)
        logps, top_ids, top_lps = [], [], []
        for _ in range(max_new_tokens):
            logits = model(input_ids=ids, use_cache=False).logits[:, -1].float() / temperature
            logp = torch.log_softmax(logits, -1)
            nxt = torch.multinomial(logp.exp().cpu(), 1, generator=generator).to(device)
            logps.append(logp.gather(-1, nxt).squeeze(-1))
            if topk:
                values, indices = logp.topk(topk, -1)
                top_lps.append(values)
                top_ids.append(indices)
            ids = torch.cat([ids, nxt], 1)
        n_prompt, n_new = len(prompt_ids), max_new_tokens
        sampler = torch.stack(logps, 1).cpu().numpy()
        for g in range(group_size):
            token_ids = ids[g].cpu().numpy()
            text = tokenizer.decode(token_ids[n_prompt:].tolist())
            pad = np.zeros(n_prompt, np.float32)
            kw = {}
            if topk:
                tid = torch.stack(top_ids, 1)[g].cpu().numpy()
                tlp = torch.stack(top_lps, 1)[g].cpu().numpy()
                kw = dict(
                    sampler_topk_ids=np.concatenate([np.zeros((n_prompt, topk), np.int64), tid]),
                    sampler_topk_logprobs=np.concatenate(
                        [np.full((n_prompt, topk), -np.inf, np.float32), tlp]
                    ),
                )
            samples.append(
                TrainingSample(
                    token_ids=token_ids,
                    loss_mask=np.r_[np.zeros(n_prompt, bool), np.ones(n_new, bool)],
                    sampler_logprobs=np.r_[pad, sampler[g]],
                    weights_versions=np.r_[np.full(n_prompt, -1), np.full(n_new, version)],
                    reward=reward_fn(text),
                    group_id=f"g{p}",
                    trajectory_id=p * group_size + g,
                    **kw,
                )
            )
    model.train()
    return samples
