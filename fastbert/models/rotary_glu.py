"""The rotary + GLU encoder block (GTE, NomicBERT): post-norm BERT blocks with rotary positions and a GLU MLP, as
mixins over transformers' modules, which both families name alike.

    tables     = cos/sin(position * inv_freq)                     once per forward (ops/rotary.py ``tables``)
    per layer:
        qkv = x @ [Wq; Wk; Wv] (+ b) ; q, k = rope(q, k)          ops/gemm.py ``stacked``, ops/rotary.py
        x   = post_attention_layernorm(attention(q, k, v) @ Wo (+ bo) + x)
        h   = act(x @ Wgate) * (x @ Wup)                          ops/glu.py ``dense_glu`` (one GEMM on [up; gate])
        x   = post_mlp_layernorm(h @ Wdown (+ bdown) + x)

The layers sit on the model itself (``model.layers``, no encoder module); HF's model runs
``layers[:num_hidden_layers]``, and so does ``RotaryGluModel``.
"""

import torch
from transformers.modeling_outputs import BaseModelOutputWithPooling

from .. import layers, modeling, padding
from ..int8 import choices as int8
from ..ops import glu, norm, rotary
from ..ops.attention import attention
from ..ops.gemm import stacked
from ..positions import Positions


class FusedSelfAttention(layers.Fused):
    quantizable_attention = True  # (rotary positions are applied to q and k before the attention)

    def fused(self, x: torch.Tensor, layout: padding.TokenLayout, positions: Positions) -> torch.Tensor:
        """[N, hidden] -> attention context [N, heads * head_dim], before ``o_proj``."""
        num_heads = self.config.num_attention_heads
        qkv = stacked(x, (self.q_proj, self.k_proj, self.v_proj))  # [N, 3 * heads * head_dim], a fresh tensor
        qkv = rotary.rotary(qkv, *positions.rotary[rotary.DEFAULT], num_heads)
        return attention(qkv, layout, num_heads, self.attention_dropout if self.training else 0.0,
                         int8_attention=int8.attention_chosen(self), handoff=self)


class FusedMLP(layers.Fused):
    """gate_proj / up_proj / act_fn / dropout (GTE's; NomicBERT has none) / down_proj, read by the layer."""


class FusedLayer(layers.Fused):
    bypassed = ("self_attn", "mlp")

    def fused(self, x: torch.Tensor, layout: padding.TokenLayout, positions: Positions) -> torch.Tensor:
        attn, mlp = self.self_attn, self.mlp
        x = norm.dense_residual_layer_norm(attn.fused(x, layout, positions), x, attn.o_proj,
                                           self.post_attention_dropout, self.post_attention_layernorm)
        h = glu.dense_glu(x, mlp.up_proj, mlp.gate_proj, mlp.act_fn)  # [N, intermediate]
        dropout = getattr(mlp, "dropout", None)
        if dropout is not None and mlp.training:
            h = dropout(h)
        return norm.dense_residual_layer_norm(h, x, mlp.down_proj, self.post_mlp_dropout, self.post_mlp_layernorm)


class RotaryGluModel(modeling.FusedModel):
    """What a rotary + GLU model states beyond ``FusedModel``: its layers on the model, the tables per forward from
    its rotary module's frequencies (ModernBERT's model subclasses it for one table per attention type)."""

    output_class = BaseModelOutputWithPooling
    encoder_name = "layers"
    read_modules = ("rotary_emb",)

    def max_seq_len(self, input_ids):
        return None  # rotary positions: no table bounds the length (nor does transformers)

    def positions(self, indices, layout):
        return layout, Positions(rotary={rotary.DEFAULT: rotary.tables(self.rotary_emb, indices[2])})

    def encode(self, x, layout, positions, keep):
        return layers.run_layers(self, self.layers[: self.config.num_hidden_layers], x, layout, positions, keep)
