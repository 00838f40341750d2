"""What the layers read by token position, built once per forward beside the layout: the tables a family derives
from its tokens' positions, which every layer shares.

    rotary         {table name: (cos, sin)}, float32 [rows, head_dim / 2] each, a row per token (``ops/rotary.py``;
                   ModernBERT has one table per attention type: its global and local theta)
    relative_bias  MPNet's relative-position bias by distance, float32 [heads, 2R + 1]: entry d + R for j - i = d
    relative_rows  DeBERTa's relative embeddings the batch's distances reach, [R, hidden] (each layer projects them)
    relative_index int32 [2C + 1]: the row of relative_rows for the distance d = column_i - column_j at d + C

The layout (``padding.TokenLayout``) says where each row sits in [batch, seq_len]; these say what a position means to
the model. A family builds them in ``FusedModel.positions`` (none for BERT: its positions index the embedding table).
"""

import dataclasses

import torch


@dataclasses.dataclass(frozen=True)
class Positions:
    rotary: dict[str, tuple[torch.Tensor, torch.Tensor]] | None = None
    relative_bias: torch.Tensor | None = None
    relative_rows: torch.Tensor | None = None
    relative_index: torch.Tensor | None = None


NONE = Positions()
