"""DeBERTa-v2 and v3 (mDeBERTa-v3): BERT's post-norm block with disentangled attention, on the shared ops.

    embeddings = LayerNorm(word[ids] (+ position[pos]) (+ token_type[tt]))      v3: words only (embed_proj: ``embed``)
    rows       = LayerNorm(rel_embeddings)[first : first + R]                   the rows the batch's distances reach
    index      = clamp(bucket(column_i - column_j) + span, 0, 2 span - 1) - first       once per forward
    per layer:
        qkv = x @ [Wq; Wk; Wv] + b                                              (query_proj, key_proj, value_proj)
        ctx = attention(q, k, v | c2p = q . pos_key(rows)^T, p2c = k . pos_query(rows)^T, index)
        x   = LayerNorm(ctx @ Wo + bo + x); h = act(x @ Wi + bi); x = LayerNorm(h @ Wo2 + bo2 + x)     (BERT's)
    after layer 0, where conv_kernel_size > 0:  x = LayerNorm(x + act(conv(embeddings)))    (v2's ConvLayer)

The position terms, their scale 1 / sqrt(D * factor) and the kernels that gather them: ``ops/disentangled.py``.
Distances are between columns of the padded batch, as transformers measures them (``padding.with_columns``), so
packing and holes in the mask keep them; the bucket function is transformers' own.
"""

import functools

import torch
from transformers.activations import ACT2FN
from transformers.modeling_outputs import BaseModelOutput
from transformers.models.deberta_v2 import modeling_deberta_v2 as hf

from .. import announce, layers, modeling, padding
from ..ops import disentangled, gemm, norm
from ..ops.attention import attention
from ..ops.gemm import stacked
from ..positions import Positions


class DebertaV2Embeddings(layers.FusedEmbeddings, hf.DebertaV2Embeddings):
    pass


class DisentangledSelfAttention(layers.Fused, hf.DisentangledSelfAttention):
    float32_linears = ("pos_key_proj", "pos_query_proj")  # (on the relative rows: int8 applies to tokens only)

    def fused(self, x: torch.Tensor, layout: padding.TokenLayout, positions: Positions) -> torch.Tensor:
        """[N, hidden] -> attention context [N, all_head_size], before the output dense."""
        qkv = stacked(x, (self.query_proj, self.key_proj, self.value_proj))  # [N, 3 * all_head_size]
        p = self.dropout.p if self.training else 0.0
        return attention(qkv, layout, self.num_attention_heads, p, disentangled=self.position_terms(positions))

    def position_terms(self, positions: Positions) -> disentangled.Disentangled:
        """This layer's projections of the relative rows (c2p's through the key projection, p2c's through the query
        one) with transformers' scale: 1 / sqrt(head_dim * (1 + the number of active terms))."""
        types = self.pos_att_type
        scale = scale_of(self.attention_head_size, 1 + ("c2p" in types) + ("p2c" in types))
        if not self.relative_attention or positions.relative_rows is None or not ("c2p" in types or "p2c" in types):
            return disentangled.Disentangled(None, None, None, scale)
        rows = self.pos_dropout(positions.relative_rows)  # [R, hidden]
        # The projections are the modules themselves (HF calls them on the rows too): LoRA and hooks apply.
        pos_key = self.key_proj if self.share_att_key else getattr(self, "pos_key_proj", None)
        pos_query = self.query_proj if self.share_att_key else getattr(self, "pos_query_proj", None)
        return disentangled.Disentangled(pos_key(rows) if "c2p" in types else None,
                                         pos_query(rows) if "p2c" in types else None, positions.relative_index, scale)


def scale_of(head_dim: int, factor: int) -> float:
    """1 / sqrt(head_dim * factor), the square root in float32 as transformers takes it."""
    return 1.0 / float(torch.sqrt(torch.tensor(head_dim, dtype=torch.float) * factor))


class DebertaV2SelfOutput(layers.FusedDenseResidualLayerNorm, hf.DebertaV2SelfOutput):
    pass


class DebertaV2Attention(layers.FusedAttention, hf.DebertaV2Attention):
    pass


class DebertaV2Intermediate(layers.FusedIntermediate, hf.DebertaV2Intermediate):
    pass


class DebertaV2Output(layers.FusedDenseResidualLayerNorm, hf.DebertaV2Output):
    pass


class DebertaV2Layer(layers.FusedLayer, hf.DebertaV2Layer):
    pass


class ConvLayer(layers.Fused, hf.ConvLayer):
    def fused(self, embeddings: torch.Tensor, residual: torch.Tensor, layout: padding.TokenLayout) -> torch.Tensor:
        """LayerNorm(residual + act(conv(embeddings))), the convolution over the padded batch's columns (zeros at
        padding, as transformers' masked embeddings are): [N, hidden] each -> [N, hidden]."""
        padded = padding.unpack(embeddings, layout)  # [B, S, hidden] (zeros at padding: DebertaShapedModel.encode)
        out = self.conv(padded.permute(0, 2, 1)).permute(0, 2, 1)  # [B, S, hidden]
        out = ACT2FN[self.conv_act](self.dropout(padding.pack(out.contiguous(), layout)))
        return _zero_padding(norm.layer_norm(residual + out, self.LayerNorm), layout)


class DebertaV2Encoder(layers.Fused, hf.DebertaV2Encoder):
    @property
    def bypassed(self) -> tuple[str, ...]:
        return ("layer",) if self.conv is None else ("layer", "conv")

    def fused(self, x: torch.Tensor, layout: padding.TokenLayout, positions: Positions, keep: set[int] | None):
        if self.conv is None:
            return layers.run_layers(self, self.layer, x, layout, positions, keep)
        # v2's convolution joins layer 0's output: the layers run in two stretches around it.
        first, states = layers.run_layers(self, self.layer[:1], x, layout, positions,
                                          None if keep is None else keep & {0})
        x = self.conv.fused(x, first, layout)
        rest = None if keep is None else {i - 1 for i in keep if i >= 1}
        x, later = layers.run_layers(self, self.layer[1:], x, layout, positions, rest)
        return x, (None if keep is None else states + later)


FUSED_CLASSES = layers.fused_map(DebertaV2Embeddings, DisentangledSelfAttention, DebertaV2SelfOutput,
                                 DebertaV2Attention, DebertaV2Intermediate, DebertaV2Output, DebertaV2Layer,
                                 ConvLayer, DebertaV2Encoder)


class LegacyDebertaV2PredictionHeadTransform(layers.FusedPredictionHeadTransform,
                                             hf.LegacyDebertaV2PredictionHeadTransform):
    """The legacy MLM head's dense -> act -> LayerNorm (config.legacy, transformers' default), fused like BERT's."""


HEAD_CLASSES = layers.fused_map(LegacyDebertaV2PredictionHeadTransform)


class DebertaShapedModel(modeling.FusedModel):
    """What DeBERTa v1 and v2 share: embeddings (with ``embed_proj`` before the LayerNorm where the widths differ),
    padding rows zeroed on the dense path, and the relative rows and index by distance the layers read."""

    output_class = BaseModelOutput

    def max_seq_len(self, input_ids):
        # Without a position table (v3) a sequence has no longest length: distances past the buckets share a row.
        return self.config.max_position_embeddings if self.embeddings.position_embeddings is not None else None

    def embed(self, indices, inputs_embeds):
        project = self.embeddings.embed_proj
        if project is None:
            return self.embeddings.fused(indices, inputs_embeds)  # [N, hidden]
        # embedding_size != hidden_size: the projection sits before the LayerNorm, where the fused kernel has none
        announce.note(f"{type(self).__name__}: embed_proj (embedding_size != hidden_size) runs the embeddings "
                      "in torch ops")
        e = self.embeddings
        x = e.word_embeddings(indices[0]) if inputs_embeds is None else inputs_embeds
        if e.position_embeddings is not None:
            x = x + e.position_embeddings(indices[2])
        if e.token_type_embeddings is not None:
            x = x + e.token_type_embeddings(indices[1])
        return e.dropout(norm.layer_norm(gemm.linear(x, project), e.LayerNorm))

    def encode(self, x, layout, positions, keep):
        return super().encode(_zero_padding(x, layout), layout, positions, keep)

    def positions(self, indices, layout):
        encoder = self.encoder
        if not encoder.relative_attention:
            return layout, Positions()
        table = encoder.get_rel_embedding()  # [2 span, hidden], LayerNorm'd where v2's norm_rel_ebd says so
        span = table.shape[0] // 2
        first, last, index = _relative_index(max(layout.seq_len, 1), getattr(encoder, "position_buckets", -1),
                                             encoder.max_relative_positions, span, table.device)
        return padding.with_columns(layout), Positions(relative_rows=table[first: last + 1], relative_index=index)


class DebertaV2Model(DebertaShapedModel, hf.DebertaV2Model):
    """Drop-in for ``transformers.DebertaV2Model``: ``DebertaV2Model(config, unpad=True)``."""

    fused_classes = FUSED_CLASSES


def _zero_padding(x: torch.Tensor, layout: padding.TokenLayout) -> torch.Tensor:
    """x [B * S, hidden] of a dense layout with zeros in its padding rows, as transformers multiplies the embeddings
    and the convolution's output by the mask (what a head reading a padding position sees with unpad=False); packed
    layouts have no padding rows."""
    keys = None if layout.packed else layout.key_mask()  # (the mask, or the bounds a right-padded one became)
    if keys is None:
        return x
    keep = keys.reshape(-1, 1).to(x.dtype)  # [B * S, 1], then the spare rows as they are
    return x * (torch.cat([keep, keep.new_ones(layout.spare_rows, 1)]) if layout.spare_rows else keep)


@functools.lru_cache(maxsize=64)
def _relative_index(seq_len: int, buckets: int, max_relative: int, span: int, device: torch.device):
    """(first row, last row, int32 index of the rows from the first) of ``disentangled.relative_index`` with
    transformers' bucket function: built on the CPU (host values, no device read) once per shape and device, so a
    CUDA graph captured after the warm-up finds it there and copies nothing."""
    with torch.inference_mode(False):  # (a normal tensor: usable inside and outside inference mode)
        rows = disentangled.relative_index(seq_len, buckets, max_relative, span, hf.make_log_bucket_position, "cpu")
        first = int(rows.min())
        return first, int(rows.max()), (rows - first).to(device=device, dtype=torch.int32)
