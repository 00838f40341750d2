"""Input checks: every bad input gets a clear Python exception before any kernel runs.

Shape and dtype checks are free (they read metadata only). Range checks read the data: on a GPU they cost one
host sync per forward, so they can be turned off for latency-critical serving with ``fastbert.set_input_checks(False)``
or ``FASTBERT_CHECK_INPUTS=0``; the kernels then clamp indices into their tables, so a bad id still never reads out
of bounds (it silently embeds a wrong token: garbage in, garbage out, but no crash or memory fault).

The range check is a registered op, so ``torch.compile(fullgraph=True)`` keeps it as one opaque call instead of
breaking the graph on data-dependent Python control flow. It returns the ids it checked, flattened into one
[3, tokens] int64 tensor (word, token type, position), which is what the embedding op consumes anyway.
"""

import os

import torch

from . import dispatch

_checks_enabled = os.environ.get("FASTBERT_CHECK_INPUTS", "1") not in ("0", "false", "False")


def set_input_checks(enabled: bool) -> None:
    """Turn the data-dependent range checks (one host sync per forward on GPU) on or off."""
    global _checks_enabled
    _checks_enabled = bool(enabled)


def input_checks_enabled() -> bool:
    return _checks_enabled


def check_inputs(
    weight: torch.Tensor, input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds,
    max_seq_len: int | None,
) -> tuple[int, int]:
    """Metadata-only checks of the forward's inputs against the model (``weight``: its word embedding table); returns
    (batch, seq_len). Each error names the argument.

    The integer inputs may be on the model's device or, all of them, on the CPU (as tokenizers return them): their
    checks and the sequence lengths packing needs are then read on the host, and a GPU forward never waits for the
    device before its kernels are queued.

    max_seq_len: the longest sequence the position table holds when positions are not given, or None when that
    depends on the data (RoBERTa numbers only non-padding tokens: the range check then tells).
    """
    named = dict(input_ids=input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids,
                 position_ids=position_ids, inputs_embeds=inputs_embeds)
    host = None  # the first integer input found on the CPU while the weights are on another device
    for name, value in named.items():
        if value is None:
            continue
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
        if value.device == weight.device:
            continue
        if name != "inputs_embeds" and value.device.type == "cpu":
            host = host or name
            continue
        raise ValueError(f"{name} is on {value.device} but the model's weights are on {weight.device}: move "
                         "the inputs (or the model) to one device"
                         + ("" if name == "inputs_embeds" else " (the integer inputs may all stay on the CPU)"))
    if host is not None:
        on_device = [n for n, v in named.items() if v is not None and n != "inputs_embeds" and v.device.type != "cpu"]
        if on_device:
            raise ValueError(f"{host} is on the CPU but {on_device[0]} is on {weight.device}: pass the integer inputs "
                             "(ids, mask, token types, positions) all on the CPU or all on the model's device")
    batch, seq_len = _check_shapes(weight.shape[1], input_ids, attention_mask, token_type_ids, position_ids,
                                   inputs_embeds, max_seq_len)
    if inputs_embeds is not None and inputs_embeds.dtype != weight.dtype:
        raise TypeError(f"inputs_embeds is {inputs_embeds.dtype} but the model is {weight.dtype}")
    return batch, seq_len


def _check_shapes(width, input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds,
                  max_seq_len) -> tuple[int, int]:
    if (input_ids is None) == (inputs_embeds is None):
        raise ValueError("pass exactly one of input_ids or inputs_embeds")
    if input_ids is not None:
        _check_integer("input_ids", input_ids)
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [batch, seq_len], got shape {tuple(input_ids.shape)}")
        batch, seq_len = input_ids.shape
    else:
        if inputs_embeds.dim() != 3 or inputs_embeds.shape[-1] != width:
            raise ValueError(f"inputs_embeds must be [batch, seq_len, {width}], got {tuple(inputs_embeds.shape)}")
        if not inputs_embeds.is_floating_point():
            raise TypeError(f"inputs_embeds must be floating point, got {inputs_embeds.dtype}")
        batch, seq_len = inputs_embeds.shape[:2]
    if attention_mask is not None and tuple(attention_mask.shape) != (batch, seq_len):
        raise ValueError(
            f"attention_mask has shape {tuple(attention_mask.shape)} but the input is [{batch}, {seq_len}]"
        )
    if token_type_ids is not None:
        _check_integer("token_type_ids", token_type_ids)
        if tuple(token_type_ids.shape) != (batch, seq_len):
            raise ValueError(
                f"token_type_ids has shape {tuple(token_type_ids.shape)} but the input is [{batch}, {seq_len}]"
            )
    if position_ids is not None:
        _check_integer("position_ids", position_ids)
        if position_ids.dim() != 2 or position_ids.shape[0] not in (1, batch) or position_ids.shape[1] != seq_len:
            raise ValueError(
                f"position_ids has shape {tuple(position_ids.shape)}; expected [{batch}, {seq_len}] or [1, {seq_len}]"
            )
    elif max_seq_len is not None and seq_len > max_seq_len:
        raise ValueError(f"sequence length {seq_len} exceeds the {max_seq_len} positions the model's position table "
                         "holds (config.max_position_embeddings)")
    if batch > 0 and seq_len == 0:
        raise ValueError("zero-length sequences have no first token for the pooler; pass seq_len >= 1")
    return batch, seq_len


def _check_integer(name: str, t: torch.Tensor) -> None:
    # The index dtypes torch's embedding lookups take (transformers accepts the same).
    if t.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"{name} must be an integer tensor of dtype torch.int64 (or torch.int32), got {t.dtype}")


@torch.library.custom_op("fastbert::checked_indices", mutates_args=())
def checked_indices(
    input_ids: torch.Tensor, token_type_ids: torch.Tensor, position_ids: torch.Tensor, limits: list[int],
    positions_name: str = "position_ids",
) -> torch.Tensor:
    """[B, S] ids, token types, positions -> [3, B*S] int64, after checking each lies in [0, limit).

    positions_name: what the error calls the positions (the argument, or how the model derived them).
    """
    stacked = torch.stack([input_ids.flatten(), token_type_ids.flatten(), position_ids.flatten()]).long()
    if stacked.numel() == 0:
        return stacked
    low, high = torch.aminmax(stacked, dim=1)
    check_spans(torch.stack([low, high], dim=1).flatten().tolist(), limits, positions_name)  # the host sync
    return stacked


# A limit meaning "any value": positions that index no table (rotary models compute from them whatever they are, as
# transformers does).
UNBOUNDED = -1


def check_spans(spans: list[int], limits: list[int], positions_name: str) -> None:
    """spans: [min, max] of ids, token types and positions, flattened (6 values read back from the device); limits:
    the tables' sizes, ``UNBOUNDED`` where any value is valid."""
    names = ("input_ids", "token_type_ids", positions_name)
    tables = ("vocab_size", "type_vocab_size", "max_position_embeddings")
    for i, (name, table, limit) in enumerate(zip(names, tables, limits)):
        lo, hi = spans[2 * i], spans[2 * i + 1]
        if limit != UNBOUNDED and (lo < 0 or hi >= limit):
            raise ValueError(
                f"{name} out of range: values span [{lo}, {hi}] but must lie in [0, {limit}) ({table}={limit})"
            )


@checked_indices.register_fake
def _(input_ids, token_type_ids, position_ids, limits, positions_name="position_ids"):
    return input_ids.new_empty((3, input_ids.numel()), dtype=torch.long)


def flat_indices(input_ids, token_type_ids, position_ids, limits: list[int], positions_name: str = "position_ids",
                 read_back: torch.Tensor | None = None, graph_safe: bool = False,
                 ) -> tuple[torch.Tensor, tuple[int, ...] | None]:
    """(the [3, B*S] int64 index tensor, range-checked unless checks are off; ``read_back`` read to the host).

    read_back: a 1-D integer tensor the caller needs on the host (packing: the sequence lengths), or None. It is read
    back in the same transfer as the range check's spans, so a padded forward syncs with the device once (eager
    only: packing never runs under torch.compile, where the check is the registered op).
    Not checked where the data cannot be read: while exporting (the exported graph has no data; the kernels and
    torch ops clamp), on the meta device, or ``graph_safe`` (a CUDA graph being captured, where a read of device data
    is an error: ``fastbert.cuda_graphs`` checks the inputs before it replays).
    """
    checks = _checks_enabled and input_ids.device.type != "meta" and not dispatch.exporting() and not graph_safe
    if read_back is None:
        if checks:
            return checked_indices(input_ids, token_type_ids, position_ids, limits, positions_name), None
        return torch.stack([input_ids.flatten(), token_type_ids.flatten(), position_ids.flatten()]).long(), None
    stacked = torch.stack([input_ids.flatten(), token_type_ids.flatten(), position_ids.flatten()]).long()
    if not checks or stacked.numel() == 0:
        return stacked, tuple(read_back.tolist())
    low, high = torch.aminmax(stacked, dim=1)
    host = torch.cat([torch.stack([low, high], dim=1).flatten(), read_back.long()]).tolist()  # the one host sync
    check_spans(host[:6], limits, positions_name)
    return stacked, tuple(host[6:])
