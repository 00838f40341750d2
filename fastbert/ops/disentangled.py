"""DeBERTa's disentangled attention terms: what a query adds to its score with a key from their relative position.

    score[i, j] = (q_i . k_j  +  q_i . r_k[δ(i, j)]  +  k_j . r_q[δ(i, j)]) * scale       scale = 1 / sqrt(D * factor)
                   content      content->position      position->content

r_k and r_q are the relative embeddings' rows projected per head (``pos_key_proj`` / ``pos_query_proj``, or the
layer's own ``key_proj`` / ``query_proj`` where the model shares them); δ(i, j) is the row of the distance between
the query's and the key's columns (transformers' log buckets, clamped to the table); ``factor`` counts the active
terms. Only the rows the batch's distances reach are projected (``Disentangled``: r_k and r_q [R, H * D], the
index [2C + 1] int32 of the row of the distance d = column_i - column_j at index[d + C], and the scale); their dot
products with the tokens are

    c2p [H, T, R] = q . r_k^T      p2c [H, T, R] = k . r_q^T            (T tokens, R rows; None where inactive)

The attention backends (``ops/attention.py``) gather c2p[h, i, δ] and p2c[h, j, δ] per score, with no [H, S, S]
tensor: the Triton kernel from ``Tables`` formed as GEMMs (``tables``), the C++ CPU kernel from the rows themselves,
forming each sequence's and head's dot products in cache. ``bias`` builds the [H, L, L] tensor from the tables for
torch's SDPA, the reference and the differentiable path.
"""

import dataclasses

import torch


@dataclasses.dataclass(frozen=True)
class Disentangled:
    """What a layer gives the attention op."""

    pos_key: torch.Tensor | None  # [R, H * D]: r_k, the relative rows through the key projection (c2p), or None
    pos_query: torch.Tensor | None  # [R, H * D]: r_q, through the query projection (p2c), or None
    index: torch.Tensor | None  # int32 [2C + 1]: the row of distance d (query column - key column) at d + C
    scale: float  # what the sum of the terms is multiplied by (also where no term is active)

    def requires_grad(self) -> bool:
        return any(t is not None and t.requires_grad for t in (self.pos_key, self.pos_query))


@dataclasses.dataclass(frozen=True)
class Tables:
    """The terms' dot products with the tokens, as the Triton kernel and torch's path read them."""

    c2p: torch.Tensor | None  # [H, T, R]: query token t's dot product with r_k's row r
    p2c: torch.Tensor | None  # [H, T, R]: key token t's dot product with r_q's row r
    index: torch.Tensor | None  # as Disentangled's
    scale: float

    @property
    def center(self) -> int:
        return (self.index.shape[0] - 1) // 2


def check_rows(qkv, seqlens, columns, pos_key, pos_query, index):
    """The C++ kernel's arguments: float32 (or qkv's dtype) [R, H * D] each, and an int32 index [2C + 1] of rows in
    [0, R) that reaches every distance between the tokens' columns (a host read: the kernel indexes without checks)."""
    if pos_key is None and pos_query is None:
        if index is not None:
            raise ValueError("index is given without pos_key or pos_query")
        return
    rows, width = (pos_key if pos_key is not None else pos_query).shape[0], qkv.shape[2] * qkv.shape[3]
    for name, table in (("pos_key", pos_key), ("pos_query", pos_query)):
        if table is not None and (table.dtype not in (torch.float32, qkv.dtype) or table.device.type != "cpu"
                                  or table.shape != (rows, width)):
            raise ValueError(f"{name} must be a float32 (or qkv's dtype) CPU tensor [rows, heads * head_dim] = "
                             f"[{rows}, {width}], got {tuple(table.shape)} {table.dtype} on {table.device}")
    if index is None or index.dtype != torch.int32 or index.dim() != 1 or index.shape[0] % 2 == 0:
        raise ValueError("index must be an int32 tensor [2 * center + 1] with pos_key or pos_query, got "
                         f"{None if index is None else (tuple(index.shape), index.dtype)}")
    if index.numel() and (int(index.min()) < 0 or int(index.max()) >= rows):
        raise ValueError(f"index must hold rows in [0, {rows}) of pos_key and pos_query")
    reach = max(seqlens, default=1) - 1
    if columns is not None and columns.numel():
        reach = max(int(chunk.max() - chunk.min()) for chunk in columns.split(list(seqlens)) if chunk.numel())
    if reach > (index.shape[0] - 1) // 2:
        raise ValueError(f"index covers distances up to {(index.shape[0] - 1) // 2}, the tokens' columns are "
                         f"{reach} apart")


def relative_index(seq_len: int, buckets: int, max_relative: int, span: int, bucket_fn, device) -> torch.Tensor:
    """The table row of every distance d = query column - key column in a batch of ``seq_len`` columns: int64
    [2 seq_len - 1], entry d + seq_len - 1 = clamp(bucket(d) + span, 0, 2 span - 1), as transformers gathers it.
    ``bucket_fn``: transformers' ``make_log_bucket_position`` (used where ``buckets`` and ``max_relative`` > 0)."""
    distance = torch.arange(-(seq_len - 1), seq_len, device=device)
    if buckets > 0 and max_relative > 0:
        distance = bucket_fn(distance, buckets, max_relative).long()
    return (distance + span).clamp(0, 2 * span - 1)


def tables(qkv: torch.Tensor, d: Disentangled) -> Tables:
    """qkv [T, 3, H, D] and the layer's rows -> the per-head GEMMs (differentiable)."""
    heads, head_dim = qkv.shape[2], qkv.shape[3]

    def per_head(content: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor | None:
        if rows is None:
            return None
        rows = rows.view(rows.shape[0], heads, head_dim).permute(1, 2, 0)  # [H, D, R]
        return torch.matmul(content.transpose(0, 1), rows)  # [H, T, D] @ [H, D, R] -> [H, T, R]

    return Tables(per_head(qkv[:, 0], d.pos_key), per_head(qkv[:, 1], d.pos_query), d.index, d.scale)


def bias(d: Tables, tokens: slice, columns: torch.Tensor) -> torch.Tensor | None:
    """The position terms of one sequence, unscaled: [H, L, L], entry [h, i, j] = c2p[h, i, δ] + p2c[h, j, δ] with
    δ = index[column_i - column_j + C] (None where no table is active). tokens: the sequence's rows of the tables;
    columns: its L columns."""
    if d.index is None:
        return None
    rows = d.index.long()[columns[:, None] - columns[None, :] + d.center]  # [L_q, L_k]
    total = 0
    if d.c2p is not None:
        c2p = d.c2p[:, tokens]  # [H, L, R]
        total = total + c2p.gather(2, rows.expand(c2p.shape[0], -1, -1))
    if d.p2c is not None:
        p2c = d.p2c[:, tokens]  # [H, L, R]: gathered with the transposed rows, then transposed back
        total = total + p2c.gather(2, rows.t().expand(p2c.shape[0], -1, -1)).transpose(1, 2)
    return total


def batch_bias(d: Tables, batch: int, seq_len: int) -> torch.Tensor | None:
    """``bias`` of every row of a dense [B, S] batch (tables of B * S tokens, columns 0 .. S - 1): [B, H, S, S]."""
    if d.index is None:
        return None
    columns = torch.arange(seq_len, device=d.index.device)
    return torch.stack([bias(d, slice(b * seq_len, (b + 1) * seq_len), columns) for b in range(batch)])


def attention_ref(qkv: torch.Tensor, seqlens, d: Tables, columns: torch.Tensor | None = None) -> torch.Tensor:
    """The attention with these terms, in float64 torch ops: qkv [T, 3, H, D], sequence b the next ``seqlens[b]``
    rows, columns [T] (None: offsets) -> [T, H, D] float64. What the kernels compute up to float32 rounding."""
    outputs, start = [], 0
    for length in seqlens:
        q, k, v = qkv[start: start + length].double().permute(1, 2, 0, 3)  # [H, L, D] each
        cols = torch.arange(length) if columns is None else columns[start: start + length].long()
        terms = bias(dataclasses.replace(d, c2p=None if d.c2p is None else d.c2p.double(),
                                         p2c=None if d.p2c is None else d.p2c.double()),
                     slice(start, start + length), cols)
        scores = (q @ k.transpose(1, 2) + (0 if terms is None else terms)) * d.scale
        outputs.append((scores.softmax(-1) @ v).transpose(0, 1))
        start += length
    return torch.cat(outputs) if outputs else qkv.new_empty(0, *qkv.shape[2:], dtype=torch.float64)
