"""The ``chunkscan`` commands and their harnesses; not part of the library API.

- :mod:`.cli`: ``chunkscan <command>`` (also ``python -m chunkscan``).
- :mod:`.repro`: ``chunkscan repro``, the measurement driver, its table and plot.
- :mod:`.reporter`: the reporter's recurrence of MLX issue #4837 in every mode.
- :mod:`.lora`: ``chunkscan lora``, ``mlx_lm.lora`` with :func:`chunkscan.mlx_lm.patch`.
- :mod:`.demo_model`: a tiny random Qwen3-Next model, tokenizer and data set (offline).
- :mod:`.measure`: memory and time measurement, each configuration in a fresh process.
"""
