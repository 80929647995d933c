"""`RowForward` computes what a plain transformers forward computes, on the engine's KV rows.

Contract: for any mix of rows, prefix lengths, chunked prefills, row moves (compaction) and cache
growth, the logits of every position equal a full-sequence HF forward within 1e-4 (float32), and
after an in-place weight change plus `refresh_weights` they equal the new model's.
"""

from __future__ import annotations

import torch

from engine.checkpoint import assign_state_dict, load_model, read_state_dict
from engine.forward import RowForward


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


def test_llama_and_qwen3_checkpoints_work_the_same_way(tmp_path):
    """Any local HF checkpoint of a supported family: Llama (no biases, untied head) and Qwen3
    (per-head q/k norms), including a non-default rotary scaling."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    common = dict(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    torch.manual_seed(0)
    llama = LlamaForCausalLM(LlamaConfig(**common, tie_word_embeddings=False,
                                         rope_scaling={"rope_type": "linear", "factor": 2.0}))
    qwen3 = Qwen3ForCausalLM(Qwen3Config(**common, head_dim=16))
    for name, hf in (("llama", llama), ("qwen3", qwen3)):
        model = load_model(_save(hf, tmp_path / name))
        forward = RowForward(model, rows=2)
        ids = torch.randint(0, 97, (20,)).tolist()
        forward.prefill(0, ids[:-1], 0)
        logits = forward.decode(torch.tensor([ids[-1]]), torch.tensor([len(ids) - 1]))
        assert (logits[0] - full_logits(model, ids)[-1]).abs().max() < 1e-4, name
