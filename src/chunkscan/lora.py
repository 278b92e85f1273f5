"""``chunkscan lora``: ``mlx_lm.lora`` with the chunked Gated DeltaNet backward.

Runs mlx-lm's own LoRA command (its parser, defaults, data loading, trainer and
adapter saving) inside :func:`chunkscan.mlx_lm.patch`, so the Gated DeltaNet layers
of Qwen3-Next / Qwen3.5 models train through :func:`chunkscan.gated_delta_rule`, the
attention layers of every model through :func:`chunkscan.attention`, and their memory
per token stays flat. Every ``mlx_lm.lora`` flag is accepted, plus:

- ``--scan-chunk-size N`` (YAML key ``scan_chunk_size``): steps per chunk of the op;
  the resolved value is saved in ``adapter_config.json``.
- ``--demo``: build a tiny random Qwen3-Next model, tokenizer and data set in a
  temporary directory (no network) and train a few steps on it; other flags still
  apply (e.g. ``chunkscan lora --demo --iters 5``); ``--model``/``--data`` paths that
  do not exist yet are written there instead, and kept.

Settings merge as in ``mlx_lm.lora``: command line > YAML (``-c``) > defaults.
"""

from __future__ import annotations

import contextlib
import inspect
import os
import pathlib
import sys
import tempfile
import types
from typing import Any

import mlx.core as mx

MiB = 1024.0 * 1024.0

DEMO_DEFAULTS = {
    "train": True,
    "iters": 30,
    "batch_size": 2,
    "num_layers": -1,
    "learning_rate": 2e-3,
    "max_seq_length": 512,
    "steps_per_report": 5,
    "steps_per_eval": 30,
    "val_batches": 2,
    "save_every": 1000,
}


def _mlx_lm_lora():
    try:
        import mlx_lm.lora as lora
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise SystemExit(f"chunkscan lora needs mlx-lm (pip install 'chunkscan[lm]'): {e}") from e
    return lora


def op_default_chunk_size() -> int:
    """The ``chunk_size`` default of :func:`chunkscan.gated_delta_rule`."""
    import chunkscan

    op = getattr(chunkscan, "gated_delta_rule", None)
    if op is None:
        return 64
    default = inspect.signature(op).parameters["chunk_size"].default
    return int(default)


def build_parser():
    """``mlx_lm.lora.build_parser()`` plus ``--scan-chunk-size`` and ``--demo``."""
    parser = _mlx_lm_lora().build_parser()
    parser.prog = "chunkscan lora"
    parser.description = (
        "LoRA or QLoRA finetuning (mlx_lm.lora) with Gated DeltaNet layers trained "
        "through chunkscan.gated_delta_rule."
    )
    # mlx_lm.lora gives these two a non-None default, so their YAML keys never
    # apply; None restores CLI > YAML > defaults (CONFIG_DEFAULTS has both).
    parser.set_defaults(clear_cache_threshold=None, trust_remote_code=None)
    parser.add_argument(
        "--scan-chunk-size",
        type=int,
        default=None,
        help="Steps per chunk of chunkscan.gated_delta_rule in Gated DeltaNet layers "
        f"(default: the op's, {op_default_chunk_size()}).",
    )
    parser.add_argument(
        "--demo",
        action="store_true",
        default=None,
        help="Train a tiny random Qwen3-Next model on synthetic data (offline).",
    )
    return parser


def resolve_args(argv: list[str], demo_dir: str | None = None) -> types.SimpleNamespace:
    """Parse ``argv`` and merge YAML, demo and ``mlx_lm.lora`` defaults."""
    lora = _mlx_lm_lora()
    args = vars(build_parser().parse_args(argv))
    if args.get("config"):
        with open(args["config"]) as f:
            config = lora.yaml.load(f, lora.yaml_loader) or {}
        for k, v in config.items():
            if args.get(k) is None:
                args[k] = v
    if args.get("demo") and demo_dir is not None:
        demo = dict(DEMO_DEFAULTS)
        demo["model"] = str(pathlib.Path(demo_dir, "model"))
        demo["data"] = str(pathlib.Path(demo_dir, "data"))
        demo["adapter_path"] = str(pathlib.Path(demo_dir, "adapters"))
        for k, v in demo.items():
            if args.get(k) is None:
                args[k] = v
    defaults = dict(lora.CONFIG_DEFAULTS, scan_chunk_size=op_default_chunk_size(), demo=False)
    for k, v in defaults.items():
        if args.get(k) is None:
            args[k] = v
    chunk = args["scan_chunk_size"]
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
        raise SystemExit(
            f"chunkscan lora: --scan-chunk-size / scan_chunk_size must be a positive "
            f"integer but got {chunk!r}."
        )
    return types.SimpleNamespace(**args)


class _PeakMemory:
    """Training callback printing peak memory at each report; chains mlx-lm's."""

    def __init__(self, inner: Any):
        self.inner = inner

    def on_train_loss_report(self, info: dict[str, Any]) -> None:
        print(
            f"  iter {info['iteration']:>4}: loss {info['train_loss']:.3f}, "
            f"{info['tokens_per_second']:,.0f} tok/s, "
            f"peak memory {mx.get_peak_memory() / MiB:,.0f} MiB",
            flush=True,
        )
        if self.inner is not None:
            self.inner.on_train_loss_report(info)

    def on_val_loss_report(self, info: dict[str, Any]) -> None:
        if self.inner is not None:
            self.inner.on_val_loss_report(info)


@contextlib.contextmanager
def _report_peak_memory(lora: Any):
    """Rebind ``mlx_lm.lora.get_reporting_callbacks`` (restored on exit).

    ``mlx_lm.lora.run`` ignores its ``training_callback`` argument and builds one from
    ``--report-to``, so this is the only way in.
    """
    original = lora.get_reporting_callbacks
    lora.get_reporting_callbacks = lambda *a, **k: _PeakMemory(original(*a, **k))
    try:
        yield
    finally:
        lora.get_reporting_callbacks = original


def _write_demo(args: types.SimpleNamespace) -> None:
    from . import _demo_model

    if not pathlib.Path(args.model, "config.json").exists():
        _demo_model.write_model(args.model)
    if not pathlib.Path(args.data, "train.jsonl").exists():
        _demo_model.write_dataset(args.data)


def run(args: types.SimpleNamespace) -> None:
    """Run ``mlx_lm.lora.run(args)`` with the Gated DeltaNet patch applied."""
    from . import mlx_lm as seam

    lora = _mlx_lm_lora()
    with seam.patch(chunk_size=args.scan_chunk_size) as handle:
        print(
            f"chunkscan: Gated DeltaNet training path -> chunkscan.gated_delta_rule "
            f"(chunk_size={args.scan_chunk_size}; patched: {', '.join(handle.families)}); "
            f"attention training path -> chunkscan.attention",
            flush=True,
        )
        with _report_peak_memory(lora):
            lora.run(args)


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``chunkscan lora``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    os.environ["TOKENIZERS_PARALLELISM"] = "true"
    if "--demo" not in argv:
        run(resolve_args(argv))
        return 0
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    with tempfile.TemporaryDirectory(prefix="chunkscan-lora-demo-") as demo_dir:
        args = resolve_args(argv, demo_dir)
        _write_demo(args)
        print(f"chunkscan lora --demo: tiny random Qwen3-Next model in {args.model}", flush=True)
        run(args)
        kept = (
            not pathlib.Path(args.adapter_path)
            .resolve()
            .is_relative_to(pathlib.Path(demo_dir).resolve())
        )
        where = (
            f"adapters in {args.adapter_path}"
            if kept
            else "the temporary directory is removed now (pass --model, --data and "
            "--adapter-path to keep model, data and adapters)"
        )
        print(
            f"chunkscan lora --demo: done; process peak memory "
            f"{mx.get_peak_memory() / MiB:,.0f} MiB; {where}",
            flush=True,
        )
    return 0
