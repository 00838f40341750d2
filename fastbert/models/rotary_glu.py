"""The rotary + GLU encoder block (GTE, NomicBERT): post-norm BERT blocks with rotary positions and a GLU MLP, as
mixins over transformers' modules, which both families name alike.

    tables     = cos/sin(position * inv_freq)                     once per forward (rotary.tables)
    per layer:
        qkv = x @ [Wq; Wk; Wv] (+ b) ; q, k = rope(q, k)          ops.qkv_projection, rotary.rotary
        x   = post_attention_layernorm(attention(q, k, v) @ Wo (+ bo) + x)
        h   = act(x @ Wgate) * (x @ Wup)                          gated_mlp.dense_glu (one GEMM on [up; gate])
        x   = post_mlp_layernorm(h @ Wdown (+ bdown) + x)

The layers sit on the model itself (``model.layers``, no encoder module); HF's model runs
``layers[:num_hidden_layers]``, and so does ``RotaryGluModel``.
"""

import dataclasses

import torch
from transformers.modeling_outputs import BaseModelOutputWithPooling

from .. import gated_mlp, layers, modeling, ops, padding, rotary


class FusedSelfAttention(layers.Fused):
    def fused(self, x: torch.Tensor, layout: padding.TokenLayout) -> torch.Tensor:
        """[N, hidden] -> attention context [N, heads * head_dim], before ``o_proj``."""
        num_heads = self.config.num_attention_heads
        qkv = ops.qkv_projection(self.q_proj, self.k_proj, self.v_proj, x)  # [N, 3 * heads * head_dim]
        qkv = rotary.rotary(qkv, layout, num_heads)
        return ops.attention(qkv, layout, num_heads, self.attention_dropout if self.training else 0.0)


class FusedMLP(layers.Fused):
    """gate_proj / up_proj / act_fn / dropout (GTE's; NomicBERT has none) / down_proj, read by the layer."""


class FusedLayer(layers.Fused):
    bypassed = ("self_attn", "mlp")

    def fused(self, x: torch.Tensor, layout: padding.TokenLayout) -> torch.Tensor:
        attention, mlp = self.self_attn, self.mlp
        x = ops.dense_residual_layer_norm(attention.fused(x, layout), x, attention.o_proj,
                                          self.post_attention_dropout, self.post_attention_layernorm)
        h = gated_mlp.dense_glu(x, mlp.up_proj, mlp.gate_proj, mlp.act_fn)  # [N, intermediate]
        dropout = getattr(mlp, "dropout", None)
        if dropout is not None and mlp.training:
            h = dropout(h)
        return ops.dense_residual_layer_norm(h, x, mlp.down_proj, self.post_mlp_dropout, self.post_mlp_layernorm)


# transformers' class-name suffix -> mixin, for the rotary + GLU families (class ``{prefix}{suffix}``).
MIXINS = {
    "Embeddings": layers.FusedEmbeddings,
    "Attention": FusedSelfAttention,
    "MLP": FusedMLP,
    "Layer": FusedLayer,
}


class RotaryGluModel(modeling.FusedModel):
    """What a rotary + GLU model states beyond ``FusedModel``: its layers on the model, the tables per forward from
    its rotary module's frequencies (ModernBERT's model subclasses it for one table per attention type)."""

    output_class = BaseModelOutputWithPooling
    encoder_name = "layers"
    read_modules = ("rotary_emb",)

    def max_seq_len(self, input_ids):
        return None  # rotary positions: no table bounds the length (nor does transformers)

    def encode(self, x, indices, layout, keep):
        layout = dataclasses.replace(layout, rotary={rotary.DEFAULT: rotary.tables(self.rotary_emb, indices[2])})
        return layers.run_layers(self, self.layers[: self.config.num_hidden_layers], x, layout, keep)
