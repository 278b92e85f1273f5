"""Peak memory and time of one LoRA training step of a tiny Qwen3-Next model.

Three ways to run the Gated DeltaNet layers, each configuration in a fresh process
(:func:`chunkscan.commands.measure.run_isolated`):

- ``stock``: mlx-lm's training path (its per-token loop, ``gated_delta_ops``);
- ``patched``: :func:`chunkscan.mlx_lm.patch` with ``attention=False``, i.e.
  :func:`chunkscan.gated_delta_rule`, attention on MLX's kernel;
- ``stub``: no recurrence at all (``o = v * sigmoid(b)``), the memory of everything
  else in the model; ``patched - stub`` is the recurrence's share.

``patched+attn`` and ``stub+attn`` also route the attention layer through
:func:`chunkscan.attention` (``patch()``'s default, what ``chunkscan lora`` runs).

The step is mlx-lm's trainer step: ``nn.value_and_grad`` of ``default_loss`` and an
Adam update of the LoRA parameters (rank 8, all layers), under
``mx.compile(inputs=state, outputs=state)``. Memory is ``mx.get_peak_memory()`` above
the active memory before the (already compiled) step.

    python bench/lora.py                      # T = 512 ... 8192, all three modes
    python bench/lora.py --T 1024 --modes patched stub --json /tmp/x.json
    python bench/lora.py --T 512 8192 --modes patched patched+attn stub stub+attn
    python bench/lora.py --cold-jit --T 512 --modes stub patched --repeats 1

The first compiled step (``first_step_seconds``) includes MLX's compile of every fused
kernel not yet in its on-disk caches; rows record how many CUDA PTX files were cached
before (``ptx_cache_files_before``), and with ``--cold-jit`` each configuration starts
from empty caches and counts the kernels it compiled (``kernels_compiled``).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import sys
import tempfile
import time
from typing import Any

ROOT = pathlib.Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
MiB = 1024.0 * 1024.0
MODES = ("stock", "patched", "patched+attn", "stub", "stub+attn")


def _stub_update(q, k, v, a, b, A_log, dt_bias, state=None, mask=None, **_):
    import mlx.core as mx

    B, _, Hk, Dk = k.shape
    Hv, Dv = v.shape[-2:]
    out = (v * mx.sigmoid(b)[..., None]).astype(q.dtype)
    return out, mx.zeros((B, Hv, Dv, Dk), dtype=mx.float32)


def measure(
    mode: str,
    T: int,
    batch: int = 1,
    chunk_size: int | None = None,
    repeats: int = 2,
    seed: int = 0,
    config: dict[str, Any] | None = None,
    dtype: str = "float32",
    save_states: str | None = None,
    memory_limit_mib: int | None = None,
) -> dict[str, Any]:
    """One configuration (run in its own process by :func:`main`); ``save_states``:
    ``patch()``'s (``None``: its default); ``memory_limit_mib``: MLX's memory limit set
    this far above the active memory once the model and the tokens exist
    (``mx.set_memory_limit``; MLX then waits for committed work to free memory)."""
    import mlx.core as mx
    import mlx.nn as nn
    import mlx.optimizers as optim
    import mlx_lm.models.qwen3_next as qwen3_next
    from mlx_lm.tuner.trainer import default_loss
    from mlx_lm.tuner.utils import linear_to_lora_layers

    import chunkscan.mlx_lm as cmlx
    from chunkscan.commands.demo_model import build_model, tiny_config
    from chunkscan.commands.measure import peak_above_active

    config = tiny_config(**(config or {}))
    model = build_model(config, seed)
    if dtype != "float32":  # the frozen weights in dtype (as a bf16 checkpoint loads)
        model.set_dtype(getattr(mx, dtype))
    model.freeze()
    linear_to_lora_layers(model, len(model.layers), {"rank": 8, "dropout": 0.0, "scale": 20.0})
    model.train()
    optimizer = optim.Adam(learning_rate=1e-5)

    base, _, attn = mode.partition("+")
    if base not in ("stock", "patched", "stub") or attn not in ("", "attn"):
        raise ValueError(
            f"[bench.lora] mode must be stock, patched, patched+attn, stub or stub+attn but "
            f"got {mode!r}."
        )
    handle = None
    if base == "patched" or attn:
        extra = {} if save_states is None else {"save_states": save_states}
        handle = cmlx.patch(chunk_size=chunk_size, attention=bool(attn), **extra)
    stock_update = qwen3_next.gated_delta_update
    if base == "stub":
        qwen3_next.gated_delta_update = _stub_update

    tokens = mx.random.randint(3, config["vocab_size"], (batch, T + 1), key=mx.random.key(seed))
    lengths = mx.array([[0, T + 1]] * batch)
    loss_value_and_grad = nn.value_and_grad(model, default_loss)
    state = [model.state, optimizer.state, mx.random.state]
    if memory_limit_mib:
        mx.eval(tokens, lengths, model.parameters())
        mx.set_memory_limit(mx.get_active_memory() + (memory_limit_mib << 20))

    def step(tokens, lengths):
        (loss, ntoks), grad = loss_value_and_grad(model, tokens, lengths)
        optimizer.update(model, grad)
        return loss, ntoks

    step = mx.compile(step, inputs=state, outputs=state)

    def run():
        out = step(tokens, lengths)
        mx.eval(state, out)
        return out

    t0 = time.perf_counter()
    loss, _ = run()  # trace, compile and run once
    first = time.perf_counter() - t0
    _, peak = peak_above_active(lambda: run()[0])
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        run()
        times.append(time.perf_counter() - t0)
    if handle is not None:
        qwen3_next.gated_delta_update = cmlx._INSTALLED_GDN  # what undo() restores
        handle.undo()
    if base == "stub":  # (a process of its own under main; a test's process goes on)
        qwen3_next.gated_delta_update = stock_update
    # the chunk the patched op ran at (stock and stub run no op: no chunk_run)
    ran = {}
    if base == "patched":
        ran["chunk_run"] = _chunk_run(config, batch, T, chunk_size, dtype)
    return {
        "mode": mode,
        "T": T,
        "batch": batch,
        "chunk_size": chunk_size,
        **ran,
        "loss": loss.item(),
        "peak_mib": peak / MiB,
        "mib_per_token": peak / MiB / (batch * T),
        # the median (with an even count the mean of the middle two: the element at
        # len // 2 was the slower of two steps at the default --repeats 2, found by
        # probing) and every step's time
        "seconds_per_step": statistics.median(times),
        "step_seconds": times,
        "first_step_seconds": first,
        "device": str(mx.default_device()),
        "dtype": dtype,
        "save_states": None if handle is None else handle.save_states,
        "memory_limit_mib": memory_limit_mib,
    }


def _chunk_run(config: dict[str, Any], batch: int, T: int, chunk_size: int | None,
               dtype: str) -> int:  # fmt: skip
    """The chunk the patched op runs at for the model's Gated DeltaNet layers at ``T``
    (``_common.gdn_chunking``: the op's default where ``chunk_size`` is None, cut to
    ``T``). The rows held the chunk asked alone, ``None`` or 64 at T = 16 (found by
    probing); the stock and stub rows run no op and record none."""
    import mlx.core as mx
    from _common import gdn_chunking

    Hk, Hv = config["linear_num_key_heads"], config["linear_num_value_heads"]
    Dk, Dv = config["linear_key_head_dim"], config["linear_value_head_dim"]
    qk = mx.zeros((batch, T, Hk, Dk), getattr(mx, dtype))
    v = mx.zeros((batch, T, Hv, Dv), getattr(mx, dtype))
    gate = mx.zeros((batch, T, Hv), mx.float32)  # (the seam's log gate and beta)
    return gdn_chunking(qk, qk, v, gate, gate, chunk_size=chunk_size).C


def _ptx_cache_files(env: dict[str, str]) -> int:
    """Kernels in MLX's CUDA PTX cache (``MLX_PTX_CACHE_DIR``, by default
    ``<tmp>/mlx/<version>/ptx``) before a configuration runs: 0 means its first step
    compiles every kernel it runs (a fresh machine, or ``--cold-jit``)."""
    import mlx.core as mx

    default = pathlib.Path(tempfile.gettempdir(), "mlx", mx.__version__, "ptx")
    path = pathlib.Path(
        env.get("MLX_PTX_CACHE_DIR") or os.environ.get("MLX_PTX_CACHE_DIR") or default
    )
    return sum(1 for _ in path.rglob("*.ptx")) if path.is_dir() else 0


def _ratio(x: dict[str, Any], y: dict[str, Any]) -> str:
    if "peak_mib" in x and "peak_mib" in y:
        return f"{x['peak_mib'] / y['peak_mib']:.3f}"
    return ""


# What a row's setup is besides its mode and T (its commit included: --merge keeps rows
# of other runs; not the chunk size and save mode, which only the patched modes have).
# The table pairs a mode's row with another's, and a T with the smallest, only within
# one setup: keyed on (mode, T) alone, a merged batch-4 patched row was set against a
# batch-1 stub row (patched/stub 5.4; found by probing).
_SETUP = ("batch", "dtype", "memory_limit_mib", "config", "commit")


def _setup(r: dict[str, Any]) -> tuple:
    return tuple(json.dumps(r.get(k), sort_keys=True) for k in _SETUP)


def _table(rows: list[dict[str, Any]], modes: list[str], Ts: list[int]) -> str:
    by = {(r["mode"], r["T"], _setup(r)): r for r in rows}
    setups = list(dict.fromkeys(_setup(r) for r in rows))
    # the fields that tell the setups apart, named in the T column where there are
    # several (none in the table of one run)
    differ = [k for i, k in enumerate(_SETUP) if len({s[i] for s in setups}) > 1]
    t0 = min(Ts)
    head = (
        "| T | "
        + " | ".join(f"{m} MiB | {m} MiB/tok | {m} s/step (first step)" for m in modes)
        + " | patched/stock | patched/stub | (patched-stub) MiB/tok | "
        + " | ".join(f"{m} MiB/tok vs T={t0}" for m in modes)
        + " |"
    )
    sep = "|" + "---|" * (1 + 4 * len(modes) + 3)
    lines = [head, sep]
    for setup in setups:
        lines += _table_rows(by, setup, differ, modes, Ts, t0)
    return "\n".join(lines)


def _table_rows(by, setup, differ, modes, Ts, t0) -> list[str]:
    """The table's lines of one setup (see :data:`_SETUP`), one per T it has."""
    lines = []
    for T in Ts:
        if not any((m, T, setup) in by for m in modes):
            continue
        named = [f"{k} {json.loads(setup[_SETUP.index(k)])}" for k in differ]
        cells = [str(T) + (f" ({', '.join(named)})" if named else "")]
        for m in modes:
            r = by.get((m, T, setup), {})
            if "peak_mib" in r:
                step = f"{r['seconds_per_step']:.2f} ({r['first_step_seconds']:.1f})"
                cells += [f"{r['peak_mib']:.0f}", f"{r['mib_per_token']:.3f}", step]
            else:
                cells += [r.get("error", "not run")[:50], "", ""]
        p, s, st = (by.get((m, T, setup), {}) for m in ("patched", "stock", "stub"))
        cells += [_ratio(p, s), _ratio(p, st)]
        if "peak_mib" in p and "peak_mib" in st:
            # per token of the batch, as the MiB/tok columns (it divided by T alone)
            tokens = T * p.get("batch", 1)
            cells.append(f"{(p['peak_mib'] - st['peak_mib']) / tokens:.4f}")
        else:
            cells.append("")
        for m in modes:
            r, r0 = by.get((m, T, setup), {}), by.get((m, t0, setup), {})
            ok = "mib_per_token" in r and "mib_per_token" in r0
            cells.append(f"{r['mib_per_token'] / r0['mib_per_token']:.3f}" if ok else "")
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def _plot(rows: list[dict[str, Any]], modes: list[str], path: pathlib.Path, device: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing: no plot", file=sys.stderr)
        return
    fig, (ax0, ax1, ax2) = plt.subplots(1, 3, figsize=(15, 4.2))
    # a line per mode and setup (see _SETUP), as the table keeps them apart: keyed on
    # (mode, T) alone, a --merge set a batch-3 patched row against a batch-1 stub row
    # and drew every setup of a mode as one line (found by probing, session 48)
    measured = [r for r in rows if "peak_mib" in r]
    by = {(r["mode"], r["T"], _setup(r)): r for r in measured}
    setups = list(dict.fromkeys(_setup(r) for r in measured))
    differ = [k for i, k in enumerate(_SETUP) if len({s[i] for s in setups}) > 1]

    def label(m: str, setup: tuple) -> str:
        named = [f"{k} {json.loads(setup[_SETUP.index(k)])}" for k in differ]
        return f"{m} ({', '.join(named)})" if named else m

    for setup in setups:
        for m in ("stock", "patched"):
            pts = sorted(T for (mm, T, s) in by if (mm, s) == (m, setup)
                         and ("stub", T, setup) in by)  # fmt: skip
            share = [(by[(m, T, setup)]["peak_mib"] - by[("stub", T, setup)]["peak_mib"])
                     / (T * by[(m, T, setup)].get("batch", 1)) for T in pts]  # fmt: skip
            if pts:
                ax2.plot(pts, share, "o-", label=f"{label(m, setup)} - stub")
        for m in modes:
            # sorted by T only: two rows of one T compared the dicts and raised after
            # the measuring, leaving the old plot (found by probing)
            pts = sorted(((r["T"], r) for r in measured
                          if r.get("mode") == m and _setup(r) == setup),
                         key=lambda tr: tr[0])  # fmt: skip
            if not pts:
                continue
            Ts = [t for t, _ in pts]
            ax0.plot(Ts, [r["mib_per_token"] for _, r in pts], "o-", label=label(m, setup))
            ax1.plot(Ts, [r["seconds_per_step"] for _, r in pts], "o-", label=label(m, setup))
    panels = (
        (ax0, "peak memory per token (MiB)"),
        (ax1, "seconds per step"),
        (ax2, "recurrence's share per token (MiB)"),
    )
    for ax, title in panels:
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("sequence length T")
        ax.set_title(title)
        ax.grid(True, which="both", alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend()
    fig.suptitle(f"One LoRA step, tiny Qwen3-Next (3 GDN + 1 attention layers), {device}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def _config_overrides(text: str) -> dict[str, Any]:
    """``--config``'s type: a JSON object (a list or a number failed after measuring)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not JSON ({exc}): {text!r}") from None
    if not isinstance(value, dict):
        example = '{"hidden_size": 2048}'
        raise argparse.ArgumentTypeError(f"must be a JSON object, e.g. '{example}', "
                                         f"but got {text!r}")  # fmt: skip
    return value


def _check_config_fields(parser: argparse.ArgumentParser, config: dict | None) -> None:
    """``--config``'s keys must be fields of the model's ``ModelArgs``: mlx-lm's
    ``from_dict`` drops the others, so a misspelt key measured the default model
    (found by probing). Its ``model_type`` must be ``qwen3_next``, the model this script
    measures: the stub replaces ``qwen3_next.gated_delta_update`` only and the titles name
    Qwen3-Next, so another model type ran its own recurrence under "stub" (qwen3_5: a
    negative patched - stub share) or none at all (llama: every ratio 1.000), with exit
    status 0 (found by probing)."""
    if not config:
        return
    import dataclasses
    import importlib

    model_type = config.get("model_type", "qwen3_next")
    if model_type != "qwen3_next":
        parser.error(f"argument --config: model_type {model_type!r} is not supported: this "
                     "script stubs and labels qwen3_next only; leave model_type out or set "
                     "it to 'qwen3_next'")  # fmt: skip
    arch = importlib.import_module(f"mlx_lm.models.{model_type}")
    fields = {f.name for f in dataclasses.fields(arch.ModelArgs)}
    unknown = sorted(set(config) - fields - {"model_type"})
    if unknown:
        parser.error(f"argument --config: {', '.join(map(repr, unknown))} not fields of "
                     f"mlx_lm.models.{model_type}.ModelArgs (it would drop them)")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    from _common import Once, check_outputs, non_negative_int, positive_float, positive_int

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--T", type=positive_int, nargs="+", action=Once, default=[512, 1024, 2048, 4096, 8192]
    )
    # choices: an unknown mode gave one error row per T and exit status 0 (found by probing)
    parser.add_argument(
        "--modes", nargs="+", action=Once, default=["stock", "patched", "stub"], choices=MODES
    )
    parser.add_argument("--batch", type=positive_int, default=1)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                        help="the model's weights (and so the activations); on CUDA, "
                        "chunkscan.attention's kernels take bfloat16 only")  # fmt: skip
    parser.add_argument("--chunk-size", type=positive_int, default=None)
    from chunkscan.ops.gated_delta.chunk import SAVE_MODES

    parser.add_argument("--save-states", choices=SAVE_MODES, default=None,
                        help="what the patched op keeps for the backward (default: "
                        "patch()'s, groups)")  # fmt: skip
    parser.add_argument("--memory-limit-mib", type=non_negative_int, default=None,
                        help="MLX's memory limit this far above the model and tokens "
                        "(mx.set_memory_limit; 0: none, as left out); with "
                        "MLX_MAX_MB_PER_BUFFER=64 in the environment it bounds the op's "
                        "peak on CUDA (docs/mlx_lm.md)")  # fmt: skip
    parser.add_argument("--repeats", type=positive_int, default=2)
    parser.add_argument("--max-stock-gib", type=positive_float, default=20.0,
                        help="skip stock once its predicted peak exceeds this")  # fmt: skip
    parser.add_argument("--config", type=_config_overrides, default=None,
                        help="JSON overrides of the tiny model's config.json, e.g. "
                        "'{\"hidden_size\": 2048}'")  # fmt: skip
    parser.add_argument("--timeout", type=positive_float, default=1800.0)
    parser.add_argument("--cold-jit", action="store_true",
                        help="give each configuration empty kernel caches (TMPDIR for the CPU "
                        "backend, MLX_PTX_CACHE_DIR for CUDA), so that its first step compiles "
                        "every kernel it runs; rows count them: kernels_compiled")  # fmt: skip
    # a string until checked: pathlib drops a folder's trailing slash (probing)
    parser.add_argument("--json", default=str(ROOT / "bench-out" / "lora.json"))
    parser.add_argument("--replot", type=pathlib.Path, default=None, metavar="JSON",
                        help="only rebuild the table and plot from this file, written beside "
                        "--json (default bench-out/), never beside the file read")  # fmt: skip
    parser.add_argument("--merge", action="store_true",
                        help="keep the other rows already in --json")  # fmt: skip
    args = parser.parse_args(argv)
    _check_config_fields(parser, args.config)
    from _common import read_saved, replotted_inputs, write_json

    # --replot's file as an input, as attention.py's and gated_delta.py's --from-json:
    # --replot R --json R over a committed R rewrote the table and plot committed
    # beside it (found by probing, session 49); one's own run in bench-out/ in place is
    # fine (replotted_inputs)
    replot = str(args.replot) if args.replot else None
    check_outputs(parser, {"--json": args.json}, beside=(".md", ".png"),
                  inputs=replotted_inputs(replot, args.json))  # fmt: skip
    args.json = pathlib.Path(args.json)

    if args.replot:
        # Beside --json: writing beside the file read rewrote committed results (their
        # tables gained columns; found by probing).
        data = read_saved(parser, "--replot", str(args.replot), keys=("meta", "rows"),
                          row_keys=ROW_KEYS, measured_keys=MEASURED_KEYS)  # fmt: skip
        args.json.parent.mkdir(parents=True, exist_ok=True)
        # the rows too: a --json of another run stayed beside the new table and plot
        # (found by probing)
        if args.json.resolve() != args.replot.resolve():
            write_json(args.json, data["meta"], data["rows"])
        _write_outputs(data["meta"], data["rows"], args.json)
        return 0

    # The rows --merge keeps, read before measuring: a --json it could not read failed
    # only after every configuration had run (found by probing).
    old = None
    if args.merge and args.json.exists():
        old = read_saved(parser, "--json", str(args.json), keys=("meta", "rows"),
                         row_keys=ROW_KEYS, measured_keys=MEASURED_KEYS)  # fmt: skip
    from _common import child_env, empty_kernel_caches, exit_status, json_text, kernels_compiled
    from _common import meta as provenance

    from chunkscan.commands.measure import run_isolated

    env = child_env(bench=True)  # (measure imports _common)
    run_meta = provenance(__file__, argv)  # once: git and nvidia-smi
    commit = run_meta.get("commit")  # per row: --merge keeps rows of other runs
    rows: list[dict[str, Any]] = []
    stock_per_token = None
    for T in sorted(args.T):
        for mode in args.modes:
            cfg = {"mode": mode, "T": T, "batch": args.batch, "chunk_size": args.chunk_size,
                   "repeats": args.repeats, "dtype": args.dtype}  # fmt: skip
            if args.save_states:
                cfg["save_states"] = args.save_states
            if args.memory_limit_mib:
                cfg["memory_limit_mib"] = args.memory_limit_mib
            if args.config:
                cfg["config"] = args.config
            if mode == "stock" and stock_per_token is not None:
                predicted = stock_per_token * T * args.batch / 1024
                if predicted > args.max_stock_gib:
                    row = dict(cfg, error=f"skipped (predicted {predicted:.0f} GiB)")
                    rows.append(row)
                    print(json.dumps(row), flush=True)
                    continue
            t0 = time.perf_counter()
            with tempfile.TemporaryDirectory() as empty:
                run_env = env
                if args.cold_jit:
                    run_env = dict(env, **empty_kernel_caches(empty))
                cached = _ptx_cache_files(run_env)
                row = run_isolated("bench.lora:measure", cfg, timeout=args.timeout, env=run_env)
                row["ptx_cache_files_before"] = cached
                if args.cold_jit:
                    row["kernels_compiled"] = kernels_compiled(empty)
            row = dict(cfg, **row, wall_seconds=time.perf_counter() - t0, commit=commit)
            if mode == "stock" and "mib_per_token" in row:
                stock_per_token = row["mib_per_token"]
            rows.append(row)
            print(json.dumps(row), flush=True)

    args.json.parent.mkdir(parents=True, exist_ok=True)
    measured = list(rows)
    commands = []
    if old is not None:
        # A row is replaced only by one of the same mode, T, chunk size, save mode,
        # memory limit, batch, dtype and model config (the last three were left out:
        # rows of another batch or model replaced each other; found by probing).
        def key(r):
            return (r["mode"], r["T"], r.get("chunk_size"), r.get("save_states"),
                    r.get("memory_limit_mib"), r.get("batch", 1), r.get("dtype", "float32"),
                    json.dumps(r.get("config"), sort_keys=True))  # fmt: skip

        new_keys = {key(r) for r in rows}
        rows = [r for r in old["rows"] if key(r) not in new_keys] + rows
        commands = old["meta"].get("commands", [old["meta"].get("command")])
    import platform

    import mlx.core as mx
    import mlx_lm

    from chunkscan.commands.demo_model import tiny_config

    meta = {
        # this run's command as meta.argv records it (the argv main parsed)
        "commands": commands + [" ".join(run_meta["argv"])],
        "mlx": mx.__version__,
        "mlx_lm": mlx_lm.__version__,
        "machine": platform.platform(),
        "cpus": os.cpu_count(),
        "model": tiny_config(**(args.config or {})),
        "lora": {"rank": 8, "layers": "all"},
        **run_meta,
    }
    args.json.write_text(json_text({"meta": meta, "rows": rows}, indent=2))
    _write_outputs(meta, rows, args.json)
    return exit_status(measured, "lora.py")  # this run's rows, not the merged ones


# What every row must hold (a --replot or --merge of another script's JSON was a KeyError,
# after measuring for --merge; found by probing), and what a row without "error" holds.
ROW_KEYS = ("mode", "T")
MEASURED_KEYS = ("peak_mib", "mib_per_token", "seconds_per_step", "first_step_seconds")


def _write_outputs(meta: dict[str, Any], rows: list[dict[str, Any]], path: pathlib.Path) -> None:
    modes = [m for m in MODES if any(r["mode"] == m for r in rows)]
    table = _table(rows, modes, sorted({r["T"] for r in rows}))
    cmds = "\n".join(f"    {c}" for c in meta.get("commands", []))
    path.with_suffix(".md").write_text(
        f"# One LoRA step, tiny Qwen3-Next, {meta.get('device', 'CPU')}\n\n{cmds}\n\n{table}\n"
    )
    _plot(rows, modes, path.with_suffix(".png"), meta.get("device", "CPU"))
    print(table)


if __name__ == "__main__":
    sys.exit(main())
