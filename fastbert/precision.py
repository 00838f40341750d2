"""The precision of output embeddings, as sentence-transformers' ``quantize_embeddings`` gives it, bit for bit:

    float32   as computed
    int8      per dimension, 256 buckets between that dimension's min and max: floor((x - min) / step) - 128
    uint8     the same buckets, 0 .. 255
    binary    one bit per dimension (x > 0), packed 8 to a byte (np.packbits), as int8 (byte - 128)
    ubinary   the same bits, as uint8

The int8/uint8 ranges ([2, dim]: mins, then maxes) are given (``ranges``), or computed from
``calibration_embeddings`` [n, dim], or else from the embeddings being quantized, as sentence-transformers does (the
other precisions ignore both). The
numpy operations are sentence-transformers' own, in the same order and dtypes, so the bytes are the same.
"""

import numpy as np

PRECISIONS = ("float32", "int8", "uint8", "binary", "ubinary")


def check(precision: str, ranges, calibration_embeddings) -> None:
    """Errors naming the argument, before any model work."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision={precision!r}: expected one of {', '.join(PRECISIONS)}")
    for name, value in (("ranges", ranges), ("calibration_embeddings", calibration_embeddings)):
        if value is not None and (not isinstance(value, np.ndarray) or value.ndim != 2
                                  or not np.issubdtype(value.dtype, np.floating)):
            raise ValueError(f"{name}: expected a 2-D float numpy array, got {type(value).__name__} "
                             f"{getattr(value, 'shape', '')}")
    if ranges is not None and ranges.shape[0] != 2:
        raise ValueError(f"ranges: expected shape (2, dim) (minimums, then maximums), got {ranges.shape}")


def check_dim(dim: int | None, ranges, calibration_embeddings) -> None:
    """The ranges or calibration embeddings fit outputs of ``dim`` dimensions (None: outputs without ranges)."""
    for name, value in (("ranges", ranges), ("calibration_embeddings", calibration_embeddings)):
        if value is not None and dim is not None and value.shape[1] != dim:
            raise ValueError(f"{name}: has {value.shape[1]} dimensions, the outputs {dim}")


def ranges_of(embeddings: np.ndarray, precision: str, calibration_embeddings: np.ndarray | None) -> np.ndarray:
    """[2, dim]: the per-dimension minimums and maximums of ``calibration_embeddings``, else of ``embeddings`` (at
    least two rows: sentence-transformers refuses to calibrate on one)."""
    if calibration_embeddings is None:
        if embeddings.ndim == 1 or embeddings.shape[0] == 1:
            raise ValueError(f"Cannot compute {precision} quantization ranges from a single embedding: give the "
                             "Embedder ranges or calibration_embeddings from a representative set of embeddings")
        calibration_embeddings = embeddings
    return np.vstack((np.min(calibration_embeddings, axis=0), np.max(calibration_embeddings, axis=0)))


def quantize(embeddings: np.ndarray, precision: str, ranges: np.ndarray | None = None) -> np.ndarray:
    """float32 embeddings [n, dim] -> [n, dim] (float32, int8, uint8) or [n, ceil(dim / 8)] (binary, ubinary).
    int8/uint8 need ``ranges`` (``ranges_of``)."""
    if embeddings.ndim == 2 and embeddings.shape[0] == 0:
        width = embeddings.shape[1] if not precision.endswith("binary") else (embeddings.shape[1] + 7) // 8
        return np.zeros((0, width), dtype=np.float32 if precision == "float32" else
                        np.int8 if precision in ("int8", "binary") else np.uint8)
    if precision == "float32":
        return embeddings.astype(np.float32)
    if precision.endswith("int8"):
        ranges = ranges.astype(np.float32, copy=False)
        starts = ranges[0, :]
        steps = (ranges[1, :] - starts) / 255
        steps = np.where(steps == 0, 1, steps)
        q_vals = np.clip(np.floor((embeddings - starts) / steps), 0, 255)
        return q_vals.astype(np.uint8) if precision == "uint8" else (q_vals - 128).astype(np.int8)
    if precision == "binary":
        return (np.packbits(embeddings > 0, axis=-1) - 128).astype(np.int8)
    return np.packbits(embeddings > 0, axis=-1)
