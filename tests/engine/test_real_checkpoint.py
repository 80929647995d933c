"""The engine on a real trained checkpoint: SmolLM2-135M-Instruct (Llama architecture, tied
embeddings, GQA 9/3), imported from its GGUF file by the test set-up.

Contract (float32, one torch thread):
- a prefill from position 0 gives exactly the logits of HF's forward over the same tokens
  (tolerance 1e-6; bitwise in practice);
- decodes (one row, several rows of equal or different lengths) and chunked prefills give HF's
  logits within 1e-4 (measured up to 5e-5: SmolLM2's logits reach 35, and other kernel shapes
  round differently, as HF's own KV-cache decode does: 6e-5 against its forward);
- the GGUF import round-trips: the saved checkpoint has the tokenizer and chat template.
"""

from __future__ import annotations

import pytest
import torch

from engine.checkpoint import load_model
from engine.forward import RowForward

pytestmark = pytest.mark.slow
EXACT = 1e-6
ROUNDING = 1e-4


@pytest.fixture(scope="module")
def smollm2(smollm2_dir):
    return load_model(smollm2_dir)


def hf_logits(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0, -1]


def worst(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max())


def test_smollm2_prefill_is_hf_exactly(smollm2):
    generator = torch.Generator().manual_seed(0)
    forward = RowForward(smollm2, rows=2)
    for row, n in enumerate((9, 120)):
        ids = torch.randint(3, smollm2.config.vocab_size, (n,), generator=generator).tolist()
        assert worst(forward.prefill(row, ids, 0), hf_logits(smollm2, ids)) < EXACT, n


def test_smollm2_decodes_and_chunked_prefills_within_rounding(smollm2):
    generator = torch.Generator().manual_seed(1)
    seqs = [torch.randint(3, smollm2.config.vocab_size, (n,), generator=generator).tolist()
            for n in (30, 75, 140)]
    forward = RowForward(smollm2, rows=len(seqs))
    for row, seq in enumerate(seqs):
        cut = len(seq) // 2  # a chunked prefill, as a session's second turn is
        forward.prefill(row, seq[:cut], 0)
        forward.prefill(row, seq[cut:-1], cut)
    logits = forward.decode(torch.tensor([s[-1] for s in seqs]),
                            torch.tensor([len(s) - 1 for s in seqs]))
    for row, seq in enumerate(seqs):
        assert worst(logits[row], hf_logits(smollm2, seq)) < ROUNDING, row
    for row in range(len(seqs)):  # equal lengths: no mask
        forward.prefill(row, seqs[2][:-1], 0)
    logits = forward.decode(torch.tensor([seqs[2][-1]] * 3), torch.tensor([len(seqs[2]) - 1] * 3))
    assert worst(logits, hf_logits(smollm2, seqs[2]).expand_as(logits)) < ROUNDING
    one = forward.decode(torch.tensor([7]), torch.tensor([len(seqs[2])]))[0]  # row 0 alone
    assert worst(one, hf_logits(smollm2, seqs[2] + [7])) < ROUNDING


def test_imported_checkpoint_has_tokenizer_and_template(smollm2_dir):
    from core.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(smollm2_dir)
    assert len(tokenizer) == 49152
    text = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                         add_generation_prompt=True)
    assert text.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    assert tokenizer.convert_ids_to_tokens(2) == "<|im_end|>"
