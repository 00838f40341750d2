"""Corpus embedding on Ray Data (the ``ray`` extra: ``pip install ".[ray]"``), on a local ``ray.init(num_cpus=2)``:
parquet of ids and texts -> ``map_batches(Embedder, compute=ActorPoolStrategy(size=2))`` -> parquet, as
docs/scale-out.md shows it. Every row comes back exactly once with the single-process embeddings, each actor loads
the model once, and a worker killed mid-job (``os._exit`` in one batch) is restarted by Ray and the job completes."""

import os
import sys

import numpy as np
import pytest

from fastbert.corpus import Embedder

from test_corpus import checkpoint, parquet_corpus  # noqa: F401 (checkpoint: a fixture)

ray = pytest.importorskip("ray", reason='Ray Data is the optional extra: pip install ".[ray]"')
pytest.importorskip("ray.data")
pq = pytest.importorskip("pyarrow.parquet")
pa = pytest.importorskip("pyarrow")

ROWS = 300
ACTORS = 2  # each with one CPU; ray.init gets one more for the read and write tasks


class RecordingEmbedder(Embedder):
    """The Embedder, writing one line per model load (``prepare``: pid and the settings the worker read) to ``log``, and
    ending its process (``os._exit``, as a crash or an OOM kill would) in the first batch holding ``kill_id``."""

    def __init__(self, *args, log: str, kill_id: int | None = None, marker: str | None = None, **kwargs):
        super().__init__(*args, dtype="float32", **kwargs)  # (compared with the single-process float32 vectors)
        self.log, self.kill_id, self.marker = log, kill_id, marker

    def prepare(self, model):
        import fastbert

        with open(self.log, "a") as f:
            f.write(f"{os.getpid()} {fastbert.dispatch.settings().cpu_gemm} {os.environ.get('FASTBERT_CACHE_DIR')}\n")
        return model

    def __call__(self, batch):
        if self.kill_id is not None and self.kill_id in batch["id"]:
            try:  # once only: the marker is created atomically by the first process to get here
                os.close(os.open(self.marker, os.O_CREAT | os.O_EXCL))
            except FileExistsError:
                pass
            else:
                os._exit(1)
        return super().__call__(batch)


@pytest.fixture(scope="module")
def local_ray(tmp_path_factory):
    """A local Ray with two CPUs; fastbert's settings reach the workers through the runtime environment, as on a
    cluster (FASTBERT_CACHE_DIR: the test session's GEMM measurements). Started from a directory outside the
    checkout: Ray puts the driver's working directory on its workers' sys.path, and from a checkout's root they
    would import the source tree (which has no fastbert.kernels) instead of the installed fastbert."""
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # workers do not import the tests directory
    env = {"FASTBERT_CACHE_DIR": os.environ["FASTBERT_CACHE_DIR"], "FASTBERT_CPU_GEMM": "auto"}
    cwd = os.getcwd()
    os.chdir(tmp_path_factory.mktemp("ray-driver"))
    try:
        ray.init(num_cpus=ACTORS + 1, include_dashboard=False, log_to_driver=False, runtime_env={"env_vars": env})
        ray.data.DataContext.get_current().enable_progress_bars = False
        yield
    finally:
        ray.shutdown()
        os.chdir(cwd)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory, checkpoint):
    """(parquet directory of ``id``/``text`` in 3 files, ids, the single-process embeddings [ROWS, 384])."""
    return parquet_corpus(tmp_path_factory.mktemp("texts"), ROWS, checkpoint)


def embed_corpus(source, destination, checkpoint, **recording) -> None:
    """The recipe of docs/scale-out.md, with the recording Embedder."""
    # (Ray Data restarts a map actor that dies and retries its tasks by default: max_restarts=-1, max_task_retries=-1)
    (ray.data.read_parquet(str(source))
     .repartition(3 * ACTORS)  # (three small files are read as one block: give both actors blocks)
     .map_batches(RecordingEmbedder, fn_constructor_args=(checkpoint,), fn_constructor_kwargs=recording,
                  batch_size=32, compute=ray.data.ActorPoolStrategy(size=ACTORS), num_cpus=1)
     .drop_columns(["text"])
     .write_parquet(str(destination)))


def read_embeddings(destination) -> tuple[np.ndarray, np.ndarray]:
    table = pq.read_table(str(destination))
    return table["id"].to_numpy(), np.stack(table["embedding"].to_numpy(zero_copy_only=False))


def assert_every_row_once(destination, corpus) -> None:
    _, ids, expected = corpus
    got_ids, embeddings = read_embeddings(destination)
    assert len(got_ids) == ROWS and sorted(got_ids.tolist()) == ids.tolist()
    order = np.argsort(got_ids)
    np.testing.assert_allclose(embeddings[order], expected, rtol=0, atol=1e-5)


def loads(log) -> list[list[str]]:
    return [line.split() for line in open(log).read().splitlines()]


def test_ray_data_embeds_every_row_once(local_ray, corpus, checkpoint, tmp_path):
    log = tmp_path / "loads.log"
    embed_corpus(corpus[0], tmp_path / "out", checkpoint, log=str(log))
    assert_every_row_once(tmp_path / "out", corpus)
    records = loads(log)
    pids = [pid for pid, *_ in records]
    assert len(pids) == len(set(pids)) <= ACTORS  # once per actor, not per batch (ROWS / 32 batches)
    assert all(gemm == "auto" and cache == os.environ["FASTBERT_CACHE_DIR"] for _, gemm, cache in records)


def test_ray_data_survives_a_killed_worker(local_ray, corpus, checkpoint, tmp_path):
    log, marker = tmp_path / "loads.log", tmp_path / "killed"
    embed_corpus(corpus[0], tmp_path / "out", checkpoint, log=str(log), kill_id=int(corpus[1][150]),
                 marker=str(marker))
    assert marker.exists()  # a worker did die mid-job
    assert_every_row_once(tmp_path / "out", corpus)
    pids = [pid for pid, *_ in loads(log)]
    assert len(pids) == len(set(pids)) <= ACTORS + 1  # the restarted actor loads once more
