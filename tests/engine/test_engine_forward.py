"""`RowForward` computes what a plain transformers forward computes, on the engine's KV rows.

Contract: for any mix of rows, prefix lengths, chunked prefills, row moves (compaction) and cache
growth, the logits of every position equal a full-sequence HF forward within 1e-4 (float32), and
after an in-place weight change plus `refresh_weights` they equal the new model's. A prefill from
position 0 and a decode of at least 4 rows match within 1e-6 (see docs/engine.md).
"""

from __future__ import annotations

import pytest
import torch

from engine.checkpoint import assign_state_dict, load_model, read_state_dict
from engine.forward import HEAD_ROWS, RowForward

EXACT = 1e-6  # same products as HF's forward: float32-identical in practice


def full_logits(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0]


def test_batched_decode_and_chunked_prefill_match_hf(model_v0):
    model = load_model(model_v0)
    forward = RowForward(model, rows=8, initial_capacity=8)  # forces growth twice
    generator = torch.Generator().manual_seed(0)
    seqs = [torch.randint(10, 100, (n,), generator=generator).tolist() for n in (3, 11, 26, 7)]
    for row, seq in enumerate(seqs):
        cut = len(seq) // 2  # two prefill chunks: positions [0, cut) then [cut, n-1)
        if cut:
            forward.prefill(row, seq[:cut], 0)
        last = forward.prefill(row, seq[cut:-1], cut) if len(seq) - 1 > cut else None
        if last is not None:
            assert (last - full_logits(model, seq[:-1])[-1]).abs().max() < 1e-4
    logits = forward.decode(torch.tensor([s[-1] for s in seqs]), torch.tensor([len(s) - 1 for s in seqs]))
    for row, seq in enumerate(seqs):
        assert (logits[row] - full_logits(model, seq)[-1]).abs().max() < 1e-4, row
    # keep decoding: sequences grow past the initial capacity at different lengths
    for _ in range(12):
        nxt = [int(torch.randint(10, 100, (1,), generator=generator)) for _ in seqs]
        logits = forward.decode(torch.tensor(nxt), torch.tensor([len(s) for s in seqs]))
        for seq, token in zip(seqs, nxt):
            seq.append(token)
    for row, seq in enumerate(seqs):
        assert (logits[row] - full_logits(model, seq)[-1]).abs().max() < 1e-4, row


def test_moved_rows_keep_their_cache(model_v0):
    model = load_model(model_v0)
    forward = RowForward(model, rows=4)
    a, b = list(range(10, 30)), list(range(40, 45))
    forward.prefill(0, a[:-1], 0)
    forward.prefill(1, b[:-1], 0)
    forward.copy_row(1, 0, len(b) - 1)  # row 0 finished: the last row moves into its place
    logits = forward.decode(torch.tensor([b[-1]]), torch.tensor([len(b) - 1]))
    assert (logits[0] - full_logits(model, b)[-1]).abs().max() < 1e-4
    saved = forward.read_row(0, len(b))
    forward.write_row(3, saved, len(b))
    c = b + [50]
    logits = forward.decode(torch.tensor([0, 0, 0, 50]), torch.tensor([0, 0, 0, len(b)]))
    assert (logits[3] - full_logits(model, c)[-1]).abs().max() < 1e-4


def test_refresh_after_in_place_update_uses_new_weights(model_v0, model_v1):
    model = load_model(model_v0)
    forward = RowForward(model, rows=2)
    ids = list(range(10, 25))
    before = forward.prefill(0, ids, 0)
    assign_state_dict(model, read_state_dict(model_v1, model))
    forward.refresh_weights()
    after = forward.prefill(0, ids, 0)
    want = full_logits(load_model(model_v1), ids)[-1]
    assert (after - want).abs().max() < 1e-4
    assert (before - want).abs().max() > 1e-3


def _save(model, directory):
    model.save_pretrained(str(directory), safe_serialization=True)
    return directory


ARCHITECTURES = {
    # Llama: no biases, untied head, Llama-3.1's frequency-dependent RoPE scaling
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(
        tie_word_embeddings=False,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 64})),
    # Qwen2: q/k/v biases, tied head, YaRN scaling (static, with an attention factor)
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(
        tie_word_embeddings=True,
        rope_scaling={"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 128})),
    # Qwen3: per-head q/k norms, head_dim not hidden/heads, untied head, linear scaling
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(
        head_dim=24, tie_word_embeddings=False,
        rope_scaling={"rope_type": "linear", "factor": 2.0})),
}


def _random_checkpoint(tmp_path, family: str):
    import transformers

    config_name, model_name, extra = ARCHITECTURES[family]
    config = getattr(transformers, config_name)(
        vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        initializer_range=0.2, **extra)
    torch.manual_seed(0)
    hf = getattr(transformers, model_name)(config)
    if family == "qwen2":  # random biases, so a dropped bias would show
        with torch.no_grad():
            for name, param in hf.named_parameters():
                if name.endswith(".bias"):
                    param.normal_(0.0, 0.5)
    return load_model(_save(hf, tmp_path / family))


@pytest.mark.parametrize("family", sorted(ARCHITECTURES))
def test_each_architecture_matches_the_hf_forward(tmp_path, family):
    """A prefill from position 0 runs the products HF's forward runs: logits within 1e-6
    (bitwise here). Decodes (equal or different lengths, one row) and a chunked prefill use
    other kernel shapes: within 1e-5 at these sizes, 1e-4 in general."""
    model = _random_checkpoint(tmp_path, family)
    forward = RowForward(model, rows=4)
    generator = torch.Generator().manual_seed(1)
    seqs = [torch.randint(0, 97, (n,), generator=generator).tolist() for n in (40, 23, 61, 9)]
    for row, seq in enumerate(seqs):
        last = forward.prefill(row, seq[:-1], 0)
        assert (last - full_logits(model, seq[:-1])[-1]).abs().max() < EXACT, (family, row)
    logits = forward.decode(torch.tensor([s[-1] for s in seqs]),
                            torch.tensor([len(s) - 1 for s in seqs]))
    for row, seq in enumerate(seqs):
        assert (logits[row] - full_logits(model, seq)[-1]).abs().max() < 1e-4, (family, row)
    same = seqs[0]
    for row in range(4):
        forward.prefill(row, same[:-1], 0)
    logits = forward.decode(torch.tensor([same[-1]] * 4),
                            torch.tensor([len(same) - 1] * 4))
    assert (logits - full_logits(model, same)[-1]).abs().max() < 1e-5, family
    chunked = forward.prefill(0, same[30:], 30)  # row 0 holds `same`: recompute from 30 on
    assert (chunked - full_logits(model, same)[-1]).abs().max() < 1e-4, family
    one = forward.decode(torch.tensor([5]), torch.tensor([len(same)]))[0]
    assert (one - full_logits(model, same + [5])[-1]).abs().max() < 1e-4, family


def test_prefill_many_equals_one_prefill_per_row(model_v0):
    """Several rows (fresh, and one continuing a cached prefix) in one forward: the same logits
    and KV as prefilling each row on its own (chunks of >= HEAD_ROWS tokens: a shorter one alone
    takes the BLAS's small-matrix kernels, so it is compared with HF's forward within 1e-4)."""
    model = load_model(model_v0)
    together, alone = RowForward(model, rows=3), RowForward(model, rows=3)
    a, b, c = list(range(10, 40)), list(range(50, 74)), list(range(80, 82))
    assert min(len(a), len(b[4:])) >= HEAD_ROWS
    for forward in (together, alone):
        forward.prefill(1, b[:4], 0)
    logits = together.prefill_many([(0, a, 0), (1, b[4:], 4), (2, c, 0)])
    for row, (got, want) in enumerate(zip(logits, [alone.prefill(0, a, 0),
                                                  alone.prefill(1, b[4:], 4)])):
        assert (got - want).abs().max() < 1e-6, row
    assert (logits[2] - full_logits(model, c)[-1]).abs().max() < 1e-4
    for row, n in ((0, len(a)), (1, len(b))):
        for mine, theirs in zip(together.read_row(row, n), alone.read_row(row, n)):
            assert torch.equal(mine[0], theirs[0]) and torch.equal(mine[1], theirs[1])
