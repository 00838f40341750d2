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
``fastbert.set_input_checks(False)``). The graphs run the dense masked path (packing sizes tensors from the data):
values at padding positions are the dense path's, not the packed path's zeros.

What invalidates the graphs, by itself: a parameter that moves, changes dtype, is replaced (``.to()``,
``load_state_dict(assign=True)``) or written in place (an optimizer step), and derived weights dropped or rebuilt
(``fastbert.clear_caches``, a forward with gradients): the parameters' identity, storage and version and the derived
weights' identity are compared before every replay (tens of microseconds for bert-base), and the graphs recaptured
when they differ. What is frozen into the graphs: the Python decisions taken while capturing (``FASTBERT_BACKEND``,
hooks, which modules are wrapped: a PEFT adapter added, switched or merged, a submodule put in training mode): call
``fastbert.cuda_graphs(model)`` again after changing them, which drops every graph. One replay runs at a time per
model (a lock); a replay on another stream waits for the previous one.

Memory: the graphs of one model share one memory pool, about the eager forward's activation memory at the largest
bucket captured, plus each bucket's input and output buffers.
"""

import threading

import torch

from . import announce, compat, derived, dispatch, inputs, padding
# (fastbert.kernels: the repository's top-level kernels/ folder, installed under that name by setup.py)
from .kernels._common import direct_launch

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
    """The captured graphs of one encoder, by bucket, with the state of the weights they were captured for."""

    def __init__(self, batch_sizes: tuple[int, ...], seq_lens: tuple[int, ...]):
        self.batch_sizes, self.seq_lens = batch_sizes, seq_lens
        self.lock = threading.Lock()  # one replay at a time: the graphs share their input and output buffers
        self.stream = None  # the one capture stream (per GraphSet: on the model's GPU)
        self.last_stream = None  # the stream of the last replay
        self._clear()

    def _clear(self) -> None:
        self.graphs: dict[tuple[int, int], _Graph | None] = {}  # None: its capture failed, the bucket runs eagerly
        self.slots: list[tuple[dict, str, torch.nn.Parameter]] = []  # every parameter, where the model holds it
        self.owners: list[torch.nn.Module] = []  # the modules holding derived weights (``derived.py``)
        self.state: tuple | None = None  # ``_weights_state`` when the graphs were captured
        self.alive: list = []  # what the graphs read and the state names by id: kept alive while they exist
        self.pool = None

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
        input_ids = kwargs.get("input_ids")
        if why is None and (not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or not input_ids.numel()):
            why = ""  # (the eager forward raises the right error, or returns the empty batch)
        bucket = None if why is not None else self._bucket(*input_ids.shape)
        if why is None and bucket is None:
            why = f"a batch beyond the largest bucket ({self.batch_sizes[-1]} x {self.seq_lens[-1]})"
        if why is None and self.graphs.get(bucket, True) is None:
            why = ""  # (its capture failed: warned then)
        if why is not None:
            if why:
                announce.fallback(f"cuda_graphs: {why}: the call runs without a CUDA graph")
            return None
        given = {name: kwargs.get(name) for name in (*_GRAPHED, *_EAGER_INPUTS)}
        with torch.no_grad():
            indices, layout = inputs.prepare(model, given, unpad=False)  # the eager checks; [3, B*S], dense layout
        # Buffers and graphs outside inference mode (a later call may come without it), never recording gradients.
        with self.lock, torch.inference_mode(False), torch.no_grad():
            if self.state is not None and self._weights_state() != self.state:
                self._clear()
            graph = self.graphs.get(bucket)
            if graph is None:
                if any(type(p) is not torch.nn.Parameter for p in model.parameters()):
                    announce.fallback("cuda_graphs: parameters that are not nn.Parameter (a replica or a functional "
                                      "call): the call runs without a CUDA graph")
                    return None
                graph = self._capture(model, bucket)
                if graph is None:
                    return None
            current = torch.cuda.current_stream(indices.device)
            if self.last_stream is not None and self.last_stream != current:
                current.wait_stream(self.last_stream)  # the previous replay's outputs are copied out first
            self.last_stream = current
            return graph.replay(model, indices, layout)

    def _capture(self, model, bucket: tuple[int, int]):
        device = model.get_input_embeddings().weight.device
        if self.stream is None:
            with torch.cuda.device(device):
                self.stream = torch.cuda.Stream()
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        try:
            graph = _Graph(model, *bucket, self.pool, self.stream)
        except RuntimeError as error:
            self.graphs[bucket] = None
            announce.fallback(f"cuda_graphs: capturing the {bucket[0]} x {bucket[1]} bucket failed ({error}): its "
                              "calls run without a CUDA graph")
            return None
        before = self.state
        self._watch(model)
        if before is not None and self.state != before:  # the warm-up rebuilt what the other graphs read: they go
            self.graphs = {}
        self.graphs[bucket] = graph
        return graph

    def _watch(self, model) -> None:
        """Record what the graphs read, after a capture (whose warm-up built the derived weights)."""
        # A marker that ``.to()``, ``.half()`` and ``clear_caches`` drop with the model's other derived weights.
        derived.cached(model, "cuda_graphs", (), object)
        modules = list(model.modules())
        self.slots = [(m._parameters, n, p) for m in modules for n, p in m._parameters.items() if p is not None]
        self.owners = [m for m in modules if m.__dict__.get(derived.ATTRIBUTE)]
        self.alive.append((self.slots, [m.__dict__[derived.ATTRIBUTE] for m in self.owners]))
        self.state = self._weights_state()

    def _weights_state(self) -> tuple:
        """What the graphs depend on, cheap enough for every call (~200 parameters for bert-base): each parameter's
        version where the model still holds that same parameter (an in-place write changes what derived weights were
        built from; a replaced parameter is read no more), and the identity of each derived-weights dict (replaced,
        never mutated, when rebuilt or dropped: ``.to()``, ``clear_caches``, a forward with gradients). The objects
        are kept alive in ``alive``, so no id is reused meanwhile."""
        try:
            versions = tuple(p._version if d[n] is p else None for d, n, p in self.slots)
        except RuntimeError:  # an inference tensor (a parameter moved under inference_mode) keeps no version counter
            versions = tuple((-1 if p.is_inference() else p._version) if d[n] is p else None
                             for d, n, p in self.slots)
        return versions, tuple(id(m.__dict__.get(derived.ATTRIBUTE)) for m in self.owners)

    def _why_eager(self, model, kwargs: dict) -> str | None:
        """Why this call cannot replay a graph ("" when it is expected and not worth a warning), or None."""
        word = model.get_input_embeddings().weight
        if dispatch.capturing() or dispatch.exporting() or not direct_launch(word):
            return ""  # (tracing, fake tensors, torch.func, or the user's own capture: the eager ops)
        if word.device.type != "cuda":
            return f"the model is on {word.device.type}, not a GPU"
        if model.training:
            return "the model is in training mode"
        if torch.is_grad_enabled() and any(p.requires_grad for p in model.parameters()):
            return "gradients are required (call under torch.inference_mode() or torch.no_grad())"
        given = [name for name in _EAGER_INPUTS if kwargs.get(name) is not None]
        config = model.config
        if compat.selected_states(compat.flag(kwargs, "output_hidden_states", config),
                                  config.num_hidden_layers) is not None:
            given.append("output_hidden_states")
        if given:
            return f"{', '.join(given)} given"
        return None

    def _bucket(self, batch: int, seq_len: int) -> tuple[int, int] | None:
        # (Positions come from the call: the bucket's padding has position 0, so any bucket fits the table.)
        b = next((b for b in self.batch_sizes if b >= batch), None)
        s = next((s for s in self.seq_lens if s >= seq_len), None)
        return None if b is None or s is None else (b, s)


class StaticForward:
    """A bucket's static inputs, [3, b, s] indices and a [b, s] mask, and the forward a graph captures from them.

    Everything that forward reads is derived from the buffers inside it, the layout's key bounds included: a value
    computed before the capture (from the buffers as they were then, all zeros) would be replayed forever, whatever
    the buffers hold later. ``feed`` fills the buffers for a call; ``forward`` runs the encoder on them (captured
    once, replayed per call; tests run it eagerly on CPU to check exactly that)."""

    def __init__(self, batch: int, seq_len: int, device: torch.device):
        self.indices = torch.zeros(3, batch, seq_len, dtype=torch.long, device=device)
        self.mask = torch.zeros(batch, seq_len, dtype=torch.bool, device=device)

    def feed(self, indices: torch.Tensor, layout: padding.TokenLayout) -> None:
        """indices [3, B*S (+ spare rows)] and the call's dense layout (``inputs.prepare``), B and S within the
        bucket."""
        batch, seq_len = layout.batch, layout.seq_len
        self.indices.zero_()  # the bucket's padding: valid ids, masked out
        self.indices[:, :batch, :seq_len].copy_(indices[:, : batch * seq_len].view(3, batch, seq_len))
        self.mask.zero_()
        keys = layout.key_mask()
        if keys is None:
            self.mask[:batch, :seq_len] = True
        else:
            self.mask[:batch, :seq_len].copy_(keys)

    def forward(self, model):
        batch, seq_len = self.mask.shape
        return model.run_encoder(self.indices.view(3, -1), padding.dense_layout(batch, seq_len, self.mask))


class _Graph:
    """One bucket: the encoder captured on its ``StaticForward``."""

    def __init__(self, model, batch: int, seq_len: int, pool, stream):
        device = model.get_input_embeddings().weight.device
        self.static = StaticForward(batch, seq_len, device)
        # Warm up on the capture stream (Triton compiles, cuBLAS picks its kernels, derived weights are cached),
        # then capture: nothing lazy may happen inside the capture. "thread_local": another thread's CUDA calls
        # (e.g. a range check's read-back) do not invalidate it.
        with torch.cuda.device(device):
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(2):
                    self.static.forward(model)
            torch.cuda.current_stream().wait_stream(stream)
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph, pool=pool, stream=stream, capture_error_mode="thread_local"):
                self.output = self.static.forward(model)

    def replay(self, model, indices: torch.Tensor, layout: padding.TokenLayout):
        """indices [3, B*S] and the dense layout of the call (``inputs.prepare``) -> the output, sliced to
        [B, S] and copied out of the graph's memory."""
        batch, seq_len = layout.batch, layout.seq_len
        self.static.feed(indices, layout)
        self.graph.replay()
        out = {"last_hidden_state": self.output.last_hidden_state[:batch, :seq_len].clone()}
        if getattr(self.output, "pooler_output", None) is not None:
            out["pooler_output"] = self.output.pooler_output[:batch].clone()
        return model.output_class(**out)
