"""transformers' *common* model tests (``ModelTesterMixin``, ~300 tests per model class) for the other families
fastbert covers: RoBERTa, XLM-RoBERTa, CamemBERT, ELECTRA, DistilBERT, GTE, NomicBERT, ModernBERT, MPNet,
DeBERTa and DeBERTa-v2,
every head class of each, on tiny configs of our own (as ``bert_common_suite.py`` does for BERT; transformers' per-model
test files are not in its sdist).

``run.py`` copies this file next to ``bert_common_suite.py`` in the tree it prepares. The model classes are looked up
on ``transformers`` when this module is imported, i.e. after the ``fastbert_standin`` plugin has rebound them.
"""

import unittest

import torch
import transformers
from transformers.testing_utils import require_torch, torch_device

from tests.test_modeling_common import ModelTesterMixin, ids_tensor, random_attention_mask


class TinyTester:
    """Shapes and inputs for the common tests: odd sizes, padding in every mask (first token always real)."""

    batch_size, seq_length, vocab_size = 5, 9, 101
    hidden_size, num_hidden_layers, num_attention_heads, intermediate_size = 32, 2, 4, 48
    num_labels, num_choices, type_sequence_label_size = 2, 2, 2
    is_training = True

    def __init__(self, parent, config_class, token_types: int, **config):
        self.parent, self.config_class, self.type_vocab_size, self.config = parent, config_class, token_types, config

    def get_config(self):
        return self.config_class(**self.config)

    def prepare_config_and_inputs_for_common(self):
        inputs = {
            # ids from 2 up: RoBERTa's padding_idx (1) only where a tokenizer puts it, at padding
            "input_ids": ids_tensor([self.batch_size, self.seq_length], self.vocab_size - 2) + 2,
            "attention_mask": random_attention_mask([self.batch_size, self.seq_length]),
        }
        if self.type_vocab_size > 1:
            inputs["token_type_ids"] = ids_tensor([self.batch_size, self.seq_length], self.type_vocab_size)
        return self.get_config(), inputs


_BERT_SHAPED = dict(
    vocab_size=TinyTester.vocab_size, hidden_size=TinyTester.hidden_size,
    num_hidden_layers=TinyTester.num_hidden_layers, num_attention_heads=TinyTester.num_attention_heads,
    intermediate_size=TinyTester.intermediate_size, max_position_embeddings=64, is_decoder=False,
    hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1,
)
# Rotary families: weights drawn wider than the 0.02 default, so that positions move the outputs. At 0.02 on these
# tiny widths the attention is nearly uniform, and a RoPE scaling changes the outputs by 1.5e-5 to 5e-5 against the
# 1e-5 + 1e-5 |x| that test_model_rope_scaling_from_config asks of a difference: a rounding either side decides it.
# At 0.1 the change is ~1e-2.
_ROTARY_INIT = dict(initializer_range=0.1)
_HEADS = ("Model", "ForMaskedLM", "ForMultipleChoice", "ForQuestionAnswering", "ForSequenceClassification",
          "ForTokenClassification")


# (The ``ForCausalLM`` heads are decoders: fastbert leaves them to transformers, as bert_common_suite.py checks.)
def _classes(prefix: str, extra: tuple[str, ...] = ()) -> tuple:
    return tuple(getattr(transformers, prefix + head) for head in _HEADS + extra)


@require_torch
class FastbertRobertaCommonTest(ModelTesterMixin, unittest.TestCase):
    all_model_classes = _classes("Roberta")

    def setUp(self):
        self.model_tester = TinyTester(self, transformers.RobertaConfig, 1, **_BERT_SHAPED, type_vocab_size=1,
                                       pad_token_id=1)


@require_torch
class FastbertXLMRobertaCommonTest(ModelTesterMixin, unittest.TestCase):
    all_model_classes = _classes("XLMRoberta")

    def setUp(self):
        self.model_tester = TinyTester(self, transformers.XLMRobertaConfig, 1, **_BERT_SHAPED, type_vocab_size=1,
                                       pad_token_id=1)


@require_torch
class FastbertCamembertCommonTest(ModelTesterMixin, unittest.TestCase):
    all_model_classes = _classes("Camembert")

    def setUp(self):
        self.model_tester = TinyTester(self, transformers.CamembertConfig, 1, **_BERT_SHAPED, type_vocab_size=1,
                                       pad_token_id=1, hidden_act="gelu_new")


@require_torch
class FastbertElectraCommonTest(ModelTesterMixin, unittest.TestCase):
    all_model_classes = _classes("Electra", ("ForPreTraining",))

    def setUp(self):
        # embedding_size != hidden_size: the embeddings_project GEMM
        self.model_tester = TinyTester(self, transformers.ElectraConfig, 3, **_BERT_SHAPED, type_vocab_size=3,
                                       embedding_size=24)

    def _prepare_for_class(self, inputs_dict, model_class, return_labels=False):
        inputs_dict = super()._prepare_for_class(inputs_dict, model_class, return_labels=return_labels)
        # The discriminator's labels (replaced-token flags per position), which the common helper does not know.
        if return_labels and model_class.__name__ == "ElectraForPreTraining":
            shape = (self.model_tester.batch_size, self.model_tester.seq_length)
            inputs_dict["labels"] = torch.zeros(shape, dtype=torch.long, device=torch_device)
        return inputs_dict


@require_torch
class FastbertDistilBertCommonTest(ModelTesterMixin, unittest.TestCase):
    all_model_classes = _classes("DistilBert")

    def setUp(self):
        self.model_tester = TinyTester(
            self, transformers.DistilBertConfig, 1, vocab_size=TinyTester.vocab_size, dim=TinyTester.hidden_size,
            n_layers=TinyTester.num_hidden_layers, n_heads=TinyTester.num_attention_heads,
            hidden_dim=TinyTester.intermediate_size, max_position_embeddings=64, dropout=0.1, attention_dropout=0.1,
            sinusoidal_pos_embds=True,
        )


@require_torch
class FastbertGteCommonTest(ModelTesterMixin, unittest.TestCase):
    all_model_classes = tuple(getattr(transformers, "Gte" + head) for head in
                              ("Model", "ForMaskedLM", "ForSequenceClassification", "ForTokenClassification"))

    def setUp(self):
        # rotary positions, GeGLU MLP, 2 token types (GTE may also have none: tests/test_families.py)
        self.model_tester = TinyTester(self, transformers.GteConfig, 2, **_BERT_SHAPED, **_ROTARY_INIT,
                                       type_vocab_size=2)


@require_torch
class FastbertNomicBertCommonTest(ModelTesterMixin, unittest.TestCase):
    all_model_classes = tuple(getattr(transformers, "NomicBert" + head) for head in
                              ("Model", "ForMaskedLM", "ForSequenceClassification", "ForTokenClassification"))

    def setUp(self):
        # GTE's block without biases, SwiGLU
        self.model_tester = TinyTester(self, transformers.NomicBertConfig, 2, **_BERT_SHAPED, **_ROTARY_INIT,
                                       type_vocab_size=2)


@require_torch
class FastbertModernBertCommonTest(ModelTesterMixin, unittest.TestCase):
    all_model_classes = _classes("ModernBert")

    def setUp(self):
        # pre-norm, local layers with a window of +-2 (shorter than the test sequences), no token types
        self.model_tester = TinyTester(
            self, transformers.ModernBertConfig, 1, vocab_size=TinyTester.vocab_size,
            hidden_size=TinyTester.hidden_size, num_hidden_layers=TinyTester.num_hidden_layers,
            num_attention_heads=TinyTester.num_attention_heads, intermediate_size=TinyTester.intermediate_size,
            max_position_embeddings=64, local_attention=4, global_attn_every_n_layers=2, pad_token_id=0,
            bos_token_id=1, eos_token_id=1, cls_token_id=1, sep_token_id=1, attention_dropout=0.1, mlp_dropout=0.1,
            **_ROTARY_INIT,
        )


@require_torch
class FastbertMPNetCommonTest(ModelTesterMixin, unittest.TestCase):
    all_model_classes = _classes("MPNet")

    def setUp(self):
        # relative-position bias, RoBERTa's positions (padding_idx 1), no token types
        self.model_tester = TinyTester(self, transformers.MPNetConfig, 1, **_BERT_SHAPED, pad_token_id=1)


@require_torch
class FastbertDebertaV2CommonTest(ModelTesterMixin, unittest.TestCase):
    all_model_classes = _classes("DebertaV2")

    def setUp(self):
        # v3's attention: log buckets (4, up to 8: shorter than the test sequences), shared position projections,
        # both terms, LayerNorm'd relative embeddings, no absolute positions nor token types
        self.model_tester = TinyTester(
            self, transformers.DebertaV2Config, 1, **_BERT_SHAPED, relative_attention=True, position_buckets=4,
            max_relative_positions=8, pos_att_type=["p2c", "c2p"], share_att_key=True, norm_rel_ebd="layer_norm",
            position_biased_input=False, type_vocab_size=0, pad_token_id=0,
        )


@require_torch
class FastbertDebertaCommonTest(ModelTesterMixin, unittest.TestCase):
    all_model_classes = tuple(getattr(transformers, "Deberta" + head) for head in
                              ("Model", "ForMaskedLM", "ForQuestionAnswering", "ForSequenceClassification",
                               "ForTokenClassification"))

    def setUp(self):
        # v1: in_proj with q and v biases, distances clamped at 8 (shorter than the test sequences), both terms,
        # absolute positions and 2 token types
        self.model_tester = TinyTester(
            self, transformers.DebertaConfig, 2, **_BERT_SHAPED, relative_attention=True, max_relative_positions=4,
            pos_att_type=["c2p", "p2c"], type_vocab_size=2, pad_token_id=0,
        )
