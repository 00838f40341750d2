"""fastbert._C's CPU attention (csrc/attention_cpu.h) against kernels/attention.py's float64 reference.

float32: the kernel must be within 1e-5 of the exact result; bfloat16 (float32 inside): the exact result rounded once, on odd shapes (head dims 8, 26, 80 and 128: below,
between and past the vector width and the value tiles; sequences of 0, 1, 17, 255, 256 and 300 tokens: around
every tile size), with and without the relative bias, a window and holes (distances between columns).
"""

import json
import warnings

import pytest
import torch

import fastbert
from fastbert import cpu, dispatch, padding
from fastbert.ops import attention, attention_cpu
from fastbert.kernels.attention_varlen import attention_varlen_ref

pytestmark = pytest.mark.skipif(bool(attention_cpu.attention_cpu_unavailable_reasons()),
                                reason="; ".join(attention_cpu.attention_cpu_unavailable_reasons()))
FP32_TOL = 1e-5
# Every instruction set this CPU runs (an AVX-512 machine checks the AVX2 build too).
ISAS = attention_cpu.attention_cpu_isas()


def qkv_of(tokens, heads, head_dim, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(tokens, 3, heads, head_dim, generator=g)


def table_of(heads, radius, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(heads, 2 * radius + 1, generator=g)


def reference(qkv, lengths, relative_bias=None, window=None, columns=None):
    cu_seqlens = torch.tensor([0, *torch.tensor(lengths, dtype=torch.long).cumsum(0).tolist()], dtype=torch.int32)
    bias = None if relative_bias is None else relative_bias.double()
    return attention_varlen_ref(qkv.double(), cu_seqlens, max(lengths, default=0), window=window, columns=columns,
                                relative_bias=bias).float()


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("head_dim", [8, 26, 80, 128])
@pytest.mark.parametrize("lengths", [[17, 0, 1, 5], [256, 255], [300]], ids=["mixed", "tile-edges", "long"])
@pytest.mark.parametrize("radius", [None, 3, 128])
def test_matches_reference(isa, head_dim, lengths, radius):
    heads = 3
    qkv = qkv_of(sum(lengths), heads, head_dim)
    table = None if radius is None else table_of(heads, radius)
    out = attention_cpu.attention_cpu(qkv, lengths, table, isa=isa)
    assert out.shape == (sum(lengths), heads, head_dim) and out.dtype == torch.float32
    torch.testing.assert_close(out, reference(qkv, lengths, table), rtol=0, atol=FP32_TOL)


def sdpa_per_sequence(qkv, lengths):
    """torch's SDPA on each sequence in qkv's dtype: what a bf16 model would run instead."""
    out, start = [], 0
    for length in lengths:
        q, k, v = qkv[start:start + length].permute(1, 2, 0, 3)[:, None]
        out.append(torch.nn.functional.scaled_dot_product_attention(q, k, v)[0].transpose(0, 1))
        start += length
    return torch.cat(out)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("head_dim", [8, 26, 27, 80])
@pytest.mark.parametrize("radius", [None, 3])
def test_bfloat16_is_the_exact_result_rounded_once(isa, head_dim, radius):
    """bfloat16 in and out, float32 inside: each output is within half a bfloat16 step (2^-8 relative) of the exact
    attention of the bf16 inputs, and no further from it than torch's bf16 SDPA is (27: an odd head dim, its last
    element outside the kernel's paired loads)."""
    lengths, heads = [17, 0, 1, 5, 256, 300], 3
    qkv = qkv_of(sum(lengths), heads, head_dim).bfloat16()
    table = None if radius is None else table_of(heads, radius).bfloat16()
    out = attention_cpu.attention_cpu(qkv, lengths, table, isa=isa)
    assert out.shape == (sum(lengths), heads, head_dim) and out.dtype == torch.bfloat16
    exact = reference(qkv.float(), lengths, None if table is None else table.float())
    error = (out.float() - exact).abs()
    assert bool((error <= exact.abs() * 2 ** -8 + 1e-5).all()), float((error - exact.abs() * 2 ** -8).max())
    if radius is None:
        sdpa = (sdpa_per_sequence(qkv, [n for n in lengths if n]).float() - exact).abs()
        assert float(error.max()) <= float(sdpa.max())


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("window", [0, 1, 5, 64])
@pytest.mark.parametrize("radius", [None, 8])
def test_window(isa, window, radius):
    lengths = [1, 40, 130]
    qkv = qkv_of(sum(lengths), 2, 26)
    table = None if radius is None else table_of(2, radius)
    out = attention_cpu.attention_cpu(qkv, lengths, table, window, isa=isa)
    torch.testing.assert_close(out, reference(qkv, lengths, table, window), rtol=0, atol=FP32_TOL)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("window, radius", [(None, 2), (2, 2), (3, None), (40, 128)])
def test_holes_measure_distances_between_columns(isa, window, radius):
    """A mask with holes: distances between the tokens' columns in the padded batch, not between their offsets."""
    g = torch.Generator().manual_seed(2)
    mask = torch.rand(3, 90, generator=g) < 0.6
    mask[0, 5:] = False  # a short row, and a row of one token
    mask[1] = False
    mask[1, 17] = True
    lengths = mask.sum(dim=1).tolist()
    columns = torch.arange(90).expand(3, 90)[mask].to(torch.int32)
    qkv, table = qkv_of(sum(lengths), 3, 16), None if radius is None else table_of(3, radius)
    out = attention_cpu.attention_cpu(qkv, lengths, table, window, columns, isa=isa)
    torch.testing.assert_close(out, reference(qkv, lengths, table, window, columns), rtol=0, atol=FP32_TOL)
    assert not torch.allclose(out, attention_cpu.attention_cpu(qkv, lengths, table, window, isa=isa), atol=1e-3)


def test_threads_and_query_blocks_give_the_same_result():
    """One sequence of one head is split into blocks of queries by the thread count (one task per (sequence, head)
    would leave threads idle): every split computes the same sums."""
    qkv, table = qkv_of(300, 1, 32), table_of(1, 128)
    threads = torch.get_num_threads()
    try:
        results = []
        for count in (1, 2, 3, 5):
            torch.set_num_threads(count)
            results.append(attention_cpu.attention_cpu(qkv, [300], table))
    finally:
        torch.set_num_threads(threads)
    for out in results[1:]:
        torch.testing.assert_close(out, results[0], rtol=0, atol=0)


@pytest.mark.parametrize("isa", ISAS)
def test_nan_and_huge_windows(isa):
    """A NaN in one key poisons every query that sees it (as in torch); a window past any length sees every key."""
    qkv = qkv_of(9, 2, 8)
    qkv[4, 1, 0, 3] = float("nan")  # key 4 of head 0
    out = attention_cpu.attention_cpu(qkv, [9], None, 2, isa=isa)
    sees_key_4 = (torch.arange(9) - 4).abs() <= 2
    assert out[:, 0].isnan().any(dim=-1).equal(sees_key_4) and not out[:, 1].isnan().any()
    clean = qkv_of(9, 2, 8)
    for window in (2 ** 31, 2 ** 32, 2 ** 40):
        torch.testing.assert_close(attention_cpu.attention_cpu(clean, [9], None, window, isa=isa),
                                   attention_cpu.attention_cpu(clean, [9], isa=isa), rtol=0, atol=0)


def test_registered_op():
    """The torch.library op's schema, fake tensor and autograd registration (torch.compile sees one opaque op)."""
    qkv, table = qkv_of(12, 2, 8), table_of(2, 3)
    torch.library.opcheck(torch.ops.fastbert.attention_cpu.default, (qkv, [5, 7], table, 2, None, ""))


def test_spare_rows_come_out_zero_after_the_tokens():
    """The packed layout's spare rows, written by the launch itself (the tensor the O projection reads, no copy)."""
    qkv = qkv_of(7, 2, 26)
    alone = attention_cpu.attention_cpu(qkv, [4, 3])
    spared = attention_cpu.attention_cpu(qkv, [4, 3], spare_rows=5)
    assert spared.shape == (12, 2, 26) and torch.equal(spared[:7], alone) and not spared[7:].any()
    with pytest.raises(ValueError, match="spare_rows"):
        attention_cpu.attention_cpu(qkv, [4, 3], spare_rows=-1)


def test_bad_arguments_raise_before_the_kernel():
    qkv = qkv_of(5, 2, 8)
    with pytest.raises(ValueError, match="seqlens"):
        attention_cpu.attention_cpu(qkv, [3, 3])
    with pytest.raises(ValueError, match="qkv"):
        attention_cpu.attention_cpu(qkv.double(), [5])
    with pytest.raises(ValueError, match="relative_bias"):
        attention_cpu.attention_cpu(qkv, [5], torch.zeros(2, 4))
    with pytest.raises(ValueError, match="window"):
        attention_cpu.attention_cpu(qkv, [5], None, -1)
    with pytest.raises(ValueError, match="columns"):
        attention_cpu.attention_cpu(qkv, [5], None, None, torch.arange(5))
    with pytest.raises(ValueError, match="isa"):
        attention_cpu.attention_cpu(qkv, [5], isa="sse2")


@pytest.fixture
def kernel_calls(monkeypatch):
    """The calls attention() makes to the kernel (sequence lengths, bias, window, columns given or not), with the
    kernel chosen whatever this CPU measured (these tests are about the routing; an Intel Xeon measures SDPA faster)."""
    calls, kernel = [], attention.attention_cpu
    monkeypatch.setattr(cpu, "attention_slower_reason", lambda kernel, dtype=None, head_dim=None: None)

    def counted(qkv, seqlens, relative_bias=None, window=None, columns=None, isa="", disentangled=None, spare_rows=0):
        calls.append((tuple(seqlens), relative_bias is not None, window, columns is not None))
        return kernel(qkv, seqlens, relative_bias, window, columns, isa, disentangled, spare_rows)

    monkeypatch.setattr(attention, "attention_cpu", counted)
    return calls


def layout_of(mask, unpad=True):
    layout = padding.unpadded_layout(mask) if unpad else padding.dense_layout(*mask.shape, mask.bool())
    return padding.with_columns(layout)


@pytest.mark.skipif(dispatch.settings().backend != "auto", reason="FASTBERT_BACKEND chooses another backend")
@pytest.mark.parametrize("window", [None, 1])
@pytest.mark.parametrize("radius", [None, 3])
def test_model_attention_runs_the_kernel(kernel_calls, window, radius):
    """float32 inference on CPU runs the kernel: packed (with holes: by columns), dense without padding (no mask, or
    a mask of ones as unpad=False gives it: bit for bit the same); a dense mask with padding keeps torch's SDPA."""
    assert dispatch.report(torch.device("cpu"), torch.float32)[0]["attention"] == "cpu-ext"
    table = None if radius is None else table_of(2, radius)
    cases = [  # (mask, unpad, kernel's lengths, columns passed)
        (torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]]), True, (3, 4), False),
        (torch.tensor([[1, 0, 1, 1], [0, 1, 1, 0]]), True, (3, 2), True),
        (torch.ones(2, 4, dtype=torch.long), True, (4, 4), False),
        (torch.ones(2, 4, dtype=torch.long), False, (4, 4), False),
        (torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]]), False, None, None),
    ]
    for mask, unpad, lengths, by_columns in cases:
        kernel_calls.clear()
        layout = layout_of(mask, unpad)
        qkv = qkv_of(layout.tokens, 2, 8).view(layout.tokens, 48)
        with torch.inference_mode():
            out = attention.attention(qkv, layout, 2, window=window, relative_bias=table).view(layout.tokens, 2, 8)
        if lengths is None:
            assert kernel_calls == []
            continue
        assert kernel_calls == [(lengths, radius is not None, window, by_columns and (window, radius) != (None, None))]
        real = mask.bool().flatten() if not layout.packed else torch.ones(layout.tokens, dtype=torch.bool)
        columns = torch.arange(4).expand(2, 4)[mask.bool()].to(torch.int32)
        expected = reference(qkv.view(-1, 3, 2, 8)[real], mask.sum(dim=1).tolist(), table, window, columns)
        torch.testing.assert_close(out[real], expected, rtol=0, atol=FP32_TOL)


def test_gradients_take_the_differentiable_path(kernel_calls):
    """The kernel is forward-only: gradients (of q, k, v or of a trainable bias alone) run torch's SDPA."""
    layout, table = layout_of(torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]])), table_of(2, 3).requires_grad_()
    qkv = qkv_of(7, 2, 8).view(7, 48)
    with pytest.warns(RuntimeWarning, match="gradients are required"):
        attention.attention(qkv, layout, 2, relative_bias=table).sum().backward()
    assert kernel_calls == [] and table.grad.abs().sum() > 0


def test_the_choice_is_measured_once_per_machine(monkeypatch, tmp_path, measurements_kept):
    """The kernel replaces SDPA where it measured as fast at every size (within ``cpu.ATTENTION_NOISE``: 99 against
    100 GFLOP/s is a tie, 90 is slower), per dtype and head dim (the figures kept per machine, in info()); where it
    measured slower, SDPA runs without a warning: a measured choice between exact paths, not a fallback, which
    info() lists among the reasons of some calls."""
    monkeypatch.setattr(cpu, "_figures", {})
    monkeypatch.setattr(dispatch, "_seen", {})
    monkeypatch.setattr(attention, "_measured_choices", {})
    monkeypatch.setenv("FASTBERT_CACHE_DIR", str(tmp_path))
    sizes = set(cpu.ATTENTION_SEQUENCES)
    figures = cpu.attention_figures(attention_cpu.attention_cpu, torch.float32, 64)
    assert figures["source"] == "measured" and set(figures["torch"]) == set(figures["cpu-ext"]) == sizes
    bf16 = cpu.attention_figures(attention_cpu.attention_cpu, torch.bfloat16, 64)  # (each dtype measured on its own)
    assert bf16["source"] == "measured" and set(bf16["cpu-ext"]) == sizes
    small = cpu.attention_figures(attention_cpu.attention_cpu, torch.float32, 8)  # (and each head dim)
    assert small["source"] == "measured" and small["torch"] != figures["torch"]
    assert fastbert.info()["cpu_attention"]["measured_gflops"] == {
        "float32, head_dim 64": figures, "bfloat16, head_dim 64": bf16, "float32, head_dim 8": small}
    store = json.loads((tmp_path / "cpu_gemm.json").read_text())
    store[cpu._key(cpu.attention_measurement(torch.float32, 8))] = {
        "torch": {"32": 100.0, "128": 100.0, "512": 100.0}, "cpu-ext": {"32": 150.0, "128": 120.0, "512": 90.0}}
    store[cpu._key(cpu.attention_measurement(torch.float32, 16))] = {  # (slower at 512 within the noise)
        "torch": {"32": 100.0, "128": 100.0, "512": 100.0}, "cpu-ext": {"32": 150.0, "128": 120.0, "512": 99.0}}
    (tmp_path / "cpu_gemm.json").write_text(json.dumps(store))
    monkeypatch.setattr(cpu, "_figures", {})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        slower = attention.Call(8, (), torch.device("cpu"), torch.float32)
        assert dispatch.decide("attention", attention.BACKENDS, slower).backend.name == "torch"
        faster = attention.Call(16, (), torch.device("cpu"), torch.float32)
        assert dispatch.decide("attention", attention.BACKENDS, faster).backend.name == "cpu-ext"
    reasons = dispatch.report(torch.device("cpu"), torch.float32)[1]["attention"]
    assert any("cpu-ext (some calls): slower than torch's SDPA on this CPU at 1 x 512 tokens (90.0 vs 100.0 "
               "GFLOP/s, float32, head_dim 8)" in reason for reason in reasons), reasons
