"""CUDA graphs of the encoder: a forward replays one captured graph instead of launching ~100 kernels from Python.

    fastbert.cuda_graphs(model)         # model: a fastbert model, or any model holding one (a head, a
                                        # SentenceTransformer, a PEFT model) after fastbert.optimize
    model(**tokenizer(texts, padding=True, return_tensors="pt"))   # the inputs may stay on the CPU

A graph replays fixed shapes and fixed memory, so each call is padded up to a *bucket*: the smallest of
``batch_sizes`` >= its batch by the smallest of ``seq_lens`` >= its length (capped at the position table). The bucket's
graph is captured on its first use (a few eager forwards: seconds for the first one, while Triton compiles), then
replayed; the padding is masked out, and the outputs are sliced back to the call's shape and copied out of the
graph's memory, so they stay valid after the next call.

What runs without a graph (each reason warned once and listed by ``fastbert.info()``): a model that is not on a GPU,
training mode, gradients, ``inputs_embeds``/``position_ids``/``output_hidden_states``, and shapes beyond the largest
bucket. The inputs are checked as in eager mode before a replay (free for CPU inputs, one sync for GPU inputs unless
``fastbert.set_input_checks(False)``).

What invalidates the graphs: a parameter that moves or changes dtype (``.to()``, ``load_state_dict(assign=True)``),
or is written in place (an optimizer step: cached derived weights such as the fused QKV would be stale). The
parameters' storage and version are compared before every replay (~20-40 us for bert-base), and the graphs are
recaptured when they differ. Settings read while capturing (``FASTBERT_BACKEND``, activations, hooks) are frozen into
the graph: call ``fastbert.cuda_graphs(model)`` again to drop every graph after changing them.

Memory: the graphs of one model share one memory pool, about the eager forward's activation memory at the largest
bucket captured, plus each bucket's input and output buffers.
"""

import threading

import torch

from . import announce, padding

DEFAULT_BATCH_SIZES = (1, 2, 4, 8, 16, 32, 64)
DEFAULT_SEQ_LENS = (16, 32, 64, 128, 256, 512)
# The inputs a graph takes; any other input given (not None) runs the call eagerly.
_GRAPHED = ("input_ids", "attention_mask", "token_type_ids")
_EAGER_INPUTS = ("position_ids", "inputs_embeds")


def cuda_graphs(model: torch.nn.Module, batch_sizes=DEFAULT_BATCH_SIZES, seq_lens=DEFAULT_SEQ_LENS,
                enabled: bool = True) -> torch.nn.Module:
    """Replay the forward of every fastbert encoder in ``model`` from CUDA graphs, one per (batch, seq_len) bucket;
    returns ``model`` (changed in place). Calling it again drops the graphs captured so far; ``enabled=False`` turns
    graphs off. Raises TypeError when ``model`` holds no fastbert encoder (``fastbert.optimize`` it first)."""
    from .modeling import FusedModel

    encoders = [m for m in model.modules() if isinstance(m, FusedModel)]
    if not encoders:
        raise TypeError(f"model: {type(model).__name__} holds no fastbert encoder; call fastbert.optimize(model) "
                        "first (or build it with fastbert's classes)")
    batch_sizes, seq_lens = _buckets("batch_sizes", batch_sizes), _buckets("seq_lens", seq_lens)
    for encoder in encoders:
        encoder._graphs = GraphSet(batch_sizes, seq_lens) if enabled else None
    return model


def _buckets(name: str, sizes) -> tuple[int, ...]:
    sizes = tuple(sorted({int(s) for s in sizes}))
    if not sizes or sizes[0] < 1:
        raise ValueError(f"{name} must be positive integers, got {sizes}")
    return sizes


class GraphSet:
    """The captured graphs of one encoder, by bucket, with the parameters' state they were captured for."""

    def __init__(self, batch_sizes: tuple[int, ...], seq_lens: tuple[int, ...]):
        self.batch_sizes, self.seq_lens = batch_sizes, seq_lens
        self.graphs: dict[tuple[int, int], _Graph] = {}
        self.params: list[torch.Tensor] = []
        self.state: list[tuple[int, int]] = []
        self.pool = None
        self.lock = threading.Lock()  # one replay at a time: the graphs share their input and output buffers

    # Copies and pickles of a model start without graphs (they hold device memory and the original's pointers).
    def __deepcopy__(self, memo):
        return GraphSet(self.batch_sizes, self.seq_lens)

    def __getstate__(self):
        return {"batch_sizes": self.batch_sizes, "seq_lens": self.seq_lens}

    def __setstate__(self, state):
        self.__init__(state["batch_sizes"], state["seq_lens"])

    def run(self, model, kwargs: dict):
        """The model's output for this call from a graph (the inputs checked first), or None where the call runs
        eagerly (the reason warned once)."""
        why = self._why_eager(model, kwargs)
        if why is not None:
            if why:
                announce.fallback(f"cuda_graphs: {why}: the call runs without a CUDA graph")
            return None
        inputs = {name: kwargs.get(name) for name in (*_GRAPHED, *_EAGER_INPUTS)}
        with torch.no_grad():
            indices, layout = model._prepare(inputs, unpad=False)  # the eager checks; [3, B*S], dense layout
        bucket = self._bucket(model, layout.batch, layout.seq_len)
        if bucket is None:
            announce.fallback(f"cuda_graphs: a batch beyond the largest bucket ({self.batch_sizes[-1]} x "
                              f"{self.seq_lens[-1]}): the call runs without a CUDA graph")
            return None
        # Buffers and graphs outside inference mode (a later call may come without it), never recording gradients.
        with self.lock, torch.inference_mode(False), torch.no_grad():
            self._check_params(model)
            graph = self.graphs.get(bucket)
            if graph is None:
                graph = self.graphs[bucket] = _Graph(model, *bucket, self._pool())
            return graph.replay(model, indices, layout)

    def _why_eager(self, model, kwargs: dict) -> str | None:
        """Why this call cannot replay a graph ("" when it is expected and not worth a warning), or None."""
        if torch.compiler.is_compiling() or torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            return ""
        word = model.embeddings.word_embeddings.weight
        if word.device.type != "cuda":
            return f"the model is on {word.device.type}, not a GPU"
        if model.training:
            return "the model is in training mode"
        if torch.is_grad_enabled() and any(p.requires_grad for p in model.parameters()):
            return "gradients are required (call under torch.inference_mode() or torch.no_grad())"
        given = [name for name in _EAGER_INPUTS if kwargs.get(name) is not None]
        if kwargs.get("output_hidden_states") or getattr(model.config, "output_hidden_states", False):
            given.append("output_hidden_states")
        if given:
            return f"{', '.join(given)} given"
        if kwargs.get("input_ids") is None:
            return "no input_ids"
        return None

    def _bucket(self, model, batch: int, seq_len: int) -> tuple[int, int] | None:
        limit = model.max_seq_len(None)  # (the position table: a padded bucket may not run past it)
        seq_lens = [min(s, limit) for s in self.seq_lens] if limit else self.seq_lens
        b = next((b for b in self.batch_sizes if b >= batch), None)
        s = next((s for s in seq_lens if s >= seq_len), None)
        return None if b is None or s is None or batch * seq_len == 0 else (b, s)

    def _check_params(self, model) -> None:
        """Drop the graphs when a parameter moved, changed dtype or was written since they were captured."""
        if not self.params:
            self.params = list(model.parameters()) + list(model.buffers())
        state = [(p.data_ptr(), p._version) for p in self.params]
        if state != self.state:
            self.graphs.clear()
            self.pool = None
            self.state = state

    def _pool(self):
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        return self.pool


class _Graph:
    """One bucket: the encoder captured on static inputs [3, b, s] indices and a [b, s] mask."""

    def __init__(self, model, batch: int, seq_len: int, pool):
        device = model.embeddings.word_embeddings.weight.device
        self.indices = torch.zeros(3, batch, seq_len, dtype=torch.long, device=device)
        self.mask = torch.zeros(batch, seq_len, dtype=torch.bool, device=device)
        layout = padding.dense_layout(batch, seq_len, self.mask)
        # Warm up on a side stream (Triton compiles, cuBLAS picks its kernels, derived weights are cached), then
        # capture: nothing lazy may happen inside the capture.
        with torch.cuda.device(device):
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(2):
                    model._encode(self.indices.view(3, -1), layout)
            torch.cuda.current_stream().wait_stream(side)
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph, pool=pool):
                self.output = model._encode(self.indices.view(3, -1), layout)

    def replay(self, model, indices: torch.Tensor, layout: padding.TokenLayout):
        """indices [3, B*S] and the dense layout of the call (``FusedModel._prepare``) -> the output, sliced to
        [B, S] and copied out of the graph's memory."""
        batch, seq_len = layout.batch, layout.seq_len
        self.indices.zero_()  # the bucket's padding: valid ids, masked out
        self.indices[:, :batch, :seq_len].copy_(indices.view(3, batch, seq_len))
        self.mask.zero_()
        if layout.key_padding_mask is None:
            self.mask[:batch, :seq_len] = True
        else:
            self.mask[:batch, :seq_len].copy_(layout.key_padding_mask)
        self.graph.replay()
        out = {"last_hidden_state": self.output.last_hidden_state[:batch, :seq_len].clone()}
        if getattr(self.output, "pooler_output", None) is not None:
            out["pooler_output"] = self.output.pooler_output[:batch].clone()
        return model.output_class(**out)
