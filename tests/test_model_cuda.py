"""The whole model on a GPU: the compiled kernels (Triton attention and LayerNorm, the CUDA embedding) against HF in
the same dtype and an fp64 reference, with the 2x rule of conftest.py. Skipped without a GPU (``cuda_device``).

fastbert and HF run on CUDA in fp16/bf16; the float64 reference runs on the CPU (eager attention, plain math).
"""

import pytest
import torch

import fastbert
from test_model_parity import mixed_mask, random_inputs

DTYPES = [pytest.param(torch.float16, id="fp16"), pytest.param(torch.bfloat16, id="bf16")]
CONFIGS = [
    pytest.param(dict(hidden_size=64, num_attention_heads=4), id="h64-d16"),
    pytest.param(dict(hidden_size=312, num_attention_heads=12, intermediate_size=256, hidden_act="gelu_new"),
                 id="h312-d26"),
    pytest.param(dict(hidden_size=256, num_attention_heads=4, max_position_embeddings=512), id="h256-d64"),
]


def _run_on(trio, device, dtype, *args, **kwargs):
    """(fastbert and HF on ``device`` in ``dtype``, the fp64 reference on the CPU), outputs back on the CPU."""
    fast, hf = trio.fast.to(device, dtype), trio.hf.to(device, dtype)
    on_device = [a.to(device) for a in args]
    kw_device = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
    with torch.inference_mode():
        out, out_hf = fast(*on_device, **kw_device), hf(*on_device, **kw_device)
        out_ref = trio.ref(*args, **kwargs)
    return out, out_hf, out_ref


@pytest.mark.parametrize("unpad", [True, False], ids=["packed", "dense"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("overrides", CONFIGS)
def test_cuda_matches_hf(cuda_device, bert_trio, assert_matches_hf, overrides, dtype, unpad):
    trio = bert_trio(unpad=unpad, **overrides)
    input_ids, token_type_ids = random_inputs(trio.config, 12, 37)
    mask = mixed_mask(12, 37)
    out, out_hf, out_ref = _run_on(trio, cuda_device, dtype, input_ids, attention_mask=mask,
                                   token_type_ids=token_type_ids)
    assert_matches_hf(out.last_hidden_state.cpu(), out_hf.last_hidden_state.cpu(), out_ref.last_hidden_state, mask,
                      dtype=dtype)


@pytest.mark.parametrize("unpad", [True, False], ids=["packed", "dense"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_cuda_seq_512(cuda_device, bert_trio, assert_matches_hf, dtype, unpad):
    trio = bert_trio(hidden_size=256, num_attention_heads=4, max_position_embeddings=512, unpad=unpad)
    input_ids, _ = random_inputs(trio.config, 4, 512)
    mask = torch.ones(4, 512, dtype=torch.long)
    mask[1, 300:] = 0
    mask[3, :77] = 0
    out, out_hf, out_ref = _run_on(trio, cuda_device, dtype, input_ids, attention_mask=mask)
    assert_matches_hf(out.last_hidden_state.cpu(), out_hf.last_hidden_state.cpu(), out_ref.last_hidden_state, mask,
                      dtype=dtype)


@pytest.mark.parametrize("unpad", [True, False], ids=["packed", "dense"])
def test_cuda_fully_padded_row(cuda_device, bert_trio, assert_matches_hf, unpad):
    trio = bert_trio(unpad=unpad)
    input_ids, _ = random_inputs(trio.config, 3, 10)
    mask = torch.ones(3, 10, dtype=torch.long)
    mask[1] = 0
    mask[2, 6:] = 0
    out, out_hf, out_ref = _run_on(trio, cuda_device, torch.float16, input_ids, attention_mask=mask)
    assert torch.isfinite(out.last_hidden_state).all() and torch.isfinite(out.pooler_output).all()
    assert_matches_hf(out.last_hidden_state.cpu(), out_hf.last_hidden_state.cpu(), out_ref.last_hidden_state, mask,
                      dtype=torch.float16)


def test_cuda_bad_input_raises_before_any_kernel(cuda_device, bert_trio):
    trio = bert_trio()
    fast = trio.fast.to(cuda_device, torch.float16)
    input_ids, _ = random_inputs(trio.config, 2, 6)
    with pytest.raises(ValueError, match="input_ids out of range"):
        fast(input_ids.to(cuda_device).index_fill(1, torch.tensor([3], device=cuda_device), 99))
    with pytest.raises(ValueError, match="input_ids out of range"):  # checked on the host
        fast(input_ids.index_fill(1, torch.tensor([3]), 99))
    with pytest.raises(ValueError, match="attention_mask is on the CPU but input_ids is on cuda"):
        fast(input_ids.to(cuda_device), attention_mask=torch.ones(2, 6, dtype=torch.long))
    torch.cuda.synchronize()  # no device-side assert left behind


@pytest.mark.parametrize("unpad", [True, False], ids=["packed", "dense"])
def test_cuda_host_inputs(cuda_device, bert_trio, read_backs, unpad):
    """Integer inputs left on the CPU (as tokenizers return them): the same outputs as on the device, and no read of
    device data (checks and lengths are read on the host)."""
    trio = bert_trio(unpad=unpad)
    fast = trio.fast.to(cuda_device, torch.float16)
    input_ids, token_type_ids = random_inputs(trio.config, 12, 37)
    mask = mixed_mask(12, 37)
    with torch.inference_mode():
        on_device = fast(input_ids.to(cuda_device), attention_mask=mask.to(cuda_device),
                         token_type_ids=token_type_ids.to(cuda_device))
        del read_backs[:]
        on_host = fast(input_ids, attention_mask=mask, token_type_ids=token_type_ids)
        assert all(read.endswith(" on cpu") for read in read_backs), read_backs
    torch.testing.assert_close(on_host.last_hidden_state, on_device.last_hidden_state, rtol=0, atol=0)
    torch.testing.assert_close(on_host.pooler_output, on_device.pooler_output, rtol=0, atol=0)


def test_cuda_uses_the_kernels(cuda_device, bert_trio):
    """On a GPU in inference the fused kernels run, not the torch fallbacks (each fallback would be listed)."""
    trio = bert_trio()
    input_ids, _ = random_inputs(trio.config, 2, 6)
    before = set(fastbert.announce.seen())
    _run_on(trio, cuda_device, torch.float16, input_ids, attention_mask=torch.ones(2, 6, dtype=torch.long))
    assert set(fastbert.announce.seen()) == before


@pytest.mark.parametrize("unpad", [True, False], ids=["packed", "dense"])
def test_cuda_training_gradients_match_hf(cuda_device, bert_trio, unpad):
    """Training on a GPU (gradients: the torch ops, packed attention through one masked SDPA): the loss and every
    gradient match HF's in fp32 within 1e-4 of the largest gradient."""
    trio = bert_trio(unpad=unpad)
    input_ids, _ = random_inputs(trio.config, 6, 21)
    mask = mixed_mask(6, 21).to(cuda_device)
    grads = []
    for model in (trio.fast, trio.hf):
        model.to(cuda_device).train()  # dropout probabilities are 0: train mode is deterministic
        out = model(input_ids.to(cuda_device), attention_mask=mask)
        # the pooler only of rows whose first token is real: on a left-padded row the packed path pools zeros where
        # transformers pools a padding token's state (said at run time, fastbert/inputs.py)
        loss = out.last_hidden_state[mask.bool()].square().mean() + out.pooler_output[mask[:, 0].bool()].sum()
        loss.backward()
        grads.append({name: p.grad.cpu() for name, p in model.named_parameters() if p.grad is not None})
    ours, hf = grads
    assert ours.keys() == hf.keys()
    scale = max(g.abs().max().item() for g in hf.values())
    for name, grad_hf in hf.items():
        assert (ours[name] - grad_hf).abs().max().item() <= 1e-4 * scale, name
