"""BERT, as in the paper's diagram, with HF's module names and state_dict keys.

    ids, token types, positions  [B, S]
      -> validate, then pack the real tokens when the mask has padding           (validation.py, padding.py)
      -> embeddings = LayerNorm(word[ids] + position[pos] + token_type[tt])     [N, hidden]
      -> num_hidden_layers x BertLayer:
             qkv = x @ Wqkv + bqkv                  one GEMM              [N, 3 * hidden]
             ctx = attention(q, k, v | layout)      flash attention       [N, hidden]
             x   = LayerNorm(ctx @ Wo + bo + x)     GEMM + fused LN
             h   = act(x @ Wi + bi)                 GEMM + fused bias/act [N, intermediate]
             x   = LayerNorm(h @ Wo2 + bo2 + x)     GEMM + fused LN
      -> unpack to [B, S, hidden]; pooler = tanh(dense(x[:, 0]))

N is B * S on the dense path and the number of real tokens on the packed one. Every module keeps the children HF has
(``query``, ``dense``, ``LayerNorm``, ...), so checkpoints load strictly both ways, and ``fastbert.optimize`` can turn
an HF module into ours in place: each class here sets its extra state in ``_configure(config)``, which both
``__init__`` and ``optimize`` call.
"""

import torch
import torch.nn.functional as F
from torch import nn
from transformers import BertConfig, BertPreTrainedModel
from transformers.activations import ACT2FN
from transformers.modeling_outputs import BaseModelOutputWithPoolingAndCrossAttentions

from . import ops, padding, validation


def _activation(config) -> tuple[str | None, nn.Module]:
    """(name of hidden_act when it is a string, the HF module computing it)."""
    act = config.hidden_act
    return (act, ACT2FN[act]) if isinstance(act, str) else (None, act)


def check_supported(config) -> None:
    """Options fastbert does not implement raise here, naming the option, instead of giving wrong results."""
    if getattr(config, "is_decoder", False) or getattr(config, "add_cross_attention", False):
        raise NotImplementedError("fastbert implements the bidirectional encoder; config.is_decoder and "
                                  "config.add_cross_attention (causal masks, KV cache, cross-attention) are not supported")
    position_type = getattr(config, "position_embedding_type", "absolute")
    if position_type != "absolute":
        raise NotImplementedError(f"config.position_embedding_type={position_type!r}: only 'absolute' is supported")


class _Module(nn.Module):
    """Base of our modules: ``_configure`` sets state derived from the config (none by default)."""

    def _configure(self, config):
        pass


class BertEmbeddings(_Module):
    def __init__(self, config):
        super().__init__()
        self.word_embeddings = nn.Embedding(config.vocab_size, config.hidden_size, padding_idx=config.pad_token_id)
        self.position_embeddings = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        self.token_type_embeddings = nn.Embedding(config.type_vocab_size, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)
        # HF's non-persistent buffers, kept so that module trees (and their .to()) match HF's.
        self.register_buffer("position_ids", torch.arange(config.max_position_embeddings).expand((1, -1)), persistent=False)
        self.register_buffer("token_type_ids", torch.zeros(self.position_ids.size(), dtype=torch.long), persistent=False)

    def forward(self, indices: torch.Tensor, inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """indices [3, N] (word, token type, position) -> [N, hidden]."""
        return ops.embedding(indices, self, inputs_embeds)


class BertSelfAttention(_Module):
    def __init__(self, config):
        super().__init__()
        if config.hidden_size % config.num_attention_heads != 0:
            raise ValueError(f"hidden_size {config.hidden_size} is not a multiple of num_attention_heads "
                             f"{config.num_attention_heads}")
        self.query = nn.Linear(config.hidden_size, config.hidden_size)
        self.key = nn.Linear(config.hidden_size, config.hidden_size)
        self.value = nn.Linear(config.hidden_size, config.hidden_size)
        self.dropout = nn.Dropout(config.attention_probs_dropout_prob)
        self._configure(config)

    def _configure(self, config):
        self.num_attention_heads = config.num_attention_heads
        self._qkv = None  # (weight [3 * hidden, hidden], bias [3 * hidden]) that query/key/value are views of

    def qkv_weight_and_bias(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The query/key/value projections stacked for one GEMM: weight [3 * hidden, hidden], bias [3 * hidden].

        With autograd on (training) they are concatenated on every call, so gradients reach the HF parameters.
        Without autograd the stacked tensors are built once and the six parameters are re-pointed to views of them:
        no extra memory, and every in-place write to a parameter (an optimizer step, ``p.data.copy_``, an EMA
        update) shows through. Replacing or moving a parameter (``load_state_dict(assign=True)``, ``.to()``,
        ``.half()``) breaks the aliasing, which the pointer check sees, and the stacked tensors are rebuilt.
        """
        params = (self.query.weight, self.key.weight, self.value.weight, self.query.bias, self.key.bias, self.value.bias)
        if torch.compiler.is_compiling() or torch.is_grad_enabled():
            return torch.cat(params[:3]), torch.cat(params[3:])
        if self._qkv is None or not _views_of(params[:3], self._qkv[0]) or not _views_of(params[3:], self._qkv[1]):
            self._qkv = _stack_and_alias(params[:3]), _stack_and_alias(params[3:])
        return self._qkv

    def forward(self, x: torch.Tensor, layout: padding.TokenLayout) -> torch.Tensor:
        weight, bias = self.qkv_weight_and_bias()
        qkv = F.linear(x, weight, bias)  # [N, 3 * hidden]
        p = self.dropout.p if self.training else 0.0
        return ops.attention(qkv, layout, self.num_attention_heads, p)  # [N, hidden]


def _views_of(params: tuple[torch.Tensor, ...], stacked: torch.Tensor) -> bool:
    """Whether ``params`` are still the consecutive equal chunks of ``stacked`` (same storage, same offsets)."""
    step = params[0].numel() * params[0].element_size()
    return all(
        p.data_ptr() == stacked.data_ptr() + i * step and p.dtype == stacked.dtype and p.shape == params[0].shape
        for i, p in enumerate(params)
    )


def _stack_and_alias(params: tuple[nn.Parameter, ...]) -> torch.Tensor:
    """Concatenate ``params`` along dim 0 and make each parameter a view of its chunk (the Parameter objects stay)."""
    # Outside inference mode, so that the parameters never become inference tensors (training after an
    # inference_mode forward must still work).
    with torch.inference_mode(False), torch.no_grad():
        stacked = torch.cat([p.detach() for p in params])
        for p, chunk in zip(params, stacked.chunk(len(params))):
            p.data = chunk
    return stacked


class _DenseResidualLayerNorm(_Module):
    """LayerNorm(dropout(dense(hidden)) + residual): the shape of both BertSelfOutput and BertOutput."""

    def __init__(self, config, in_features: int):
        super().__init__()
        self.dense = nn.Linear(in_features, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)

    def forward(self, hidden: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        p = self.dropout.p if self.training else 0.0
        return ops.dense_residual_layer_norm(hidden, self.dense, residual, self.LayerNorm, p)


class BertSelfOutput(_DenseResidualLayerNorm):
    def __init__(self, config):
        super().__init__(config, config.hidden_size)


class BertAttention(_Module):
    def __init__(self, config):
        super().__init__()
        self.self = BertSelfAttention(config)
        self.output = BertSelfOutput(config)

    def forward(self, x: torch.Tensor, layout: padding.TokenLayout) -> torch.Tensor:
        return self.output(self.self(x, layout), x)


class BertIntermediate(_Module):
    def __init__(self, config):
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.intermediate_size)
        self.intermediate_act_fn = _activation(config)[1]
        self._configure(config)

    def _configure(self, config):
        self.activation = _activation(config)[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.dense_act(x, self.dense, self.activation, self.intermediate_act_fn)


class BertOutput(_DenseResidualLayerNorm):
    def __init__(self, config):
        super().__init__(config, config.intermediate_size)


class BertLayer(_Module):
    def __init__(self, config):
        super().__init__()
        self.attention = BertAttention(config)
        self.intermediate = BertIntermediate(config)
        self.output = BertOutput(config)

    def forward(self, x: torch.Tensor, layout: padding.TokenLayout) -> torch.Tensor:
        x = self.attention(x, layout)
        return self.output(self.intermediate(x), x)


class BertEncoder(_Module):
    def __init__(self, config):
        super().__init__()
        self.layer = nn.ModuleList([BertLayer(config) for _ in range(config.num_hidden_layers)])
        self._configure(config)

    def _configure(self, config):
        # Set by HF's gradient_checkpointing_enable(), with _gradient_checkpointing_func; kept if already set.
        self.gradient_checkpointing = getattr(self, "gradient_checkpointing", False)

    def forward(self, x: torch.Tensor, layout: padding.TokenLayout, output_hidden_states: bool = False):
        """x [N, hidden] -> (last [N, hidden], per-layer [B, S, hidden] outputs or None)."""
        hidden_states = [padding.unpack(x, layout)] if output_hidden_states else None
        checkpointing = self.gradient_checkpointing and self.training and torch.is_grad_enabled()
        for layer in self.layer:
            x = self._gradient_checkpointing_func(layer.__call__, x, layout) if checkpointing else layer(x, layout)
            if output_hidden_states:
                hidden_states.append(padding.unpack(x, layout))
        return x, hidden_states


class BertPooler(_Module):
    def __init__(self, config):
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.activation = nn.Tanh()

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """[B, S, hidden] -> [B, hidden] from each row's first position, as HF does."""
        return self.activation(self.dense(hidden_states[:, 0]))


class BertPredictionHeadTransform(_Module):
    """The MLM head's dense -> act -> LayerNorm, with act + LayerNorm fused (used by ``optimize``)."""

    def __init__(self, config):
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.transform_act_fn = _activation(config)[1]
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self._configure(config)

    def _configure(self, config):
        self.activation = _activation(config)[0]

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        x = hidden_states.reshape(-1, hidden_states.shape[-1])
        x = ops.dense_act_layer_norm(x, self.dense, self.activation, self.transform_act_fn, self.LayerNorm)
        return x.view(hidden_states.shape)


class BertModel(BertPreTrainedModel):
    """Drop-in for ``transformers.BertModel`` (encoder configurations): same constructor, weights and outputs.

    ``unpad`` (default True): when ``attention_mask`` has padding, run every layer on the packed real tokens only.
    ``last_hidden_state`` then holds zeros at padding positions (HF returns values there that carry no meaning).
    """

    _no_split_modules = ["BertEmbeddings", "BertLayer"]

    def __init__(self, config: BertConfig, add_pooling_layer: bool = True, unpad: bool = True):
        super().__init__(config)
        check_supported(config)
        self.embeddings = BertEmbeddings(config)
        self.encoder = BertEncoder(config)
        self.pooler = BertPooler(config) if add_pooling_layer else None
        self._configure(config, unpad)
        self.post_init()

    def _configure(self, config, unpad: bool = True):
        check_supported(config)
        self.unpad = unpad

    def get_input_embeddings(self):
        return self.embeddings.word_embeddings

    def set_input_embeddings(self, value):
        self.embeddings.word_embeddings = value

    def forward(
        self,
        input_ids: torch.Tensor | None = None,  # [B, S] token ids
        attention_mask: torch.Tensor | None = None,  # [B, S], nonzero = real token
        token_type_ids: torch.Tensor | None = None,  # [B, S], default 0
        position_ids: torch.Tensor | None = None,  # [B, S] or [1, S], default 0..S-1
        head_mask: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,  # [B, S, hidden] instead of input_ids
        encoder_hidden_states: torch.Tensor | None = None,
        encoder_attention_mask: torch.Tensor | None = None,
        past_key_values=None,
        use_cache: bool | None = None,
        output_attentions: bool | None = None,
        output_hidden_states: bool | None = None,
        return_dict: bool | None = None,
        **kwargs,
    ):
        config = self.config
        _reject_unsupported(head_mask, encoder_hidden_states, encoder_attention_mask, past_key_values, use_cache,
                            output_attentions if output_attentions is not None else config.output_attentions, kwargs)
        if output_hidden_states is None:
            output_hidden_states = config.output_hidden_states
        if return_dict is None:
            return_dict = getattr(config, "return_dict", True)
        batch, seq_len = validation.check_shapes(
            config, input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds
        )
        word = self.embeddings.word_embeddings.weight
        if inputs_embeds is not None and inputs_embeds.dtype != word.dtype:
            raise TypeError(f"inputs_embeds is {inputs_embeds.dtype} but the model is {word.dtype}")

        device = word.device if input_ids is None else input_ids.device
        if token_type_ids is None:
            token_type_ids = torch.zeros(batch, seq_len, dtype=torch.long, device=device)
        if position_ids is None:
            position_ids = torch.arange(seq_len, device=device)[None]
        indices = validation.flat_indices(
            torch.zeros_like(token_type_ids) if input_ids is None else input_ids,
            token_type_ids,
            position_ids.expand(batch, seq_len),
            [config.vocab_size, config.type_vocab_size, config.max_position_embeddings],
        )  # [3, B * S]

        layout = self._layout(batch, seq_len, attention_mask)
        if layout.packed:
            indices = indices.index_select(1, layout.indices)  # [3, N]
        embeds = None if inputs_embeds is None else padding.pack(inputs_embeds, layout)
        x = self.embeddings(indices, embeds)  # [N, hidden]
        x, hidden_states = self.encoder(x, layout, output_hidden_states)
        sequence_output = padding.unpack(x, layout)  # [B, S, hidden]
        pooled_output = self.pooler(sequence_output) if self.pooler is not None else None

        hidden_states = tuple(hidden_states) if output_hidden_states else None
        if not return_dict:
            return tuple(v for v in (sequence_output, pooled_output, hidden_states) if v is not None)
        return BaseModelOutputWithPoolingAndCrossAttentions(
            last_hidden_state=sequence_output, pooler_output=pooled_output, hidden_states=hidden_states
        )

    def _layout(self, batch: int, seq_len: int, attention_mask: torch.Tensor | None) -> padding.TokenLayout:
        """Packed when unpadding is on and the mask has padding; dense otherwise.

        Under torch.compile the dense (masked) path runs: packing sizes tensors from the data, which a static graph
        cannot do.
        """
        if attention_mask is None or not self.unpad or torch.compiler.is_compiling() or batch * seq_len == 0:
            return padding.dense_layout(batch, seq_len, attention_mask)
        return padding.unpadded_layout(attention_mask)


def _reject_unsupported(head_mask, encoder_hidden_states, encoder_attention_mask, past_key_values, use_cache,
                        output_attentions, kwargs) -> None:
    """Arguments of transformers.BertModel that fastbert does not implement: an error naming them, never a no-op."""
    unsupported = {
        "head_mask": head_mask is not None,
        "encoder_hidden_states": encoder_hidden_states is not None,
        "encoder_attention_mask": encoder_attention_mask is not None,
        "past_key_values": past_key_values is not None,
        "use_cache": bool(use_cache),
        "output_attentions": bool(output_attentions),
    }
    named = [name for name, given in unsupported.items() if given]
    if named:
        raise NotImplementedError(
            f"fastbert.BertModel does not support {', '.join(named)} (encoder inference and training only; fused "
            "attention never materializes attention probabilities): use transformers.BertModel for these"
        )
    if kwargs:
        raise TypeError(f"unexpected arguments for BertModel.forward: {', '.join(sorted(kwargs))}")
