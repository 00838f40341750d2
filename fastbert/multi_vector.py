"""Multi-vector (ColBERT-style) token embeddings on a fastbert encoder, padding-free from the embedding to the vectors.

    input_ids, attention_mask, token_type_ids [B, S]; scored [B, S] bool (the positions that get a vector)
      -> encoder.token_states: the tokens' last hidden states            [N, hidden]   (modeling.py)
      -> the scored rows                                                 [M, hidden]   (padding.rows_where)
      -> project (the model's Dense: Linear, activation), L2-normalize   [M, dim]

what sentence-transformers' MultiVectorEncoder computes (Transformer, Dense, MultiVectorMask, Normalize, then each
text's scored rows), where its Dense and Normalize run on [B, S, hidden], padding included. Every step after the
encoder is row-wise, so running it on the scored rows only gives the same vectors. ``packed_token_vectors`` takes
sequences back to back instead (``forward_packed``: the server's batches).

Scored positions are the real tokens minus a skip-list, plus, for queries with ColBERT's expansion, the [MASK]
positions appended after them. With ``attend=False`` (classic ColBERT) those have attention mask 0: no token attends
to them, yet they are scored, so their hidden states must be computed as transformers computes a padding position
(it attends to the real tokens). The encoder then runs the batch dense (``unpad=False``), every position computed.
"""

from collections.abc import Callable

import torch
import torch.nn.functional as F

from . import modeling, padding


def token_vectors(encoder: modeling.FusedModel, input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                  token_type_ids: torch.Tensor | None, scored: torch.Tensor,
                  project: Callable[[torch.Tensor], torch.Tensor] | None,
                  normalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, S] inputs and ``scored`` [B, S] bool -> (the scored positions' vectors [M, dim] in row-major order,
    cu_seqlens [B + 1] int32: text b's vectors are rows cu_seqlens[b]:cu_seqlens[b + 1]). Inference only."""
    real = torch.ones_like(scored) if attention_mask is None else attention_mask.bool()
    outside_mask = bool((scored & ~real).any())  # positions scored although nothing attends to them
    x, layout = encoder.token_states(input_ids, attention_mask, token_type_ids, unpad=False if outside_mask else None)
    x, cu_seqlens = padding.rows_where(x, layout, scored.to(x.device))
    return _head(x, project, normalize), cu_seqlens


def packed_token_vectors(encoder: modeling.FusedModel, input_ids: torch.Tensor, seqlens: list[int],
                         scored: torch.Tensor, project: Callable[[torch.Tensor], torch.Tensor] | None,
                         normalize: bool) -> torch.Tensor:
    """Sequences back to back (``FusedModel.forward_packed``'s input_ids [N], seqlens [B]; every token attended to)
    and ``scored`` [N] bool -> the scored tokens' vectors [M, dim] in order, each as ``token_vectors`` gives it for
    its sequence alone, with no [batch, seq_len] tensor at any step (what the server runs). Inference only."""
    x = encoder.forward_packed(input_ids, seqlens)  # [N, hidden]
    return _head(x[scored.to(x.device)], project, normalize)


def _head(x: torch.Tensor, project: Callable[[torch.Tensor], torch.Tensor] | None, normalize: bool) -> torch.Tensor:
    """The scored rows [M, hidden] -> their vectors [M, dim]: the projection, then L2 normalization (row-wise)."""
    if project is not None:
        x = project(x)
    return F.normalize(x, p=2, dim=-1) if normalize else x


def scatter(vectors: torch.Tensor, scored: torch.Tensor) -> torch.Tensor:
    """vectors [M, dim] of the scored positions (row-major) -> [B, S, dim], zeros elsewhere: the layout
    sentence-transformers' modules hand on (its encode reads the scored positions only)."""
    out = vectors.new_zeros(*scored.shape, vectors.shape[-1])
    out[scored.to(vectors.device)] = vectors
    return out
