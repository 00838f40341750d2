"""The ops of an encoder layer, each run by the backend ``dispatch`` picks.

Every function takes the HF modules that own the weights (``nn.Linear``, ``nn.LayerNorm``, ``nn.Dropout``, the
activation), so the model reads like the encoder diagram and the weights stay where HF keeps them. Activations are
token-major: [tokens, features], where tokens is batch * seq_len (dense) or the number of real tokens (packed, see
``padding.py``).

Each op is two steps. ``_how_<op>`` decides how to run it and returns a runner: which backend; whether its modules
are plain, so a kernel may read their weights (``plain.is_plain``: a wrapped module, LoRA, hooks, offload,
quantization, is called and the kernel fuses what remains around it); whether autograd needs the reference ops. The
runner does the work, reading the weights from their modules as it runs (a decision holds no parameter). Within a
model forward the decision is kept in the forward's plan and reused while nothing it depends on changes
(``plan.py``); outside one it is taken on every call. Derived weights are looked up by the runner, so they are
checked on every call (``derived.py``). The torch backend calls the modules, exactly as HF does.
"""

import torch
import torch.nn.functional as F
from torch import nn

from . import _extension, announce, derived, dispatch, int8
from .attention import attention  # noqa: F401  (the attention op, in a module of its own)
from .kernels import activation as activation_kernels
from . import cpu_gemm
from .kernels import embedding as embedding_kernels
from .kernels import layer_norm as layer_norm_kernels
from .plain import has_hooks, is_plain
from .plan import decided


def _resolve(op: str, tensor: torch.Tensor, why: str | None) -> tuple[str, str | None]:
    """(backend of ``op`` for tensors like ``tensor``, the fallback to announce on every call, or None)."""
    return dispatch.resolve(op, tensor, why)


def counted(run, warning: str | None):
    """``run``, announcing ``warning`` on every call when there is one (``announce`` warns once and counts)."""
    if warning is None:
        return run

    def announced(*args):
        announce.fallback(warning)
        return run(*args)

    return announced


# The activation modules transformers builds for each ``hidden_act`` we fuse, by type: the kernel name follows the
# module the model actually holds, not the config it was built from.
def _fused_activations() -> dict[type, str]:
    from transformers.activations import ACT2FN

    return {type(ACT2FN[name]): name for name in activation_kernels.ACTIVATIONS}


_ACTIVATION_NAMES = _fused_activations()


def fused_activation(act_fn: nn.Module) -> str | None:
    """The kernels' name for the activation module ``act_fn``, or None when it has no kernel (or hooks)."""
    name = _ACTIVATION_NAMES.get(type(act_fn))
    return None if name is None or has_hooks(act_fn) else name


def _why_no_kernel(act_fn: nn.Module, activation: str | None) -> str | None:
    if activation is not None:
        return None
    return f"activation {type(act_fn).__name__} has no fused kernel (HF's activation module runs)"


def why_not_plain(device: torch.device, **modules: tuple[nn.Module, type]) -> str | None:
    """Why the fused kernel cannot read these modules' weights (the first one that is not plain), or None."""
    for name, (module, cls) in modules.items():
        if not is_plain(module, cls, device):
            return (f"{name} is a {type(module).__name__} with hooks, a wrapper or parameters elsewhere than the "
                    "input, so it is called as a module (as HF does)")
    return None


def layer_norm_call(layer_norm: nn.Module, device: torch.device):
    """``layer_norm`` as a function of [tokens, hidden]: ``F.layer_norm`` on a plain LayerNorm's weights (no module
    call), the module otherwise."""
    if not is_plain(layer_norm, nn.LayerNorm, device):
        return layer_norm
    return lambda x: F.layer_norm(x, layer_norm.normalized_shape, layer_norm.weight, layer_norm.bias, layer_norm.eps)


# --- GEMMs ---------------------------------------------------------------------------------------------------------


def linear(x: torch.Tensor, dense: nn.Module) -> torch.Tensor:
    """``dense(x)``: a plain nn.Linear's GEMM (oneDNN or F.linear, no module-call overhead), otherwise the module."""
    return decided(dense, "linear", _how_linear, x, dense)(x)


def _how_linear(x: torch.Tensor, dense: nn.Module):
    if not is_plain(dense, nn.Linear, x.device):
        return dense
    gemm = onednn_gemm(x, dense, dispatch.why_reference(x, dense.weight, dense.bias))
    if gemm is not None:
        return gemm
    return lambda x: F.linear(x, dense.weight, dense.bias)


def onednn_gemm(x: torch.Tensor, dense: nn.Module, why: str | None, activation: str | None = None):
    """A runner of act(dense(x)), or dense(x) + residual (``run(x, residual)``), through oneDNN with the weight
    prepacked (``kernels/cpu_gemm.py``); None where that does not apply: not CPU, a wrapped dense, ``why``
    (gradients, dropout), autocast (which would not reach oneDNN's op), torch.func transforms, a weight that is not
    the module's parameter (nothing to cache it with), or dispatch keeping F.linear on this CPU."""
    if x.device.type != "cpu":
        return None
    if why is not None or not is_plain(dense, nn.Linear, x.device):
        # Training: the weights are about to change. A wrapper (LoRA) may later write into the Linear it wraps
        # through ``.data`` (``merge_and_unload``). Either way the packed copy goes now, not at the next rebuild.
        if why is not None:
            int8.training_fallback(dense)
        derived.clear(dense)
        return None
    quantized = int8.gemm(x, dense, activation)  # (a Linear fastbert.quantize chose, where int8 runs)
    if quantized is not None:
        return quantized
    if not onednn_applies(x, (dense.weight,)):
        return None

    def run(x, residual=None):
        packed = derived.cached(dense, "onednn_weight", (dense.weight,), cpu_gemm.pack)
        return cpu_gemm.linear(x, packed, dense.bias, activation, residual)

    return run


def onednn_applies(x: torch.Tensor, weights: tuple, why: str | None = None) -> bool:
    """Whether a CPU GEMM of ``x`` with ``weights`` runs through oneDNN (see ``onednn_gemm``)."""
    return dispatch.why_not_prepacked(x, weights) is None and dispatch.choose("gemm", x, why) == "onednn"


def gemm_epilogue(activation: str | None, device: torch.device) -> bool | None:
    """``use_gelu`` for ``torch._addmm_activation`` where its epilogue computes exactly the model's activation, else
    None. ReLU everywhere; its GELU is the tanh approximation on CUDA (cuBLASLt's epilogue, or gelu(approximate="tanh")
    where cuBLASLt does not apply) but exact erf on CPU: tanh models (gelu_new, gelu_pytorch_tanh) fuse on CUDA only,
    and erf models (BERT's "gelu") keep the Triton bias+GELU kernel."""
    kind = activation_kernels.ACTIVATIONS.get(activation)
    if kind == "relu":
        return False
    if kind == "gelu_tanh" and device.type == "cuda":
        return True
    return None


# --- embeddings ----------------------------------------------------------------------------------------------------


def embedding(indices: torch.Tensor, embeddings: nn.Module, inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
    """LayerNorm(word[ids] + position[pos] + token_type[tt]) -> [tokens, width] (width: the tables' width).

    indices: [3, tokens] int64 (word, token type, position), range-checked by ``validation.flat_indices``.
    embeddings: HF's embeddings module, a ``layers.FusedEmbeddings`` (its ``table(role)``: the word table, the
    LayerNorm, the dropout, the position table unless positions are rotary, then indices[2] is ignored here, and the
    token-type table unless the family has none, as DistilBERT; then indices[1] is ignored).
    inputs_embeds: [tokens, width] replaces the word lookup when given (then indices[0] is ignored).
    """
    op = "embedding" if inputs_embeds is None else "embedding(inputs_embeds)"
    return decided(embeddings, op, _how_embedding, embeddings, inputs_embeds)(indices, inputs_embeds)


def _how_embedding(embeddings: nn.Module, inputs_embeds: torch.Tensor | None):
    word_embeddings, position_embeddings = embeddings.table("word"), embeddings.table("position")
    token_type_embeddings = embeddings.table("token_type")
    ln, dropout = embeddings.table("norm"), embeddings.table("dropout")
    word = word_embeddings.weight
    position = None if position_embeddings is None else position_embeddings.weight
    token_type = None if token_type_embeddings is None else token_type_embeddings.weight
    p = dropout.p if embeddings.training else 0.0
    why = dispatch.why_reference(word, position, token_type, ln.weight, ln.bias, inputs_embeds, dropout_p=p)
    if inputs_embeds is not None:
        why = why or "inputs_embeds replaces the fused word-embedding lookup"
    tables = dict(word_embeddings=(word_embeddings, nn.Embedding), LayerNorm=(ln, nn.LayerNorm))
    for name, table in (("position_embeddings", position_embeddings), ("token_type_embeddings", token_type_embeddings)):
        if table is not None:
            tables[name] = (table, nn.Embedding)
    why = why or why_not_plain(word.device, **tables)
    backend, warning = _resolve("embedding", word, why)

    if backend == "torch":
        def run(indices, inputs_embeds):
            input_ids, token_type_ids, position_ids = indices.unbind(0)
            # Clamp like the kernels do, so that with range checks off a bad id never reads out of bounds. The
            # modules themselves, in HF's order: hooks, wrappers and padding_idx's missing gradient as in HF.
            x = (word_embeddings(input_ids.clamp(0, word_embeddings.num_embeddings - 1)) if inputs_embeds is None
                 else inputs_embeds)
            if token_type_embeddings is not None:
                x = x + token_type_embeddings(token_type_ids.clamp(0, token_type_embeddings.num_embeddings - 1))
            if position_embeddings is not None:
                x = x + position_embeddings(position_ids.clamp(0, position_embeddings.num_embeddings - 1))
            return dropout(ln(x))

        return counted(run, warning)

    def run(indices, inputs_embeds):
        input_ids, token_type_ids, position_ids = indices.unbind(0)
        word = word_embeddings.weight
        # The kernels always add a token-type row and a position row: a family without token types (DistilBERT, GTE
        # with type_vocab_size 0) or without a position table (rotary models) adds a zero row (one [1, width] table,
        # cached with the word table it follows in dtype and device), read at index 0.
        zero = None
        if token_type_embeddings is None or position_embeddings is None:
            zero = derived.cached(embeddings, "zero_row", (word,), _zero_row)
        # (token types are all 0 already: ``FusedModel._token_ids`` passes zeros where there is no table)
        types = zero if token_type_embeddings is None else token_type_embeddings.weight
        if position_embeddings is None:
            positions, position_ids = zero, torch.zeros_like(position_ids)
        else:
            positions = position_embeddings.weight
        fused = _extension.embedding_layer_norm if backend.endswith("-ext") else embedding_kernels.embedding_layer_norm
        return fused(input_ids, position_ids, token_type_ids, word, positions, types, ln.weight, ln_bias(ln), ln.eps)

    return counted(run, warning)


def _zero_row(word: torch.Tensor) -> torch.Tensor:
    return word.new_zeros(1, word.shape[1])


def ln_bias(layer_norm: nn.LayerNorm) -> torch.Tensor:
    """A plain LayerNorm's bias, or zeros for one without (``bias=False``, ModernBERT's): the kernels always add
    one (a cached [hidden] zero vector costs one load per row; a kernel variant would cost a compile)."""
    if layer_norm.bias is not None:
        return layer_norm.bias
    return derived.cached(layer_norm, "zero_bias", (layer_norm.weight,), torch.zeros_like)


# --- attention -----------------------------------------------------------------------------------------------------


def qkv_projection(query: nn.Module, key: nn.Module, value: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """[tokens, hidden] -> [tokens, 3 * hidden]: q, k, v side by side.

    Plain projections run as one GEMM on their weights stacked [3 * hidden, hidden]. Without gradients the stacked
    weight is a cache derived from the six parameters (``derived.cached``: rebuilt when any changes, never written
    into them); with gradients it is concatenated per call so gradients reach HF's parameters. Wrapped projections
    (LoRA, hooks) are called as modules.
    """
    return decided(query, "qkv_projection", _how_qkv_projection, query, key, value, x)(x)


def _how_qkv_projection(query: nn.Module, key: nn.Module, value: nn.Module, x: torch.Tensor):
    plain = all(is_plain(m, nn.Linear, x.device) for m in (query, key, value))
    params = stacked_parameters(query, key, value) if plain else None
    if params is None:
        # A wrapper (LoRA) may later write into the Linear it wraps through ``.data`` (``merge_and_unload``): what
        # was cached on ``query`` before it was wrapped goes.
        derived.clear(query)
        return lambda x: torch.cat([query(x), key(x), value(x)], dim=-1)

    if torch.is_grad_enabled() and any(p.requires_grad for p in params):
        int8.training_fallback(query)

        def run(x):
            # Training: the weights are about to change, possibly through buffers that alias them (ZeRO, FSDP)
            # where no version counter sees it, so the inference cache goes.
            derived.discard(query, "qkv")
            derived.discard(query, "qkv_onednn")
            return F.linear(x, *stack_linears(3, *stacked_parameters(query, key, value)))

        return run
    quantized = x.device.type == "cpu" and int8.stacked_gemm(
        x, query, (query, key, value), lambda: stacked_parameters(query, key, value), _stack_qkv)
    if quantized:
        return quantized
    if x.device.type == "cpu" and onednn_applies(x, params, dispatch.why_reference(x)):  # (gradients may reach x)
        def run(x):
            params = stacked_parameters(query, key, value)
            weight, bias = derived.cached(query, "qkv_onednn", params, _stack_and_pack_qkv)
            return cpu_gemm.linear(x, weight, bias)

        return run

    def run(x):
        return F.linear(x, *derived.cached(query, "qkv", stacked_parameters(query, key, value), _stack_qkv))

    return run


def stacked_parameters(*linears: nn.Linear) -> tuple[torch.Tensor, ...] | None:
    """The weights, then the biases, of plain ``linears`` whose outputs one GEMM computes side by side; no biases where
    none has one; None where some have a bias and others not (then they run as modules)."""
    biases = [m.bias for m in linears]
    weights = tuple(m.weight for m in linears)
    if all(b is None for b in biases):
        return weights
    return None if any(b is None for b in biases) else weights + tuple(biases)


def stack_linears(count: int, *params: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``stacked_parameters`` of ``count`` linears -> (weight [sum of outputs, in], bias [sum of outputs] or None)."""
    return torch.cat(params[:count]), torch.cat(params[count:]) if len(params) > count else None


def _stack_qkv(*params) -> tuple[torch.Tensor, torch.Tensor | None]:
    return stack_linears(3, *params)


def _stack_and_pack_qkv(*params) -> tuple[torch.Tensor, torch.Tensor | None]:
    weight, bias = stack_linears(3, *params)
    return cpu_gemm.pack(weight), bias


# --- dense + residual + LayerNorm, dense + activation -------------------------------------------------------------


def dense_residual_layer_norm(
    x: torch.Tensor, residual: torch.Tensor, dense: nn.Module, dropout: nn.Module | None, layer_norm: nn.Module
) -> torch.Tensor:
    """LayerNorm(dropout(dense(x)) + residual): BertSelfOutput and BertOutput (``dropout`` None: none, as after
    DistilBERT's attention projection)."""
    run = decided(layer_norm, "dense_residual_layer_norm", _how_dense_residual_layer_norm,
                  x, residual, dense, dropout, layer_norm)
    return run(x, residual)


def _how_dense_residual_layer_norm(x, residual, dense, dropout, layer_norm):
    p = dropout.p if dropout is not None and dropout.training else 0.0
    why_gemm = dispatch.why_reference(x, getattr(dense, "weight", None), getattr(dense, "bias", None), residual,
                                      dropout_p=p)
    why = why_gemm or dispatch.why_reference(getattr(layer_norm, "weight", None), getattr(layer_norm, "bias", None))
    why = why or why_not_plain(x.device, LayerNorm=(layer_norm, nn.LayerNorm))
    backend, warning = _resolve("layer_norm", x, why)
    if backend == "triton":
        ln = layer_norm
        # The GEMM with its 1-D bias (cuBLASLt's bias epilogue, one kernel); the kernel adds the residual and
        # normalizes. (addmm(residual, x, W^T) would first copy the residual into the output: one more kernel.)
        gemm = _how_linear(x, dense)
        return counted(lambda x, residual: layer_norm_kernels.layer_norm(gemm(x), ln.weight, ln_bias(ln), ln.eps,
                                                                          residual=residual), warning)
    norm = layer_norm_call(layer_norm, x.device)
    fused = onednn_gemm(x, dense, why_gemm)  # (only without dropout: it comes before the add)
    if fused is not None:
        return counted(lambda x, residual: norm(fused(x, residual)), warning)
    gemm = _how_linear(x, dense)
    if dropout is None or (p == 0 and not has_hooks(dropout)):
        return counted(lambda x, residual: norm(gemm(x) + residual), warning)
    return counted(lambda x, residual: layer_norm(dropout(gemm(x)) + residual), warning)


def dense_act(x: torch.Tensor, dense: nn.Module, act_fn: nn.Module) -> torch.Tensor:
    """act(dense(x)): BertIntermediate. ``act_fn`` is HF's activation module."""
    return decided(dense, "dense_act", _how_dense_act, x, dense, act_fn)(x)


def _how_dense_act(x, dense, act_fn):
    activation = fused_activation(act_fn)
    why_gemm = dispatch.why_reference(x, getattr(dense, "weight", None), getattr(dense, "bias", None))
    why = why_gemm or _why_no_kernel(act_fn, activation)
    backend, warning = _resolve("bias_act", x, why)
    if backend == "triton":
        if not is_plain(dense, nn.Linear, x.device):
            return counted(lambda x: activation_kernels.bias_act(dense(x), None, activation), warning)
        use_gelu = gemm_epilogue(activation, x.device)
        if use_gelu is not None and dense.bias is not None:
            # bias + activation in the GEMM's epilogue (cuBLASLt): the [tokens, intermediate] output is written once
            return counted(lambda x: torch._addmm_activation(dense.bias, x, dense.weight.t(), use_gelu=use_gelu),
                            warning)
        return counted(lambda x: activation_kernels.bias_act(F.linear(x, dense.weight), dense.bias, activation),
                        warning)
    fused = onednn_gemm(x, dense, why_gemm, activation)
    if fused is not None:
        return counted(fused if activation is not None else (lambda x: act_fn(fused(x))), warning)
    gemm = _how_linear(x, dense)
    return counted(lambda x: act_fn(gemm(x)), warning)


def dense_act_layer_norm(x: torch.Tensor, dense: nn.Module, act_fn: nn.Module, layer_norm: nn.Module) -> torch.Tensor:
    """LayerNorm(act(dense(x))): the MLM head transform (BertPredictionHeadTransform)."""
    return decided(layer_norm, "dense_act_layer_norm", _how_dense_act_layer_norm, x, dense, act_fn, layer_norm)(x)


def _how_dense_act_layer_norm(x, dense, act_fn, layer_norm):
    activation = fused_activation(act_fn)
    why_gemm = dispatch.why_reference(x, getattr(dense, "weight", None), getattr(dense, "bias", None))
    why = why_gemm or dispatch.why_reference(getattr(layer_norm, "weight", None), getattr(layer_norm, "bias", None))
    why = why or _why_no_kernel(act_fn, activation)
    why = why or why_not_plain(x.device, LayerNorm=(layer_norm, nn.LayerNorm))
    backend, warning = _resolve("act_layer_norm", x, why)
    if backend == "triton":
        ln = layer_norm
        if is_plain(dense, nn.Linear, x.device):
            return counted(lambda x: layer_norm_kernels.layer_norm(F.linear(x, dense.weight), ln.weight, ln_bias(ln),
                                                                   ln.eps, bias=dense.bias, activation=activation),
                           warning)
        return counted(lambda x: layer_norm_kernels.layer_norm(dense(x), ln.weight, ln_bias(ln), ln.eps,
                                                               activation=activation), warning)
    norm = layer_norm_call(layer_norm, x.device)
    fused = onednn_gemm(x, dense, why_gemm, activation)
    if fused is not None:
        return counted(lambda x: norm(fused(x) if activation is not None else act_fn(fused(x))), warning)
    gemm = _how_linear(x, dense)
    return counted(lambda x: norm(act_fn(gemm(x))), warning)
