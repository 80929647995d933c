"""Create the tiny default policy: a Qwen2-architecture causal LM of about 1M parameters.

Nothing is downloaded: the config and weights are created here and saved with the character
tokenizer in Hugging Face format, so every component loads the directory like any checkpoint.
The weights are a function of the seed alone, and the folder records it (`core.tiny`).
"""

from __future__ import annotations

from pathlib import Path

from core.tiny import write_tiny_seed
from core.tiny_tokenizer import save_tiny_tokenizer


def init_tiny(directory: str | Path, *, seed: int = 0, hidden: int = 128, layers: int = 4,
              heads: int = 4, kv_heads: int = 2, intermediate: int = 384,
              max_positions: int = 2048, initializer_range: float = 0.02) -> Path:
    """Write the tiny model to `directory`; a larger `initializer_range` gives peakier logits."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer = save_tiny_tokenizer(directory)
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=max_positions,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        torch_dtype="float32",
        initializer_range=initializer_range,
    )
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config)
    model.save_pretrained(str(directory), safe_serialization=True)
    write_tiny_seed(directory, seed)
    return directory
