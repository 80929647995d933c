"""Batched forward passes over a Hugging Face Llama/Qwen2-family model, with a row KV cache.

`RowForward` runs the same arithmetic as the transformers implementation (RMSNorm, rotary
embedding from the model's own rotary module, grouped-query attention with a 1/sqrt(d) scale,
gated MLP, tied or untied head) but on the engine's own cache, so many sequences of different
lengths decode in one forward per step instead of one `generate` call each.

The cache is a set of rows: per layer, keys and values of shape (rows, kv_heads, capacity,
head_dim). Row r holds one sequence; position p of that sequence lives at index p. Guarantees:

- `prefill(row, ids, start)` computes positions start..start+n-1 of one row and returns the
  float32 logits of the last one (`prefill_many` does several rows in one forward); `decode(ids_B, positions_B)` computes one new position for
  rows 0..B-1 at once. Both read exactly the positions below the ones they write.
- Logits agree with a plain `model(input_ids)` forward over the whole sequence, which is what
  the learner recomputes: a prefill from position 0 runs exactly HF's products (SDPA causal
  attention, unfused residual adds, a head of at least HEAD_ROWS rows), so its logits are
  HF's to the bit on one thread; decode steps and chunked prefills use other kernel shapes
  and agree to float32 rounding (3e-7 on the tiny model, <= 5e-5 on SmolLM2-135M, whose
  logits reach 35; docs/engine.md).
- The cache, the activations and the products are in the model's dtype (float32, or bfloat16
  where `[engine] dtype` chose it: `core.numerics`); logits are always returned as float32,
  and the sampler's log-probs are computed from them in float32. In bfloat16 the agreement
  with HF is that of two bfloat16 forwards, not float32 rounding (docs/engine.md).
- `refresh_weights()` must be called after the model's parameters change in place: the fused
  projection matrices used here are copies.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import PreTrainedModel
from transformers.activations import ACT2FN

from engine.checkpoint import CheckpointError

# Matrix products of fewer rows than this take another kernel path in the CPU BLAS (MKL) and
# round differently from the same rows inside a full-sequence forward; a prefill's head gets
# at least this many rows, so its logits are those of HF's forward. MKL's small-matrix bound
# depends on the CPU: 4 rows with its AVX2 kernels, 16 with its AVX-512 ones (on SmolLM2 a
# 4-row head was 3.5e-5 off HF's there, a 16-row one bitwise).
HEAD_ROWS = 16


@dataclass
class _Layer:
    qkv_weight: torch.Tensor
    qkv_bias: torch.Tensor | None
    o_weight: torch.Tensor
    o_bias: torch.Tensor | None
    gate_up_weight: torch.Tensor
    gate_up_bias: torch.Tensor | None
    down_weight: torch.Tensor
    down_bias: torch.Tensor | None
    input_norm: torch.Tensor
    post_norm: torch.Tensor
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None


def _cat_bias(*linears: torch.nn.Linear) -> torch.Tensor | None:
    biases = [lin.bias for lin in linears]
    if all(b is None for b in biases):
        return None
    return torch.cat([b if b is not None else torch.zeros(lin.out_features)
                      for b, lin in zip(biases, linears)])


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class RowForward:
    """Forward passes of one model over a row-addressed KV cache (see module docstring)."""

    def __init__(self, model: PreTrainedModel, *, rows: int, initial_capacity: int = 256,
                 max_len: int | None = None) -> None:
        config = model.config
        rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if "dynamic" in str(rope_type) or rope_type == "longrope":
            raise CheckpointError(f"rope type {rope_type!r} depends on the sequence length and is "
                                  f"not supported by the embedded engine; serve it with vLLM")
        if getattr(config, "use_sliding_window", False) or any(
                t != "full_attention" for t in getattr(config, "layer_types", None) or []):
            raise CheckpointError("sliding-window attention is not supported by the embedded engine")
        self.model = model
        self.n_layers = config.num_hidden_layers
        self.n_heads = config.num_attention_heads
        self.n_kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.n_heads
        self.groups = self.n_heads // self.n_kv_heads
        self.vocab_size = config.vocab_size
        self.max_len = int(config.max_position_embeddings)
        if max_len is not None:  # rows grow up to this many positions: it bounds KV memory
            self.max_len = min(self.max_len, int(max_len))
        self.eps = float(config.rms_norm_eps)
        self.scale = self.head_dim ** -0.5
        self.act = ACT2FN[config.hidden_act]
        self.rows = rows
        self.dtype = model.dtype  # of the weights, the activations and the KV rows
        self.capacity = min(initial_capacity, self.max_len)
        shape = (rows, self.n_kv_heads, self.capacity, self.head_dim)
        self.keys = [torch.zeros(shape, dtype=self.dtype) for _ in range(self.n_layers)]
        self.values = [torch.zeros(shape, dtype=self.dtype) for _ in range(self.n_layers)]
        with torch.no_grad():
            positions = torch.arange(self.max_len).unsqueeze(0)
            probe = torch.zeros(1, 1, dtype=self.dtype)  # HF casts cos/sin to the model dtype
            cos, sin = model.model.rotary_emb(probe, positions)
        self.cos_P_D = cos[0].contiguous()
        self.sin_P_D = sin[0].contiguous()
        self.refresh_weights()

    # ---- weights -------------------------------------------------------------------------
    def refresh_weights(self) -> None:
        """Rebuild the fused matrices from the model's current parameters."""
        base = self.model.model
        layers = []
        with torch.no_grad():
            for layer in base.layers:
                attn, mlp = layer.self_attn, layer.mlp
                layers.append(_Layer(
                    qkv_weight=torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]),
                    qkv_bias=_cat_bias(attn.q_proj, attn.k_proj, attn.v_proj),
                    o_weight=attn.o_proj.weight, o_bias=attn.o_proj.bias,
                    gate_up_weight=torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]),
                    gate_up_bias=_cat_bias(mlp.gate_proj, mlp.up_proj),
                    down_weight=mlp.down_proj.weight, down_bias=mlp.down_proj.bias,
                    input_norm=layer.input_layernorm.weight,
                    post_norm=layer.post_attention_layernorm.weight,
                    q_norm=getattr(getattr(attn, "q_norm", None), "weight", None),
                    k_norm=getattr(getattr(attn, "k_norm", None), "weight", None),
                ))
        self.layers = layers
        self.embed = base.embed_tokens.weight
        self.final_norm = base.norm.weight
        self.head_weight = self.model.lm_head.weight
        self.head_bias = self.model.lm_head.bias

    # ---- cache rows ------------------------------------------------------------------------
    def ensure_capacity(self, length: int) -> None:
        """Grow every row to hold `length` positions (doubling, at most the model's max length)."""
        if length <= self.capacity:
            return
        if length > self.max_len:
            raise ValueError(f"sequence of {length} positions exceeds the model's {self.max_len}")
        new_capacity = self.capacity
        while new_capacity < length:
            new_capacity = min(2 * new_capacity, self.max_len)
        for store in (self.keys, self.values):
            for i, old in enumerate(store):
                grown = torch.zeros(self.rows, self.n_kv_heads, new_capacity, self.head_dim,
                                    dtype=self.dtype)
                grown[:, :, : self.capacity] = old
                store[i] = grown
        self.capacity = new_capacity

    def copy_row(self, src: int, dst: int, length: int) -> None:
        for store in (self.keys, self.values):
            for tensor in store:
                tensor[dst, :, :length] = tensor[src, :, :length]

    def read_row(self, row: int, length: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Copies of the first `length` positions of `row`, per layer (keys, values)."""
        return [(k[row, :, :length].clone(), v[row, :, :length].clone())
                for k, v in zip(self.keys, self.values)]

    def write_row(self, row: int, kv: list[tuple[torch.Tensor, torch.Tensor]], length: int) -> None:
        self.ensure_capacity(length)
        for (k, v), k_cache, v_cache in zip(kv, self.keys, self.values):
            k_cache[row, :, :length] = k[:, :length]
            v_cache[row, :, :length] = v[:, :length]

    def bytes_per_token(self) -> int:
        return 2 * self.n_layers * self.n_kv_heads * self.head_dim * self.dtype.itemsize

    # ---- forward -----------------------------------------------------------------------------
    def _rms(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), weight, self.eps)

    def _project(self, layer: _Layer, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q (N, H, D), k and v (N, Hkv, D) with rotary embedding applied; x is (N, hidden)."""
        n = x.shape[0]
        qkv = F.linear(x, layer.qkv_weight, layer.qkv_bias)
        n_qk = self.n_heads + self.n_kv_heads
        qk = qkv[:, : n_qk * self.head_dim].view(n, n_qk, self.head_dim)
        v = qkv[:, n_qk * self.head_dim:].view(n, self.n_kv_heads, self.head_dim)
        if layer.q_norm is not None:  # Qwen3: per-head norms before the rotary embedding
            qk = torch.cat([self._rms(qk[:, : self.n_heads], layer.q_norm),
                            self._rms(qk[:, self.n_heads:], layer.k_norm)], dim=1)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        qk = qk * cos + _rotate_half(qk) * sin  # one rotation for queries and keys together
        return qk[:, : self.n_heads], qk[:, self.n_heads:], v

    @staticmethod
    def _residual(h: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                  bias: torch.Tensor | None) -> torch.Tensor:
        """h + linear(x), rounded as HF rounds it: the product first, then the sum (addmm would
        accumulate into h inside the GEMM and round differently)."""
        return h + F.linear(x, weight, bias)

    def _mlp(self, layer: _Layer, h: torch.Tensor) -> torch.Tensor:
        x = self._rms(h, layer.post_norm)
        gate_up = F.linear(x, layer.gate_up_weight, layer.gate_up_bias)
        gate, up = gate_up.chunk(2, dim=-1)
        return self._residual(h, self.act(gate) * up, layer.down_weight, layer.down_bias)

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        """The head's float32 logits (a bfloat16 model's are widened after the product)."""
        return F.linear(self._rms(h, self.final_norm), self.head_weight, self.head_bias).float()

    @torch.no_grad()
    def prefill(self, row: int, input_ids: list[int], start: int) -> torch.Tensor:
        """Compute positions start..start+n-1 of `row`; logits (vocab,) of the last position."""
        return self.prefill_many([(row, input_ids, start)])[0]

    @torch.no_grad()
    def prefill_many(self, chunks: list[tuple[int, list[int], int]]) -> torch.Tensor:
        """Prefill several rows in one forward: each chunk is (row, ids, start). Returns the
        logits (chunks, vocab) of each chunk's last position. The matrix products run over all
        chunks' tokens at once (the weights are read once, not once per sequence); attention
        runs per chunk, with the same SDPA call as the HF forward of that sequence."""
        lengths = [len(ids) for _, ids, _ in chunks]
        ends = [start + n for (_, _, start), n in zip(chunks, lengths)]
        self.ensure_capacity(max(ends))
        h = self.embed[torch.tensor([t for _, ids, _ in chunks for t in ids], dtype=torch.long)]
        positions = torch.cat([torch.arange(start, end) for (_, _, start), end in zip(chunks, ends)])
        cos, sin = self.cos_P_D[positions], self.sin_P_D[positions]
        offsets = [sum(lengths[:i]) for i in range(len(chunks))]
        # query i (absolute position start+i) sees keys 0..start+i; a prefill from position 0
        # is plain causal attention, the same SDPA call as the HF forward makes
        masks = [None if start == 0 else
                 torch.arange(end).unsqueeze(0) <= torch.arange(start, end).unsqueeze(1)
                 for (_, _, start), end in zip(chunks, ends)]
        for layer, k_cache, v_cache in zip(self.layers, self.keys, self.values):
            q, k, v = self._project(layer, self._rms(h, layer.input_norm), cos, sin)
            outs = []
            for (row, _, start), n, end, off, mask in zip(chunks, lengths, ends, offsets, masks):
                k_cache[row, :, start:end] = k[off:off + n].transpose(0, 1)
                v_cache[row, :, start:end] = v[off:off + n].transpose(0, 1)
                out = F.scaled_dot_product_attention(
                    q[off:off + n].transpose(0, 1).unsqueeze(0), k_cache[row:row + 1, :, :end],
                    v_cache[row:row + 1, :, :end], attn_mask=mask, is_causal=mask is None,
                    scale=self.scale, enable_gqa=True)
                outs.append(out[0].transpose(0, 1).reshape(n, self.n_heads * self.head_dim))
            out = outs[0] if len(outs) == 1 else torch.cat(outs)
            h = self._mlp(layer, self._residual(h, out, layer.o_weight, layer.o_bias))
        # each chunk's last HEAD_ROWS positions go through the head; its last one is kept
        tails = [torch.arange(off + max(n - HEAD_ROWS, 0), off + n) for n, off in zip(lengths, offsets)]
        logits = self._logits(h[torch.cat(tails)])
        lasts = torch.tensor([len(t) for t in tails]).cumsum(0) - 1
        return logits[lasts]

    @torch.no_grad()
    def decode(self, input_ids_B: torch.Tensor, positions_B: torch.Tensor) -> torch.Tensor:
        """One new position for each of rows 0..B-1; logits (B, vocab)."""
        batch = int(input_ids_B.shape[0])
        length = int(positions_B.max()) + 1
        self.ensure_capacity(length)
        rows_B = torch.arange(batch)
        h = self.embed[input_ids_B]
        cos, sin = self.cos_P_D[positions_B], self.sin_P_D[positions_B]
        mask_B_1_1_L = None  # rows of equal length attend to everything below: no mask needed
        if batch > 1 and bool(positions_B.min() != positions_B.max()):
            mask_B_1_1_L = (torch.arange(length).unsqueeze(0) <= positions_B.unsqueeze(1)).view(
                batch, 1, 1, length)
        for layer, k_cache, v_cache in zip(self.layers, self.keys, self.values):
            q, k, v = self._project(layer, self._rms(h, layer.input_norm), cos, sin)
            k_cache[rows_B, :, positions_B] = k
            v_cache[rows_B, :, positions_B] = v
            # the G query heads sharing a KV head play the role of SDPA's query positions
            q_B_K_G_D = q.reshape(batch, self.n_kv_heads, self.groups, self.head_dim)
            out = F.scaled_dot_product_attention(
                q_B_K_G_D, k_cache[:batch, :, :length], v_cache[:batch, :, :length],
                attn_mask=mask_B_1_1_L, scale=self.scale)
            out = out.reshape(batch, self.n_heads * self.head_dim)
            h = self._mlp(layer, self._residual(h, out, layer.o_weight, layer.o_bias))
        return self._logits(h)
