"""fastbert's own BERT test class for transformers' *common* model tests.

transformers' per-model test (tests/models/bert/test_modeling_bert.py) is not shipped in the transformers sdist, but
the common machinery is (tests/test_modeling_common.py: ModelTesterMixin, ~300 tests run against every model class;
tests/test_pipeline_mixin.py). This module plugs the nine BERT classes into that machinery with a tiny config of
our own, plus a few BERT-specific checks of our own (heads, decoder, cache, training) in the spirit of the per-model file.

It is not collected by fastbert's own ``pytest tests`` (the name does not match test_*.py): ``run.py`` copies it to
tests/fastbert_suite/ of the tree it prepares from a transformers checkout, where ``tests`` is transformers' tests.
The model classes are looked up on ``transformers`` when this module is imported, i.e. after the
``fastbert_standin`` plugin has rebound them (FASTBERT_STANDIN=rebind).
"""

import unittest

import transformers
from transformers import BertConfig
from transformers.testing_utils import require_torch, torch_device

from tests.generation.test_utils import GenerationTesterMixin
from tests.test_modeling_common import ModelTesterMixin, floats_tensor, ids_tensor, random_attention_mask
from tests.test_pipeline_mixin import PipelineTesterMixin

import torch

BertModel = transformers.BertModel
BertLMHeadModel = transformers.BertLMHeadModel
BertForMaskedLM = transformers.BertForMaskedLM
BertForMultipleChoice = transformers.BertForMultipleChoice
BertForNextSentencePrediction = transformers.BertForNextSentencePrediction
BertForPreTraining = transformers.BertForPreTraining
BertForQuestionAnswering = transformers.BertForQuestionAnswering
BertForSequenceClassification = transformers.BertForSequenceClassification
BertForTokenClassification = transformers.BertForTokenClassification


class TinyBertTester:
    """Shapes and inputs for the common tests: odd sizes, padding in every mask, several token types."""

    def __init__(self, parent):
        self.parent = parent
        self.batch_size = 5
        self.seq_length = 9
        self.is_training = True
        self.vocab_size = 101
        self.hidden_size = 32
        self.num_hidden_layers = 2
        self.num_attention_heads = 4
        self.intermediate_size = 48
        self.max_position_embeddings = 64
        self.type_vocab_size = 3
        self.num_labels = 2
        self.num_choices = 2
        self.type_sequence_label_size = 2

    def get_config(self, **overrides):
        values = dict(
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            num_hidden_layers=self.num_hidden_layers,
            num_attention_heads=self.num_attention_heads,
            intermediate_size=self.intermediate_size,
            hidden_act="gelu",
            hidden_dropout_prob=0.1,
            attention_probs_dropout_prob=0.1,
            max_position_embeddings=self.max_position_embeddings,
            type_vocab_size=self.type_vocab_size,
            initializer_range=0.02,
            is_decoder=False,
        )
        values.update(overrides)
        return BertConfig(**values)

    def inputs(self):
        """input_ids, token_type_ids, attention_mask (random padding, first token always real)."""
        input_ids = ids_tensor([self.batch_size, self.seq_length], self.vocab_size)
        token_type_ids = ids_tensor([self.batch_size, self.seq_length], self.type_vocab_size)
        attention_mask = random_attention_mask([self.batch_size, self.seq_length])
        return input_ids, token_type_ids, attention_mask

    def prepare_config_and_inputs_for_common(self):
        input_ids, token_type_ids, attention_mask = self.inputs()
        inputs = {"input_ids": input_ids, "token_type_ids": token_type_ids, "attention_mask": attention_mask}
        return self.get_config(), inputs


@require_torch
class FastbertBertCommonTest(ModelTesterMixin, GenerationTesterMixin, PipelineTesterMixin, unittest.TestCase):
    all_model_classes = (
        BertModel,
        BertLMHeadModel,
        BertForMaskedLM,
        BertForMultipleChoice,
        BertForNextSentencePrediction,
        BertForPreTraining,
        BertForQuestionAnswering,
        BertForSequenceClassification,
        BertForTokenClassification,
    )
    pipeline_model_mapping = {
        "feature-extraction": BertModel,
        "fill-mask": BertForMaskedLM,
        "question-answering": BertForQuestionAnswering,
        "text-classification": BertForSequenceClassification,
        "text-generation": BertLMHeadModel,
        "token-classification": BertForTokenClassification,
        "zero-shot": BertForSequenceClassification,
    }

    def setUp(self):
        self.model_tester = TinyBertTester(self)

    def _prepare_for_class(self, inputs_dict, model_class, return_labels=False):
        inputs_dict = super()._prepare_for_class(inputs_dict, model_class, return_labels=return_labels)
        # The pre-training head takes two label tensors, which the common helper does not know about.
        if return_labels and model_class.__name__ == "BertForPreTraining":
            batch, seq = self.model_tester.batch_size, self.model_tester.seq_length
            inputs_dict["labels"] = torch.zeros((batch, seq), dtype=torch.long, device=torch_device)
            inputs_dict["next_sentence_label"] = torch.zeros(batch, dtype=torch.long, device=torch_device)
        return inputs_dict

    # ------------------------------------------------------------------------------------------------------------
    # BERT-specific checks of our own
    # ------------------------------------------------------------------------------------------------------------

    def _eval(self, model):
        return model.to(torch_device).eval()

    def test_bert_encoder_outputs(self):
        config, inputs = self.model_tester.prepare_config_and_inputs_for_common()
        tester = self.model_tester
        for pooling in (True, False):
            model = self._eval(BertModel(config, add_pooling_layer=pooling))
            with torch.no_grad():
                full = model(**inputs)
                no_types = model(inputs["input_ids"], attention_mask=inputs["attention_mask"])
                bare = model(inputs["input_ids"])
            for out in (full, no_types, bare):
                self.assertEqual(out.last_hidden_state.shape, (tester.batch_size, tester.seq_length, tester.hidden_size))
                self.assertEqual(out.pooler_output is None, not pooling)

    def test_bert_heads_output_shapes(self):
        config, inputs = self.model_tester.prepare_config_and_inputs_for_common()
        b, s, v = self.model_tester.batch_size, self.model_tester.seq_length, self.model_tester.vocab_size
        expected = {
            BertForMaskedLM: ("logits", (b, s, v)),
            BertLMHeadModel: ("logits", (b, s, v)),
            BertForNextSentencePrediction: ("logits", (b, 2)),
            BertForPreTraining: ("prediction_logits", (b, s, v)),
            BertForQuestionAnswering: ("start_logits", (b, s)),
            BertForSequenceClassification: ("logits", (b, config.num_labels)),
            BertForTokenClassification: ("logits", (b, s, config.num_labels)),
        }
        for model_class, (name, shape) in expected.items():
            model = self._eval(model_class(config))
            with torch.no_grad():
                out = model(**self._prepare_for_class(inputs, model_class, return_labels=True))
            self.assertEqual(getattr(out, name).shape, shape, model_class.__name__)
            self.assertIsNotNone(out.loss, model_class.__name__)

    def test_bert_multiple_choice(self):
        config, inputs = self.model_tester.prepare_config_and_inputs_for_common()
        n = self.model_tester.num_choices
        model = self._eval(BertForMultipleChoice(config))
        choices = {k: v.unsqueeze(1).expand(-1, n, -1).contiguous() for k, v in inputs.items()}
        labels = ids_tensor([self.model_tester.batch_size], n)
        with torch.no_grad():
            out = model(**choices, labels=labels)
        self.assertEqual(out.logits.shape, (self.model_tester.batch_size, n))

    def test_bert_as_decoder_with_cross_attention(self):
        config, inputs = self.model_tester.prepare_config_and_inputs_for_common()
        config.is_decoder = True
        config.add_cross_attention = True
        b, s, h = self.model_tester.batch_size, self.model_tester.seq_length, self.model_tester.hidden_size
        encoder_states = floats_tensor([b, s + 2, h])
        encoder_mask = random_attention_mask([b, s + 2])
        for model_class in (BertModel, BertLMHeadModel):
            model = self._eval(model_class(config))
            with torch.no_grad():
                out = model(**inputs, encoder_hidden_states=encoder_states, encoder_attention_mask=encoder_mask)
                out_no_mask = model(**inputs, encoder_hidden_states=encoder_states)
            first = out.last_hidden_state if model_class is BertModel else out.logits
            self.assertEqual(first.shape[:2], (b, s), model_class.__name__)
            self.assertEqual(out_no_mask[0].shape, first.shape)

    def test_bert_decoder_cache_matches_full_pass(self):
        """Decoding the last tokens with past_key_values gives what one full pass gives at those positions."""
        config, inputs = self.model_tester.prepare_config_and_inputs_for_common()
        config.is_decoder = True
        model = self._eval(BertLMHeadModel(config))
        input_ids = inputs["input_ids"]
        mask = torch.ones_like(input_ids)
        extra = ids_tensor([self.model_tester.batch_size, 3], self.model_tester.vocab_size)
        with torch.no_grad():
            first = model(input_ids, attention_mask=mask, use_cache=True)
            full = model(torch.cat([input_ids, extra], 1), attention_mask=torch.cat([mask, torch.ones_like(extra)], 1))
            step = model(
                extra,
                attention_mask=torch.cat([mask, torch.ones_like(extra)], 1),
                past_key_values=first.past_key_values,
            )
        torch.testing.assert_close(step.logits, full.logits[:, -3:], atol=1e-4, rtol=1e-4)

    def test_bert_train_step_changes_every_encoder_weight(self):
        config, inputs = self.model_tester.prepare_config_and_inputs_for_common()
        model = BertForSequenceClassification(config).to(torch_device).train()
        labels = ids_tensor([self.model_tester.batch_size], config.num_labels)
        model(**inputs, labels=labels).loss.backward()
        missing = [n for n, p in model.bert.named_parameters() if p.requires_grad and p.grad is None]
        if model.bert.pooler is None:
            missing = [n for n in missing if not n.startswith("pooler.")]
        self.assertEqual(missing, [], "encoder parameters without a gradient")
