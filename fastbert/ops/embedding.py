"""The embeddings: ``LayerNorm(word[ids] + position[pos] + token_type[tt])`` -> [tokens, width].

Reference: ``kernels/embedding.py``'s ``embedding_layer_norm_ref`` (statistics in fp32). Two fused kernels compute
it, behind one registered op, ``fastbert::embedding_layer_norm`` (``implementation``: "triton" or "ext"):

  ext     fastbert._C's C++ kernel (float32 and bfloat16, OpenMP) on CPU tensors, its CUDA kernel on GPU ones, where
          the build has this GPU's arch (csrc/embedding_layer_norm*.{cpp,cu})
  triton  the Triton kernel (``kernels/embedding.py``), on a GPU or under the interpreter

Backends, fastest first: cuda-ext, cpu-ext, triton, torch (transformers' own modules, in its order: hooks, wrappers
and padding_idx's missing gradient as in transformers). A family without token types (DistilBERT, GTE with
``type_vocab_size`` 0) or without a position table (rotary models) has the kernels add a zero row instead.
"""

import dataclasses

import torch
from torch import nn

from .. import _extension, derived, dispatch
from ..dispatch import Backend
# (fastbert.kernels: the repository's top-level kernels/ folder, installed under that name by setup.py)
from ..kernels import embedding as triton_embedding
from ..kernels._common import launch_or_op
from ..plan import decided
from . import dropout_p, ln_bias, ln_class, ln_eps, why_not_plain

# dtype codes of csrc/embedding_layer_norm.h's DType.
_DTYPE_CODES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
_CPU_DTYPES = (torch.float32, torch.bfloat16)
_CUDA_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
IMPLEMENTATIONS = ("ext", "triton")


# --- fastbert._C's kernel ---------------------------------------------------------------------------------------------


def _check_ext(input_ids, position_ids, token_type_ids, word, position, token_type, weight, bias, eps):
    """The op's contract (``kernels.embedding.check_embedding_args``: metadata only, fake tensors too), plus what
    ``_C`` itself takes: int64 ids, cpu or cuda tensors, and on CPU float32 or bfloat16 only."""
    triton_embedding.check_embedding_args(input_ids, position_ids, token_type_ids, word, position, token_type, weight,
                                          bias, eps)
    for name, ids in (("input_ids", input_ids), ("position_ids", position_ids), ("token_type_ids", token_type_ids)):
        if ids.dtype != torch.int64:
            raise TypeError(f"{name} must be int64 for fastbert._C, got {ids.dtype}")
    if word.device.type not in ("cpu", "cuda"):
        raise ValueError(f"fastbert._C runs on cpu and cuda tensors, not {word.device.type}")
    if word.device.type == "cpu" and word.dtype not in _CPU_DTYPES:
        raise TypeError(f"the C++ CPU kernel takes float32 or bfloat16, not {word.dtype}")


def _ext_launch(input_ids, position_ids, token_type_ids, word, position, token_type, weight, bias, eps):
    # The kernel reads raw pointers, so every tensor is pinned first: a detached alias holds the storage and the
    # dtype it has now, even if another thread re-points the parameter meanwhile (``model.to(torch.bfloat16)``
    # swaps and frees parameters' storage). Everything below reads the aliases only: a conversion racing this call
    # gives a consistent old call or a dtype error, never a kernel writing past its output.
    tensors = [t.detach() for t in (input_ids, position_ids, token_type_ids, word, position, token_type, weight, bias)]
    input_ids, position_ids, token_type_ids, word, position, token_type, weight, bias = tensors
    _check_ext(input_ids, position_ids, token_type_ids, word, position, token_type, weight, bias, eps)
    native = _extension._C
    if native is None:
        raise RuntimeError(_extension._IMPORT_ERROR)
    tensors = [t.contiguous() for t in tensors]  # (dense row-major arrays; free when they already are)
    out = torch.empty((input_ids.shape[0], word.shape[1]), dtype=word.dtype, device=word.device)
    if out.numel() == 0:
        return out
    args = (out.data_ptr(), *(t.data_ptr() for t in tensors), out.shape[0], out.shape[1], word.shape[0],
            position.shape[0], token_type.shape[0], float(eps), _DTYPE_CODES[word.dtype])
    if word.device.type == "cuda":
        with torch.cuda.device(word.device):
            native.embedding_layer_norm_cuda(*args, torch.cuda.current_stream().cuda_stream)
    else:
        native.embedding_layer_norm_cpu(*args, torch.get_num_threads())
    return out


# --- the op -----------------------------------------------------------------------------------------------------------


def _launch(input_ids, position_ids, token_type_ids, word, position, token_type, weight, bias, eps,
            implementation):
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"implementation must be one of {IMPLEMENTATIONS}, got {implementation!r}")
    launch = _ext_launch if implementation == "ext" else triton_embedding.embedding_layer_norm
    return launch(input_ids, position_ids, token_type_ids, word, position, token_type, weight, bias, eps)


@torch.library.custom_op("fastbert::embedding_layer_norm", mutates_args=())
def _embedding_layer_norm_op(input_ids: torch.Tensor, position_ids: torch.Tensor, token_type_ids: torch.Tensor,
                             word: torch.Tensor, position: torch.Tensor, token_type: torch.Tensor,
                             weight: torch.Tensor, bias: torch.Tensor, eps: float,
                             implementation: str) -> torch.Tensor:
    return _launch(input_ids, position_ids, token_type_ids, word, position, token_type, weight, bias, eps,
                   implementation)


@_embedding_layer_norm_op.register_fake
def _(input_ids, position_ids, token_type_ids, word, position, token_type, weight, bias, eps, implementation):
    check = _check_ext if implementation == "ext" else triton_embedding.check_embedding
    check(input_ids, position_ids, token_type_ids, word, position, token_type, weight, bias, eps)
    return word.new_empty((input_ids.shape[0], word.shape[1]))


def embedding_layer_norm(input_ids, position_ids, token_type_ids, word, position, token_type, weight, bias, eps,
                         implementation: str = "ext"):
    """``LayerNorm(word[input_ids] + position[position_ids] + token_type[token_type_ids]) * weight + bias`` by
    ``implementation`` ("ext": fastbert._C, "triton"): ids [tokens] int64 (dense [B*S] or packed; clamped into their
    tables), tables [rows, hidden], weight and bias [hidden], one float dtype (float32/bfloat16 on CPU for "ext") and
    one device -> [tokens, hidden]; statistics in fp32. Raises TypeError/ValueError before any launch when the
    arguments do not fit."""
    return launch_or_op(_launch, _embedding_layer_norm_op, input_ids, position_ids, token_type_ids, word, position,
                        token_type, weight, bias, eps, implementation)


# --- backends ---------------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Call:
    embeddings: nn.Module  # a layers.FusedEmbeddings: its ``table(role)`` gives each module
    inputs_embeds: bool
    reasons: tuple[str, ...]  # why only transformers' modules may run it (gradients, dropout, a wrapped table)
    device: torch.device
    dtype: torch.dtype


def _cuda_unavailable(device: torch.device, dtype: torch.dtype) -> list[str]:
    reasons = list(_extension.cuda_unavailable_reasons(device))
    return reasons + ([f"dtype {dtype} not supported"] if dtype not in _CUDA_DTYPES else [])


def _cpu_unavailable(device: torch.device, dtype: torch.dtype) -> list[str]:
    reasons = list(_extension.cpu_unavailable_reasons())
    return reasons + ([f"the C++ CPU kernel takes float32/bfloat16, not {dtype}"] if dtype not in _CPU_DTYPES else [])


def _fused_why_not(call: Call) -> list[str]:
    return list(call.reasons)


def _fused_run(implementation: str):
    def run(call: Call, indices: torch.Tensor, inputs_embeds: torch.Tensor | None) -> torch.Tensor:
        embeddings = call.embeddings
        word_table, ln = embeddings.table("word"), embeddings.table("norm")
        position_table, type_table = embeddings.table("position"), embeddings.table("token_type")
        input_ids, token_type_ids, position_ids = indices.unbind(0)
        word = word_table.weight
        # The kernels always add a token-type row and a position row: a family without one adds a zero row (one
        # [1, width] table, cached with the word table it follows in dtype and device), read at index 0 (token types
        # are all 0 already: ``inputs.prepare`` passes zeros where there is no table).
        zero = None
        if type_table is None or position_table is None:
            zero = derived.cached(embeddings, "zero_row", (word,), lambda w: w.new_zeros(1, w.shape[1]))
        types = zero if type_table is None else type_table.weight
        positions = zero if position_table is None else position_table.weight
        if position_table is None:
            position_ids = torch.zeros_like(position_ids)
        return embedding_layer_norm(input_ids, position_ids, token_type_ids, word, positions, types, ln.weight,
                                    ln_bias(ln), ln_eps(ln), implementation)

    return run


def _torch_run(call: Call, indices: torch.Tensor, inputs_embeds: torch.Tensor | None) -> torch.Tensor:
    embeddings = call.embeddings
    word_table, position_table = embeddings.table("word"), embeddings.table("position")
    type_table, ln, dropout = embeddings.table("token_type"), embeddings.table("norm"), embeddings.table("dropout")
    input_ids, token_type_ids, position_ids = indices.unbind(0)
    # Clamped like the kernels clamp, so that with range checks off a bad id never reads out of bounds.
    x = word_table(input_ids.clamp(0, word_table.num_embeddings - 1)) if inputs_embeds is None else inputs_embeds
    if type_table is not None:
        x = x + type_table(token_type_ids.clamp(0, type_table.num_embeddings - 1))
    if position_table is not None:
        x = x + position_table(position_ids.clamp(0, position_table.num_embeddings - 1))
    return dropout(ln(x))


BACKENDS = dispatch.register("embedding", [
    Backend("cuda-ext", run=_fused_run("ext"), unavailable=_cuda_unavailable, why_not=_fused_why_not,
            devices=("cuda",)),
    Backend("cpu-ext", run=_fused_run("ext"), unavailable=_cpu_unavailable, why_not=_fused_why_not,
            devices=("cpu",)),
    Backend("triton", run=_fused_run("triton"), unavailable=dispatch.triton_unavailable, why_not=_fused_why_not),
    Backend("torch", run=_torch_run),
])


def _decide(embeddings: nn.Module, inputs_embeds: torch.Tensor | None):
    tables = {role: embeddings.table(role) for role in ("word", "position", "token_type", "norm", "dropout")}
    word, ln = tables["word"].weight, tables["norm"]
    weights = [word, ln.weight, ln.bias]
    weights += [tables[role].weight for role in ("position", "token_type") if tables[role] is not None]
    reasons = dispatch.needs_reference(*weights, inputs_embeds,
                                       dropout_p=dropout_p(tables["dropout"]) if embeddings.training else 0.0)
    if inputs_embeds is not None:
        reasons = reasons or ["inputs_embeds replaces the fused word-embedding lookup"]
    plain = dict(word_embeddings=(tables["word"], nn.Embedding), LayerNorm=(ln, ln_class(ln)))
    for name, role in (("position_embeddings", "position"), ("token_type_embeddings", "token_type")):
        if tables[role] is not None:
            plain[name] = (tables[role], nn.Embedding)
    reasons = reasons or why_not_plain(word.device, **plain)
    return dispatch.decide("embedding", BACKENDS, Call(embeddings, inputs_embeds is not None, tuple(reasons),
                                                        word.device, word.dtype))


def embedding(indices: torch.Tensor, embeddings: nn.Module, inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
    """LayerNorm(word[ids] + position[pos] + token_type[tt]) -> [tokens, width] (width: the tables' width).

    indices: [3, tokens] int64 (word, token type, position), range-checked by ``inputs.prepare``. embeddings:
    transformers' embeddings module as a ``layers.FusedEmbeddings`` (``table(role)``: the word table, the LayerNorm,
    the dropout, the position table unless positions are rotary, then indices[2] is ignored here, and the token-type
    table unless the family has none, then indices[1] is ignored). inputs_embeds: [tokens, width] replaces the word
    lookup when given (then indices[0] is ignored).
    """
    key = "embedding" if inputs_embeds is None else "embedding(inputs_embeds)"
    return decided(embeddings, key, _decide, embeddings, inputs_embeds)(indices, inputs_embeds)
