"""How ``/v1/embeddings`` puts a vector on the wire (its ``encoding_format``), and the int8/uint8 calibration of a
server. After ``dimensions`` (``truncated``), each embedding is:

    float     a JSON list of numbers, one per dimension
    base64    its little-endian float32 bytes, base64 (what the openai client asks for, and decodes, by default)
    int8      a JSON list of ints in [-128, 127], one per dimension: 256 buckets per dimension between the
              calibration's minimum and maximum, floor((x - min) / step) - 128 (values outside are clipped)
    uint8     the same buckets as ints in [0, 255]
    binary    a JSON list of ints in [-128, 127], one per 8 dimensions: the bits x > 0 packed as np.packbits packs
              them (the first dimension in the highest bit, the last byte padded with zeros), each byte minus 128
    ubinary   the same bytes as ints in [0, 255]

The last four are sentence-transformers' ``quantize_embeddings`` bit for bit (``fastbert.precision``), as Cohere's
embed API shapes them. Their int8/uint8 ranges come from calibration embeddings fixed when the server starts
(``Calibration``), never from a request's own vectors: a text's bytes do not depend on what else is in its request
or batch.
"""

import base64

import numpy as np

from .. import precision

FORMATS = ("float", "base64", "int8", "uint8", "binary", "ubinary")


def truncated(vectors: np.ndarray, dimensions: int | None) -> np.ndarray:
    """[n, dim] float32 -> [n, dimensions]: the first ``dimensions``, L2-normalized again (OpenAI's ``dimensions``:
    Matryoshka models; sentence-transformers' ``truncate_dim`` with ``normalize_embeddings``); as they are for None
    or all of them."""
    if dimensions is None or dimensions >= vectors.shape[1]:
        return vectors
    vectors = vectors[:, :dimensions]
    return vectors / np.maximum(np.linalg.norm(vectors, axis=1, keepdims=True), 1e-12)


class Calibration:
    """The int8/uint8 ranges of a server: from ``embeddings`` [n, dim] float32 (n >= 2: the model's outputs for a
    representative sample), fixed at start; for vectors of d dimensions, the min and max of the calibration
    embeddings cut to d and normalized again as the vectors are (``truncated``) -- what ``quantize_embeddings``
    computes from ``calibration_embeddings`` -- once per d."""

    def __init__(self, embeddings: np.ndarray, dim: int):
        if not isinstance(embeddings, np.ndarray) or embeddings.ndim != 2 or not np.issubdtype(
                embeddings.dtype, np.floating):
            raise ValueError(f"calibration embeddings: expected a 2-D float array [n, {dim}], got "
                             f"{type(embeddings).__name__} {getattr(embeddings, 'shape', '')}")
        if embeddings.shape[0] < 2 or embeddings.shape[1] != dim:
            raise ValueError(f"calibration embeddings: expected [n >= 2, {dim}] (the model's {dim} dimensions), got "
                             f"{list(embeddings.shape)}")
        self.embeddings = embeddings.astype(np.float32)
        self._ranges: dict[int, np.ndarray] = {}  # width -> [2, width]

    def ranges(self, dimensions: int) -> np.ndarray:
        """[2, dimensions]: the minimums, then the maximums, of the calibration embeddings at that width."""
        if dimensions not in self._ranges:
            self._ranges[dimensions] = precision.ranges_of(truncated(self.embeddings, dimensions), "int8", None)
        return self._ranges[dimensions]


def encoded(vectors: np.ndarray, encoding_format: str, calibration: Calibration) -> list:
    """[n, d] float32 (after ``truncated``) -> each row as ``encoding_format`` puts it on the wire: an array (orjson
    writes it as a JSON list) or a base64 string."""
    if encoding_format == "float":
        return list(vectors)
    if encoding_format == "base64":
        return [base64.b64encode(row.astype("<f4").tobytes()).decode("ascii") for row in vectors]
    ranges = calibration.ranges(vectors.shape[1]) if encoding_format.endswith("int8") else None
    return list(precision.quantize(vectors, encoding_format, ranges))
