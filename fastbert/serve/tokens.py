"""Texts to token ids as the model's tokenizer makes them with truncation at the model's length (what
``SentenceTransformer.encode`` and ``CrossEncoder.predict`` run), from a bounded prefix of each text.

A tokenizer normalizes, splits and tokenizes a whole text before it truncates: for a 15 MB string that is seconds of
work and GBs of memory, to keep 256 tokens. Here a text is first cut at ``(max_length + 2) * CHARS_PER_TOKEN``
characters (a token is 4-5 characters of English text, rarely over 10 in any language: 16 leaves a margin; 8K
characters for 512 tokens) and only that prefix is tokenized. The cut is exact, not a guess: the tokens kept must end
before a space that follows a non-space character in the prefix -- a boundary no token crosses in the tokenizers of
the families served (BERT's WordPiece splits on whitespace; byte-level BPE starts a word at its space;
SentencePiece's Metaspace splits at spaces), so every token before it is the one the whole text has there. Where the
prefix holds too few tokens or no such space (long runs of whitespace, of text without spaces, characters the
tokenizer drops), the cut grows fourfold and is tokenized again, up to the whole text: bounded by the request's size,
and in the server's tokenizing threads, so such a text costs its own request time, not anyone else's.

Pairs (rerank's query and each document) are cut the same way and truncated by the tokenizer's own ``longest_first``
rule (``Tokenizer.post_process``): it needs each text's first ``max_length`` tokens and, when both texts are too
long and the budget is odd (the longer one keeps the extra token), which of the two whole texts is longer -- then
their lengths are counted a window at a time (``_length``). The query is cut once per request.

A tokenizer that truncates on the left keeps the end of a text: it tokenizes whole texts (said once).
"""

import copy
import dataclasses
import re

import tokenizers

from .. import announce

CHARS_PER_TOKEN = 16
GROWTH = 4
WINDOW = 1 << 16  # characters tokenized at a time when a whole text's length is counted
_BOUNDARY = re.compile(r"(?<=\S) ")  # a space after a non-space character: no token spans it


@dataclasses.dataclass
class Tokenized:
    """One sequence for the model: token ids and token types with the special tokens; ``cut``: the text had more
    tokens than the model takes."""

    ids: list[int]
    types: list[int]
    cut: bool


@dataclasses.dataclass
class Query:
    """A rerank query, tokenized once for all its documents: the first ``Tokens.pair_budget + 2`` tokens of its text
    (fewer: its whole text), and its whole length once a document needs it."""

    text: str
    encoding: tokenizers.Encoding
    length: int | None = None
    shortened: tokenizers.Encoding | None = None  # the first pair_budget + 1 tokens, where a document needs them


class Tokens:
    """A fast tokenizer (transformers' ``PreTrainedTokenizerFast``) at ``max_length``; ``lowercase``: texts are
    lowercased first (a sentence-transformers folder's ``do_lower_case``); ``special_tokens``: whether single texts
    get them (False: as ``add_special_tokens=False``, a static lookup's tokens). Safe to call from several
    threads."""

    def __init__(self, tokenizer, max_length: int, lowercase: bool = False, special_tokens: bool = True):
        if not getattr(tokenizer, "is_fast", False):
            raise ValueError(f"{type(tokenizer).__name__} is not a fast tokenizer (the server needs the tokenizers "
                             "library's, which transformers loads for every family fastbert serves)")
        self.max_length, self.lowercase, self.special_tokens = max_length, lowercase, special_tokens
        self.side = side = tokenizer.truncation_side
        # Own copies of the Rust tokenizer: transformers sets truncation on its own before every call, which other
        # threads would see. One encodes texts (at most max_length + 2 tokens kept), one adds the special tokens and
        # truncates as transformers' call with truncation=True and max_length does, one counts.
        self.encoder = copy.deepcopy(tokenizer.backend_tokenizer)
        self.encoder.no_padding()
        self.encoder.enable_truncation(max_length + 2, direction=side)
        self.finisher = copy.deepcopy(self.encoder)
        self.finisher.enable_truncation(max_length, strategy="longest_first", direction=side)
        self.counter = copy.deepcopy(self.encoder)  # (whole lengths, a window at a time)
        self.counter.no_truncation()
        self.single_budget = max_length - special_tokens * self.finisher.num_special_tokens_to_add(False)  # a text's
        self.pair_budget = max_length - self.finisher.num_special_tokens_to_add(True)  # of a query and a document
        self.first_cut = (max_length + 2) * CHARS_PER_TOKEN
        if side != "right":
            announce.note(f"{type(tokenizer).__name__} truncates on the {side}: the server tokenizes whole texts "
                          "(bounded by the request's size only)")
            self.first_cut = None

    def single(self, texts: list[str]) -> list[Tokenized]:
        """Texts -> their sequences, each cut at max_length as the tokenizer cuts it."""
        sequences = []
        for text in texts:
            encoding = self._prefix(text, self.single_budget + 1)
            final = self.finisher.post_process(encoding, None, add_special_tokens=self.special_tokens)
            sequences.append(Tokenized(final.ids, final.type_ids, len(encoding.ids) > self.single_budget))
        return sequences

    def query(self, text: str) -> Query:
        return Query(text, self._prefix(text, self.pair_budget + 2))

    def shortest_pair(self, query: Query) -> int:
        """The fewest tokens a (query, document) pair can have: the query's, the special tokens and no document."""
        return min(self.max_length, len(query.encoding.ids) + self.max_length - self.pair_budget)

    def pairs(self, query: Query, documents: list[str]) -> list[Tokenized]:
        """(query, document) pairs -> their sequences, truncated as the tokenizer truncates the pair."""
        budget = self.pair_budget
        sequences = []
        for document in documents:
            first, second = query.encoding, self._prefix(document, budget + 2)
            if len(first.ids) > budget and len(second.ids) > budget and budget % 2:
                # Both are halved and the longer whole text keeps the odd token: give the tokenizer's rule the order
                # of the whole lengths (the longer one budget + 2 tokens, the other budget + 1).
                first, second = self._ordered(query, second, document)
            final = self.finisher.post_process(first, second, add_special_tokens=True)
            sequences.append(Tokenized(final.ids, final.type_ids, len(first.ids) + len(second.ids) > budget))
        return sequences

    # --- cutting ---------------------------------------------------------------------------------------------------

    def _prefix(self, text: str, count: int) -> tokenizers.Encoding:
        """The first ``count`` tokens of ``text`` without special tokens (all of them where it has fewer), exactly as
        the whole text's tokenization has them, from as short a prefix as the cut rule allows."""
        cut = self.first_cut
        while True:
            whole = cut is None or cut >= len(text)
            head = text if whole else text[:cut]
            head = head.lower() if self.lowercase else head
            encoding = self.encoder.encode(head, add_special_tokens=False)
            if len(encoding.ids) >= count and (whole or _settled(head, encoding.offsets[count - 1][1])):
                encoding.truncate(count, direction=self.side)
                return encoding
            if whole:
                return encoding
            cut *= GROWTH

    def _ordered(self, query: Query, encoding: tokenizers.Encoding, document: str):
        """(query, document) encodings of budget + 2 tokens each -> the one whose whole text is not the longer of the
        two shortened to budget + 1 tokens (both, for equal lengths)."""
        if query.length is None:
            query.length = self._length(query.text)
        length = self._length(document, stop_after=query.length)
        if length < query.length:
            encoding.truncate(self.pair_budget + 1, direction=self.side)
            return query.encoding, encoding
        if query.shortened is None:
            query.shortened = tokenizers.Encoding.merge([query.encoding])  # (a copy)
            query.shortened.truncate(self.pair_budget + 1, direction=self.side)
        if length == query.length:
            encoding.truncate(self.pair_budget + 1, direction=self.side)
        return query.shortened, encoding

    def _length(self, text: str, stop_after: int | None = None) -> int:
        """The number of tokens of the whole text (no special tokens), tokenizing ``WINDOW`` characters at a time,
        each window ending before a space after a non-space (so the windows' tokens are the text's); counting stops
        once past ``stop_after``."""
        total, start = 0, 0
        while start < len(text) and (stop_after is None or total <= stop_after):
            boundary = _BOUNDARY.search(text, start + WINDOW)
            end = boundary.start() if boundary else len(text)
            window = text[start:end]
            total += len(self.counter.encode(window.lower() if self.lowercase else window,
                                             add_special_tokens=False).ids)
            start = end
        return total


def _settled(head: str, end: int) -> bool:
    """Whether the tokens of ``head`` (a prefix of a longer text) that end at or before character ``end`` are the whole
    text's: a space after a non-space character follows them (where no token or pre-token crosses)."""
    return _BOUNDARY.search(head, max(end, 1)) is not None
