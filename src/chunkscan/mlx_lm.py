"""Train mlx-lm's recurrent models with chunkscan's ops.

``patch()`` swaps the training path of every mlx-lm model family that runs the gated
delta rule (Qwen3-Next, Qwen3.5 and Qwen3.5-MoE, and any other family the installed
mlx-lm has) for :func:`chunkscan.gated_delta_rule`, whose backward memory does not grow
with the sequence length; of the Lightning-attention, Mamba2, Mamba, RWKV-7 and
RecurrentGemma families for :func:`chunkscan.linear_attention`,
:func:`chunkscan.selective_scan`, :func:`chunkscan.dplr_delta_rule` and
:func:`chunkscan.diagonal_recurrence` (below); and, with ``attention=True``, every
attention call without a cache, in eval mode too, for :func:`chunkscan.attention`.
Generation's one-token steps are left alone (the Gated DeltaNet and attention seams
leave every call with a cache alone; the rebound recurrences, whose functions have no
sign of training, take a prompt's prefill too)::

    import chunkscan.mlx_lm

    with chunkscan.mlx_lm.patch():        # or: handle = patch(); ...; handle.undo()
        model, tokenizer = mlx_lm.load(path)
        ...                               # train as usual (model.train())

The seam
--------
Each family's module imports ``gated_delta_update`` by name from
``mlx_lm.models.gated_delta`` and calls it from its ``GatedDeltaNet.__call__`` as::

    gated_delta_update(q, k, v, a, b, A_log, dt_bias, state, mask,
                       use_kernel=not self.training, [lower_bound=..., allow_neg_eigval=...])

with ``q`` and ``k`` already L2-normalized and ``q`` already scaled by ``Dk**-0.5``
(``normalize_qk``); the decay is ``exp(-exp(A_log) * softplus(a + dt_bias))`` (or
``exp(lower_bound * sigmoid(exp(A_log) * (a + dt_bias)))``), ``beta = sigmoid(b)``
(times 2 with ``allow_neg_eigval``), the state is ``[B, Hv, Dv, Dk]`` float32.

``patch()`` rebinds that module-level name in each family's module (patching
``gated_delta.gated_delta_update`` itself would not reach the by-name imports) to a
function that:

* with ``use_kernel=True`` (inference: ``model.eval()``) calls mlx-lm's own
  function unchanged;
* with ``use_kernel=False`` (training: ``model.train()``) computes the log-decay
  directly, ``-exp(A_log) * softplus(a + dt_bias)`` (no ``log(exp(.))``, so no
  ``log(0)``), per value head (``a`` ``[B, T, Hv]``: Qwen3-Next, Qwen3.5) or per key
  channel (``a`` ``[B, T, Hv, Dk]`` with ``A_log`` ``[Hv, 1]`` and ``dt_bias``
  ``[Hv, Dk]``: Kimi Linear's KDA, and any family passing a rank-4 gate), and calls
  ``chunkscan.gated_delta_rule(q, k, v, log_decay, beta, scale=1.0,
  initial_state=state, chunk_size=..., save_states=...)`` (the handle's; ``"groups"``
  by default). Padding steps (``mask`` False) keep the
  state and output zero, as mlx-lm's kernels do, whatever their inputs hold (their
  ``q``, ``k``, ``v`` read as zero); mlx-lm's training loss passes no mask (right
  padding, masked in the loss).

``undo()`` (or leaving the ``with`` block) puts mlx-lm's functions back. Patches nest:
the names are restored when the last handle is undone, and the innermost live
handle's ``chunk_size`` and ``save_states`` apply.

The seam is checked when patching, against the installed mlx-lm: the module, the
signature of ``gated_delta_update`` (via ``inspect.signature``), the by-name imports
of each family, and a numerical probe of the patched against the stock training
path (with and without a padding mask, and with each keyword option). Any mismatch
raises :class:`IncompatibleMlxLmError` naming the mlx-lm version.

Lightning attention
-------------------
``patch()`` also rebinds ``recurrent_gla``, mlx-lm's Lightning-attention recurrence,
in each ``mlx_lm.models`` module that defines it with the signature
``(q, k, v, g, scale, h=None)`` (bailing_moe_linear's per-token loop in mlx-lm 0.32.2)
or ``(q, k, v, g, *, scale, h=None, mask=None, chunk=128)`` (bailing_hybrid's chunks):
calls of more than one token without a padding mask go to
:func:`chunkscan.linear_attention`, others (decoding) to mlx-lm's function.
No such family is required; one whose function the patched call does not reproduce is
left alone with a warning (``docs/mlx_lm.md``, "Lightning attention").

Mamba2
------
``patch()`` also rebinds ``ssm_attn`` in ``mlx_lm.models.ssm`` (the Mamba2 layers of
mamba2, nemotron_h, falcon_h1, granitemoehybrid and plamo2 reach it through
``ssm_update``): calls of more than one token without a mask or lengths go to
:func:`chunkscan.linear_attention` (``q = C``, ``k = B``, ``v = dt x``, ``g = dt A``),
others to mlx-lm's function; probed and left alone with a warning as above
(``docs/mlx_lm.md``, "Mamba2").

Mamba
-----
``patch()`` also rebinds, on their classes, ``MambaBlock._process_sequence`` of
``mlx_lm.models.mamba`` (mamba, falcon_mamba) and ``JambaMambaMixer.ssm_step`` of
``mlx_lm.models.jamba``: calls of more than one token run the selective scan through
:func:`chunkscan.selective_scan` instead of mlx-lm's per-token loops, with mlx-lm's own
projections, convolution and caches; others go to mlx-lm's method; probed on tiny layers
and left alone with a warning as above (``docs/mlx_lm.md``, "Mamba").

RWKV-7
------
``patch()`` also rebinds ``Rwkv7TimeMixing._wkv7`` of ``mlx_lm.models.rwkv7`` on its
class: calls of more than one token run the recurrence through
:func:`chunkscan.dplr_delta_rule` (``q = r``, ``g = log w``) instead of mlx-lm's
per-token loop (CPU, CUDA) or its Metal kernel (no gradient); one-token calls go to
mlx-lm's method; probed and left alone with a warning as above (``docs/mlx_lm.md``,
"RWKV-7").

RG-LRU
------
``patch()`` also rebinds ``rnn_scan`` in ``mlx_lm.models.recurrent_gemma`` (the RG-LRU's
scan ``h = a * h + x``, a loop of slice updates): calls of more than one token go to
:func:`chunkscan.diagonal_recurrence`, others to mlx-lm's function; probed and left
alone with a warning as above (``docs/mlx_lm.md``, "RG-LRU": mlx-lm 0.32.2's
``recurrent_gemma.Model`` cannot be trained by ``nn.value_and_grad`` itself).

Attention
---------
``patch()`` (unless ``attention=False``) also rebinds ``scaled_dot_product_attention``,
which model modules import by name from ``mlx_lm.models.base`` and call as
``scaled_dot_product_attention(queries, keys, values, cache=cache, scale=...,
mask=mask[, sinks=...])`` with ``[B, H, L, D]`` tensors, in every module of the
installed mlx-lm that holds it (llama, qwen3_next and so qwen3_5, ... about a hundred
families; ``base`` too, so modules imported later pick the replacement up; a family
that computes attention itself, such as gemma2, or calls ``mx.fast``'s, is untouched). The
replacement calls :func:`chunkscan.attention` for calls with no cache, no attention
sinks, a ``mask`` that is ``"causal"``, ``None`` or boolean, one dtype and a Python
``scale`` (the training path); every other call (a cache: generation, prefill,
quantized caches; sinks; a floating mask; mixed dtypes) goes to mlx-lm's function
unchanged. The seam checks are those of the Gated DeltaNet seam: the
signature, the by-name imports of :data:`REQUIRED_ATTENTION_MODULES`, and a probe of
values and gradients against the stock function.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import importlib
import inspect
import pathlib
import sys
import threading
import warnings
from collections.abc import Callable, Collection
from types import ModuleType
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_unflatten

from . import _random
from ._tree import with_article
from .ops._checks import check_bool
from .ops.gated_delta.chunk import SAVE_MODES
from .split import check_chunk_size

__all__ = [
    "IncompatibleMlxLmError",
    "Patch",
    "attention_patched_modules",
    "lightning_patched_modules",
    "mamba_patched_modules",
    "patch",
    "patched_families",
    "rg_lru_patched_modules",
    "rwkv7_patched_modules",
    "ssd_patched_modules",
]

#: Families that must be covered (the issue's targets).
REQUIRED_FAMILIES = ("qwen3_next", "qwen3_5", "qwen3_5_moe")
_NAME = "gated_delta_update"
_POSITIONAL = ("q", "k", "v", "a", "b", "A_log", "dt_bias", "state", "mask")
# Keyword-only options this module understands, with the defaults it expects.
_KNOWN_OPTIONS = {"use_kernel": True, "lower_bound": None, "allow_neg_eigval": False}


class IncompatibleMlxLmError(RuntimeError):
    """The installed mlx-lm does not have the seam :func:`patch` relies on."""


# --------------------------------------------------------------------------- state

_lock = threading.RLock()
_stack: list[Patch] = []  # live handles, innermost last
_saved: dict[str, Any] = {}  # module name -> stock function, while patched
_stock: dict[str, Any] = {}  # "fn" -> mlx-lm's gated_delta_update
# The seams whose numerical probe ran while some handle is live ("gdn", "attention", and
# the keys of _REBOUND: "lightning", "ssd", "mamba", "jamba", "rwkv7", "rg_lru"; a
# rebound function that failed its probe is unbound, not kept):
# a nested patch(verify=True) under a patch(verify=False) skipped its probe, the seam
# being installed already (found by probing); emptied with the last handle's undo.
_verified: set[str] = set()


def _mlx_lm_version() -> str:
    try:
        import mlx_lm

        return str(getattr(mlx_lm, "__version__", "unknown"))
    except Exception:  # noqa: BLE001 - only for the message
        return "not importable"


def _seam_error(
    seam: str, written_for: str, problems: list[str], fix: str
) -> IncompatibleMlxLmError:
    """The error of a seam check: ``seam`` ("the seam", "the attention seam") is not
    what this patch was written for (``written_for``, as in mlx-lm 0.32.x)."""
    bullets = "\n".join(f"  * {p};" for p in problems)
    return IncompatibleMlxLmError(
        f"[chunkscan.mlx_lm.patch] the installed mlx-lm {_mlx_lm_version()} does not "
        f"match {seam} this patch was written for (mlx-lm 0.32.x: {written_for}), but "
        f"they differ:\n{bullets}\n{fix}"
    )


def _differences(pairs, prefix: str = "") -> list[str]:
    """The probes' comparison: ``(what, patched, stock)`` arrays whose largest difference
    passes 1e-4 of the stock one's largest magnitude, each as a problem to report."""
    problems = []
    for what, ours, theirs in pairs:
        if ours.shape != theirs.shape or ours.dtype != theirs.dtype:
            problems.append(
                f"{prefix}the {what} is {ours.dtype} {tuple(ours.shape)} where mlx-lm's is "
                f"{theirs.dtype} {tuple(theirs.shape)}"
            )
            continue
        err = (mx.abs(ours - theirs).max() / (mx.abs(theirs).max() + 1e-12)).item()
        if not err <= 1e-4:
            problems.append(f"{prefix}the {what} differs by {err:.2e}")
    return problems


def _fail(problems: list[str], fix: str) -> IncompatibleMlxLmError:
    return _seam_error(
        "the seam",
        f"mlx_lm.models.gated_delta.{_NAME}(q, k, v, a, b, A_log, dt_bias, state=None, "
        f"mask=None, *, use_kernel=True, ...), imported by name into each family's module",
        problems,
        fix,
    )


# ------------------------------------------------------------------ the replacement


def _op():
    """:func:`chunkscan.gated_delta_rule` (looked up at call time, so tests can spy)."""
    import chunkscan

    return chunkscan.gated_delta_rule


def _log_decay(a, A_log, dt_bias, lower_bound):
    """``log`` of mlx-lm's ``compute_g`` / ``compute_lower_bound_g``, computed directly."""
    if lower_bound is None:
        sp = mx.logaddexp(a + dt_bias, mx.array(0.0, dtype=a.dtype))  # nn.softplus
        return -mx.exp(A_log.astype(mx.float32)) * sp
    x = mx.exp(A_log.astype(mx.float32)) * (a.astype(mx.float32) + dt_bias)
    return lower_bound * mx.sigmoid(x)


def _chunked_update(q, k, v, a, b, A_log, dt_bias, state=None, mask=None, *, options):
    lower_bound = options.get("lower_bound")
    beta = mx.sigmoid(b)
    if options.get("allow_neg_eigval", False):
        beta = beta * 2.0
    log_g = _log_decay(a, A_log, dt_bias, lower_bound)
    if mask is not None:
        # A padding step leaves the state as it is: decay 1 (log 0), no write, and its
        # q, k, v read as zeros. The op carries a non-finite input on to every later
        # step (its contract), where mlx-lm's loop keeps the old state at a padding
        # step: a NaN or inf at a padding token spread over the rest of the row (found
        # by probing).
        keep = mask.astype(mx.bool_)
        log_g = mx.where(keep.reshape(keep.shape + (1,) * (log_g.ndim - 2)), log_g, 0.0)
        beta = mx.where(keep[..., None], beta, 0.0)
        q, k, v = (mx.where(keep[..., None, None], x, 0).astype(x.dtype) for x in (q, k, v))
    kwargs = {}
    chunk_size = _stack[-1].chunk_size if _stack else None
    if chunk_size is not None:
        kwargs["chunk_size"] = chunk_size
    if _stack:
        kwargs["save_states"] = _stack[-1].save_states
    out, state = _op()(
        q,
        k,
        v,
        log_g.astype(mx.float32),
        beta.astype(mx.float32),
        scale=1.0,  # normalize_qk already folded Dk**-0.5 into q
        initial_state=None if state is None else state.astype(mx.float32),
        **kwargs,
    )
    if mask is not None:
        out = mx.where(mask.astype(mx.bool_)[..., None, None], out, 0).astype(out.dtype)
    return out, state


def gated_delta_update(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    a: mx.array,
    b: mx.array,
    A_log: mx.array,
    dt_bias: mx.array,
    state: mx.array | None = None,
    mask: mx.array | None = None,
    *,
    use_kernel: bool = True,
    **options: Any,
) -> tuple[mx.array, mx.array]:
    """Drop-in for mlx-lm's ``gated_delta_update`` (what :func:`patch` installs).

    ``use_kernel=True`` (inference) goes to mlx-lm's function; the training path
    (``use_kernel=False``, gate ``a`` of shape ``[B, T, Hv]`` or, per key channel,
    ``[B, T, Hv, Dk]``) runs :func:`chunkscan.gated_delta_rule`.
    """
    if use_kernel:
        stock = _stock_function(_stock, "mlx_lm.models.gated_delta", _NAME)
        return stock(q, k, v, a, b, A_log, dt_bias, state, mask, use_kernel=use_kernel, **options)
    routed_calls["chunkscan.gated_delta_rule"] += 1
    return _chunked_update(q, k, v, a, b, A_log, dt_bias, state, mask, options=options)


def _stock_function(kept: dict[str, Any], module: str, name: str) -> Any:
    """mlx-lm's own function: the one :func:`patch` kept, else (the public drop-ins
    imported and called with no patch ever made: a ``KeyError`` before; found by
    probing) the module's, which holds mlx-lm's while nothing is patched."""
    fn = kept.get("fn")
    return getattr(importlib.import_module(module), name) if fn is None else fn


# -------------------------------------------------------------------- seam checks


def _load_seam() -> tuple[Any, dict[str, Any]]:
    try:
        gd = importlib.import_module("mlx_lm.models.gated_delta")
    except ImportError as e:
        raise _fail(
            [f"'mlx_lm.models.gated_delta' cannot be imported ({e})"],
            "Install mlx-lm 0.32.x (pip install 'mlx-lm>=0.32.2,<0.33').",
        ) from e
    fn = _stock.get("fn") if _saved else getattr(gd, _NAME, None)
    if fn is None or not callable(fn):
        raise _fail(
            [f"'mlx_lm.models.gated_delta' has no function {_NAME!r}"],
            "Use an mlx-lm whose Gated DeltaNet layers call gated_delta_update.",
        )
    sig = inspect.signature(fn)
    params = list(sig.parameters.values())
    problems = []
    positional = [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if tuple(positional) != _POSITIONAL:
        problems.append(
            f"its positional parameters are ({', '.join(positional)}) but "
            f"({', '.join(_POSITIONAL)}) were expected"
        )
    options = {p.name: p.default for p in params if p.kind == p.KEYWORD_ONLY}
    if "use_kernel" not in options:
        problems.append("it has no keyword-only parameter 'use_kernel'")
    for name, default in options.items():
        if name not in _KNOWN_OPTIONS:
            problems.append(f"it has an unknown keyword-only parameter {name!r}")
        elif default != _KNOWN_OPTIONS[name]:
            problems.append(
                f"its parameter {name!r} defaults to {default!r}, not {_KNOWN_OPTIONS[name]!r}"
            )
    if any(p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in params):
        problems.append("it takes *args or **kwargs")
    if problems:
        raise _fail(
            [f"{_NAME}{sig}: " + p for p in problems],
            "Pin mlx-lm to a version with this seam, or update chunkscan.mlx_lm.",
        )
    return gd, options


@functools.lru_cache(maxsize=16)
def _models_naming(models_dir: str, text: str) -> tuple[str, ...]:
    """The ``mlx_lm.models`` modules whose source holds ``text``, by name (each seam's
    search read every model file, about 140, at every ``patch()``: once per installed
    mlx-lm and text now)."""
    return tuple(
        f"mlx_lm.models.{path.stem}"
        for path in sorted(pathlib.Path(models_dir).glob("*.py"))
        if text in path.read_text(encoding="utf-8")
    )


def _family_modules(gd: ModuleType) -> dict[str, ModuleType]:
    """Every module of ``mlx_lm.models`` that imports ``gated_delta_update`` by name."""
    found = {}
    for name in _models_naming(str(pathlib.Path(gd.__file__).parent), _NAME):
        if name == gd.__name__:
            continue
        try:
            found[name] = importlib.import_module(name)
        except Exception as e:  # noqa: BLE001 - an optional family that cannot load
            warnings.warn(
                f"[chunkscan.mlx_lm] skipping {name}: it cannot be imported ({e}).",
                RuntimeWarning,
                stacklevel=3,
            )
    return found


def _covered(family: str, patched: Collection[str]) -> bool:
    """Whether ``mlx_lm.models.<family>``'s model runs a patched module's layers
    (``patched``: the patched modules' full names)."""
    name = f"mlx_lm.models.{family}"
    if name in patched:
        return True
    module = importlib.import_module(name)
    model = getattr(module, "Model", None)
    return model is not None and any(c.__module__ in patched for c in model.__mro__)


def _check_families(gd: ModuleType, stock: Any) -> dict[str, ModuleType]:
    modules = _family_modules(gd)
    problems = []
    usable = {}
    for name, module in modules.items():
        bound = getattr(module, _NAME, None)
        if bound is stock or bound is gated_delta_update or bound is _INSTALLED_GDN:
            usable[name] = module
        else:
            problems.append(f"{name}.{_NAME} is {bound!r}, not mlx_lm.models.gated_delta.{_NAME}")
    for family in REQUIRED_FAMILIES:
        try:
            ok = _covered(family, usable)
        except ImportError as e:
            problems.append(f"mlx_lm.models.{family} cannot be imported ({e})")
            continue
        if not ok:
            problems.append(
                f"mlx_lm.models.{family} neither imports {_NAME} by name nor builds "
                "on a module that does"
            )
    if problems:
        raise _fail(problems, "Pin mlx-lm to a version with this seam.")
    return usable


@contextlib.contextmanager
def on_cpu():
    """Run the numerical probes on the CPU: they check conventions (layout, scale,
    gates, masks), which any difference of order one betrays, and must not see the
    GPU's arithmetic (MLX on CUDA multiplies float32 matrices in TF32 by default: the
    attention probe measured 4e-4 there, above its 1e-4 bound). They leave MLX's global
    random key as they found it: the layers the Mamba, Jamba and RWKV-7 probes build
    draw their initial weights from it, so a seeded run drew other numbers (LoRA
    initializations, dropout masks) under ``patch()`` than without it (found by probing)."""
    previous = mx.default_device()
    mx.set_default_device(mx.cpu)
    try:
        with _random.replaying(mx.array(_random.key())):
            yield
    finally:
        mx.set_default_device(previous)


def _probe(stock: Any, options: dict[str, Any]) -> None:
    """Compare the patched and stock training paths on a tiny random input. Two key
    heads (a value head's key head: with one, any mapping of value heads to key heads
    gave the same numbers, and a loop tiling them passed; found by probing)."""
    B, T, Hk, Hv, Dk, Dv = 2, 5, 2, 4, 8, 4
    keys = mx.random.split(mx.random.key(7), 8)
    q = mx.random.normal((B, T, Hk, Dk), key=keys[0]) * 0.3
    k = mx.random.normal((B, T, Hk, Dk), key=keys[1])
    k = k / mx.linalg.norm(k, axis=-1, keepdims=True)
    v = mx.random.normal((B, T, Hv, Dv), key=keys[2])
    a = mx.random.normal((B, T, Hv), key=keys[3])
    b = mx.random.normal((B, T, Hv), key=keys[4])
    A_log = mx.random.uniform(-1.0, 1.0, (Hv,), key=keys[5])
    dt_bias = mx.random.normal((Hv,), key=keys[6])
    s0 = mx.random.normal((B, Hv, Dv, Dk), key=keys[7]) * 0.1
    # A padding mask (True = a real token) with a hole and right padding: a masked
    # step keeps the state. Only the outputs of real tokens are compared (mlx-lm's
    # loop returns the unmasked step's output at a padding step, the patch zero).
    mask = mx.array([[True] * T, [True, True, False, True, False]])
    # A per-key-channel gate as Kimi Linear passes it: a [B, T, Hv, Dk], A_log [Hv, 1],
    # dt_bias [Hv, Dk].
    a_ch = mx.random.normal((B, T, Hv, Dk), key=keys[3])
    channel = (a_ch, A_log[:, None], mx.random.normal((Hv, Dk), key=keys[6]))
    variants: list[tuple[dict[str, Any], mx.array | None, tuple | None]] = [
        ({}, None, None),
        ({}, mask, None),
        ({}, None, channel),
        ({}, mask, channel),
    ]
    if "allow_neg_eigval" in options:
        variants.append(({"allow_neg_eigval": True}, None, None))
    if "lower_bound" in options:
        variants.append(({"lower_bound": -5.0}, None, None))
        variants.append(({"lower_bound": -5.0}, None, channel))
    problems = []
    for extra, m, gate in variants:
        a_, A_log_, dt_bias_ = (a, A_log, dt_bias) if gate is None else gate
        args = (q, k, v, a_, b, A_log_, dt_bias_, s0, m)
        y0, s_0 = stock(*args, use_kernel=False, **extra)
        y1, s_1 = _chunked_update(*args, options=extra)
        if m is not None:
            keep = m[..., None, None]
            y0, y1 = mx.where(keep, y0, 0), mx.where(keep, y1, 0)
        label = ", ".join(f"{key}={val!r}" for key, val in extra.items()) or "defaults"
        if m is not None:
            label += " and a padding mask"
        if gate is not None:
            label += " and a per-channel gate"
        problems += _differences((("output", y1, y0), ("state", s_1, s_0)), f"with {label} ")
    if problems:
        raise _fail(
            ["the patched training path does not reproduce the stock one: " + p for p in problems],
            "mlx-lm's gate, scale, state or mask convention changed; update chunkscan.mlx_lm.",
        )


# ------------------------------------------------------------------------- handle


class Patch:
    """A live :func:`patch`; also a context manager and a decorator. ``undo()`` is
    idempotent. A handle applies once: entering it again after its ``with`` block (or
    ``undo()``) raises, since it would run mlx-lm's own path with no sign of it. As a
    decorator (``@patch()``) it undoes itself at once and patches each call of the
    function instead, with the same options."""

    def __init__(
        self,
        chunk_size: int | None,
        families: tuple[str, ...],
        attention: bool = False,
        save_states: str | None = "groups",
        verify: bool = True,
        lightning: tuple[str, ...] = (),
        ssd: tuple[str, ...] = (),
        mamba: tuple[str, ...] = (),
        rwkv7: tuple[str, ...] = (),
        rg_lru: tuple[str, ...] = (),
    ):
        self.chunk_size = chunk_size
        self.families = families
        self.lightning = lightning  # the Lightning-attention modules rebound
        self.ssd = ssd  # the modules whose Mamba2 SSD (ssm_attn) is rebound
        self.mamba = mamba  # the modules whose Mamba (S6) layer method is rebound
        self.rwkv7 = rwkv7  # the modules whose RWKV-7 layer method is rebound
        self.rg_lru = rg_lru  # the modules whose rnn_scan (RG-LRU) is rebound
        self.attention = attention
        self.save_states = save_states
        self.verify = verify
        self._entered = False  # in a with block (a second entry is refused)

    @property
    def active(self) -> bool:
        return self in _stack

    def undo(self) -> None:
        """Remove this handle; restore mlx-lm's functions when none is left."""
        with _lock:
            if self not in _stack:
                return
            _stack.remove(self)
            _sync_attention()
            if not _stack:
                # The families patched held mlx-lm's function (_check_families); so
                # does any module that imported the replacement by name while patched.
                _roll_back()

    def __enter__(self) -> Patch:
        if not self.active:
            raise RuntimeError(
                f"[chunkscan.mlx_lm.patch] this handle is undone ({self!r}): its with block "
                "ended or undo() was called, and a handle applies once. Call "
                "chunkscan.mlx_lm.patch() again for each with block."
            )
        if self._entered:  # the inner block's end undid it for the outer (probing)
            raise RuntimeError(
                f"[chunkscan.mlx_lm.patch] this handle is in a with block already "
                f"({self!r}): the inner block's end would undo it for the rest of the "
                "outer one. Call chunkscan.mlx_lm.patch() again for the inner block."
            )
        self._entered = True
        return self

    def __call__(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """``@patch(...)``: each call of ``fn`` runs patched (with these options); of a
        generator function, each iteration of the generator it returns, from its first
        step to its end (the patch holds, for the whole process, while it is
        suspended). Coroutine functions raise a ``TypeError``."""
        self.undo()  # first: a decorator that raises leaves no patch behind
        if not callable(fn):
            raise TypeError(
                f"[chunkscan.mlx_lm.patch] a Patch decorates a function, not "
                f"{with_article(type(fn).__name__)}."
            )
        if inspect.iscoroutinefunction(fn) or inspect.isasyncgenfunction(fn):
            raise TypeError(
                f"[chunkscan.mlx_lm.patch] cannot decorate the async function {fn.__name__}: "
                "the patch would end before it runs. Use 'with chunkscan.mlx_lm.patch():' "
                "inside it."
            )
        options = dict(chunk_size=self.chunk_size, verify=self.verify,
                       attention=self.attention, save_states=self.save_states)  # fmt: skip

        if inspect.isgeneratorfunction(fn):  # before: patched only while it was created

            @functools.wraps(fn)
            def patched_steps(*args: Any, **kwargs: Any) -> Any:
                with patch(**options):
                    options["verify"] = False
                    return (yield from fn(*args, **kwargs))

            return patched_steps

        @functools.wraps(fn)
        def patched(*args: Any, **kwargs: Any) -> Any:
            with patch(**options):
                options["verify"] = False  # the seam was probed once: not at every call
                return fn(*args, **kwargs)

        return patched

    def __exit__(self, *exc: object) -> None:
        self.undo()

    def __repr__(self) -> str:
        state = "active" if self.active else "undone"
        return (
            f"<chunkscan.mlx_lm.Patch {state} chunk_size={self.chunk_size} "
            f"save_states={self.save_states!r} families={self.families} "
            f"lightning={self.lightning} ssd={self.ssd} mamba={self.mamba} "
            f"rwkv7={self.rwkv7} rg_lru={self.rg_lru} attention={self.attention}>"
        )


_NO_ARGUMENT = object()  # patch()'s positional slot, empty


def patch(
    _positional: object = _NO_ARGUMENT,
    /,
    *,
    chunk_size: int | None = None,
    verify: bool = True,
    attention: bool = True,
    save_states: str | None = "groups",
) -> Patch:
    """Run mlx-lm's Gated DeltaNet training path through :func:`chunkscan.gated_delta_rule`,
    its Lightning-attention and Mamba2 recurrences through :func:`chunkscan.linear_attention`,
    its Mamba layers' selective scan through :func:`chunkscan.selective_scan`, its RWKV-7
    recurrence through :func:`chunkscan.dplr_delta_rule`, its RG-LRU scan through
    :func:`chunkscan.diagonal_recurrence`, and
    (``attention=True``) its attention training path through :func:`chunkscan.attention`.

    Rebinds ``gated_delta_update`` in each mlx-lm model module that imports it by
    name (Qwen3-Next, Qwen3.5 and so Qwen3.5-MoE, which builds on it, ...). Of the
    Gated DeltaNet path only calls with ``use_kernel=False`` (modules in training mode)
    change; with ``attention=True`` every attention call without a cache goes to
    :func:`chunkscan.attention`, in eval mode too (validation; the values agree but
    for rows that attend to no key); calls with a cache (generation) are untouched.
    The Lightning, Mamba2, Mamba, RWKV-7 and RG-LRU seams (module docstring) route every
    call of more than one token without padding (RWKV-7's: with ``r``, ``k``, ``v`` of one
    dtype), a prompt's prefill included, and leave the rest (one-token steps) to
    mlx-lm; ``chunk_size`` is the Gated DeltaNet op's only (the others take their op's
    default).
    Models already loaded are covered too (the name is looked up at call time); a
    step compiled with ``mx.compile`` keeps the path it was traced with (traced before
    the patch: mlx-lm's own, and its memory; inside it: chunkscan's, after ``undo()``
    too), so patch before a compiled step's first call.

    Args:
        chunk_size (int, optional): Steps per chunk for the op; ``None`` keeps the
            op's default. Default: ``None``.
        verify (bool, optional): Compare patched and stock paths numerically on a
            tiny input: the Gated DeltaNet and attention seams before patching (a
            mismatch raises), the rebound recurrences (Lightning, Mamba2, Mamba, RWKV-7,
            RG-LRU) once
            bound (one that fails gets mlx-lm's function back with a warning, and is
            not bound again in this process); once while some handle is live (a nested
            ``patch(verify=True)`` probes what no live handle has probed). The
            comparison runs on the CPU, by switching MLX's default device for its
            duration (MLX has one default device per
            process, so work of other threads started meanwhile goes to the CPU too:
            patch before starting them, or pass ``False``). Default: ``True``.
        attention (bool, optional): Also route calls of mlx-lm's
            ``scaled_dot_product_attention`` without a cache or sinks, whose mask is
            ``"causal"``, ``None`` or boolean, to :func:`chunkscan.attention` (others
            stay with mlx-lm's, see :func:`scaled_dot_product_attention`); ``False``
            keeps MLX's kernels, unless another live handle asks for the routing (it
            stays while any does: an inner ``attention=False`` does not undo an outer
            handle's). Default: ``True``.
        save_states (str, optional): The op's ``save_states``: ``"groups"`` keeps one
            state per group of chunks for the backward instead of one per chunk, which
            adds up over a model's layers (on the H200, the 4-layer LoRA step at
            T = 32768: 8% less peak memory for 2% more time); ``"chunks"`` is the
            op's own default; ``None`` leaves it to ``CHUNKSCAN_GDN_SAVE``. Default:
            ``"groups"``.

    Returns:
        Patch: a handle; ``handle.undo()`` or ``with patch(): ...`` restores mlx-lm;
        ``@patch()`` on a function patches each of its calls.

    Raises:
        IncompatibleMlxLmError: the installed mlx-lm does not have the expected seam.
        TypeError: a positional argument (``@patch`` without parentheses),
            ``chunk_size`` is neither an int nor None, or ``verify`` / ``attention``
            is not a bool.
        ValueError: ``chunk_size`` is an int below 1, or ``save_states`` is not
            ``"chunks"``, ``"groups"`` or ``None``.
    """
    if _positional is not _NO_ARGUMENT:  # Python's "takes 0 positional arguments" (probing)
        if callable(_positional):
            how = "@chunkscan.mlx_lm.patch() (with parentheses)"
        elif isinstance(_positional, int) and not isinstance(_positional, bool):
            how = f"patch(chunk_size={_positional!r})"
        else:
            how = "its options by name, such as patch(chunk_size=64)"
        raise TypeError(
            f"[chunkscan.mlx_lm.patch] takes keyword arguments only but got "
            f"{with_article(type(_positional).__name__)} as its first argument. Write {how}."
        )
    chunk_size = check_chunk_size(
        "chunkscan.mlx_lm.patch", chunk_size, example=64, none="for the op's default"
    )
    check_bool("chunkscan.mlx_lm.patch", "verify", verify)
    check_bool("chunkscan.mlx_lm.patch", "attention", attention)
    if save_states not in (None, *SAVE_MODES):
        raise ValueError(
            f"[chunkscan.mlx_lm.patch] save_states must be 'groups', 'chunks' or None, not "
            f"{save_states!r}"
        )
    with _lock:
        try:
            return _apply(chunk_size, verify, attention, save_states)
        except BaseException:
            if not _stack:  # a first handle that failed half-way leaves nothing behind
                _roll_back()
            raise


def _apply(chunk_size, verify, attention, save_states) -> Patch:
    """:func:`patch`'s work, under the lock."""
    gd, options = _load_seam()
    stock = _stock["fn"] if _saved else getattr(gd, _NAME)
    modules = _check_families(gd, stock)
    _op()
    if attention:
        _check_attention_seam(verify)
    if verify and "gdn" not in _verified:
        with on_cpu():
            _probe(stock, options)
        _verified.add("gdn")
    if not _saved:
        _stock["fn"] = stock
        for name, module in modules.items():
            _saved[name] = getattr(module, _NAME)
            setattr(module, _NAME, _INSTALLED_GDN)
        for seam in _REBOUND.values():
            seam.install()
    for key, seam in _REBOUND.items():
        if verify and key not in _verified:
            seam.verify()
            _verified.add(key)
    names = {m.rsplit(".", 1)[1] for m in modules} | set(REQUIRED_FAMILIES)
    handle = Patch(chunk_size, tuple(sorted(names)), attention, save_states, verify,
                   lightning_patched_modules(), ssd_patched_modules(),
                   mamba_patched_modules(), rwkv7_patched_modules(),
                   rg_lru_patched_modules())  # fmt: skip
    _stack.append(handle)
    try:
        _sync_attention()
    except BaseException:  # (an interrupt) the handle is not returned: not live either
        _stack.remove(handle)
        _sync_attention()
        raise
    return handle


def _roll_back() -> None:
    """Put back everything a patch with no live handle left bound, and forget its
    probes: a first ``patch()`` that raised half-way (a seam's probe raising) left
    mlx-lm patched with no handle to undo it, and a probe that had passed was not run
    again by the next ``patch(verify=True)`` (found by review)."""
    if _saved:
        _restore_everywhere(_NAME, _INSTALLED_GDN, _stock["fn"])
        _saved.clear()
    for seam in _REBOUND.values():
        seam.restore()
    _verified.clear()
    _sync_attention()


def patched_families() -> tuple[str, ...]:
    """Names of the ``mlx_lm.models`` modules currently patched (empty when none)."""
    return tuple(sorted(n.rsplit(".", 1)[1] for n in _saved))


# ------------------------------------------------------------------------ attention

#: Modules that must import ``scaled_dot_product_attention`` by name (qwen3_5 and
#: qwen3_5_moe reuse qwen3_next's attention layer).
REQUIRED_ATTENTION_MODULES = ("llama", "qwen3_next")
_ATTN = "scaled_dot_product_attention"
_ATTN_PARAMS = ("queries", "keys", "values", "cache", "scale", "mask", "sinks")
_attn_saved: dict[str, Any] = {}  # module name -> stock function, while patched
_attn_stock: dict[str, Any] = {}  # "fn" -> mlx-lm's base.scaled_dot_product_attention
# The training paths' calls by where they went: "chunkscan.gated_delta_rule",
# "chunkscan.attention", and "mlx-lm's attention" for attention calls without a cache
# that stay with mlx-lm (sinks, a floating mask, mixed dtypes). ``chunkscan lora``
# prints them at its first report: what a model's modules hold does not say which of
# their calls can take the op (every attention call of kimi_linear and DeepSeek's MLA
# passes a floating mask, gpt_oss's sinks: none reached chunkscan.attention under a
# banner that named it; found by probing). Counted per Python call, so once per trace
# under mx.compile.
routed_calls: collections.Counter[str] = collections.Counter()


def _attention_op():
    """:func:`chunkscan.attention` (looked up at call time, so tests can spy)."""
    import chunkscan

    return chunkscan.attention


def scaled_dot_product_attention(
    queries: mx.array,
    keys: Any,
    values: Any,
    cache: Any,
    scale: float,
    mask: Any,
    sinks: mx.array | None = None,
) -> mx.array:
    """Drop-in for mlx-lm's ``base.scaled_dot_product_attention`` (what :func:`patch`
    installs): calls with no cache and no sinks whose mask is ``None``, ``"causal"`` or
    boolean and whose queries, keys and values share one dtype run
    :func:`chunkscan.attention`, every other call mlx-lm's function (which promotes
    mixed dtypes where :func:`chunkscan.attention` asks for one).

    Floating (additive) masks go to mlx-lm's function: some families compute them from
    trainable weights (kimi_linear's and DeepSeek's MLA add rotary-position scores as
    the mask), and :func:`chunkscan.attention` treats an array mask as a constant, so
    their gradient would be lost. So does a ``scale`` given as an ``mx.array`` (no
    family of mlx-lm 0.32.2 passes one; it raised ``TypeError``, found by probing).

    A boolean mask row with no key to attend to gives 0 here (no gradient), the mean of
    the values in mlx-lm's function (``mx.fast``); other rows agree."""
    if (
        cache is not None
        or sinks is not None
        or not isinstance(keys, mx.array)
        or not queries.dtype == keys.dtype == values.dtype
        or (isinstance(mask, mx.array) and mask.dtype != mx.bool_)
        or isinstance(scale, mx.array)  # chunkscan.attention takes a Python number
    ):
        if cache is None:
            routed_calls["mlx-lm's attention"] += 1
        stock = _stock_function(_attn_stock, "mlx_lm.models.base", _ATTN)
        return stock(queries, keys, values, cache, scale, mask, sinks)
    routed_calls["chunkscan.attention"] += 1
    return _attention_op()(queries, keys, values, scale=scale, mask=mask)


def _attention_fail(problems: list[str], fix: str) -> IncompatibleMlxLmError:
    return _seam_error(
        "the attention seam",
        f"mlx_lm.models.base.{_ATTN}(queries, keys, values, cache, scale, mask, "
        f"sinks=None), imported by name into each model module",
        problems,
        f"{fix} Or pass attention=False to keep mlx-lm's attention.",
    )


def _check_attention_seam(verify: bool) -> None:
    """Check the seam; raises :class:`IncompatibleMlxLmError` on a mismatch."""
    try:
        base = importlib.import_module("mlx_lm.models.base")
    except ImportError as e:
        raise _attention_fail(
            [f"'mlx_lm.models.base' cannot be imported ({e})"],
            "Install mlx-lm 0.32.x (pip install 'mlx-lm>=0.32.2,<0.33').",
        ) from e
    stock = _attn_stock["fn"] if _attn_saved else getattr(base, _ATTN, None)
    if stock is None or not callable(stock):
        raise _attention_fail([f"'mlx_lm.models.base' has no function {_ATTN!r}"], "")
    sig = inspect.signature(stock)
    names = tuple(sig.parameters)
    if names != _ATTN_PARAMS or sig.parameters["sinks"].default is not None:
        raise _attention_fail(
            [f"{_ATTN}{sig}: its parameters are ({', '.join(names)}) but "
             f"({', '.join(_ATTN_PARAMS)}) with sinks=None were expected"],
            "Pin mlx-lm to a version with this seam, or update chunkscan.mlx_lm.",
        )  # fmt: skip
    problems = []
    for family in REQUIRED_ATTENTION_MODULES:
        name = f"mlx_lm.models.{family}"
        try:
            bound = getattr(importlib.import_module(name), _ATTN, None)
        except ImportError as e:
            problems.append(f"{name} cannot be imported ({e})")
            continue
        if all(bound is not f for f in (stock, scaled_dot_product_attention, _INSTALLED_ATTENTION)):
            problems.append(f"{name}.{_ATTN} is {bound!r}, not mlx_lm.models.base.{_ATTN}")
    if problems:
        raise _attention_fail(problems, "Pin mlx-lm to a version with this seam.")
    if verify and "attention" not in _verified:
        with on_cpu():
            _probe_attention(stock)
        _verified.add("attention")
    _attn_stock["fn"] = stock


def _probe_attention(stock: Any) -> None:
    """Values and gradients of the blocked op against the stock function (causal, GQA)."""
    from .ops.attention import blocked

    B, Hq, Hkv, T, D = 2, 4, 2, 37, 16
    keys = mx.random.split(mx.random.key(11), 4)
    q, k, v, ct = (mx.random.normal(s, key=kk) for s, kk in zip(
        [(B, Hq, T, D), (B, Hkv, T, D), (B, Hkv, T, D), (B, Hq, T, D)], keys))  # fmt: skip

    def ours(q, k, v):
        # The blocked path itself: small calls would otherwise go to mx.fast.
        return blocked.blocked_attention(q, k, v, scale=D**-0.5, mask="causal", chunk_size=8)

    def theirs(q, k, v):
        return stock(q, k, v, None, D**-0.5, "causal")

    got = mx.vjp(lambda *a: [ours(*a)], [q, k, v], [ct])
    ref = mx.vjp(lambda *a: [theirs(*a)], [q, k, v], [ct])
    problems = _differences(zip(("output", "dq", "dk", "dv"), got[0] + got[1], ref[0] + ref[1]))
    if problems:
        raise _attention_fail(
            ["chunkscan.attention does not reproduce the stock function: " + p for p in problems],
            "mlx-lm's layout, scale or mask convention changed; update chunkscan.mlx_lm.",
        )


def _sync_attention() -> None:
    """Rebind the attention name while some live handle asks for it; restore otherwise.

    Rebinds it in every ``mlx_lm.models`` module imported so far that holds mlx-lm's
    function, ``base`` included, so that a model module imported later (e.g. by
    ``mlx_lm.load`` inside ``with patch():``) imports the replacement by name.
    Restoring puts mlx-lm's function back wherever the replacement is bound, in any
    module (:func:`_restore_everywhere`).
    """
    want = any(h.attention for h in _stack)
    if want and not _attn_saved:
        stock = _attn_stock["fn"]
        for name, module in _model_modules():
            if getattr(module, _ATTN, None) is stock:
                _attn_saved[name] = stock
                setattr(module, _ATTN, _INSTALLED_ATTENTION)
    elif not want and _attn_saved:
        _restore_everywhere(_ATTN, _INSTALLED_ATTENTION, _attn_stock["fn"])
        _attn_saved.clear()


def _installed(fn: Callable[..., Any], name: str) -> Callable[..., Any]:
    """A function of its own that calls ``fn``: what :func:`patch` binds in mlx-lm's
    modules, so that undoing it restores exactly what it bound, and not a module that
    imported the public drop-in (``from chunkscan.mlx_lm import gated_delta_update``) on
    purpose (it was switched back to mlx-lm's function by any patch and undo; found by
    probing). ``name``: the module attribute that holds it, its ``__qualname__``, so
    that pickle finds it (``functools.wraps`` gave it ``fn``'s)."""

    @functools.wraps(fn)
    def installed(*args: Any, **kwargs: Any) -> Any:
        return fn(*args, **kwargs)

    installed.__qualname__ = name
    return installed


_INSTALLED_GDN = _installed(gated_delta_update, "_INSTALLED_GDN")
_INSTALLED_ATTENTION = _installed(scaled_dot_product_attention, "_INSTALLED_ATTENTION")


def _restore_everywhere(name: str, installed: Any, stock: Any) -> None:
    """Bind ``stock`` to ``name`` in every imported module that binds ``installed``
    (:func:`_installed`) there: mlx-lm's and any other that imported the name from
    mlx-lm while patched (before, only ``mlx_lm.models`` was searched, and such a
    module kept the replacement)."""
    _rebind_everywhere(name, lambda bound: stock if bound is installed else None)


def _rebind_everywhere(name: str, stock_for: Callable[[Any], Any]) -> None:
    """In every imported module, replace what ``name`` binds by ``stock_for(it)`` where
    that is not None. Reads each module's ``__dict__``, so no module's ``__getattr__``
    hook runs."""
    for module in list(sys.modules.values()):
        if isinstance(module, ModuleType) and name in vars(module):
            stock = stock_for(vars(module)[name])
            if stock is not None:
                setattr(module, name, stock)


def _model_modules() -> list[tuple[str, ModuleType]]:

    return [
        (name, module)
        for name, module in list(sys.modules.items())
        if name.startswith("mlx_lm.models.") and isinstance(module, ModuleType)
    ]


def attention_patched_modules() -> tuple[str, ...]:
    """Names of the ``mlx_lm.models`` modules whose attention is patched now."""
    return tuple(sorted(n.rsplit(".", 1)[1] for n in _attn_saved))


# ----------------------------------------------------- Lightning attention (Bailing)

#: mlx-lm's Lightning-attention recurrence, a module-level function that the family's
#: ``LinearAttention.__call__`` calls by name (``[B, H, T, D]`` tensors, ``g`` one
#: log-decay per head, ``h`` the state ``[B, H, Dk, Dv]`` or None), in two signatures:
#: bailing_moe_linear's per-token loop ``recurrent_gla(q, k, v, g, scale, h=None)``
#: (its outputs in ``q``'s dtype promoted with ``h``'s), and bailing_hybrid's chunks of
#: 128 in a Python loop ``recurrent_gla(q, k, v, g, *, scale, h=None, mask=None,
#: chunk=128)`` (a padding mask; ``y`` in ``q``'s dtype, the state float32), mlx-lm 0.32.2.
_GLA = "recurrent_gla"
_GLA_PARAMS = ("q", "k", "v", "g", "scale", "h")
_GLA_KEYWORD_PARAMS = ("q", "k", "v", "g", "scale", "h", "mask", "chunk")


def _gla_style(fn: Callable[..., Any]) -> str | None:
    """``"positional"`` (bailing_moe_linear's signature), ``"keyword"`` (bailing_hybrid's)
    or ``None`` (neither: not the seam)."""
    if _plain_signature(fn, _GLA_PARAMS):
        return "positional" if inspect.signature(fn).parameters["h"].default is None else None
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return None
    P = inspect.Parameter
    kinds = [P.POSITIONAL_OR_KEYWORD] * 4 + [P.KEYWORD_ONLY] * 4
    if tuple(p.name for p in params) != _GLA_KEYWORD_PARAMS or [p.kind for p in params] != kinds:
        return None
    defaults = {p.name: p.default for p in params}
    plain = defaults["h"] is None and defaults["mask"] is None
    return "keyword" if plain and defaults["scale"] is inspect.Parameter.empty else None


def _lightning_op():
    """:func:`chunkscan.linear_attention` (looked up at call time, so tests can spy)."""
    import chunkscan

    return chunkscan.linear_attention


def _chunked_gla(q, k, v, g, scale, h, style="positional"):
    """mlx-lm's ``recurrent_gla`` through :func:`chunkscan.linear_attention`: the layout
    turned (time before heads, the state ``[Dv, Dk]``), the gate the same at every token,
    the results in the dtypes of mlx-lm's function of that ``style``
    (:func:`_gla_style`)."""
    B, H, T, _ = q.shape
    y_dtype = state_dtype = q.dtype  # bailing_moe_linear's: q's, promoted with a state's
    if style == "keyword":  # bailing_hybrid's: q's, and a float32 state
        state_dtype = mx.float32
    elif h is not None:
        y_dtype = state_dtype = mx.result_type(q, h)
    # The op's own default chunk (64 on the CPU, 256 on a GPU), not the handle's
    # chunk_size: that is the Gated DeltaNet op's (chunkscan lora resolves it to that
    # op's default, 64 on a GPU, where this op holds 1.3-2.2x the memory of 256: run 118).
    o, state = _lightning_op()(
        *(x.transpose(0, 2, 1, 3) for x in (q, k, v)),
        mx.broadcast_to(g.astype(mx.float32), (B, T, H)),
        scale=scale,
        initial_state=None if h is None else h.swapaxes(-1, -2),
    )
    return o.transpose(0, 2, 1, 3).astype(y_dtype), state.swapaxes(-1, -2).astype(state_dtype)


def _state_shaped(h: Any, q: mx.array, v: mx.array) -> bool:
    """Whether ``h`` is a state ``[B, H, Dk, Dv]`` of the call's own sizes."""
    return isinstance(h, mx.array) and h.shape == (*q.shape[:2], q.shape[3], v.shape[3])


def _lightning(stock: Callable[..., Any]) -> Callable[..., Any]:
    """What :func:`patch` binds to ``recurrent_gla`` in a family's module: calls of more
    than one token (training; prefill too, which has no other sign) with one head count
    and one dtype for ``q``, ``k`` and ``v``, a gate per head, no padding mask (the
    keyword signature's) and no state or one of the call's own shape ``[B, H, Dk, Dv]``
    (not broadcast over the batch) go to :func:`chunkscan.linear_attention`, every other
    call (decoding one token; a padded batch of prompts; mixed dtypes, which mlx-lm
    promotes and the op refuses: a bfloat16 model with float32 q and k norms raised,
    found by probing) to mlx-lm's function, with mlx-lm's defaults for what it leaves out."""
    style = _gla_style(stock)
    signature = inspect.signature(stock)

    @functools.wraps(stock)
    def recurrent_gla(*args: Any, **kwargs: Any) -> Any:
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        q, k, v, g, scale, h = (bound.arguments[n] for n in _GLA_PARAMS)
        takes = (
            all(isinstance(x, mx.array) and x.ndim == 4 for x in (q, k, v))
            and q.shape[2] > 1
            and q.shape[1] == k.shape[1] == v.shape[1]
            and q.dtype == k.dtype == v.dtype
            and isinstance(g, mx.array)
            and g.shape == (q.shape[1],)
            and not isinstance(scale, mx.array)
            # a state of the call's own shape (one broadcast over the batch is mlx-lm's:
            # the op raised, naming the layout; found by probing)
            and (h is None or _state_shaped(h, q, v))
            and bound.arguments.get("mask") is None
        )
        if not takes:
            return stock(*args, **kwargs)
        routed_calls["chunkscan.linear_attention"] += 1
        return _chunked_gla(q, k, v, g, scale, h, style)

    recurrent_gla.__qualname__ = "_lightning.recurrent_gla"
    return recurrent_gla


def _probe_lightning(stock: Callable[..., Any]) -> list[str]:
    """The patched call against mlx-lm's on a tiny float32 input, with and without a
    state; the problems found (none: ``[]``)."""
    style = _gla_style(stock)
    keys = mx.random.split(mx.random.key(13), 4)
    q, k, v = (mx.random.normal((2, 3, 5, s), key=kk) for s, kk in zip((8, 8, 4), keys))
    g = -mx.array([0.1, 0.7, 2.0])
    h = mx.random.normal((2, 3, 8, 4), key=keys[3]) * 0.3
    problems = []
    for state in (None, h):
        ours = _chunked_gla(q, k, v, g, 0.35, state, style)
        if style == "keyword":
            theirs = stock(q, k, v, g, scale=0.35, h=state)
        else:
            theirs = stock(q, k, v, g, 0.35, state)
        label = "a state" if state is not None else "no state"
        problems += _differences(zip(("output", "state"), ours, theirs), f"with {label} ")
    return problems


class _Rebound:
    """A recurrence of mlx-lm that :func:`patch` rebinds to a wrapper routing some calls
    to a chunkscan op: a module-level function, in each ``mlx_lm.models`` module that
    defines it with the expected parameters (``recurrent_gla``: Lightning attention;
    ``ssm_attn``: Mamba2's SSD), or, given ``owners``, a method of one layer class per
    module (Mamba's ``_process_sequence``, Jamba's ``ssm_step``). None is required: one
    whose function the probe finds the wrapper does not reproduce gets mlx-lm's back,
    with a warning.

    ``wrap(stock)`` builds the wrapper; ``probe(stock)`` returns the problems found
    comparing the routed path with mlx-lm's function (``[]``: none); ``accepts(fn)``
    says whether a function's signature is the seam's; ``owners()``, where given, maps
    module names to the class whose method ``name`` is the seam."""

    def __init__(self, name: str, wrap, probe, accepts, owners=None):
        self.name = name
        self._wrap, self._probe, self._accepts, self._owners = wrap, probe, accepts, owners
        self.saved: dict[str, Any] = {}  # module name -> mlx-lm's function, while patched
        self._bound_on: dict[str, Any] = {}  # module name -> the module or class rebound
        # Functions whose probe failed, for the rest of the process: a later patch() with
        # verify=False (the decorator's calls after its first) bound them again unchecked
        # (found by review).
        self._rejected: list[Any] = []

    def _candidates(self) -> dict[str, Any]:
        """Module name -> where the seam's name would be bound (a module or a class)."""
        if self._owners is not None:
            return self._owners()
        base = importlib.import_module("mlx_lm.models.base")
        found = {}
        for name in _models_naming(str(pathlib.Path(base.__file__).parent), f"def {self.name}("):
            try:
                found[name] = importlib.import_module(name)
            except Exception:  # noqa: BLE001 - an optional family that cannot load
                continue
        return found

    def targets(self) -> dict[str, tuple[Any, Any]]:
        """Each place that holds the function with the seam's signature: ``module name ->
        (module or class, mlx-lm's function)``."""
        found = {}
        for name, owner in self._candidates().items():
            fn = self.saved.get(name, vars(owner).get(self.name))
            if callable(fn) and self._accepts(fn):
                found[name] = (owner, fn)
        return found

    def install(self) -> None:
        for name, (owner, stock) in self.targets().items():
            if name not in self.saved and not any(stock is r for r in self._rejected):
                self.saved[name], self._bound_on[name] = stock, owner
                wrapper = self._wrap(stock)
                wrapper._chunkscan_stock = stock
                setattr(owner, self.name, wrapper)

    def verify(self) -> None:
        """Probe each rebound place; one that fails gets mlx-lm's function back."""
        for name, stock in list(self.saved.items()):
            try:
                with on_cpu():
                    problems = self._probe(stock)
            except Exception as e:  # noqa: BLE001 - another output shape, an error: not the seam
                problems = [f"the probe raised {type(e).__name__}: {e}"]
            if problems:
                self._rejected.append(stock)
                self._put_back(name, stock)
                del self.saved[name]
                owner = self._bound_on.pop(name, None)
                where = name if self._owners is None else f"{name}.{owner.__name__}"
                warnings.warn(
                    f"[chunkscan.mlx_lm] {where}.{self.name} is left as it is (mlx-lm "
                    f"{_mlx_lm_version()}): the patched call does not reproduce it: "
                    + "; ".join(problems),
                    RuntimeWarning,
                    stacklevel=4,
                )

    def _put_back(self, name: str, stock: Any) -> None:
        owner = self._bound_on.get(name)
        bound = vars(owner).get(self.name) if owner is not None else None
        if getattr(bound, "_chunkscan_stock", None) is stock:
            setattr(owner, self.name, stock)

    def restore(self) -> None:
        """Put mlx-lm's functions back where this seam bound its wrappers, and in any
        module that imported a wrapper by the seam's name while patched (it kept it after
        undo before; found by probing), as :func:`_restore_everywhere` does for the
        others."""
        for name, stock in self.saved.items():
            self._put_back(name, stock)
        if self._owners is None:
            stocks = {id(stock): stock for stock in self.saved.values()}
            _rebind_everywhere(
                self.name, lambda bound: stocks.get(id(getattr(bound, "_chunkscan_stock", None)))
            )
        self.saved.clear()
        self._bound_on.clear()

    def patched_modules(self) -> tuple[str, ...]:
        return tuple(sorted(n.rsplit(".", 1)[1] for n in self.saved))


def _plain_signature(fn: Callable[..., Any], params: tuple[str, ...]) -> bool:
    """Whether ``fn`` takes exactly ``params``, each positional or by keyword."""
    try:
        found = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return False
    return tuple(p.name for p in found) == params and all(
        p.kind == p.POSITIONAL_OR_KEYWORD for p in found
    )


_LIGHTNING = _Rebound(
    _GLA,
    lambda stock: _lightning(stock),
    lambda stock: _probe_lightning(stock),  # looked up at call time, so tests can spy
    lambda fn: _gla_style(fn) is not None,
)


def lightning_patched_modules() -> tuple[str, ...]:
    """Names of the ``mlx_lm.models`` modules whose ``recurrent_gla`` is patched now."""
    return _LIGHTNING.patched_modules()


# ------------------------------------------------ Mamba2 state-space duality (SSD)

#: mlx-lm's Mamba2 recurrence (``mlx_lm.models.ssm.ssm_attn``), which ``ssm_update``
#: calls by its module's name for every call but the one-token step of Metal's kernel;
#: the families import ``ssm_update`` (mamba2, nemotron_h, falcon_h1, granitemoehybrid
#: and plamo2 in mlx-lm 0.32.2), so rebinding ``ssm_attn`` in ``ssm`` reaches them all.
#: Per head ``h`` (``x`` ``[B, T, H, Dh]``, ``B`` and ``C`` ``[B, T, G, N]`` with ``H``
#: a multiple of ``G``, ``dt`` ``[B, T, H]``), with ``dt' = compute_dt(dt, dt_bias,
#: time_step_limit)`` (softplus, clipped, float32) and ``A = -exp(A_log)``::
#:
#:     S_t = exp(dt'_t A) S_{t-1} + (dt'_t x_t) B_t^T      (S: [Dh, N])
#:     y_t = S_t C_t + D x_t
#:
#: that is :func:`chunkscan.linear_attention` with ``q = C``, ``k = B``, ``v = dt' x``,
#: the log-decay ``g = dt' A``, ``scale = 1``, and the same state layout ``[B, H, Dh, N]``.
#: mlx-lm's form runs chunks of ``step`` (256) tokens in a Python loop under autograd,
#: each keeping ``[B, H, step, step]`` float32 decay matrices for the backward.
_SSD = "ssm_attn"
_SSD_PARAMS = ("x", "A_log", "B", "C", "D", "dt", "dt_bias", "state", "time_step_limit",
               "mask", "lengths", "step")  # fmt: skip
_SSD_DTYPES = (mx.float32, mx.bfloat16, mx.float16)


def _ssd_op():
    """:func:`chunkscan.linear_attention` for the SSD seam (looked up at call time, so
    tests can spy)."""
    import chunkscan

    return chunkscan.linear_attention


def _chunked_ssd(stock, x, A_log, B, C, D, dt, dt_bias, state, time_step_limit):
    """mlx-lm's ``ssm_attn`` (no mask, no lengths) through
    :func:`chunkscan.linear_attention`, in mlx-lm's dtypes: ``y`` in ``x``'s promoted
    with ``D``'s, the state float32. ``dt`` goes through the ``compute_dt`` of
    ``stock``'s module (mlx-lm's own softplus and clip)."""
    compute_dt = getattr(stock, "__globals__", {}).get("compute_dt")
    if compute_dt is None:  # a function of another module wrapping mlx-lm's
        compute_dt = importlib.import_module("mlx_lm.models.ssm").compute_dt
    dt = compute_dt(dt, dt_bias, time_step_limit)
    log_decay = dt * -mx.exp(A_log).astype(dt.dtype)
    v = dt[..., None] * x
    # The op's own default chunk, as for Lightning attention (the handle's chunk_size is
    # the Gated DeltaNet op's).
    y, final = _ssd_op()(
        C.astype(v.dtype),
        B.astype(v.dtype),
        v,
        log_decay.astype(v.dtype),
        scale=1.0,
        initial_state=None if state is None else state.astype(mx.float32),
    )
    return y.astype(x.dtype) + x * D.reshape(1, 1, -1, 1), final


def _ssd_takes(x, A_log, B, C, D, dt, dt_bias, state, mask, lengths) -> bool:
    """Whether the op can take an ``ssm_attn`` call: more than one token, no padding
    mask and no lengths (a batch of left-padded or ragged prompts, mlx-lm's), the
    shapes of the docstring above, a float32 / bfloat16 / float16 ``x``, and no state
    or one of the call's own shape (not broadcast over the batch)."""
    arrays = (x, A_log, B, C, D, dt, dt_bias)
    if mask is not None or lengths is not None or not all(isinstance(a, mx.array) for a in arrays):
        return False
    if x.ndim != 4 or B.ndim != 4 or x.shape[1] < 2 or x.dtype not in _SSD_DTYPES:
        return False
    b, t, h, dh = x.shape
    g, n = B.shape[2:]
    return (
        B.shape == C.shape == (b, t, g, n)
        and h % g == 0
        and dt.shape == (b, t, h)
        and A_log.shape == D.shape == dt_bias.shape == (h,)
        and (state is None or (isinstance(state, mx.array) and state.shape == (b, h, dh, n)))
    )


def _ssd(stock: Callable[..., Any]) -> Callable[..., Any]:
    """What :func:`patch` binds to ``ssm_attn``: calls the op can take
    (:func:`_ssd_takes`: training's, and a prompt's prefill with no padding) go to
    :func:`chunkscan.linear_attention`, every other (one token, a padding mask or
    lengths) to mlx-lm's function. mlx-lm's defaults apply to what the call leaves out."""
    signature = inspect.signature(stock)

    @functools.wraps(stock)
    def ssm_attn(*args: Any, **kwargs: Any) -> Any:
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        a = bound.arguments
        parts = (a["x"], a["A_log"], a["B"], a["C"], a["D"], a["dt"], a["dt_bias"], a["state"])
        if not _ssd_takes(*parts, a["mask"], a["lengths"]):
            return stock(*args, **kwargs)
        routed_calls["chunkscan.linear_attention (Mamba2)"] += 1
        return _chunked_ssd(stock, *parts, a["time_step_limit"])

    ssm_attn.__qualname__ = "_ssd.ssm_attn"
    return ssm_attn


def _probe_ssd(stock: Callable[..., Any]) -> list[str]:
    """The patched call against mlx-lm's on a tiny float32 input (two groups of two
    heads, 9 tokens), with and without a state; the problems found (none: ``[]``)."""
    keys = mx.random.split(mx.random.key(17), 8)
    x = mx.random.normal((2, 9, 4, 3), key=keys[0])
    B, C = (mx.random.normal((2, 9, 2, 5), key=kk) * 0.5 for kk in keys[1:3])
    dt = mx.random.normal((2, 9, 4), key=keys[3])
    A_log = mx.random.uniform(-1.0, 1.0, (4,), key=keys[4])
    D, dt_bias = (mx.random.normal((4,), key=kk) for kk in keys[5:7])
    s0 = mx.random.normal((2, 4, 3, 5), key=keys[7]) * 0.3
    problems = []
    for state in (None, s0):
        args = (x, A_log, B, C, D, dt, dt_bias, state)
        ours = _chunked_ssd(stock, *args, (0.001, 100.0))
        theirs = stock(*args, (0.001, 100.0))
        label = "a state" if state is not None else "no state"
        problems += _differences(zip(("output", "state"), ours, theirs), f"with {label} ")
    return problems


_SSD_SEAM = _Rebound(
    _SSD,
    lambda stock: _ssd(stock),
    lambda stock: _probe_ssd(stock),  # looked up at call time, so tests can spy
    lambda fn: _plain_signature(fn, _SSD_PARAMS),
)


def ssd_patched_modules() -> tuple[str, ...]:
    """Names of the ``mlx_lm.models`` modules whose ``ssm_attn`` (Mamba2) is patched now."""
    return _SSD_SEAM.patched_modules()


# ------------------------------------------------------- Mamba (S6: mamba, jamba)

#: Mamba's selective scan runs inside layer methods in mlx-lm 0.32.2, not a module-level
#: function: ``mamba.MambaBlock._process_sequence(self, x, conv_cache, state_cache)``
#: (mamba and falcon_mamba: a Python loop calling ``ssm_step`` per token, whose backward
#: keeps ``[B, Dc, N]`` states per token) and ``jamba.JambaMambaMixer.ssm_step(self, x, A,
#: state=None)`` (a loop of slice updates of a ``[B, T, Dc, N]`` array, each one a new
#: array under autograd). ``patch()`` rebinds these methods on their classes; calls of
#: more than one token go to :func:`chunkscan.selective_scan`, others to mlx-lm's.
_MAMBA_PARAMS = ("self", "x", "conv_cache", "state_cache")
_JAMBA_PARAMS = ("self", "x", "A", "state")


def _s6_op():
    """:func:`chunkscan.selective_scan` (looked up at call time, so tests can spy)."""
    import chunkscan

    return chunkscan.selective_scan


def _s6(x, delta, A, B, C, state, state_dtype):
    """The selective scan of mlx-lm's Mamba layers through :func:`chunkscan.selective_scan`
    (float32 inside): ``y`` without the skip term, in the dtype of mlx-lm's ``state @ C``
    (``state_dtype`` promoted with ``C``'s), and the state in ``state_dtype``."""
    y, final = _s6_op()(x, delta, A, B, C, initial_state=state)
    return y.astype(mx.result_type(state_dtype, C.dtype)), final.astype(state_dtype)


def _mamba_projections(layer, x):
    """``delta, B, C`` of mlx-lm's Mamba layers from the convolved inputs ``x``, for every
    token at once (mlx-lm's ``ssm_step`` makes them per token, or for the sequence in
    jamba's): ``x_proj``, split, falcon_mamba's RMS norms or jamba's layer norms, then
    ``softplus(dt_proj(delta))``."""
    r, n = layer.time_step_rank, layer.ssm_state_size
    delta, B, C = mx.split(layer.x_proj(x), [r, r + n], axis=-1)
    if getattr(layer, "use_bcdt_rms", False):  # falcon_mamba (mamba.py)
        eps = layer.args.mixer_rms_eps
        delta, B, C = (mx.fast.rms_norm(a, weight=None, eps=eps) for a in (delta, B, C))
    if hasattr(layer, "dt_layernorm"):  # jamba
        delta, B, C = layer.dt_layernorm(delta), layer.b_layernorm(B), layer.c_layernorm(C)
    return nn.softplus(layer.dt_proj(delta)), B, C


def _mamba_sequence(layer, x, conv_cache, state_cache):
    """mlx-lm's ``MambaBlock._process_sequence`` with the per-token loop replaced by one
    :func:`chunkscan.selective_scan`: the same projections, convolution and caches, the
    state in the dtype mlx-lm's loop leaves it (its products' promotion)."""
    x, z = layer.in_proj(x).split(indices_or_sections=2, axis=-1)
    K = layer.conv_kernel_size
    if conv_cache is not None:
        x_full = mx.concatenate([conv_cache, x], axis=1)
    else:
        x_full = mx.pad(x, [(0, 0), (K - 1, 0), (0, 0)])
    new_conv_cache = x_full[:, -(K - 1) :, :]
    x = nn.silu(layer.conv1d(x_full))
    A = -mx.exp(layer.A_log)
    delta, B, C = _mamba_projections(layer, x)
    parts = (delta, x, B, A) + (() if state_cache is None else (state_cache,))
    y, state = _s6(x, delta, A, B, C, state_cache, mx.result_type(*parts))
    y = y + layer.D * x
    return layer.out_proj(_swiglu(z, y)), (new_conv_cache, state)


def _swiglu(z, y):
    from mlx_lm.models.activations import swiglu

    return swiglu(z, y)


def _jamba_step(layer, x, A, state):
    """mlx-lm's ``JambaMambaMixer.ssm_step`` through :func:`chunkscan.selective_scan`:
    ``y`` with the skip term and the last state, in mlx-lm's dtypes (its slice updates
    keep the dtype of ``delta x B``)."""
    delta, B, C = _mamba_projections(layer, x)
    y, final = _s6(x, delta, A, B, C, state, mx.result_type(delta, x, B))
    return y + layer.D * x, final


def _s6_takes(x: Any, state: Any) -> bool:
    """More than one token of ``[B, T, Dc]`` in a float dtype, and no state or one per
    batch row."""
    return (
        isinstance(x, mx.array)
        and x.ndim == 3
        and x.shape[1] > 1
        and x.dtype in (mx.float32, mx.bfloat16, mx.float16)
        and (state is None or (isinstance(state, mx.array) and state.shape[0] == x.shape[0]))
    )


def _mamba_wrap(stock: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(stock)
    def _process_sequence(self, x, conv_cache, state_cache):
        if not _s6_takes(x, state_cache):
            return stock(self, x, conv_cache, state_cache)
        routed_calls["chunkscan.selective_scan"] += 1
        return _mamba_sequence(self, x, conv_cache, state_cache)

    return _process_sequence


def _jamba_wrap(stock: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(stock)
    def ssm_step(self, x, A, state=None):
        if not _s6_takes(x, state):
            return stock(self, x, A, state)
        routed_calls["chunkscan.selective_scan"] += 1
        return _jamba_step(self, x, A, state)

    return ssm_step


def _probe_layer(make, call_stock, call_ours) -> list[str]:
    """The routed layer call against mlx-lm's on a tiny float32 input, without and with
    a cache (``make(variant)`` builds the layer and its inputs)."""
    problems = []
    for variant in (0, 1):
        layer, args, label = make(variant)
        theirs = tree_flatten(call_stock(layer, *args))
        ours = tree_flatten(call_ours(layer, *args))
        if [k for k, _ in ours] != [k for k, _ in theirs]:
            problems.append(f"with {label} the results' structure differs from mlx-lm's")
            continue
        pairs = [(f"result {i}", a[1], b[1]) for i, (a, b) in enumerate(zip(ours, theirs))]
        problems += _differences(pairs, f"with {label} ")
    return problems


def _random_parameters(layer: Any, seed: int) -> None:
    """Give a tiny probe layer random weights (``A_log``, ``D`` included)."""
    params = tree_flatten(layer.parameters())
    keys = mx.random.split(mx.random.key(seed), len(params))
    layer.update(tree_unflatten([(n, 0.5 * mx.random.normal(p.shape, key=k))
                                 for (n, p), k in zip(params, keys)]))  # fmt: skip


def _probe_mamba(stock: Callable[..., Any]) -> list[str]:
    mamba = importlib.import_module("mlx_lm.models.mamba")
    keys = mx.random.split(mx.random.key(19), 3)

    def make(variant):
        args = mamba.ModelArgs(
            model_type="mamba", vocab_size=8, hidden_size=8, intermediate_size=6,
            state_size=3, num_hidden_layers=1, conv_kernel=3, use_bias=False,
            use_conv_bias=True, time_step_rank=2, use_bcdt_rms=bool(variant),
        )  # fmt: skip
        layer = mamba.MambaBlock(args)
        _random_parameters(layer, 23 + variant)
        x = mx.random.normal((2, 7, 8), key=keys[0])
        caches = (None, None)
        if variant:
            caches = (mx.random.normal((2, 2, 6), key=keys[1]),
                      0.3 * mx.random.normal((2, 6, 3), key=keys[2]))  # fmt: skip
        label = "falcon_mamba's norms and a cache" if variant else "no cache"
        return layer, (x, *caches), label

    return _probe_layer(make, stock, _mamba_sequence)


def _probe_jamba(stock: Callable[..., Any]) -> list[str]:
    jamba = importlib.import_module("mlx_lm.models.jamba")
    keys = mx.random.split(mx.random.key(29), 3)

    def make(variant):
        args = jamba.ModelArgs(
            model_type="jamba", hidden_size=8, intermediate_size=8, num_hidden_layers=1,
            num_attention_heads=1, num_key_value_heads=1, attn_layer_offset=1,
            attn_layer_period=2, expert_layer_offset=1, expert_layer_period=2,
            mamba_d_conv=3, mamba_d_state=3, mamba_expand=1, num_experts=1,
            num_experts_per_tok=1, rms_norm_eps=1e-6, max_position_embeddings=64,
            vocab_size=8, mamba_dt_rank=2,
        )  # fmt: skip
        layer = jamba.JambaMambaMixer(args)
        _random_parameters(layer, 31)
        x = mx.random.normal((2, 7, 8), key=keys[0])
        A = -mx.exp(layer.A_log)
        state = 0.3 * mx.random.normal((2, 8, 3), key=keys[2]) if variant else None
        return layer, (x, A, state), "a state" if variant else "no state"

    return _probe_layer(make, stock, _jamba_step)


def _layer_class(module: str, name: str) -> Callable[[], dict[str, Any]]:
    def owners() -> dict[str, Any]:
        try:
            cls = getattr(importlib.import_module(module), name, None)
        except Exception:  # noqa: BLE001 - a family that cannot load
            return {}
        return {module: cls} if isinstance(cls, type) else {}

    return owners


_MAMBA_SEAM = _Rebound(
    "_process_sequence",
    lambda stock: _mamba_wrap(stock),
    lambda stock: _probe_mamba(stock),  # looked up at call time, so tests can spy
    lambda fn: _plain_signature(fn, _MAMBA_PARAMS),
    owners=_layer_class("mlx_lm.models.mamba", "MambaBlock"),
)
_JAMBA_SEAM = _Rebound(
    "ssm_step",
    lambda stock: _jamba_wrap(stock),
    lambda stock: _probe_jamba(stock),
    lambda fn: _plain_signature(fn, _JAMBA_PARAMS),
    owners=_layer_class("mlx_lm.models.jamba", "JambaMambaMixer"),
)
# ------------------------------------------------------------------ RWKV-7 (rwkv7)
#: mlx-lm's ``Rwkv7TimeMixing._wkv7(self, r, w, k, v, a, b, state)``: on a CPU (and CUDA)
#: a per-token loop under autograd that keeps a ``[B, H, D, D]`` state per token; on an
#: Apple GPU a Metal kernel with no gradient. ``patch()`` rebinds the method on its class;
#: calls of more than one token go to :func:`chunkscan.dplr_delta_rule`, others to
#: mlx-lm's method.
_RWKV7_PARAMS = ("self", "r", "w", "k", "v", "a", "b", "state")


def _dplr_op():
    """:func:`chunkscan.dplr_delta_rule` (looked up at call time, so tests can spy)."""
    import chunkscan

    return chunkscan.dplr_delta_rule


def _rwkv7_wkv(r, w, k, v, a, b, state):
    """mlx-lm's ``_wkv7`` through :func:`chunkscan.dplr_delta_rule` (``q = r``, ``g =
    log w``, float32 inside): the outputs as mlx-lm's loop returns them (``[B, T, H, D,
    1]`` in ``r``'s dtype) and the state in the dtype its products leave it."""
    y, final = _dplr_op()(r, k, v, a, b, mx.log(w.astype(mx.float32)), initial_state=state)
    parts = (r if state is None else state, w, k, v, a, b)
    return y[..., None], final.astype(mx.result_type(*parts))


def _rwkv7_takes(r: Any, k: Any, v: Any, state: Any) -> bool:
    """More than one token of ``[B, T, H, D]``, ``r``, ``k``, ``v`` in one float dtype
    (the op's rule; mlx-lm's loop promotes mixed ones: a float32 ``k_a`` beside
    bfloat16 weights makes ``k`` float32, and the patched call raised; found by review),
    and no state or one of ``[B, H, D, D]``."""
    return (
        all(isinstance(x, mx.array) for x in (r, k, v))
        and r.ndim == 4
        and r.shape[1] > 1
        and r.dtype in (mx.float32, mx.bfloat16, mx.float16)
        and r.dtype == k.dtype == v.dtype
        and (
            state is None
            or (
                isinstance(state, mx.array)
                and tuple(state.shape) == (r.shape[0], r.shape[2], r.shape[3], r.shape[3])
            )
        )
    )


def _rwkv7_wrap(stock: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(stock)
    def _wkv7(self, r, w, k, v, a, b, state):
        if not _rwkv7_takes(r, k, v, state):
            return stock(self, r, w, k, v, a, b, state)
        routed_calls["chunkscan.dplr_delta_rule"] += 1
        return _rwkv7_wkv(r, w, k, v, a, b, state)

    return _wkv7


def _probe_rwkv7(stock: Callable[..., Any]) -> list[str]:
    rwkv7 = importlib.import_module("mlx_lm.models.rwkv7")
    keys = mx.random.split(mx.random.key(37), 8)
    B, T, H, D = 2, 7, 2, 4

    def make(variant):
        args = rwkv7.ModelArgs(
            model_type="rwkv7", vocab_size=8, hidden_size=H * D, intermediate_size=8,
            norm_eps=1e-5, head_dim=D, num_hidden_layers=1, a_low_rank_dim=2,
            v_low_rank_dim=2, gate_low_rank_dim=2, decay_low_rank_dim=2,
        )  # fmt: skip
        layer = rwkv7.Rwkv7TimeMixing(args, layer_idx=0)
        r, k, v, kk, lr, d = (mx.random.normal((B, T, H, D), key=key) for key in keys[:6])
        kk = kk / mx.linalg.norm(kk, axis=-1, keepdims=True)
        w = mx.exp(-0.606531 * mx.sigmoid(d))
        state = 0.3 * mx.random.normal((B, H, D, D), key=keys[6]) if variant else None
        return (
            layer,
            (r, w, k, v, -kk, kk * mx.sigmoid(lr), state),
            ("a state" if variant else "no state"),
        )

    return _probe_layer(make, stock, lambda layer, *args: _rwkv7_wkv(*args))


_RWKV7_SEAM = _Rebound(
    "_wkv7",
    lambda stock: _rwkv7_wrap(stock),
    lambda stock: _probe_rwkv7(stock),
    lambda fn: _plain_signature(fn, _RWKV7_PARAMS),
    owners=_layer_class("mlx_lm.models.rwkv7", "Rwkv7TimeMixing"),
)
# ------------------------------------------------- RG-LRU (recurrent_gemma's rnn_scan)
#: mlx-lm's ``recurrent_gemma.rnn_scan(x, a, h0)``: ``h_t = a_t h_{t-1} + x_t`` over
#: ``[B, T, D]``, for more than one token a loop of slice updates ``y[:, t] = h_t`` of a
#: ``[B, T, D]`` array, one op per token (on CUDA its backward's peak per token grew
#: with T, 623 to 1462 KiB/token from T = 1024 to 4096 in RecurrentGemma 2B's block; on
#: the CPU MLX updates in place and it stays flat: ``docs/mlx_lm.md``, "RG-LRU").
#: ``patch()`` rebinds it in the modules that define it; calls of more than one token go
#: to :func:`chunkscan.diagonal_recurrence`, others (decoding) to mlx-lm's.
_RNN_SCAN_PARAMS = ("x", "a", "h0")


def _diagonal_op():
    """:func:`chunkscan.diagonal_recurrence` (looked up at call time, so tests can spy)."""
    import chunkscan

    return chunkscan.diagonal_recurrence


def _chunked_rnn_scan(x, a, h0):
    """``rnn_scan`` through :func:`chunkscan.diagonal_recurrence` (float32 inside): every
    state in ``x``'s dtype (mlx-lm's slice updates cast to it) and the last in the dtype
    its products leave it."""
    h, final = _diagonal_op()(x, a, initial_state=h0)
    parts = (x, a) + (() if h0 is None else (h0,))
    return h, final.astype(mx.result_type(*parts))


def _rnn_scan_takes(x: Any, a: Any, h0: Any) -> bool:
    """More than one token of ``[B, T, D]`` in a float dtype, ``a`` of its shape, and no
    state or one of ``[B, D]``."""
    return (
        isinstance(x, mx.array)
        and isinstance(a, mx.array)
        and x.ndim == 3
        and x.shape[1] > 1
        and tuple(a.shape) == tuple(x.shape)
        and x.dtype in _SSD_DTYPES
        and a.dtype in _SSD_DTYPES
        and (
            h0 is None or (isinstance(h0, mx.array) and tuple(h0.shape) == (x.shape[0], x.shape[2]))
        )
    )


def _rnn_scan_wrap(stock: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(stock)
    def rnn_scan(x, a, h0):
        if not _rnn_scan_takes(x, a, h0):
            return stock(x, a, h0)
        routed_calls["chunkscan.diagonal_recurrence"] += 1
        return _chunked_rnn_scan(x, a, h0)

    return rnn_scan


def _probe_rnn_scan(stock: Callable[..., Any]) -> list[str]:
    """The patched call against mlx-lm's on a tiny float32 input, with and without a
    state; the problems found (none: ``[]``)."""
    keys = mx.random.split(mx.random.key(41), 3)
    x = mx.random.normal((2, 9, 5), key=keys[0])
    a = mx.sigmoid(mx.random.normal((2, 9, 5), key=keys[1]))
    h0 = mx.random.normal((2, 5), key=keys[2])
    problems = []
    for state in (None, h0):
        label = "a state" if state is not None else "no state"
        ours, theirs = _chunked_rnn_scan(x, a, state), stock(x, a, state)
        problems += _differences(zip(("states", "last state"), ours, theirs), f"with {label} ")
    return problems


_RNN_SCAN_SEAM = _Rebound(
    "rnn_scan",
    lambda stock: _rnn_scan_wrap(stock),
    lambda stock: _probe_rnn_scan(stock),
    lambda fn: _plain_signature(fn, _RNN_SCAN_PARAMS),
)
#: The rebound recurrences, by the key of their probe in ``_verified``.
_REBOUND = {
    "lightning": _LIGHTNING,
    "ssd": _SSD_SEAM,
    "mamba": _MAMBA_SEAM,
    "jamba": _JAMBA_SEAM,
    "rwkv7": _RWKV7_SEAM,
    "rg_lru": _RNN_SCAN_SEAM,
}


def mamba_patched_modules() -> tuple[str, ...]:
    """Names of the ``mlx_lm.models`` modules whose Mamba (S6) layer method is patched now."""
    return tuple(sorted(_MAMBA_SEAM.patched_modules() + _JAMBA_SEAM.patched_modules()))


def rwkv7_patched_modules() -> tuple[str, ...]:
    """Names of the ``mlx_lm.models`` modules whose RWKV-7 layer method is patched now."""
    return _RWKV7_SEAM.patched_modules()


def rg_lru_patched_modules() -> tuple[str, ...]:
    """Names of the ``mlx_lm.models`` modules whose ``rnn_scan`` (RG-LRU) is patched now."""
    return _RNN_SCAN_SEAM.patched_modules()
