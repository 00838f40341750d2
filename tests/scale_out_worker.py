"""One rank of the multi-process tests in tests/test_scale_out.py, started by ``torchrun --nproc_per_node=2`` (gloo,
CPU). Each mode trains transformers' model and the same weights through fastbert in this one process, the same way,
and saves what the test compares to ``<out>/<mode>-rank<rank>.pt``:

    {"hf" | "fast": {"losses": [float], "evals": [Tensor], "params": {name: Tensor}, ...}}

    python -m torch.distributed.run --standalone --nproc_per_node=2 tests/scale_out_worker.py MODE OUT [MODEL_DIR]

Modes: ``trainer`` (the HF Trainer under DDP), ``sentence-transformers`` (a SentenceTransformer under torch DDP,
MODEL_DIR holds it), ``fsdp2`` (``fully_shard`` per layer and on the root only).
"""

import copy
import os
import sys
import warnings

import torch
import torch.distributed as dist
import transformers

import fastbert

STEPS = 4


def small_config(**overrides) -> transformers.BertConfig:
    # Dropout off: fastbert's training path and transformers' then compute the same function, step by step.
    values = dict(vocab_size=99, hidden_size=32, num_attention_heads=4, num_hidden_layers=2, intermediate_size=64,
                  max_position_embeddings=32, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, num_labels=3)
    values.update(overrides)
    return transformers.BertConfig(**values)


def padded_batch(rows: int, seq_len: int, vocab: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask) [rows, seq_len], right padded to lengths between 3 and seq_len."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, vocab, (rows, seq_len), generator=generator)
    lengths = torch.randint(3, seq_len + 1, (rows,), generator=generator)
    mask = (torch.arange(seq_len)[None] < lengths[:, None]).long()
    return ids * mask, mask


def pair(model_class, config) -> dict[str, torch.nn.Module]:
    """{"hf": transformers' model, "fast": a copy through fastbert.optimize}, the same random weights on every rank."""
    torch.manual_seed(0)
    hf = model_class(config)
    return {"hf": hf, "fast": fastbert.optimize(copy.deepcopy(hf))}


def full_parameters(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter, whole (FSDP2's DTensor shards gathered)."""
    return {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
            for n, p in model.named_parameters()}


def trainer(out: str) -> dict:
    """transformers' Trainer under DDP (it wraps the model itself when started by torchrun), an eval forward after
    every optimizer step, ``find_unused_parameters=False`` so a parameter left out of the graph is an error."""
    config = small_config()
    ids, mask = padded_batch(16, 12, config.vocab_size, seed=1)
    rows = [dict(input_ids=i, attention_mask=m, labels=torch.tensor(k % 3)) for k, (i, m) in enumerate(zip(ids, mask))]
    eval_ids, eval_mask = padded_batch(5, 12, config.vocab_size, seed=2)
    results = {}
    for name, model in pair(transformers.BertForSequenceClassification, config).items():
        evals = []

        class EvalBetweenSteps(transformers.TrainerCallback):
            def on_step_end(self, args, state, control, model=None, **kwargs):
                model.eval()
                with torch.no_grad():
                    evals.append(model(eval_ids, attention_mask=eval_mask).logits)
                model.train()

        args = transformers.TrainingArguments(
            output_dir=os.path.join(out, name), per_device_train_batch_size=4, max_steps=STEPS, learning_rate=1e-3,
            logging_steps=1, report_to=[], use_cpu=True, save_strategy="no", seed=0, dataloader_num_workers=0,
            ddp_backend="gloo", ddp_find_unused_parameters=False,
        )
        run = transformers.Trainer(model=model, args=args, train_dataset=rows, callbacks=[EvalBetweenSteps()])
        run.train()
        assert isinstance(run.model_wrapped, torch.nn.parallel.DistributedDataParallel), type(run.model_wrapped)
        results[name] = dict(losses=[e["loss"] for e in run.state.log_history if "loss" in e], evals=evals,
                             params=full_parameters(model))
    return results


def sentence_transformers(out: str, model_dir: str) -> dict:
    """A SentenceTransformer (fastbert.BertModel inside after optimize) trained under torch DDP on pairs with a
    cosine-similarity loss, each rank its own pairs; ``encode`` between steps."""
    from sentence_transformers import SentenceTransformer

    words = "the a cat dog sat ran on under mat table red blue quickly slowly big small".split()
    generator = torch.Generator().manual_seed(10 + dist.get_rank())

    def sentence():
        return " ".join(words[i] for i in torch.randint(0, len(words), (int(torch.randint(2, 9, (1,))),),
                                                        generator=generator))

    batches = [([sentence() for _ in range(4)], [sentence() for _ in range(4)], torch.rand(4, generator=generator))
               for _ in range(STEPS)]
    probe = ["a cat sat on the mat", "dog", "the big red table ran quickly under a small blue cat"]
    results = {}
    for name in ("hf", "fast"):
        torch.manual_seed(0)
        model = SentenceTransformer(model_dir, device="cpu")
        if name == "fast":
            fastbert.optimize(model)
            assert any(isinstance(m, fastbert.BertModel) for m in model.modules())
        for parameter_name, parameter in model.named_parameters():
            if ".pooler." in parameter_name:  # (mean pooling never reads BERT's pooler, in transformers' model too)
                parameter.requires_grad_(False)
        ddp = torch.nn.parallel.DistributedDataParallel(model)  # (find_unused_parameters=False: any other is an error)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        losses, evals = [], []
        for first, second, labels in batches:
            model.train()
            features = model.preprocess(first + second)
            embeddings = ddp(features)["sentence_embedding"]  # [8, H]: the first sentences, then the second
            a, b = embeddings.chunk(2)
            loss = torch.nn.functional.mse_loss(torch.cosine_similarity(a, b), labels)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
            evals.append(model.encode(probe, convert_to_tensor=True))
        results[name] = dict(losses=losses, evals=evals, params=full_parameters(model))
    return results


def fsdp2(out: str) -> dict:
    """FSDP2 (``fully_shard``) two ways: every layer and the root sharded (the usual recipe: fastbert's fused path
    would skip the layers' all-gather hooks, so transformers' forward runs, said), and the root only (its hook
    gathers every parameter before the forward: fastbert runs). AdamW steps with an eval forward between them, then
    a write into the shards (as a checkpoint load does) and one more eval."""
    from torch.distributed.fsdp import fully_shard

    config = small_config()
    ids, mask = padded_batch(4, 12, config.vocab_size, seed=20 + dist.get_rank())
    labels = torch.arange(4) % 3
    eval_ids, eval_mask = padded_batch(5, 12, config.vocab_size, seed=2)
    results = {}
    for layout in ("layers", "root"):
        for name, model in pair(transformers.BertForSequenceClassification, config).items():
            if layout == "layers":
                for layer in model.bert.encoder.layer:
                    fully_shard(layer)
            fully_shard(model)
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
            losses, evals = [], []
            with warnings.catch_warnings(record=True) as said:
                warnings.simplefilter("always")
                for _ in range(STEPS):
                    model.train()
                    loss = model(ids, attention_mask=mask, labels=labels).loss
                    loss.backward()
                    optimizer.step()
                    optimizer.zero_grad()
                    losses.append(loss.item())
                    model.eval()
                    with torch.no_grad():
                        evals.append(model(eval_ids, attention_mask=eval_mask).logits)
                with torch.no_grad():
                    for p in model.parameters():
                        p.mul_(0.9)  # the local shards, in place
                    evals.append(model(eval_ids, attention_mask=eval_mask).logits)
            cached = any(m.__dict__.get(fastbert.derived.ATTRIBUTE) for m in model.modules())
            results[f"{layout}-{name}"] = dict(
                losses=losses, evals=evals, params=full_parameters(model), cached=cached,
                said=sorted({str(w.message) for w in said if str(w.message).startswith("fastbert")}))
    return results


def main(mode: str, out: str, model_dir: str | None = None) -> None:
    dist.init_process_group("gloo")
    try:
        if mode == "trainer":
            results = trainer(out)
        elif mode == "sentence-transformers":
            results = sentence_transformers(out, model_dir)
        elif mode == "fsdp2":
            results = fsdp2(out)
        else:
            raise ValueError(f"mode={mode!r}: expected trainer, sentence-transformers or fsdp2")
        torch.save(results, os.path.join(out, f"{mode}-rank{dist.get_rank()}.pt"))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
