"""Train mlx-lm's recurrent models with chunkscan's ops.

``patch()`` swaps the training path of every mlx-lm model family that runs the gated
delta rule (Qwen3-Next, Qwen3.5 and Qwen3.5-MoE, and any other family the installed
mlx-lm has) for :func:`chunkscan.gated_delta_rule`, whose backward memory does not grow
with the sequence length; of the Lightning-attention, Mamba2, Mamba, RWKV-7 and
RecurrentGemma families for :func:`chunkscan.linear_attention`,
:func:`chunkscan.selective_scan`, :func:`chunkscan.dplr_delta_rule` and
:func:`chunkscan.diagonal_recurrence` (below); and, with ``attention=True``, every
attention call without a cache, in eval mode too, for :func:`chunkscan.attention`.
Generation as mlx-lm runs it (eval mode) is left alone, but for a prompt's prefill in
the rebound recurrences, whose functions have no sign of training. The Gated DeltaNet
seam routes by mode, not by cache: under ``model.train()`` a call with a cache runs the
op too (with stock's values); the attention seam leaves every call with a cache alone::

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
:func:`chunkscan.linear_attention` (``q = C``, ``k = B``, ``v = dt x``, ``g = dt A``,
``scale = 1``), others to mlx-lm's function; probed and left alone with a warning as above
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

These five seams' code is :mod:`chunkscan.mlx_lm._recurrences` (one ``_Rebound`` each);
this module holds the handle, the Gated DeltaNet and attention seams, and the state
they share (``routed_calls``, the probes' ``on_cpu``).

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
import numbers
import pathlib
import sys
import threading
import warnings
from collections.abc import Callable, Collection
from types import ModuleType
from typing import Any

import mlx.core as mx

from .. import _random
from .._tree import with_article
from ..ops._checks import FLOAT_DTYPES, check_bool
from ..ops.gated_delta.chunk import check_save_states
from ..split import check_chunk_size

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
# The float dtypes the ops take; calls in others (float64, CPU only) are mlx-lm's, which
# promotes them (the ops raised naming arguments the caller never passed; probing).
_OP_DTYPES = (mx.float32, mx.bfloat16, mx.float16)


def _op_dtypes(*xs: Any) -> bool:
    """Whether every array among ``xs`` is in a float dtype the ops take
    (:data:`_OP_DTYPES`); what is not an array (a state of ``None``) is passed over. The
    seams' one dtype rule: each spelt it out before."""
    return all(x.dtype in _OP_DTYPES for x in xs if isinstance(x, mx.array))


class IncompatibleMlxLmError(RuntimeError):
    """The installed mlx-lm does not have the seam :func:`patch` relies on."""


# --------------------------------------------------------------------------- state


def _kept(name: str, make: Callable[[], Any]) -> Any:
    """The module's own ``name`` from an earlier run of this module, else ``make()``:
    ``importlib.reload(chunkscan.mlx_lm)`` runs it again in its namespace, and a reload
    while a patch was live lost its handles and records (``undo`` did nothing, mlx-lm
    stayed patched, and ``patch()`` called the wrappers it had installed other code's;
    found by probing, session 54). Every piece of state below is kept so."""
    old = globals().get(name)
    return make() if old is None else old


_lock = _kept("_lock", threading.RLock)
_stack: list[Patch] = _kept("_stack", list)  # live handles, innermost last
_saved: dict[str, Any] = _kept("_saved", dict)  # module name -> stock function, while patched
_stock: dict[str, Any] = _kept("_stock", dict)  # "fn" -> mlx-lm's gated_delta_update
# The seams whose numerical probe ran while some handle is live ("gdn", "attention", and
# the keys of _REBOUND: "lightning", "ssd", "mamba", "jamba", "rwkv7", "rg_lru"; a
# rebound function that failed its probe is unbound, not kept):
# a nested patch(verify=True) under a patch(verify=False) skipped its probe, the seam
# being installed already (found by probing); emptied with the last handle's undo.
_verified: set[str] = _kept("_verified", set)


def _mlx_lm_version() -> str:
    try:
        import mlx_lm

        return str(getattr(mlx_lm, "__version__", "unknown"))
    except Exception:  # noqa: BLE001 - only for the message
        return "not importable"


def _seam_error(
    seam: str, written_for: str, problems: list[str], fix: str, rebound: bool = False
) -> IncompatibleMlxLmError:
    """The error of a seam check: ``seam`` ("the seam", "the attention seam") is not
    what this patch was written for (``written_for``, as in mlx-lm 0.32.x); or, with
    ``rebound``, it is, but other code has rebound its function in some modules
    (:func:`_not_mlx_lms`)."""
    bullets = "\n".join(f"  * {p};" for p in problems)
    version = _mlx_lm_version()
    if rebound:
        return IncompatibleMlxLmError(
            f"[chunkscan.mlx_lm.patch] the installed mlx-lm {version} has {seam} this "
            f"patch was written for ({written_for}), but other code has rebound its "
            f"function:\n{bullets}\n{fix}"
        )
    return IncompatibleMlxLmError(
        f"[chunkscan.mlx_lm.patch] the installed mlx-lm {version} does not "
        f"match {seam} this patch was written for (mlx-lm 0.32.x: {written_for}), but "
        f"they differ:\n{bullets}\n{fix}"
    )


def _not_mlx_lms(module: str, attr: str, bound: Any, home: str, stock: Any) -> tuple[str, bool]:
    """``module.attr`` (``bound``), which is not ``stock`` (what ``home.attr`` holds), as a
    problem to report, and whether other code rebound a name of mlx-lm's seam: ``bound``
    a wrapper of ``stock``'s function (``__wrapped__``), another copy of it (the same
    code: a module reloaded after the import), what ``stock`` wraps (other code wrapped
    ``home.attr`` itself), or a function from outside mlx-lm (a replacement); else a
    version mismatch (a missing name, mlx-lm's own other function). All were reported
    as an mlx-lm of another version, with "pin mlx-lm" for a fix (found by probing,
    session 52: a profiler's wrapper, or ``importlib.reload`` of
    ``mlx_lm.models.gated_delta``, on the very version the patch was written for); the
    first form of this check called a missing name and mlx-lm's own other function
    rebound (found by review, the same session)."""
    where = f"{module}.{attr}"
    original = _unwrapped(stock)
    code = getattr(original, "__code__", None)
    if callable(bound) and bound is not original:
        inner = _unwrapped(bound)
        if inner is original or (code is not None and getattr(inner, "__code__", None) == code):
            if inner is bound:
                return f"{where} is another copy of {home}.{attr} (a module was reloaded)", True
            return f"{where} is {bound!r}, a wrapper (other code wrapped {home}.{attr})", True
    if bound is original:  # stock itself is a wrapper: home.attr was rebound
        wrapped = f"a wrapper of what {where} holds (other code wrapped it)"
        return f"{home}.{attr} is {stock!r}, {wrapped}", True
    mlx_lms = (
        getattr(bound, "__module__", None) == home and getattr(bound, "__qualname__", None) == attr
    )
    if mlx_lms and not _from_mlx_lm(original):
        # home.attr replaced (found by review, session 52): the module keeps mlx-lm's
        replaced = f"not mlx-lm's, which {where} holds (other code replaced it)"
        return f"{home}.{attr} is {stock!r}, {replaced}", True
    if callable(bound) and not _from_mlx_lm(bound):
        return f"{where} is {bound!r}, not {home}.{attr} (other code replaced it)", True
    return f"{where} is {bound!r}, not {home}.{attr}", False


def _from_mlx_lm(obj: Any) -> bool:
    """Whether ``obj`` was defined in mlx-lm (its ``__module__``)."""
    origin = getattr(obj, "__module__", None) or ""
    return origin == "mlx_lm" or origin.startswith("mlx_lm.")


def _unwrapped(fn: Any) -> Any:
    """``inspect.unwrap(fn)``; ``fn`` itself where its ``__wrapped__`` chain loops."""
    try:
        return inspect.unwrap(fn)
    except ValueError:
        return fn


def _rebound_fix(home: str, attr: str) -> str:
    """The fix where every problem is a rebound name (:func:`_not_mlx_lms`)."""
    return (
        f"Call chunkscan.mlx_lm.patch() before other code wraps or replaces {attr} (or undo "
        f"that first); after importlib.reload({home}) reload the modules that import it "
        f"too, or restart Python."
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


def _fail(problems: list[str], fix: str, rebound: bool = False) -> IncompatibleMlxLmError:
    return _seam_error(
        "the seam",
        f"mlx_lm.models.gated_delta.{_NAME}(q, k, v, a, b, A_log, dt_bias, state=None, "
        f"mask=None, *, use_kernel=True, ...), imported by name into each family's module",
        problems,
        fix,
        rebound,
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


# What _chunked_update's probe is when the call is not the probe's.
_NOT_A_PROBE = object()


def _chunked_update(
    q, k, v, a, b, A_log, dt_bias, state=None, mask=None, *, options,
    probe: Any = _NOT_A_PROBE,
):  # fmt: skip
    """mlx-lm's ``gated_delta_update`` training path through the op, with the live
    handle's ``chunk_size`` and ``save_states``; called by :func:`_probe` (for the
    handle about to be made, a live one or none) with that handle's, ``probe`` =
    ``(chunk_size, save_states)``: without it the probe's op read
    ``CHUNKSCAN_GDN_SAVE`` where no handle was live, and an invalid value broke
    ``patch(save_states="groups")``, which never reads it (found by probing, session
    47), or took an outer handle's options (review)."""
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
    if probe is not _NOT_A_PROBE:
        chunk_size, kwargs["save_states"] = probe
    elif _stack:
        chunk_size, kwargs["save_states"] = _stack[-1].chunk_size, _stack[-1].save_states
    else:
        chunk_size = None
    if chunk_size is not None:
        kwargs["chunk_size"] = chunk_size
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
    ``[B, T, Hv, Dk]``) runs :func:`chunkscan.gated_delta_rule`, with ``q``, ``k``,
    ``v`` of mixed dtypes promoted to one as mlx-lm's loop promotes them, its output in
    ``q``'s dtype as mlx-lm's (the op takes one dtype; such calls raised, found by
    probing). A call with any array in float64 (CPU only), which the op does not take,
    goes to mlx-lm's function (a float64 state came back float32; found by review).
    """
    unknown = [name for name in options if name not in _KNOWN_OPTIONS]
    if unknown:  # as mlx-lm's own function raises (the training path dropped them: a
        # misspelt lower_bnd=-5.0 trained with no bound; found by probing, session 51)
        raise TypeError(f"gated_delta_update() got an unexpected keyword argument {unknown[0]!r}")
    shaped = None if use_kernel else _call_shaped(q, k, v, a, b, state)
    if shaped is None or not _op_dtypes(q, k, v, a, b, A_log, dt_bias, state):
        stock = _stock_function(_stock, "mlx_lm.models.gated_delta", _NAME)
        return stock(q, k, v, a, b, A_log, dt_bias, state, mask, use_kernel=use_kernel, **options)
    q, k, v, a, b, state = shaped
    dtype, out_dtype = mx.result_type(q, k, v), q.dtype
    q, k, v = (x.astype(dtype) for x in (q, k, v))
    routed_calls["chunkscan.gated_delta_rule"] += 1
    out, state = _chunked_update(q, k, v, a, b, A_log, dt_bias, state, mask, options=options)
    return out.astype(out_dtype), state


def _call_shaped(q, k, v, a, b, state) -> tuple | None:
    """``(q, k, v, a, b, state)`` broadcast to the call's own sizes (``q``, ``k``
    ``[B, T, Hk, Dk]``, ``v`` ``[B, T, Hv, Dv]``, ``a`` ``[B, T, Hv(, Dk)]``, ``b``
    ``[B, T, Hv]``, ``state`` ``[B, Hv, Dv, Dk]``; ``B`` the largest batch among them),
    as mlx-lm's loop broadcasts them: a state shared over the batch (``[1, Hv, Dv, Dk]``,
    a learned initial state) or a gate ``[1, T, Hv]`` raised in the op, naming
    ``initial_state`` or ``g`` (found by probing, session 50). Its gradient sums over
    the batch (``mx.broadcast_to``'s). ``None`` (mlx-lm's function) where they do not
    broadcast so, or are not arrays of four, four, four, three or four, three and four
    dimensions."""
    arrays = (q, k, v, a, b) if state is None else (q, k, v, a, b, state)
    if not all(isinstance(x, mx.array) for x in arrays):
        return None
    if (q.ndim, k.ndim, v.ndim, b.ndim) != (4, 4, 4, 3) or a.ndim not in (3, 4):
        return None
    if state is not None and state.ndim != 4:
        return None
    B = max(x.shape[0] for x in arrays)
    T, Hk, Dk = q.shape[1], q.shape[2], q.shape[3]
    Hv, Dv = v.shape[2], v.shape[3]
    wanted = [(B, T, Hk, Dk), (B, T, Hk, Dk), (B, T, Hv, Dv), (B, T, Hv, Dk)[: a.ndim],
              (B, T, Hv), (B, Hv, Dv, Dk)]  # fmt: skip
    out = []
    for x, shape in zip(arrays, wanted):
        if x.shape != shape:
            try:
                x = mx.broadcast_to(x, shape)
            except ValueError:
                return None
        out.append(x)
    return (*out, None) if state is None else tuple(out)


def _stock_function(kept: dict[str, Any], module: str, name: str) -> Any:
    """mlx-lm's own function: the one :func:`patch` kept, else (the public drop-ins
    imported and called with no patch ever made: a ``KeyError`` before; found by
    probing) the module's, which holds mlx-lm's while nothing is patched. Where that
    module holds a drop-in of this module itself (bound there by hand), a
    ``RuntimeError`` saying so: the drop-in called itself until Python's recursion
    limit (found by probing, session 54)."""
    fn = kept.get("fn")
    if fn is not None:
        return fn
    fn = getattr(importlib.import_module(module), name)
    if _is_ours(fn):
        problem, fix = _bound_at_home(module, name, fn)
        raise RuntimeError(f"[chunkscan.mlx_lm.{name}] {problem}. {fix}")
    return fn


# Each drop-in's name and the name of the wrapper patch() installs for it (_installed)
_INSTALLED_NAMES = {"gated_delta_update": "_INSTALLED_GDN",
                    "scaled_dot_product_attention": "_INSTALLED_ATTENTION"}  # fmt: skip


def _drop_in(fn: Any, name: str, installed: bool = True) -> bool:
    """Whether ``fn`` is this module's drop-in ``name`` (``"gated_delta_update"`` or
    ``"scaled_dot_product_attention"``), or with ``installed`` the wrapper :func:`patch`
    installs for it: by module, name and code, not identity, since
    ``importlib.reload(chunkscan.mlx_lm)`` makes new functions (of equal code) while a
    user's modules hold the old ones (found by review, session 54); the code, since a
    ``functools.wraps`` wrapper has the name of what it wraps but code of its own (one
    that routes elsewhere was taken for the drop-in; review)."""
    codes = {_INSTALLED_NAMES[name]: _INSTALLED_CODE, name: globals()[name].__code__}
    if not installed:
        del codes[_INSTALLED_NAMES[name]]
    qualname = getattr(fn, "__qualname__", None)
    return (
        getattr(fn, "__module__", None) == __name__
        and qualname in codes
        and getattr(fn, "__code__", None) == codes[qualname]
    )


def _is_ours(fn: Any) -> bool:
    """Whether ``fn`` is a drop-in of this module, a wrapper :func:`patch` installs, or
    a wrapper of either (``functools.wraps``: a profiler's)."""
    return any(_drop_in(f, n) for f in (fn, _unwrapped(fn)) for n in _INSTALLED_NAMES)


def _bound_at_home(module: str, name: str, fn: Any) -> tuple[str, str]:
    """What is wrong where ``module.name``, mlx-lm's own function, holds ``fn``, a
    drop-in of this module or a wrapper of one (bound there by hand), and the fix."""
    what = f"chunkscan.mlx_lm's {name}"
    if _unwrapped(fn) is not fn and not _drop_in(fn, name, installed=False):
        what = f"{fn!r}, a wrapper of {what}"
    if name == _NAME:
        passed, families = "use_kernel=True: inference, validation", "qwen3_next, kimi_linear"
    else:
        passed, families = "a KV cache, sinks, a floating mask", "llama, qwen3_next"
    return (
        f"{module}.{name} holds {what}, not mlx-lm's function: the drop-in hands the "
        f"calls it does not take ({passed}) to {module}.{name}, which would be itself",
        f"Keep mlx-lm's function there and bind the drop-in in the model modules that "
        f"import {name} by name (mlx_lm.models.{families}, ...), or let "
        f"chunkscan.mlx_lm.patch() bind it.",
    )


# -------------------------------------------------------------------- seam checks


def _signature(fn: Any, where: str, fail: Callable[..., IncompatibleMlxLmError]) -> Any:
    """``inspect.signature(fn)``; a wrapper chain that loops (``__wrapped__``), which
    ``inspect`` cannot follow, raises the seam's error naming ``where`` (a bare
    ``ValueError`` before; found by review, session 54)."""
    try:
        return inspect.signature(fn)
    except ValueError as e:
        raise fail([f"{where} is {fn!r}, whose signature cannot be read ({e})"],
                   _rebound_fix(*where.rsplit(".", 1)), rebound=True) from None  # fmt: skip


def _load_seam() -> tuple[Any, dict[str, Any]]:
    try:
        gd = importlib.import_module("mlx_lm.models.gated_delta")
    except ImportError as e:
        raise _fail(
            [f"'mlx_lm.models.gated_delta' cannot be imported ({e})"],
            "Install mlx-lm 0.32.x (pip install 'mlx-lm>=0.32.2,<0.33').",
        ) from e
    fn = _stock.get("fn") if _saved else getattr(gd, _NAME, None)
    if _is_ours(fn):  # (its **options read as another version's; found by probing)
        problem, fix = _bound_at_home(gd.__name__, _NAME, fn)
        raise _fail([problem], fix, rebound=True)
    if fn is None or not callable(fn):
        raise _fail(
            [f"'mlx_lm.models.gated_delta' has no function {_NAME!r}"],
            "Use an mlx-lm whose Gated DeltaNet layers call gated_delta_update.",
        )
    sig = _signature(fn, f"{gd.__name__}.{_NAME}", _fail)
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
    rebound = True  # every problem a name other code rebound (none yet)
    for name, module in modules.items():
        bound = getattr(module, _NAME, None)
        if bound is stock or _drop_in(bound, _NAME):
            usable[name] = module
        else:
            problem, by_others = _not_mlx_lms(name, _NAME, bound, gd.__name__, stock)
            problems.append(problem)
            rebound = rebound and by_others
    for family in REQUIRED_FAMILIES:
        try:  # (a module that imports the name covers it; a rebound one is reported above)
            ok = _covered(family, modules)
        except ImportError as e:
            problems.append(f"mlx_lm.models.{family} cannot be imported ({e})")
            continue
        if not ok:
            problems.append(
                f"mlx_lm.models.{family} neither imports {_NAME} by name nor builds "
                "on a module that does"
            )
    if problems and rebound and len(problems) == len(modules) - len(usable):
        raise _fail(problems, _rebound_fix(gd.__name__, _NAME), rebound=True)
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


def _probe(
    stock: Any, options: dict[str, Any], chunk_size: int | None = None,
    save_states: str | None = None,
) -> None:  # fmt: skip
    """Compare the patched and stock training paths on a tiny random input, with the
    ``chunk_size`` and ``save_states`` of the handle being made. Two key
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
        y1, s_1 = _chunked_update(*args, options=extra, probe=(chunk_size, save_states))
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
        # the Gated DeltaNet families covered: patched_families() and those built on
        # one of them (qwen3_5_moe on qwen3_5), which patched_families() does not list
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
    for rows that attend to no key); attention calls with a cache (generation) are
    untouched, and Gated DeltaNet calls in eval mode (``use_kernel=True``) with or
    without one.
    The Lightning, Mamba2, Mamba, RWKV-7 and RG-LRU seams (module docstring) route every
    call of more than one token they can take (docs/mlx_lm.md lists each seam's
    conditions; RWKV-7's, for one, need ``r``, ``k``, ``v`` of one dtype), a prompt's
    prefill included, and leave the rest (one-token steps) to mlx-lm; ``chunk_size`` is
    the Gated DeltaNet op's only (the others take their op's default).
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
            ``chunk_size`` is neither an int nor None, ``verify`` / ``attention``
            is not a bool, or ``save_states`` is neither a string nor None.
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
    if save_states is not None:
        check_save_states("chunkscan.mlx_lm.patch", save_states, "CHUNKSCAN_GDN_SAVE")
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
            _probe(stock, options, chunk_size, save_states)
        _verified.add("gdn")
    if not _saved:
        _stock["fn"] = stock
        for name, module in modules.items():
            _saved[name] = getattr(module, _NAME)
            # A module that holds the public drop-in (bound by hand) keeps it: it routes
            # as the wrapper does, and undo restores only what holds the wrapper (it was
            # given mlx-lm's function back; found by probing, session 54)
            if not _drop_in(_saved[name], _NAME, installed=False):
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
    """Names of the ``mlx_lm.models`` modules currently patched (empty when none).
    A family that builds its layers from another's module is patched through that one
    and not listed: ``qwen3_5_moe`` takes ``qwen3_5``'s model, so ``qwen3_5`` covers it."""
    return tuple(sorted(n.rsplit(".", 1)[1] for n in _saved))


# ------------------------------------------------------------------------ attention

#: Modules that must import ``scaled_dot_product_attention`` by name (qwen3_5 and
#: qwen3_5_moe reuse qwen3_next's attention layer).
REQUIRED_ATTENTION_MODULES = ("llama", "qwen3_next")
_ATTN = "scaled_dot_product_attention"
_ATTN_PARAMS = ("queries", "keys", "values", "cache", "scale", "mask", "sinks")
_attn_saved: dict[str, Any] = _kept("_attn_saved", dict)  # module name -> stock, while patched
_attn_stock: dict[str, Any] = _kept("_attn_stock", dict)  # "fn" -> mlx-lm's base function
# The training paths' calls by where they went: "chunkscan.gated_delta_rule",
# "chunkscan.attention", and "mlx-lm's attention" for attention calls without a cache
# that stay with mlx-lm (sinks, a floating mask, mixed dtypes). ``chunkscan lora``
# prints them at its first report: what a model's modules hold does not say which of
# their calls can take the op (every attention call of kimi_linear and DeepSeek's MLA
# passes a floating mask, gpt_oss's sinks: none reached chunkscan.attention under a
# banner that named it; found by probing). Counted per Python call, so once per trace
# under mx.compile.
routed_calls: collections.Counter[str] = _kept("routed_calls", collections.Counter)


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
    their gradient would be lost. So does a ``scale`` that is not a real number (an
    ``mx.array``, a 0-d NumPy array: no family of mlx-lm 0.32.2 passes one; they raised
    ``TypeError``, found by probing), and float64 queries (a model in float64 on the CPU,
    which :func:`chunkscan.attention` refuses: a ``ValueError`` from every full-attention
    layer, found by probing, session 49).

    A boolean mask row with no key to attend to gives 0 here (no gradient), the mean of
    the values in mlx-lm's function (``mx.fast``); other rows agree."""
    if (
        cache is not None
        or sinks is not None
        or not isinstance(keys, mx.array)
        or not queries.dtype == keys.dtype == values.dtype
        or queries.dtype not in FLOAT_DTYPES  # float64 (CPU): a ValueError there
        or (isinstance(mask, mx.array) and mask.dtype != mx.bool_)
        # chunkscan.attention takes a Python number (not a bool)
        or isinstance(scale, bool)
        or not isinstance(scale, numbers.Real)
    ):
        # Counted where there is no KV cache: none, or (deepseek_v32's and glm_moe_dsa's
        # training) a list of Nones, whose calls went uncounted (found by probing).
        if cache is None or (isinstance(cache, (list, tuple)) and all(c is None for c in cache)):
            routed_calls["mlx-lm's attention"] += 1
        stock = _stock_function(_attn_stock, "mlx_lm.models.base", _ATTN)
        return stock(queries, keys, values, cache, scale, mask, sinks)
    routed_calls["chunkscan.attention"] += 1
    return _attention_op()(queries, keys, values, scale=scale, mask=mask)


def _attention_fail(problems: list[str], fix: str, rebound: bool = False) -> IncompatibleMlxLmError:
    return _seam_error(
        "the attention seam",
        f"mlx_lm.models.base.{_ATTN}(queries, keys, values, cache, scale, mask, "
        f"sinks=None), imported by name into each model module",
        problems,
        f"{fix} Or pass attention=False to keep mlx-lm's attention.",
        rebound,
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
    if _is_ours(stock):  # (accepted, then every call with a cache recursed; probing)
        problem, fix = _bound_at_home(base.__name__, _ATTN, stock)
        raise _attention_fail([problem], fix, rebound=True)
    if stock is None or not callable(stock):
        raise _attention_fail([f"'mlx_lm.models.base' has no function {_ATTN!r}"], "")
    sig = _signature(stock, f"{base.__name__}.{_ATTN}", _attention_fail)
    names = tuple(sig.parameters)
    if names != _ATTN_PARAMS or sig.parameters["sinks"].default is not None:
        raise _attention_fail(
            [f"{_ATTN}{sig}: its parameters are ({', '.join(names)}) but "
             f"({', '.join(_ATTN_PARAMS)}) with sinks=None were expected"],
            "Pin mlx-lm to a version with this seam, or update chunkscan.mlx_lm.",
        )  # fmt: skip
    problems = []
    rebound = True  # every problem a name other code rebound (none yet)
    for family in REQUIRED_ATTENTION_MODULES:
        name = f"mlx_lm.models.{family}"
        try:
            bound = getattr(importlib.import_module(name), _ATTN, None)
        except ImportError as e:
            rebound = False
            problems.append(f"{name} cannot be imported ({e})")
            continue
        if bound is not stock and not _drop_in(bound, _ATTN):
            problem, by_others = _not_mlx_lms(name, _ATTN, bound, base.__name__, stock)
            problems.append(problem)
            rebound = rebound and by_others
    if problems and rebound:
        raise _attention_fail(problems, _rebound_fix(base.__name__, _ATTN), rebound=True)
    if problems:
        raise _attention_fail(problems, "Pin mlx-lm to a version with this seam.")
    if verify and "attention" not in _verified:
        with on_cpu():
            _probe_attention(stock)
        _verified.add("attention")
    _attn_stock["fn"] = stock


def _probe_attention(stock: Any) -> None:
    """Values and gradients of the blocked op against the stock function (causal, GQA)."""
    from ..ops.attention import blocked

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


def _installed(target: str) -> Callable[..., Any]:
    """A function of its own that calls the drop-in ``target`` (looked up in this
    module when called, so that after ``importlib.reload(chunkscan.mlx_lm)`` the wrapper
    kept across it runs the reloaded drop-in): what :func:`patch` binds in mlx-lm's
    modules, so that undoing it restores exactly what it bound, and not a module that
    imported the public drop-in (``from chunkscan.mlx_lm import gated_delta_update``) on
    purpose (it was switched back to mlx-lm's function by any patch and undo; found by
    probing). Its ``__qualname__`` is the module attribute that holds it
    (:data:`_INSTALLED_NAMES`), so that pickle finds it (``functools.wraps`` gave it the
    drop-in's)."""
    module = globals()

    @functools.wraps(module[target])
    def installed(*args: Any, **kwargs: Any) -> Any:
        return module[target](*args, **kwargs)

    installed.__qualname__ = _INSTALLED_NAMES[target]
    return installed


# (kept across a reload: what patch() bound is found by identity where it is restored)
_INSTALLED_GDN = _kept("_INSTALLED_GDN", lambda: _installed(_NAME))
_INSTALLED_ATTENTION = _kept("_INSTALLED_ATTENTION", lambda: _installed(_ATTN))
_INSTALLED_CODE = _INSTALLED_GDN.__code__  # (both wrappers' code: _installed's inner function)


def _restore_everywhere(name: str, installed: Any, stock: Any) -> None:
    """Bind ``stock`` to ``name`` in every imported module that binds ``installed``
    (:func:`_installed`) there, or a wrapper of it (its ``__wrapped__`` chain reaches
    ``installed``: a profiler's of what patch() bound kept routing to chunkscan after
    the undo; found by review, session 54): mlx-lm's and any other that imported the
    name from mlx-lm while patched (before, only ``mlx_lm.models`` was searched, and
    such a module kept the replacement)."""
    _rebind_everywhere(name, lambda bound: stock if _wraps(bound, installed) else None)


def _wraps(fn: Any, target: Any) -> bool:
    """Whether ``fn`` is ``target`` or its ``__wrapped__`` chain passes ``target`` (at
    most 100 links: a chain that loops ends there)."""
    for _ in range(100):
        if fn is target:
            return True
        fn = getattr(fn, "__wrapped__", None)
        if fn is None:
            return False
    return False


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
    """The ``mlx_lm.models`` modules imported so far, by full name."""
    return [
        (name, module)
        for name, module in list(sys.modules.items())
        if name.startswith("mlx_lm.models.") and isinstance(module, ModuleType)
    ]


def attention_patched_modules() -> tuple[str, ...]:
    """Names of the ``mlx_lm.models`` modules whose attention is patched now: those that
    hold the replacement, the ones imported while patched too (they import it from
    ``base`` by name; the list named only those patched at the start: found by
    probing, session 50), and while patched those that hold the public drop-in (bound
    by hand, as :func:`patched_families` lists such a Gated DeltaNet module)."""
    return tuple(
        sorted(
            name.rsplit(".", 1)[1]
            for name, module in _model_modules()
            if getattr(module, _ATTN, None) is _INSTALLED_ATTENTION
            or (_attn_saved and _drop_in(getattr(module, _ATTN, None), _ATTN, installed=False))
        )
    )


# The rebound recurrences live in their own module; they use the names above, so they
# are imported last.
from ._recurrences import (  # noqa: E402
    _REBOUND,
    lightning_patched_modules,
    mamba_patched_modules,
    rg_lru_patched_modules,
    rwkv7_patched_modules,
    ssd_patched_modules,
)
