"""The recurrences of mlx-lm that :func:`chunkscan.mlx_lm.patch` rebinds to chunkscan's
ops: Lightning attention (``recurrent_gla``), Mamba2's SSD (``ssm_attn``), Mamba's and
Jamba's selective scans (layer methods), RWKV-7's ``_wkv7`` and RecurrentGemma's
``rnn_scan``, each a :class:`_Rebound` seam (probed when bound; one whose function the
probe finds the patched call does not reproduce is left to mlx-lm with a warning).
:mod:`chunkscan.mlx_lm` holds the handle, the Gated DeltaNet and attention seams and the
shared state; the module docstring there says what each seam routes.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import pathlib
import sys
import warnings
from collections.abc import Callable
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_unflatten

from . import _differences, _mlx_lm_version, _models_naming, _op_dtypes, _rebind_everywhere


def on_cpu():
    """The package's :func:`chunkscan.mlx_lm.on_cpu`, looked up at call time (so tests
    can spy on it there)."""
    return sys.modules[__package__].on_cpu()


def _count(route: str) -> None:
    """One more call down ``route`` in the package's ``routed_calls`` (looked up at call
    time: the object a caller may have replaced)."""
    sys.modules[__package__].routed_calls[route] += 1


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
    found by probing; float64 arrays, likewise) to mlx-lm's function, with mlx-lm's
    defaults for what it leaves out."""
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
            # float64 (CPU only) is mlx-lm's, which promotes it: the op raised (probing)
            and _op_dtypes(q, g, h)
            and bound.arguments.get("mask") is None
        )
        if not takes:
            return stock(*args, **kwargs)
        _count("chunkscan.linear_attention")
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
    shapes of the docstring above, every array (the state too) in float32 / bfloat16 /
    float16 (a float64 state came back float32; found by review), and no state or one
    of the call's own shape (not broadcast over the batch)."""
    arrays = (x, A_log, B, C, D, dt, dt_bias)
    if mask is not None or lengths is not None or not all(isinstance(a, mx.array) for a in arrays):
        return False
    if x.ndim != 4 or B.ndim != 4 or x.shape[1] < 2:
        return False
    if not _op_dtypes(*arrays, state):
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
        _count("chunkscan.linear_attention (Mamba2)")
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


def _s6_takes(layer: Any, x: Any, state: Any, A: Any = None) -> bool:
    """More than one token of ``[B, T, Dc]`` in a float dtype, and no state or one per
    batch row, with the state, Jamba's ``A`` and the layer's float parameters in float
    dtypes the op takes (float64 ones, which mlx-lm's loop promotes, raised naming an
    argument the caller never passed; found by probing and review). Integer parameters
    are a quantized layer's packed weights (QLoRA), which reach the op only through
    that layer's float output: counted, every quantized Mamba or Jamba call went to
    mlx-lm's per-token loop, silently (found by probing, session 47)."""
    floats = [
        p for _, p in tree_flatten(layer.parameters()) if not mx.issubdtype(p.dtype, mx.integer)
    ]
    return (
        isinstance(x, mx.array)
        and x.ndim == 3
        and x.shape[1] > 1
        and (state is None or (isinstance(state, mx.array) and state.shape[0] == x.shape[0]))
        and _op_dtypes(x, state, A, *floats)
    )


def _mamba_wrap(stock: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(stock)
    def _process_sequence(self, x, conv_cache, state_cache):
        if not _s6_takes(self, x, state_cache):
            return stock(self, x, conv_cache, state_cache)
        _count("chunkscan.selective_scan")
        return _mamba_sequence(self, x, conv_cache, state_cache)

    return _process_sequence


def _jamba_wrap(stock: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(stock)
    def ssm_step(self, x, A, state=None):
        if not _s6_takes(self, x, state, A):
            return stock(self, x, A, state)
        _count("chunkscan.selective_scan")
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


def _rwkv7_takes(r: Any, w: Any, k: Any, v: Any, a: Any, b: Any, state: Any) -> bool:
    """More than one token of ``[B, T, H, D]``, ``r``, ``k``, ``v`` in one float dtype
    (the op's rule; mlx-lm's loop promotes mixed ones: a float32 ``k_a`` beside
    bfloat16 weights makes ``k`` float32, and the patched call raised; found by review),
    ``w``, ``a``, ``b`` in float dtypes the op takes, and no state or one of ``[B, H, D,
    D]`` in such a dtype (a float64 one, which mlx-lm's loop promotes, raised naming an
    argument the caller never passed; found by probing)."""
    return (
        all(isinstance(x, mx.array) for x in (r, w, k, v, a, b))
        and r.ndim == 4
        and r.shape[1] > 1
        and r.dtype == k.dtype == v.dtype
        and _op_dtypes(r, w, a, b, state)
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
        if not _rwkv7_takes(r, w, k, v, a, b, state):
            return stock(self, r, w, k, v, a, b, state)
        _count("chunkscan.dplr_delta_rule")
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
    """More than one token of ``[B, T, D]`` in a float dtype, ``a`` of its shape and
    dtype, and no state or one of ``[B, D]`` in a float dtype the op takes (a float64
    one, which mlx-lm's loop promotes, raised naming ``initial_state``; found by
    probing). An ``a`` of another dtype goes to mlx-lm's function, which asserts they
    match: the patch trained such a model, which then failed at its first decoding step
    (found by probing, session 49)."""
    return (
        isinstance(x, mx.array)
        and isinstance(a, mx.array)
        and x.ndim == 3
        and x.shape[1] > 1
        and tuple(a.shape) == tuple(x.shape)
        and a.dtype == x.dtype
        and _op_dtypes(x, a, h0)
        and (
            h0 is None or (isinstance(h0, mx.array) and tuple(h0.shape) == (x.shape[0], x.shape[2]))
        )
    )


def _rnn_scan_wrap(stock: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(stock)
    def rnn_scan(x, a, h0):
        if not _rnn_scan_takes(x, a, h0):
            return stock(x, a, h0)
        _count("chunkscan.diagonal_recurrence")
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
