"""The inputs of ``fastbert.quantize``'s guard (``guard.py``): its texts, the model's tokenizer, and the batches it
runs: its sentences (default: ``data/int8_guard.txt``, 59 sentences in several languages, code and log lines, 5-62
tokens with all-MiniLM-L6-v2's tokenizer), in batches of up to 16, and the same sentences back to back in up to two
inputs of up to 512 tokens (or the model's limit), so that long inputs are judged too."""

import os

_GUARD_TEXTS = os.path.join(os.path.dirname(os.path.dirname(__file__)), "data", "int8_guard.txt")  # (fastbert/data)
# A sentence with more unknown tokens than this share checks nothing for the model's vocabulary.
MAX_UNKNOWN = 0.5
_BATCH = 16
LONG_ITEMS, LONG_TOKENS = 2, 512  # the guard's long inputs: its texts back to back (``batches_of``)


def usable_texts(tokenizer, texts: list[str] | None) -> tuple[list[str], int]:
    """(the texts the guard runs, how many of the shipped ones were left out as mostly unknown tokens). The user's
    texts are checked as they are: mostly unknown tokens is an error, since the guard would compare nothing but the
    unknown token's embedding."""
    shipped = texts is None
    if shipped:
        with open(_GUARD_TEXTS, encoding="utf-8") as f:
            texts = [line.strip() for line in f if line.strip()]
    elif isinstance(texts, str) or not all(isinstance(t, str) and t.strip() for t in texts) or not list(texts):
        raise ValueError("texts must be a non-empty list of non-empty strings")
    texts = list(texts)
    unknown_id = getattr(tokenizer, "unk_token_id", None)
    if unknown_id is None:  # (byte-level vocabularies have no unknown token)
        return texts, 0
    ids = tokenizer(texts, add_special_tokens=False)["input_ids"]
    shares = [sum(i == unknown_id for i in row) / max(1, len(row)) for row in ids]
    kept = [t for t, share in zip(texts, shares) if share <= MAX_UNKNOWN] if shipped else texts
    unknown = sum(share * len(row) for share, row in zip(shares, ids)) / max(1, sum(len(row) for row in ids))
    if not kept or (not shipped and unknown > MAX_UNKNOWN):
        raise ValueError(f"texts: {unknown:.0%} of their tokens are unknown to the model's tokenizer "
                         f"({tokenizer.unk_token}): the guard would compare nothing but that token's embedding; pass "
                         "texts= in the model's language(s), or guard=False to skip the check")
    return kept, len(texts) - len(kept)


def tokenizer_of(model, tokenizer, encoders):
    if tokenizer is not None:
        return tokenizer
    own = getattr(model, "tokenizer", None)  # SentenceTransformer, CrossEncoder
    if own is not None and callable(own):
        return own
    path = encoders[0].config._name_or_path
    if path:
        from transformers import AutoTokenizer

        try:
            return AutoTokenizer.from_pretrained(path)
        except (OSError, ValueError):
            pass
    raise ValueError("fastbert.quantize checks int8 against float32 on real sentences and needs the model's "
                     "tokenizer: pass tokenizer=..., or guard=False to skip the check")


def batches_of(tokenizer, texts: list[str], encoders) -> list[dict]:
    """Batches of at most ``_BATCH`` texts of up to 128 tokens, and two at least where there are two texts (static
    scales are calibrated on every other batch and judged on all); then one batch of the texts back to back, in up to
    ``LONG_ITEMS`` inputs of up to ``LONG_TOKENS`` tokens (or the model's limit), so that long inputs are judged too
    (the int8 attention's error grows with the number of keys, and a layer's activation ranges with the length)."""
    positions = [e.config.max_position_embeddings for e in encoders
                 if getattr(e.config, "max_position_embeddings", None)]
    limit = min([128] + positions)
    size = max(1, min(_BATCH, (len(texts) + 1) // 2))
    batches = [dict(tokenizer(texts[i:i + size], padding=True, truncation=True, max_length=limit,
                              return_tensors="pt"))
               for i in range(0, len(texts), size)]
    longest = min([LONG_TOKENS] + positions)
    joined = _joined(tokenizer, texts, longest, limit) if longest > limit else []
    if joined:
        batches.append(dict(tokenizer(joined, padding=True, truncation=True, max_length=longest, return_tensors="pt")))
    return batches


def _joined(tokenizer, texts: list[str], tokens: int, shorter: int) -> list[str]:
    """``texts`` back to back, cut into at most ``LONG_ITEMS`` strings of about ``tokens`` tokens each (a last one
    only if it is longer than ``shorter``, the sentence batches' own limit)."""
    joined, current, count = [], [], 0
    for text in texts:
        current.append(text)
        count += len(tokenizer(text, add_special_tokens=False)["input_ids"])
        if count >= tokens:
            joined.append(" ".join(current))
            current, count = [], 0
            if len(joined) == LONG_ITEMS:
                return joined
    return joined + ([" ".join(current)] if current and count > shorter else [])


def longest_input(batches: list[dict]) -> int:
    """The longest input the guard runs, in tokens."""
    return max(int(batch["attention_mask"].sum(dim=1).max()) for batch in batches)
