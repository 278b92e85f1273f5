"""``chunkscan lora``: ``mlx_lm.lora`` under :func:`chunkscan.mlx_lm.patch` (the chunked
recurrences and attention).

Runs mlx-lm's own LoRA command (its parser, defaults, data loading, trainer and
adapter saving) inside :func:`chunkscan.mlx_lm.patch`, so the Gated DeltaNet layers
of Qwen3-Next / Qwen3.5 models train through :func:`chunkscan.gated_delta_rule`, the
attention layers of every model that calls mlx-lm's ``scaled_dot_product_attention``
through :func:`chunkscan.attention`, and their memory per token stays flat. Every
``mlx_lm.lora`` flag is accepted, plus:

- ``--gdn-chunk-size N`` (YAML key ``gdn_chunk_size``): steps per chunk of
  :func:`chunkscan.gated_delta_rule` in the Gated DeltaNet layers (default:
  :func:`op_default_chunk_size`); the resolved value is saved in ``adapter_config.json``.
  ``--scan-chunk-size`` / ``scan_chunk_size`` are deprecated aliases (they warn).
- ``--demo``: build a tiny random Qwen3-Next model, tokenizer and data set in a
  temporary directory (no network) and train a few steps on it; other flags still
  apply (e.g. ``chunkscan lora --demo --iters 5``); ``--model``/``--data`` paths that
  do not exist yet are written there instead, and kept. The demo never writes into a
  directory it did not create (it marks its own with a ``.chunkscan-demo`` file): an
  existing ``--model`` folder with a ``config.json`` (or ``--data`` folder with a
  ``train.jsonl``) is used as it is, any other existing folder is refused; so is an
  existing ``--adapter-path`` folder it did not make (training would replace the
  adapters there with ones of a model deleted at exit; found by probing).

Settings merge as in ``mlx_lm.lora``: command line > YAML (``-c``) > defaults. Before
anything is loaded, the command checks that there is something to do (``--train`` or
``--test``) and that ``--model`` and ``--data`` name an existing folder or a Hugging
Face repo id (``namespace/name``), that every data file there reads as mlx-lm reads it
(one JSON example per line, none blank, each with the first line's keys:
:func:`chunkscan.commands._lora_data._read_examples`) and none is empty, that the numbers
mlx-lm takes unchecked are in range (``--batch-size``, ``--iters``, ``--num-layers``,
``--val-batches``, ``--learning-rate``, ...:
:data:`chunkscan.commands._lora_config._WHOLE_NUMBERS`; ``--batch-size -2`` hung mlx-lm
for ever, ``--num-layers 0`` trained every layer; ``--iters`` at least
``--grad-accumulation-steps``), that an ``lr_schedule`` builds, its rate within
``--learning-rate``'s bounds at every step up to ``--iters``, and ``--report-to`` names
installed services, that the YAML file decodes and parses, its ``optimizer_config``
builds the optimizer mlx-lm builds
(:func:`chunkscan.commands._lora_config._check_optimizer_config`), and that a
``--resume-adapter-file`` comes with ``--train`` (one from ``-c`` without it: a warning
that it is not read), loads,
and has this run's fine-tune type, rank and scale, its layers and projections among
those this run wraps (:func:`chunkscan.commands._lora_adapters._check_resumed_adapters`),
and says what is wrong; a failed Hub download is reported in one line, not as a
traceback. Once the model is wrapped, a resumed file's tensors must all name its
parameters, with their shapes
(:func:`chunkscan.commands._lora_adapters._check_resumed_weights_fit`); after training,
the saved adapters must be finite
(:func:`chunkscan.commands._lora_adapters._check_saved_adapters`).
"""

from __future__ import annotations

import argparse
import os
import pathlib
import sys
import tempfile
import types
import warnings

import mlx.core as mx

from .._backend import plain_int
from ..ops.gated_delta.chunk import SAVE_MODES
from ..split import check_chunk_size
from ._lora_adapters import (
    _adapter_stamps,
    _check_adapter_paths,
    _check_resumed_adapters,
    _check_saved_adapters,
    _resumed_weights_must_fit,
    _say_what_a_failure_left,
)
from ._lora_common import PROG, MiB, _mlx_lm_lora
from ._lora_config import (
    _OLD_FLAG,
    _OLD_KEY,
    _check_config,
    _check_config_values,
    _check_numbers,
    _check_optimizer_config,
    _check_report_to,
    _not_text,
    _unread_resume_from_config,
)
from ._lora_demo import (
    DEMO_DEFAULTS,
    _demo_adapter_folder,
    _demo_banner,
    _demo_kept,
    _mark_demo_folder,
    _write_demo,
)
from ._lora_inputs import _check_local_inputs, _check_something_to_do, _hub_errors, check_args
from ._lora_reports import _lora_keys_must_name_modules, _model_routes, _report_peak_memory
from ._stdout import guarded_stdout, say


def op_default_chunk_size() -> int:
    """The ``chunk_size`` :func:`chunkscan.gated_delta_rule` uses when given none, for
    head sizes ``Dk = Dv = 128`` on this machine (:func:`default_chunk_size`'s defaults:
    32 on a CPU, 64 on an Apple GPU; on a CUDA GPU 32, 64 or 128, depending on the fused
    kernels)."""
    from ..ops.gated_delta.chunk import default_chunk_size

    return default_chunk_size()


def _warn_renamed(old: str, new: str) -> None:
    warnings.warn(
        f"{PROG}: {old} is deprecated (it sets the Gated DeltaNet op's chunk, not a scan's); "
        f"use {new}.",
        FutureWarning,
        stacklevel=2,
    )


def _chunk_size_arg(text: str) -> int:
    """argparse ``type`` of ``--gdn-chunk-size``: :func:`chunkscan.split.check_chunk_size`."""
    try:  # ASCII digits only: int() read 1_6 as 16, and other scripts' digits (probing)
        value: object = plain_int(text)
    except ValueError:
        value = text
    try:
        return check_chunk_size(PROG, value, example=op_default_chunk_size())
    except (TypeError, ValueError) as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _size_arg(parse):
    """``parse`` (mlx-lm's ``_parse_size``: "512", "1.5G", "100MB") as an argparse type:
    its ``decimal.InvalidOperation`` or ``KeyError`` for "abc" or "-5" came out of
    argparse as a traceback (found by probing)."""

    def size(text: str) -> int:
        try:
            value = parse(text)
        except Exception:  # noqa: BLE001 (any of mlx-lm's parse errors)
            value = None
        if not isinstance(value, int) or value < 0:
            raise argparse.ArgumentTypeError(
                f"must be a size in bytes such as 512, 100MB or 1.5G, not {text!r}"
            )
        return value

    return size


class _GdnChunkSize(argparse.Action):
    """Stores ``--gdn-chunk-size``; warns when it is given as ``--scan-chunk-size``."""

    def __call__(self, parser, namespace, values, option_string=None):
        if option_string == _OLD_FLAG:
            _warn_renamed(_OLD_FLAG, "--gdn-chunk-size")
        setattr(namespace, self.dest, values)


def build_parser():
    """``mlx_lm.lora.build_parser()`` plus ``--gdn-chunk-size``, ``--gdn-save-states``
    and ``--demo``."""
    parser = _mlx_lm_lora().build_parser()
    parser.prog = PROG
    parser.description = (
        "LoRA or QLoRA finetuning (mlx_lm.lora) under chunkscan.mlx_lm.patch(): the "
        "recurrences of Gated DeltaNet (Qwen3-Next, Qwen3.5, Kimi Linear / K3, "
        "Olmo hybrid, Bailing MoE V3), Lightning attention (Bailing), Mamba / Mamba2 / "
        "Jamba and RWKV-7, and "
        "softmax attention, trained through chunkscan's ops in memory that does not grow "
        "with the sequence."
    )
    # mlx_lm.lora gives these two a non-None default, so their YAML keys never
    # apply; None restores CLI > YAML > defaults (CONFIG_DEFAULTS has both).
    parser.set_defaults(clear_cache_threshold=None, trust_remote_code=None)
    for action in parser._actions:
        if action.dest == "clear_cache_threshold" and action.type is not None:
            action.type = _size_arg(action.type)  # mlx-lm's raises decimal's errors
            # mlx_lm.lora never passes it to training (docs/mlx_lm.md; found by probing)
            action.help = (action.help or "") + " (No effect in mlx-lm 0.32.2's training.)"
        if action.dest == "optimizer" and action.choices:  # its help left muon out
            action.help = f"Optimizer to use for training: {', '.join(action.choices)}."
    parser.add_argument(
        "--gdn-chunk-size",
        _OLD_FLAG,
        dest="gdn_chunk_size",
        type=_chunk_size_arg,
        action=_GdnChunkSize,
        default=None,
        metavar="N",
        help="Steps per chunk of chunkscan.gated_delta_rule in Gated DeltaNet layers "
        f"(default: {op_default_chunk_size()} on this machine: "
        "chunkscan.ops.gated_delta.default_chunk_size() for heads of 128, which is 32 on "
        "a CPU, 64 on an Apple GPU and 32, 64 or 128 on a CUDA GPU; "
        f"{_OLD_FLAG} is a deprecated alias).",
    )
    parser.add_argument(
        "--gdn-save-states",
        dest="gdn_save_states",
        choices=SAVE_MODES,
        default=None,
        help="What chunkscan.gated_delta_rule keeps for the backward: one state per group "
        "of chunks ('groups', the default: less memory over many layers) or per chunk "
        "('chunks': a slightly faster backward).",
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
    parser = build_parser()
    args = vars(parser.parse_args(argv))
    given = {k for k, v in args.items() if v is not None}  # the command line's
    if args.get("config"):
        args["config"] = os.path.expanduser(args["config"])  # '~/x.yaml' unread (probing)
        try:
            with open(args["config"]) as f:
                config = lora.yaml.load(f, lora.yaml_loader) or {}
        except OSError as e:
            raise SystemExit(
                f"{PROG}: -c {args['config']}: the config file cannot be read "
                f"({e.strerror or e}). Pass the path of a YAML file."
            ) from None
        except UnicodeDecodeError as e:  # a traceback (found by probing, session 52)
            raise SystemExit(_not_text(args["config"], e)) from None
        except lora.yaml.YAMLError as e:  # a traceback before (found by probing)
            where = getattr(e, "problem_mark", None)
            at = f" at line {where.line + 1}, column {where.column + 1}" if where else ""
            raise SystemExit(
                f"{PROG}: -c {args['config']}: the config file is not valid YAML{at} "
                f"({getattr(e, 'problem', None) or type(e).__name__}). Fix it, or pass "
                f"another file."
            ) from None
        config = _check_config(args["config"], config, args, lora.CONFIG_DEFAULTS)
        _check_config_values(args["config"], config, parser, args)
        if _OLD_KEY in config:
            _warn_renamed(f"the YAML key {_OLD_KEY}", "gdn_chunk_size")
            config.setdefault("gdn_chunk_size", config.pop(_OLD_KEY))
        for k, v in config.items():
            if args.get(k) is None:
                args[k] = v
        _unread_resume_from_config(args, given)
    # The demo's settings in both passes of _main (its folders only once they exist):
    # the first pass, without them, checked the grad-accumulation remainder and an
    # lr_schedule up to mlx-lm's --iters 1000, not the demo's 30, and the second pass's
    # warnings are silenced (found by probing, session 52)
    if args.get("demo"):
        demo = dict(DEMO_DEFAULTS)
        if demo_dir is not None:
            demo["model"] = str(pathlib.Path(demo_dir, "model"))
            demo["data"] = str(pathlib.Path(demo_dir, "data"))
            demo["adapter_path"] = str(pathlib.Path(demo_dir, "adapters"))
        for k, v in demo.items():
            if args.get(k) is None:
                args[k] = v
    defaults = dict(lora.CONFIG_DEFAULTS, gdn_chunk_size=op_default_chunk_size(),
                    gdn_save_states="groups", demo=False)  # fmt: skip
    for k, v in defaults.items():
        if args.get(k) is None:
            args[k] = v
    try:  # a YAML value has not been through the parser's check
        check_chunk_size(PROG, args["gdn_chunk_size"], example=op_default_chunk_size())
    except (TypeError, ValueError) as e:
        raise SystemExit(f"{PROG}: gdn_chunk_size (from -c {args.get('config')}): {e}") from None
    _check_numbers(args)
    _check_optimizer_config(args)
    _check_report_to(args)
    return types.SimpleNamespace(**args)


def run(args: types.SimpleNamespace) -> None:
    """Run ``mlx_lm.lora.run(args)`` with the Gated DeltaNet patch applied."""
    from .. import mlx_lm as seam

    lora = _mlx_lm_lora()
    with seam.patch(chunk_size=args.gdn_chunk_size, save_states=args.gdn_save_states) as handle:
        routes = _model_routes(args.model, handle.families)
        if routes is not None and routes.lightning:
            gdn = (
                "Lightning attention (mlx-lm's recurrent_gla) training path -> "
                "chunkscan.linear_attention (its default chunk: 64 on a CPU, 256 on a GPU)"
            )
        elif routes is not None and routes.mamba:
            gdn = (
                "Mamba's selective scan (mlx-lm's per-token loop) training path -> "
                "chunkscan.selective_scan (its default chunk: 8)"
            )
        elif routes is not None and routes.rwkv7:
            gdn = (
                "RWKV-7's recurrence (mlx-lm's per-token loop) training path -> "
                "chunkscan.dplr_delta_rule (its default chunk: 8 on a CPU, 32 on a GPU)"
            )
        elif routes is not None and routes.rg_lru:
            gdn = (
                "RG-LRU's scan (mlx-lm's rnn_scan) training path -> "
                "chunkscan.diagonal_recurrence (its default chunk: 64; but mlx-lm's "
                "recurrent_gemma.Model skips nn.Module.__init__, so mlx_lm.lora's freeze "
                "and nn.value_and_grad fail on it with an AttributeError about '_no_grad', "
                'as without chunkscan: docs/mlx_lm.md, "RG-LRU")'
            )
        elif routes is not None and routes.ssd:
            gdn = (
                "Mamba2 SSD (mlx-lm's ssm_attn) training path -> chunkscan.linear_attention "
                "(calls without a padding mask; its default chunk: 64 on a CPU, 256 on a GPU)"
            )
        elif routes is not None and not routes.gated_deltanet:
            gdn = f"{routes.model_type} has no Gated DeltaNet layers"  # not "patched: qwen3_next"
        else:
            gdn = (
                f"Gated DeltaNet training path -> chunkscan.gated_delta_rule "
                f"(chunk_size={args.gdn_chunk_size}, save_states={args.gdn_save_states}; "
                f"patched: {', '.join(handle.families)})"
            )
        if routes is None:
            attention = (
                "attention training path -> chunkscan.attention (where the model calls "
                "mlx-lm's scaled_dot_product_attention without sinks or a floating mask; "
                "the first report counts each path's calls)"
            )
        elif routes.attention:  # per call: sinks and floating masks stay mlx-lm's
            attention = (
                "attention training path -> chunkscan.attention (calls without sinks or "
                "a floating mask; the first report counts each path's calls)"
            )
        else:  # gemma2 and olmo write their own softmax, plamo2 calls mx.fast's, mamba none
            attention = (
                f"{routes.model_type} does not call mlx-lm's scaled_dot_product_attention "
                f"(its attention, if any, trains as in mlx-lm)"
            )
        say(f"chunkscan: {gdn}; {attention}")
        seam.routed_calls.clear()  # patch()'s own probes called the paths
        before = _adapter_stamps(args)
        with (
            _report_peak_memory(lora, args, routes),
            _lora_keys_must_name_modules(lora),
            _resumed_weights_must_fit(lora, args),
            _say_what_a_failure_left(args, before),
        ):
            lora.run(args)
    if args.train:
        _check_saved_adapters(args)


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``chunkscan lora``. Its stdout is guarded for the whole command
    (:func:`guarded_stdout`): a reader that leaves (``| head -1``) ends neither
    chunkscan's lines nor mlx-lm's (its ``print`` and rich console wrote to the closed
    pipe and lost the run; found by review, session 50); they go to ``os.devnull``."""
    with guarded_stdout():
        return _main(list(sys.argv[1:] if argv is None else argv))


def _main(argv: list[str]) -> int:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "true")  # a user's setting kept (probing)
    if not argv:
        build_parser().print_usage(sys.stderr)
        print(
            f"{PROG}: no arguments. Pass --model (a folder or a Hugging Face repo "
            "id), --data and --train, plus any mlx_lm.lora flag; or try --demo (offline).",
            file=sys.stderr,
        )
        return 2
    args = resolve_args(argv)  # --demo (or an abbreviation, or demo: true in -c) decides
    if not args.demo:
        check_args(args)
        try:
            run(args)
        except _hub_errors() as e:
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise SystemExit(
                f"{PROG}: a Hugging Face Hub lookup failed for --model "
                f"{args.model} or --data {args.data} ({type(e).__name__}: {first}). "
                "Check the repo id and the network, or pass local folders."
            ) from None
        return 0
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    with tempfile.TemporaryDirectory(prefix="chunkscan-lora-demo-") as demo_dir:
        with warnings.catch_warnings():  # the first resolve_args gave its warnings (the
            # same: it read the demo's settings too)
            warnings.simplefilter("ignore")
            args = resolve_args(argv, demo_dir)
        # ~ expanded as without --demo (_check_source): '~/dm/model' from -c or quoted
        # was a folder named ~ in the working folder (found by probing, session 49)
        for key in ("model", "data"):
            if isinstance(getattr(args, key, None), str):
                setattr(args, key, os.path.expanduser(getattr(args, key)))
        # The checks made without --demo: the demo's folders may be the user's own
        # (a --data folder it uses as it is; found by probing)
        _check_something_to_do(args)
        _check_adapter_paths(args)
        _check_resumed_adapters(args)
        adapters = _demo_adapter_folder(args, demo_dir)  # (refuses before any writing)
        _write_demo(args)
        _check_local_inputs(args)
        if adapters is not None:
            _mark_demo_folder(adapters)
        # stdout's prints by say(): `chunkscan lora --demo | head -1` raised
        # BrokenPipeError at the next line and lost the run (found by probing)
        say(_demo_banner(args.model))
        run(args)
        where = _demo_kept(args, demo_dir)
        say(
            f"chunkscan lora --demo: done; MLX peak memory "
            f"{mx.get_peak_memory() / MiB:,.0f} MiB; {where}"
        )
    return 0
