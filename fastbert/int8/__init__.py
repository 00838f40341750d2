"""CPU int8: the encoder's GEMMs (and, where the guard passes, its attention) in int8 on the CPU.

    quantize.py      ``fastbert.quantize(model)``: choose, guard, record the decision in the config
    guard.py         the accuracy guard: int8 against float32 on real sentences, and its ladder of recipes
    guard_inputs.py  the guard's sentences, the model's tokenizer, the batches it runs
    choices.py       which Linears and attentions run in int8 (a ``Choice`` on the module), whether int8 runs here,
                     and the ranges the guard records of the GEMM inputs
    decisions.py     a decision applied again from a checkpoint's config, and reported
    linear.py        the int8 GEMM (fastbert's own for 7-bit weights, oneDNN's quantized linear for 8-bit ones), and
                     the activation quantizers
    native_gemm.py   fastbert._C's int8 GEMM (CPUs without VNNI: 7-bit weights)
    handoff.py       the u8 an op writes beside its output for the int8 GEMM that reads it next

The ops run them through their ``int8`` backends (``ops/gemm.py``, ``ops/mlp.py``, ``ops/norm.py``,
``ops/attention.py`` with ``ops/attention_int8.py``). Nothing is imported here: ``choices`` reads the CPU's
measurements (``cpu.py``), which time ``linear``, so importing a submodule must not import the others.
"""
