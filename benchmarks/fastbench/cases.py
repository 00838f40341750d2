"""What one benchmark case is: padding (real lengths per row) or varied shapes, FLOPs, the case grid, the inputs.

Pure functions of their arguments (seeded), importable without running anything.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}

LENGTH_DISTRIBUTION = (
    "Right padding. Row 0 is always full length (so the padded shape is really [batch, seq_len]); the other rows' "
    "real lengths are drawn (seeded) uniformly from the widest interval inside [1, seq_len] centred on the mean those "
    "rows need, then nudged by 1 token at a time on random rows until the batch holds exactly "
    "round((1 - pad_ratio) * batch * seq_len) real tokens (clamped to what a full row 0 and rows of >= 1 token "
    "allow). Batch 1 therefore has no padding, and cases with batch 1 and pad_ratio > 0 are skipped as duplicates. "
    "--lengths L0,L1,... sets the real lengths explicitly instead (batch = their count, seq_len = their max)."
)
VARIED_DISTRIBUTION = (
    "Varied shapes (--varied-shapes N): every call a new batch, as a server sees. Batch size uniform in [1, max "
    "--batch], each row's real length uniform in [1, max --seq-len], right-padded to the batch's longest row (as a "
    "tokenizer with padding=True pads), drawn with random.Random(--seed) and redrawn until no two batches of the case "
    "(output check and warm-up included) have the same padded size (batch x seq_len) or the same real-token count: "
    "every timed call brings a token count the case has not run before, padded (HF's GEMM rows) and packed "
    "(fastbert's, before any rounding of row counts it does itself). Every provider gets the same sequence of "
    "batches."
)


def make_lengths(batch: int, seq_len: int, pad_ratio: float, seed: int = 0) -> list[int]:
    """Per-row real lengths whose padding fraction is ``pad_ratio`` (see ``LENGTH_DISTRIBUTION``)."""
    if batch < 1 or seq_len < 1:
        raise ValueError(f"batch and seq_len must be >= 1, got {batch} and {seq_len}")
    if not 0.0 <= pad_ratio < 1.0:
        raise ValueError(f"pad_ratio must be in [0, 1), got {pad_ratio}")
    rng = random.Random(seed)
    rows = batch - 1
    if rows == 0:
        return [seq_len]
    target = round((1.0 - pad_ratio) * batch * seq_len)
    target = min(max(target, seq_len + rows), batch * seq_len)  # row 0 full, every other row >= 1 token
    rest = target - seq_len
    mean = rest / rows  # in [1, seq_len]
    half = min(mean - 1, seq_len - mean)
    others = [min(max(round(rng.uniform(mean - half, mean + half)), 1), seq_len) for _ in range(rows)]
    diff = rest - sum(others)
    while diff:
        i = rng.randrange(rows)
        step = 1 if diff > 0 else -1
        if 1 <= others[i] + step <= seq_len:
            others[i] += step
            diff -= step
    return [seq_len] + others


def varied_shapes(count: int, max_batch: int, max_len: int, seed: int = 0) -> list[tuple[int, ...]]:
    """``count`` batches of real lengths, each a new shape (see ``VARIED_DISTRIBUTION``)."""
    if count < 1 or max_batch < 1 or max_len < 1:
        raise ValueError(f"count, max_batch and max_len must be >= 1, got {count}, {max_batch}, {max_len}")
    rng = random.Random(seed)
    shapes: list[tuple[int, ...]] = []
    padded_sizes, token_counts = set(), set()
    for _ in range(1000 * count):  # rejection sampling: ample while count is well below max_batch * max_len
        lengths = tuple(rng.randint(1, max_len) for _ in range(rng.randint(1, max_batch)))
        padded, tokens = len(lengths) * max(lengths), sum(lengths)
        if padded in padded_sizes or tokens in token_counts:
            continue
        shapes.append(lengths)
        padded_sizes.add(padded)
        token_counts.add(tokens)
        if len(shapes) == count:
            return shapes
    raise ValueError(f"cannot draw {count} batches of distinct shapes with batch <= {max_batch} and lengths <= "
                     f"{max_len}: ask for fewer varied shapes or allow larger batches or lengths")


def parse_lengths(text: str) -> list[int]:
    """'256,200,150' -> [256, 200, 150]; every length >= 1."""
    lengths = [int(v) for v in text.split(",") if v.strip()]
    if not lengths or min(lengths) < 1:
        raise ValueError(f"--lengths needs positive integers, got {text!r}")
    return lengths


def pad_fraction(lengths: list[int], seq_len: int) -> float:
    """Fraction of the [batch, seq_len] positions that are padding."""
    return 1.0 - sum(lengths) / (len(lengths) * seq_len)


def bert_flops(lengths: list[int], hidden_size: int, intermediate_size: int, num_layers: int) -> int:
    """FLOPs of one BERT encoder forward, counted on the real tokens only (a multiply-add is 2 FLOPs).

    Per real token and layer, with H = hidden_size, I = intermediate_size:
        Q, K, V projections        3 * (2 * H * H)   = 6 H^2
        attention output dense     2 * H * H         = 2 H^2
        FFN up and down            2 * (2 * H * I)   = 4 H I
        -> 8 H^2 + 4 H I = 2 * (4 H^2 + 2 H I): twice the layer's weight count (biases left out).
        attention, for a token of sequence b with S_b real tokens:
        scores q . k over S_b keys  2 * S_b * H
        probs @ v over S_b values   2 * S_b * H      = 4 S_b H
    Total = sum over sequences b of  num_layers * S_b * (8 H^2 + 4 H I + 4 S_b H).
    Left out (each well under 1% for BERT shapes): biases, LayerNorm, GELU, softmax, the embedding lookup and the
    pooler. Padding is never counted, so a provider that computes on padding gets no credit for it. The same count
    holds for every family benchmarked here (RoBERTa/XLM-R and DistilBERT have BERT's post-LN block).
    """
    H, I = hidden_size, intermediate_size
    return sum(num_layers * n * (8 * H * H + 4 * H * I + 4 * n * H) for n in lengths)


@dataclass(frozen=True)
class Case:
    model: str
    dtype: str
    batch: int  # varied shapes: the largest batch drawn from
    seq_len: int  # varied shapes: the longest row drawn
    lengths: tuple[int, ...]  # varied shapes: ()
    length_dist: str  # "pad_ratio=0.5", "explicit:256/200/..." or "varied:..."
    warm_shapes: tuple[tuple[int, ...], ...] = ()  # varied shapes: the output check's and the warm-up's batches
    shapes: tuple[tuple[int, ...], ...] = ()  # varied shapes: the real lengths of each timed call's batch

    @property
    def varied(self) -> bool:
        return bool(self.shapes)

    @property
    def real_tokens(self) -> int:
        """Real tokens of one call; varied shapes: of all the timed calls together."""
        return sum(map(sum, self.shapes)) if self.varied else sum(self.lengths)

    @property
    def pad_ratio(self) -> float:
        if self.varied:
            return 1.0 - self.real_tokens / sum(len(s) * max(s) for s in self.shapes)
        return pad_fraction(list(self.lengths), self.seq_len)

    @property
    def label(self) -> str:
        if self.varied:
            return (f"{self.model} {self.dtype} varied: {len(self.shapes)} shapes, b1-{self.batch}, "
                    f"s1-{self.seq_len}")
        return f"{self.model} {self.dtype} b{self.batch}x{self.seq_len} pad{self.pad_ratio:.2f}"


def make_cases(models, dtypes, batches, seq_lens, pad_ratios, lengths=None, seed=0, log=print, varied=0,
               warm=1) -> list[Case]:
    """Every (model, dtype, seq_len, batch, pad_ratio), model and dtype outermost (models are built once per pair).

    ``varied`` > 0 adds, last for each model and dtype, a varied-shapes case of ``varied`` timed calls after ``warm``
    untimed ones (the first of them is the output check), each a new shape (``VARIED_DISTRIBUTION``).
    """
    cases = []
    for model in models:
        for dtype in dtypes:
            if lengths is not None:
                for seq_len in seq_lens:
                    cases.append(Case(model, dtype, len(lengths), seq_len, tuple(lengths),
                                      "explicit:" + "/".join(map(str, lengths))))
            else:
                for seq_len in seq_lens:
                    for batch in batches:
                        for pad in pad_ratios:
                            if batch == 1 and pad > 0:
                                log(f"note: skipping {model} {dtype} b1x{seq_len} pad_ratio={pad:g}: row 0 is "
                                    "always full length, so batch 1 has no padding (same as pad_ratio=0)")
                                continue
                            lens = make_lengths(batch, seq_len, pad, seed)
                            cases.append(Case(model, dtype, batch, seq_len, tuple(lens), f"pad_ratio={pad:g}"))
            if varied:
                max_batch = len(lengths) if lengths is not None else max(batches)
                drawn = varied_shapes(warm + varied, max_batch, max(seq_lens), seed)
                cases.append(Case(model, dtype, max_batch, max(seq_lens), (),
                                  f"varied:{varied} shapes b1-{max_batch} s1-{max(seq_lens)} seed{seed}",
                                  tuple(drawn[:warm]), tuple(drawn[warm:])))
    return cases


def batch_inputs(lengths, seq_len: int, vocab_size: int, pad_token_id: int, seed: int, device: torch.device) -> dict:
    """input_ids [B, S] and attention_mask [B, S] for real ``lengths`` right-padded to ``seq_len``: random ids in
    [1, vocab) on real tokens (never the pad id: RoBERTa-style models count positions on ``input_ids !=
    pad_token_id``), pad_token_id on padding."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, vocab_size, (len(lengths), seq_len), generator=g)
    if pad_token_id != 0:
        ids = ids.masked_fill(ids == pad_token_id, 0)
    mask = (torch.arange(seq_len)[None, :] < torch.tensor(lengths)[:, None]).long()
    ids = ids.masked_fill(mask == 0, pad_token_id)
    return {"input_ids": ids.to(device), "attention_mask": mask.to(device)}


def make_inputs(case: Case, vocab_size: int, pad_token_id: int, seed: int, device: torch.device) -> dict:
    """The inputs of a fixed-shape case (``batch_inputs`` of its lengths)."""
    return batch_inputs(case.lengths, case.seq_len, vocab_size, pad_token_id, seed, device)


def varied_inputs(case: Case, vocab_size: int, pad_token_id: int, seed: int, device: torch.device) -> list[dict]:
    """The inputs of a varied-shapes case, one per batch (``warm_shapes``, then ``shapes``), each padded to its
    longest row; the token ids seeded per batch."""
    return [batch_inputs(s, max(s), vocab_size, pad_token_id, seed + i, device)
            for i, s in enumerate(case.warm_shapes + case.shapes)]
