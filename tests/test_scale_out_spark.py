"""Corpus embedding on Spark with ``pyspark.ml.functions.predict_batch_udf`` on ``local[2,2]`` (two worker threads,
a failed task tried twice), as docs/scale-out.md shows it. It needs the spark extra and a Java 17 runtime (CI installs
the extra; without either the module is skipped with the way to run it)."""

import os
import shutil
import sys

import numpy as np
import pytest

from fastbert.corpus import Embedder

from test_corpus import checkpoint, corpus_texts, parquet_corpus  # noqa: F401 (checkpoint: a fixture)

HOW_TO_RUN = ('Spark needs pyspark and Java 17: pip install ".[spark]" and a Java 17 runtime (Debian/Ubuntu: '
              "apt-get install openjdk-17-jre-headless), then pytest tests/test_scale_out_spark.py")
if shutil.which("java") is None:
    pytest.skip(HOW_TO_RUN, allow_module_level=True)
pyspark = pytest.importorskip("pyspark", reason=HOW_TO_RUN)
pq = pytest.importorskip("pyarrow.parquet", reason=HOW_TO_RUN)
pa = pytest.importorskip("pyarrow", reason=HOW_TO_RUN)

from pyspark.ml.functions import predict_batch_udf  # noqa: E402
from pyspark.sql import SparkSession  # noqa: E402
from pyspark.sql.types import ArrayType, FloatType  # noqa: E402

ROWS = 300


@pytest.fixture(scope="module")
def spark(tmp_path_factory):
    """A local Spark: workers run this Python; fastbert's settings reach them through ``spark.executorEnv``. Started
    from a directory outside the checkout: its Python workers (``python -m pyspark.daemon``) start in the JVM's
    working directory, which ``-m`` puts first on sys.path, and from a checkout's root they would import the source
    tree (which has no fastbert.kernels) instead of the installed fastbert."""
    before, cwd = os.environ.get("PYSPARK_PYTHON"), os.getcwd()
    os.environ["PYSPARK_PYTHON"] = sys.executable
    os.chdir(tmp_path_factory.mktemp("spark-driver"))
    try:
        session = (SparkSession.builder.master("local[2,2]").appName("fastbert-scale-out")
                   .config("spark.executorEnv.FASTBERT_CACHE_DIR", os.environ["FASTBERT_CACHE_DIR"])
                   .config("spark.ui.enabled", "false")
                   .getOrCreate())
        try:
            yield session
        finally:
            session.stop()
    finally:
        os.chdir(cwd)
        if before is None:
            del os.environ["PYSPARK_PYTHON"]
        else:
            os.environ["PYSPARK_PYTHON"] = before


@pytest.fixture(scope="module")
def corpus(tmp_path_factory, checkpoint):
    """(parquet directory of ``id``/``text`` in 3 files, ids, the single-process embeddings [ROWS, 384])."""
    return parquet_corpus(tmp_path_factory.mktemp("texts"), ROWS, checkpoint)


def embed_corpus(spark, source, destination, make_predict_fn) -> None:
    """The recipe of docs/scale-out.md with the given ``make_predict_fn``."""
    embed = predict_batch_udf(make_predict_fn, return_type=ArrayType(FloatType()), batch_size=64)
    (spark.read.parquet(str(source)).repartition(4)
     .select("id", embed("text").alias("embedding"))
     .write.parquet(str(destination)))


def assert_every_row_once(destination, corpus) -> None:
    _, ids, expected = corpus
    table = pq.read_table(str(destination))
    got = table["id"].to_numpy()
    assert len(got) == ROWS and sorted(got.tolist()) == ids.tolist()
    embeddings = np.stack(table["embedding"].to_numpy(zero_copy_only=False))[np.argsort(got)]
    np.testing.assert_allclose(embeddings, expected, rtol=0, atol=1e-5)


def test_spark_predict_batch_udf_embeds_every_row_once(spark, corpus, checkpoint, tmp_path):
    log = str(tmp_path / "loads.log")

    def make_predict_fn():  # (nested: Spark ships it by value; called once per Python worker, then cached)
        with open(log, "a") as f:
            f.write(f"{os.getpid()} {os.environ.get('FASTBERT_CACHE_DIR')}\n")
        return Embedder(checkpoint, dtype="float32").embed

    embed_corpus(spark, corpus[0], tmp_path / "out", make_predict_fn)
    assert_every_row_once(tmp_path / "out", corpus)
    records = [line.split() for line in open(log).read().splitlines()]
    pids = [pid for pid, _ in records]
    assert len(pids) == len(set(pids)) <= 2  # once per Python worker (reused across tasks), not per batch
    assert all(cache == os.environ["FASTBERT_CACHE_DIR"] for _, cache in records)


def test_spark_survives_a_killed_worker(spark, corpus, checkpoint, tmp_path):
    marker = str(tmp_path / "killed")
    kill_text = corpus_texts(ROWS, seed=3)[150]

    def make_predict_fn():
        embed = Embedder(checkpoint, dtype="float32").embed

        def predict(texts):
            if kill_text in texts.tolist():
                try:  # once only: the first worker to get here ends its process, as a crash would
                    os.close(os.open(marker, os.O_CREAT | os.O_EXCL))
                except FileExistsError:
                    pass
                else:
                    os._exit(1)
            return embed(texts)

        return predict

    embed_corpus(spark, corpus[0], tmp_path / "out", make_predict_fn)
    assert os.path.exists(marker)
    assert_every_row_once(tmp_path / "out", corpus)
