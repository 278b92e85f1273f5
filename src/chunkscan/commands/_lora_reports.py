"""What a ``chunkscan lora`` run says while it trains, and the hooks it sets in
``mlx_lm.lora`` for it: which of chunkscan's paths the model's layers reach
(:func:`_model_routes`, for the banner) and where the calls went (:func:`_routes_line`,
at the first report); the peak memory at every report, and a stop at a loss that is not
finite (:class:`_Reports`); ``lora_parameters`` keys that name no module
(:func:`_lora_keys_must_name_modules`)."""

from __future__ import annotations

import functools
import json
import math
import pathlib
import sys
import types
import warnings
from typing import Any, NamedTuple

import mlx.core as mx
import mlx.nn as nn

from ._lora_common import PROG, MiB, _rebound, _some
from ._stdout import say


class _Reports:
    """Training callback printing peak memory at each report, and stopping the run at
    a training loss that is not finite; chains mlx-lm's."""

    def __init__(self, inner: Any, args: types.SimpleNamespace, routes: _Routes | None = None):
        self.inner = inner
        self.args = args
        self.routes = routes
        self.routes_printed = False

    def on_train_loss_report(self, info: dict[str, Any]) -> None:
        if not self.routes_printed:
            self.routes_printed = True
            say(_routes_line(self.routes))
        say(
            f"  iter {info['iteration']:>4}: loss {info['train_loss']:.3f}, "
            f"{info['tokens_per_second']:,.0f} tok/s, "
            f"MLX peak memory so far {mx.get_peak_memory() / MiB:,.0f} MiB"
        )
        if self.inner is not None:
            self.inner.on_train_loss_report(info)
        if not math.isfinite(info["train_loss"]):
            raise SystemExit(_not_finite_loss(info, self.args))

    def on_val_loss_report(self, info: dict[str, Any]) -> None:
        if self.inner is not None:
            self.inner.on_val_loss_report(info)


# The recurrences' routes of the first report: (the _Routes flag of the model that has
# it, the routed_calls key, what the line says).
_RECURRENCE_ROUTES = (
    ("lightning", "chunkscan.linear_attention",
     "Lightning attention of more than one token -> chunkscan.linear_attention"),
    ("ssd", "chunkscan.linear_attention (Mamba2)",
     "Mamba2 SSD without padding -> chunkscan.linear_attention"),
    ("mamba", "chunkscan.selective_scan", "Mamba's selective scan -> chunkscan.selective_scan"),
    ("rg_lru", "chunkscan.diagonal_recurrence",
     "RG-LRU's scan -> chunkscan.diagonal_recurrence"),
    ("rwkv7", "chunkscan.dplr_delta_rule", "RWKV-7's recurrence -> chunkscan.dplr_delta_rule"),
)  # fmt: skip


def _routes_line(routes: _Routes | None = None) -> str:
    """The training paths' calls so far, by where they went (the seam's
    ``routed_calls``): what the banner cannot tell from the model's modules. A
    recurrence's route is given where the model has it (``routes``, the banner's
    reading of the model folder), with its count even at 0 (a route that never ran
    left no sign: a quantized Mamba model's calls, all mlx-lm's, printed nothing; found
    by probing), and wherever calls went to it; Gated DeltaNet's, with validation's
    note, only where the model has such layers or ``routes`` is not known (it was
    printed for Mamba and RWKV models too)."""
    from .. import mlx_lm as seam

    calls = seam.routed_calls
    stock = calls["mlx-lm's attention"]
    gdn = calls["chunkscan.gated_delta_rule"]
    has_gdn = routes is None or routes.gated_deltanet or gdn > 0
    parts = []
    if has_gdn:
        parts.append(f"Gated DeltaNet training path -> chunkscan.gated_delta_rule {gdn}")
    parts.append(
        f"attention without a cache -> chunkscan.attention {calls['chunkscan.attention']}, "
        f"mlx-lm's {stock}"
        + (" (sinks, a floating mask or mixed dtypes: as in mlx-lm)" if stock else "")
    )
    recurrences = 0
    for flag, key, text in _RECURRENCE_ROUTES:
        if calls[key] or (routes is not None and getattr(routes, flag)):
            parts.append(f"{text} {calls[key]}")
            recurrences += 1
    # the other recurrences take every call without a cache, validation's too (it said
    # attention's alone; found by probing)
    counted = "attention's and the recurrences'" if recurrences else "attention's"
    # mlx-lm's Metal kernel on an Apple GPU, its per-token loop elsewhere (the note named
    # a kernel, where a CPU or CUDA run went through the loop; found by probing)
    validation = (
        ", which runs Gated DeltaNet through mlx-lm's own path: its Metal kernel on an Apple "
        "GPU, its per-token loop elsewhere"
        if has_gdn
        else ""
    )
    return (
        f"chunkscan: where the calls went so far (per Python call: a compiled step counts "
        f"once, a checkpointed layer twice; {counted} include validation's{validation}): "
        + "; ".join(parts)
    )


def _not_finite_loss(info: dict[str, Any], args: types.SimpleNamespace) -> str:
    """The message that stops a run whose training loss is not finite. mlx-lm trained
    on and saved NaN adapters, exit 0: with ``--mask-prompt``, a batch whose prompts
    fill ``--max-seq-length`` has no target tokens and its loss is 0 / 0 (found by
    probing)."""
    causes = "a learning rate too high, or float16 overflow"
    if getattr(args, "mask_prompt", False):
        causes = (
            f"with --mask-prompt, a batch whose prompts fill --max-seq-length "
            f"({getattr(args, 'max_seq_length', '?')}) has no target tokens (its loss is "
            f"0 / 0): raise --max-seq-length or drop such examples; or " + causes
        )
    return (
        f"{PROG}: stopped: the training loss is {info['train_loss']} at iteration "
        f"{info['iteration']}; its gradients reach the adapters, so they were not "
        f"saved at the end (a checkpoint saved since the last finite report may hold "
        f"non-finite weights). Likely causes: {causes}."
    )


def _report_peak_memory(lora: Any, args: types.SimpleNamespace, routes: _Routes | None = None):
    """Rebind ``mlx_lm.lora.get_reporting_callbacks`` (restored on exit).

    ``mlx_lm.lora.run`` ignores its ``training_callback`` argument and builds one from
    ``--report-to``, so this is the only way in.
    """
    return _rebound(
        lora,
        "get_reporting_callbacks",
        lambda original: lambda *a, **k: _Reports(original(*a, **k), args, routes),
    )


def _lora_keys_must_name_modules(lora: Any):
    """Rebind ``mlx_lm.lora.linear_to_lora_layers`` (restored on exit) to check, once
    the model has loaded, that the ``lora_parameters`` keys name modules of the layers
    it wraps (or of the model, by full path): mlx-lm skips a key that names none, and
    with none left ``mx.grad`` failed with "Must specify at least one argument" (found
    by probing). A key naming nothing while others do is warned about (a typo trains
    fewer adapters than asked). A layer mlx-lm cannot wrap (a key naming a ``Conv1d``;
    DoRA on a mixture of experts' ``SwitchLinear``, which mlx-lm's default keys take)
    stops the run with one line naming the fix, where mlx-lm's ``ValueError`` was a
    traceback (found by probing, session 54)."""

    def linear_layers(wrapped: list) -> str:
        """Some linear layers of the last wrapped layer, for a message ('' for none)."""
        if not wrapped:
            return ""
        linear = (nn.Linear, nn.QuantizedLinear)
        names = {name for name, m in wrapped[-1].named_modules() if isinstance(m, linear)}
        return _some(sorted(names), 8)

    def checked(original, model, num_layers, config, *args, **kwargs):
        keys = config.get("keys") if isinstance(config, dict) else None
        wrapped = model.layers[-max(num_layers, 0) :]
        shown = linear_layers(wrapped)  # (before mlx-lm wraps any: a LoRA layer's .linear)
        if keys:
            names = {name for layer in wrapped for name, _ in layer.named_modules()}
            names |= {name for name, _ in model.named_modules()}
            unknown = [key for key in keys if key not in names]
            if unknown:
                what = (
                    f"lora_parameters keys {unknown!r} name no module of the "
                    f"{len(wrapped)} layers this run wraps (nor of the model, by full path)"
                )
                if len(unknown) == len(keys):
                    raise SystemExit(
                        f"{PROG}: {what}, so there is nothing to train. Give keys such as "
                        f"{shown or 'the names of its linear layers'} (-c)."
                    )
                warnings.warn(
                    f"{PROG}: {what}; mlx-lm skips them. Its linear layers: {shown}.",
                    UserWarning,
                    stacklevel=2,
                )
        try:
            return original(model, num_layers, config, *args, **kwargs)
        except ValueError as e:  # mlx-lm's to_lora: a layer it cannot wrap
            dora = kwargs.get("use_dora", args[0] if args else False)
            other = "pass --fine-tune-type lora, or " if dora else ""
            raise SystemExit(
                f"{PROG}: mlx-lm cannot wrap a layer this run asks for ({e}): {other}give "
                f"lora_parameters keys (-c) that name linear layers, such as "
                f"{shown or 'the names of its linear layers'}."
            ) from None

    return _rebound(
        lora, "linear_to_lora_layers", lambda original: functools.partial(checked, original)
    )


class _Routes(NamedTuple):
    model_type: str
    gated_deltanet: bool  # runs a patched family's Gated DeltaNet layers
    attention: bool  # some module of the model holds the patched attention
    lightning: bool = False  # runs a family whose recurrent_gla is patched (Bailing linear)
    ssd: bool = False  # its layers' modules call a patched ssm_attn's module (Mamba2)
    mamba: bool = False  # runs a family whose Mamba layer method is patched (mamba, jamba)
    rwkv7: bool = False  # runs a family whose RWKV-7 layer method is patched (rwkv7)
    rg_lru: bool = False  # runs a family whose rnn_scan is patched (recurrent_gemma)


def _model_routes(model: str, families: tuple[str, ...]) -> _Routes | None:
    """What the patch reaches in the model of a local model folder, found as mlx-lm
    finds it (``model_type`` remapped by its architecture); ``None`` where this cannot
    be told (a Hub id, an unreadable config). Gated DeltaNet: the model runs one of
    ``families``' layers (the seam's own test, ``chunkscan.mlx_lm._covered``; the raw
    ``model_type`` was not enough: Bailing MoE V3 checkpoints say ``bailing_hybrid``,
    and a family may subclass a patched one; found by review). Attention: a module of
    the model's layers holds the patch's attention by the seam's name (``_ATTN``);
    gemma2 and olmo compute attention themselves and plamo2 calls ``mx.fast``'s, so the banner
    said "attention training path -> chunkscan.attention" for runs that never called it
    (found by probing)."""
    from .. import mlx_lm as seam

    try:
        with open(pathlib.Path(model, "config.json")) as f:
            config = json.load(f)
        from mlx_lm.utils import _get_classes

        model_class = _get_classes(config)[0]
        module = model_class.__module__  # mlx_lm.models.<remapped type>
        patched = {f"mlx_lm.models.{name}" for name in families}
        covered = seam._covered(module.rsplit(".", 1)[1], patched)
        lightning = {f"mlx_lm.models.{name}" for name in seam.lightning_patched_modules()}
        lightning_covered = seam._covered(module.rsplit(".", 1)[1], lightning)
        modules = _layer_modules(model_class)
    except Exception:  # noqa: BLE001 (any failure: say nothing about the routes)
        return None
    installed = seam._INSTALLED_ATTENTION
    attention = any(getattr(m, seam._ATTN, None) is installed for m in modules)
    # Mamba2: a layer's module imports ssm_update from the module whose ssm_attn is rebound
    ssd_modules = {f"mlx_lm.models.{name}" for name in seam.ssd_patched_modules()}
    ssd = any(
        callable(value) and getattr(value, "__module__", None) in ssd_modules
        for m in modules
        for value in vars(m).values()
    )
    mamba = {f"mlx_lm.models.{name}" for name in seam.mamba_patched_modules()}
    mamba_covered = seam._covered(module.rsplit(".", 1)[1], mamba)
    rwkv7 = {f"mlx_lm.models.{name}" for name in seam.rwkv7_patched_modules()}
    rwkv7_covered = seam._covered(module.rsplit(".", 1)[1], rwkv7)
    rg_lru = {f"mlx_lm.models.{name}" for name in seam.rg_lru_patched_modules()}
    rg_lru_covered = seam._covered(module.rsplit(".", 1)[1], rg_lru)
    return _Routes(str(config["model_type"]), covered, attention, lightning_covered, ssd,
                   mamba_covered, rwkv7_covered, rg_lru_covered)  # fmt: skip


def _layer_modules(model_class: type) -> list[types.ModuleType]:
    """The ``mlx_lm.models`` modules that define ``model_class``, its bases, and the
    ``nn.Module`` classes and modules their modules name, transitively (qwen3_5 names
    qwen3_next's attention layer, gemma3 the module gemma3_text)."""
    import mlx.nn as nn

    seen: dict[str, types.ModuleType] = {}
    todo = [c.__module__ for c in model_class.__mro__]
    while todo:
        name = todo.pop()
        # base defines the attention function (the patch rebinds it there too): no layer
        if name in seen or not name.startswith("mlx_lm.models.") or name.endswith(".base"):
            continue
        seen[name] = module = sys.modules[name]
        for value in vars(module).values():
            if isinstance(value, type) and issubclass(value, nn.Module):
                todo.append(value.__module__)
            elif isinstance(value, types.ModuleType):  # gemma3: from . import gemma3_text
                todo.append(value.__name__)
    return list(seen.values())
