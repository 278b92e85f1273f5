"""chunkscan.mlx_lm: the patched training path matches mlx-lm's, inference is unchanged,
and an mlx-lm without the expected seam fails loudly."""

from __future__ import annotations

import contextlib
import functools
import importlib
import inspect
import pathlib
import re
import sys
import warnings

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
import pytest
from helpers import greedy_tokens, small_config
from helpers import rel_rmse as rel

pytest.importorskip("mlx_lm")

import mlx_lm  # noqa: E402
import mlx_lm.models.base as mlx_base  # noqa: E402
import mlx_lm.models.gated_delta as gd  # noqa: E402
import mlx_lm.models.llama as llama  # noqa: E402
import mlx_lm.models.qwen3_next as qwen3_next  # noqa: E402
import mlx_lm.models.ssm as ssm  # noqa: E402
from mlx.utils import tree_flatten, tree_unflatten  # noqa: E402
from mlx_lm.tuner import trainer  # noqa: E402
from mlx_lm.tuner.utils import linear_to_lora_layers  # noqa: E402

import chunkscan  # noqa: E402
import chunkscan.mlx_lm as cmlx  # noqa: E402
import chunkscan.mlx_lm._recurrences as rec  # noqa: E402
from chunkscan.commands.demo_model import build_model  # noqa: E402

STOCK = gd.gated_delta_update
STOCK_ATTN = mlx_base.scaled_dot_product_attention
STOCK_SSD = ssm.ssm_attn
CHUNK = 16
# Patched against stock, float32 (relative RMSE, or relative for a loss): measured at most
# 6.0e-6 for the Gated DeltaNet families (qwen3_next's LoRA gradients: the per-token loop
# against the chunk form, each rounding in its own order), 2.4e-5 for bailing_moe_linear's
# Lightning attention, 2.0e-6 for bailing_hybrid's, 8.2e-7 for the Mamba2 families
# (mamba2, nemotron_h, granitemoehybrid), 4.8e-6 for the Mamba ones (mamba,
# falcon_mamba's norms, jamba), 2.9e-6 for RWKV-7 and 8.8e-7 for recurrent_gemma, over
# every comparison below; the bound is about 4x the largest.
RTOL = 1e-4


def float64_on_cpu(test):
    """Run ``test`` on MLX's CPU stream: it builds float64 arrays, which MLX's GPUs do
    not have (built on the GPU's stream they raised on an H100: run 124)."""

    @functools.wraps(test)
    def run(*args, **kwargs):
        with mx.stream(mx.cpu):
            return test(*args, **kwargs)

    return run


def lora_model(config, seed=0, quantize=False):
    """A tiny random model of ``config`` with LoRA layers (``lora_b`` non-zero); its
    base 4-bit quantized first where ``quantize`` (QLoRA; the layers whose input width
    is a multiple of the group size, 32)."""
    model = build_model(config, seed)
    if quantize:
        nn.quantize(model, group_size=32, bits=4,
                    class_predicate=lambda _, m: hasattr(m, "to_quantized")
                    and m.weight.shape[-1] % 32 == 0)  # fmt: skip
        assert any(isinstance(m, nn.QuantizedLinear) for m in model.modules())
    model.freeze()
    linear_to_lora_layers(model, len(model.layers), {"rank": 4, "dropout": 0.0, "scale": 10.0})
    # lora_b starts at zero, which zeroes lora_a's gradient: make both non-trivial.
    params = tree_flatten(model.trainable_parameters())
    keys = mx.random.split(mx.random.key(seed + 1), len(params))
    new = [
        (k, 0.05 * mx.random.normal(v.shape, key=kk) if k.endswith("lora_b") else v)
        for (k, v), kk in zip(params, keys)
    ]
    model.update(tree_unflatten(new))
    mx.eval(model.parameters())
    model.train()
    return model


def padded_batch(vocab, lengths=(46, 31), seed=0):
    """Right-padded batch as mlx-lm's iterate_batches builds it: T-1 = 45, 45 % 16 != 0."""
    rng = np.random.default_rng(seed)
    width = max(lengths)
    arr = np.zeros((len(lengths), width), np.int32)
    for i, n in enumerate(lengths):
        arr[i, :n] = rng.integers(3, vocab, n)
    return mx.array(arr), mx.array([[0, n] for n in lengths])


def loss_and_grads(model, batch, lengths, compiled=True):
    """One step as mlx-lm's trainer does it: nn.value_and_grad under mx.compile."""
    loss_value_and_grad = nn.value_and_grad(model, trainer.default_loss)
    state = [model.state, mx.random.state]

    def step(batch, lengths):
        (loss, _), grad = loss_value_and_grad(model, batch, lengths)
        return loss, grad

    if compiled:
        step = mx.compile(step, inputs=state, outputs=state)
    loss, grad = step(batch, lengths)
    mx.eval(loss, grad)
    return loss.item(), dict(tree_flatten(grad))


@pytest.fixture(autouse=True)
def _clean():
    assert cmlx.patched_families() == ()
    yield
    assert cmlx.patched_families() == (), "a test left the patch applied"
    assert qwen3_next.gated_delta_update is STOCK
    assert cmlx.attention_patched_modules() == ()
    for module in (mlx_base, llama, qwen3_next):
        assert module.scaled_dot_product_attention is STOCK_ATTN
    assert ssm.ssm_attn is STOCK_SSD and cmlx.ssd_patched_modules() == ()
    assert cmlx.mamba_patched_modules() == ()
    assert cmlx.rwkv7_patched_modules() == ()
    assert cmlx.rg_lru_patched_modules() == ()


def _record_calls(monkeypatch, getter: str, kwarg: str) -> list:
    """Wrap the op ``<module>.<getter>()`` returns (the module that defines the getter:
    :mod:`chunkscan.mlx_lm` or its rebound recurrences'); record ``kwarg`` of each of
    its calls."""
    calls = []
    module = rec if hasattr(rec, getter) else cmlx
    op = getattr(module, getter)()

    def wrapped(*args, **kwargs):
        calls.append(kwargs.get(kwarg))
        return op(*args, **kwargs)

    monkeypatch.setattr(module, getter, lambda: wrapped)
    return calls


@pytest.fixture
def spy(monkeypatch):
    """Record the chunk_size of each call of the op (proves the patched path runs)."""
    return _record_calls(monkeypatch, "_op", "chunk_size")


def test_op_is_chunkscans():
    from chunkscan.ops.gated_delta import gated_delta_rule

    assert cmlx._op() is chunkscan.gated_delta_rule is gated_delta_rule


@pytest.fixture
def restore_layer_classes(monkeypatch):
    """mlx-lm's grad_checkpoint rebinds type(layer).__call__ for good; undo it."""

    def save(model):
        for cls in {type(layer) for layer in model.layers}:
            monkeypatch.setattr(cls, "__call__", cls.__call__)

    return save


@pytest.mark.parametrize("grad_checkpoint", [False, True], ids=["plain", "grad-ckpt"])
@pytest.mark.parametrize("model_type", ["qwen3_next", "qwen3_5", "qwen3_5_moe"])
def test_lora_grads_match_stock(model_type, grad_checkpoint, spy, restore_layer_classes):
    extra = {}
    if model_type == "qwen3_5_moe":
        extra = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                     shared_expert_intermediate_size=32)  # fmt: skip
    model = lora_model(small_config(model_type, **extra))
    if grad_checkpoint:
        restore_layer_classes(model)
        trainer.grad_checkpoint(model.layers[0])
    batch, lengths = padded_batch(64)
    loss0, g0 = loss_and_grads(model, batch, lengths)
    with cmlx.patch(chunk_size=CHUNK):
        loss1, g1 = loss_and_grads(model, batch, lengths)
    assert CHUNK in spy and set(spy) <= {None, CHUNK}  # None: the probe in patch()
    assert abs(loss1 - loss0) <= RTOL * abs(loss0)
    assert g0.keys() == g1.keys() and any("linear_attn" in k for k in g0)
    for name in g0:
        assert rel(g1[name], g0[name]) <= RTOL, name


def test_trainer_losses_match_stock(tmp_path, restore_layer_classes):
    """mlx-lm's own train() (compiled step, padding, grad checkpoint), 3 steps."""
    rng = np.random.default_rng(1)
    data = [(rng.integers(3, 64, int(n)).tolist(), 0) for n in rng.integers(20, 60, 8)]

    class Losses(trainer.TrainingCallback):
        def __init__(self):
            self.losses = []

        def on_train_loss_report(self, info):
            self.losses.append(info["train_loss"])

    def run(patched):
        model = lora_model(small_config())
        restore_layer_classes(model)
        args = trainer.TrainingArgs(
            batch_size=2,
            iters=3,
            steps_per_report=1,
            steps_per_eval=1000,
            max_seq_length=128,
            grad_checkpoint=True,
            adapter_file=str(tmp_path / f"a{int(patched)}.safetensors"),
        )
        cb = Losses()
        opt = optim.Adam(learning_rate=1e-2)
        mx.random.seed(0)
        np.random.seed(0)  # iterate_batches shuffles with the global numpy state
        with cmlx.patch(chunk_size=CHUNK) if patched else contextlib.nullcontext():
            trainer.train(model, opt, data, None, args=args, training_callback=cb)
        return cb.losses

    stock, patched = run(False), run(True)
    assert len(stock) == 3
    np.testing.assert_allclose(patched, stock, rtol=RTOL)


def test_inference_unchanged():
    model = build_model(small_config(), seed=3)
    model.eval()
    prompt = mx.array([[5, 6, 7, 8, 9, 10, 11]])

    toks0, last0 = greedy_tokens(model, prompt, 5)
    with cmlx.patch():
        toks1, last1 = greedy_tokens(model, prompt, 5)
        # Training mode (no cache) agrees with inference too.
        model.train()
        train_logits = model(prompt)
        model.eval()
        eval_logits = model(prompt)
    assert toks1 == toks0
    assert mx.array_equal(last1, last0).item()
    assert rel(train_logits, eval_logits) <= RTOL


@pytest.mark.parametrize("bad", [None, "q", "k", "v", "a", "b"])
def test_mask_keeps_state(bad):
    """A padding mask (right padding on row 1, a hole on row 0) leaves the state as the
    stock path does, also where a padding token carries a NaN in one input: the op
    carries a non-finite input on to every later step, so before the patch zeroed q,
    k and v at padding steps a NaN there spread over the rest of its row and into the
    final state, where mlx-lm's loop keeps the old state (found by probing)."""
    B, T, Hk, Hv, Dk, Dv = 2, 21, 1, 2, 32, 16
    ks = mx.random.split(mx.random.key(0), 7)
    q = mx.random.normal((B, T, Hk, Dk), key=ks[0]) * Dk**-0.5
    k = mx.random.normal((B, T, Hk, Dk), key=ks[1])
    k = k / mx.linalg.norm(k, axis=-1, keepdims=True)
    v = mx.random.normal((B, T, Hv, Dv), key=ks[2])
    a = mx.random.normal((B, T, Hv), key=ks[3])
    b = mx.random.normal((B, T, Hv), key=ks[4])
    A_log = mx.random.uniform(0, 1, (Hv,), key=ks[5])
    dt_bias = mx.ones((Hv,))
    mask = mx.arange(T)[None] < mx.array([[T], [13]])
    mask = mask & (mx.arange(T)[None] != mx.array([[5], [-1]]))  # row 0: a hole at 5
    if bad is not None:  # a NaN at one padding token of each row
        xs = dict(q=q, k=k, v=v, a=a, b=b)
        x = xs[bad]
        at = (mx.arange(B)[:, None] == mx.array([[0], [1]])) & (
            mx.arange(T)[None] == mx.array([[5], [16]])
        )
        xs[bad] = mx.where(at.reshape(at.shape + (1,) * (x.ndim - 2)), mx.nan, x)
        q, k, v, a, b = (xs[n] for n in "q k v a b".split())
    y0, s0 = STOCK(q, k, v, a, b, A_log, dt_bias, None, mask, use_kernel=False)
    with cmlx.patch(chunk_size=8):
        y1, s1 = qwen3_next.gated_delta_update(
            q, k, v, a, b, A_log, dt_bias, None, mask, use_kernel=False
        )
    assert rel(s1, s0) <= RTOL
    keep = mask[..., None, None]
    assert rel(mx.where(keep, y1, 0), mx.where(keep, y0, 0)) <= RTOL
    assert mx.all(mx.where(keep, 0, y1) == 0).item()


def test_patch_handle_nested_and_idempotent():
    h1 = cmlx.patch(chunk_size=32)
    assert qwen3_next.gated_delta_update is cmlx._INSTALLED_GDN
    assert {"qwen3_next", "qwen3_5"} <= set(cmlx.patched_families())
    assert {"qwen3_next", "qwen3_5", "qwen3_5_moe"} <= set(h1.families)
    with cmlx.patch(chunk_size=8) as h2:
        assert h2.active and h1.active
    assert not h2.active
    assert qwen3_next.gated_delta_update is cmlx._INSTALLED_GDN  # h1 still live
    h1.undo()
    h1.undo()
    assert not h1.active
    assert qwen3_next.gated_delta_update is STOCK


def test_an_undone_handle_does_not_enter_again_and_a_decorator_patches_each_call():
    """Re-entering a handle after its ``with`` block ran mlx-lm's own path silently
    (found by probing the API); it raises now. ``@patch()`` crashed with Python's 'not
    callable' and left the patch on; it now undoes itself and patches each call."""
    handle = cmlx.patch(chunk_size=16, verify=False)
    with handle:
        assert handle.active
    with pytest.raises(
        RuntimeError, match=re.escape("[chunkscan.mlx_lm.patch] this handle is undone")
    ):
        with handle:
            pass
    assert qwen3_next.gated_delta_update is STOCK

    @cmlx.patch(chunk_size=8, verify=False, attention=False)
    def inside():
        (live,) = cmlx._stack
        return qwen3_next.gated_delta_update is cmlx._INSTALLED_GDN, live.chunk_size

    assert qwen3_next.gated_delta_update is STOCK and not cmlx._stack  # not at decoration
    assert inside() == (True, 8) and inside.__name__ == "inside"
    assert qwen3_next.gated_delta_update is STOCK and not cmlx._stack


def test_a_live_handle_does_not_enter_twice_and_patch_takes_no_positional_argument():
    """A handle entered again inside its own ``with`` block: the inner block's end
    undid it, and the rest of the outer block ran mlx-lm's own path silently; refused
    now, the outer block still patched. ``@patch`` without parentheses (or
    ``patch(32)``) raised Python's "takes 0 positional arguments"; it says what to
    write (both found by probing, session 40)."""
    handle = cmlx.patch(chunk_size=16, verify=False)
    with handle:
        with pytest.raises(RuntimeError, match="this handle is in a with block already"):
            with handle:
                pass
        assert handle.active and qwen3_next.gated_delta_update is cmlx._INSTALLED_GDN
    assert qwen3_next.gated_delta_update is STOCK and not cmlx._stack
    with pytest.raises(TypeError, match=re.escape("Write @chunkscan.mlx_lm.patch() (with")):

        @cmlx.patch
        def train():
            pass

    with pytest.raises(TypeError, match=re.escape("an int as its first argument. Write "
                                                  "patch(chunk_size=32).")):  # fmt: skip
        cmlx.patch(32)
    with pytest.raises(TypeError, match="got None as its first argument"):  # (review)
        cmlx.patch(None)
    assert not cmlx._stack


def test_a_decorated_generator_is_patched_while_it_runs_and_async_raises():
    """``@patch()`` on a generator function patched only while the generator object was
    made, so its body ran mlx-lm's own path (found by probing the API); now each
    iteration runs patched to its end. An async function raises."""

    @cmlx.patch(chunk_size=8, verify=False, attention=False)
    def steps():
        for _ in range(2):
            yield qwen3_next.gated_delta_update is cmlx._INSTALLED_GDN
        return "done"

    gen = steps()
    assert qwen3_next.gated_delta_update is STOCK  # nothing runs before the first step
    assert next(gen) and next(gen)
    with pytest.raises(StopIteration) as stop:
        next(gen)
    assert stop.value.value == "done"
    assert qwen3_next.gated_delta_update is STOCK and not cmlx._stack
    partly = steps()
    assert next(partly)
    partly.close()  # a generator left early undoes the patch as it closes
    assert qwen3_next.gated_delta_update is STOCK and not cmlx._stack

    async def later():
        return None

    with pytest.raises(TypeError, match=re.escape("cannot decorate the async function later")):
        cmlx.patch(verify=False)(later)
    assert not cmlx._stack
    with pytest.raises(TypeError, match=re.escape("a Patch decorates a function, not an int")):
        cmlx.patch(verify=False)(3)
    assert not cmlx._stack  # (before, a rejected decoration left its patch applied)


def test_undo_restores_attention_in_modules_outside_mlx_lm(tmp_path, monkeypatch):
    """A module that imports the attention (or the recurrence) by name while patched
    gets mlx-lm's function back at undo (only ``mlx_lm.models`` was searched: it kept
    chunkscan's, found by probing the API)."""
    import importlib
    import sys

    (tmp_path / "user_model_mod.py").write_text(
        "from mlx_lm.models.base import scaled_dot_product_attention\n"
        "from mlx_lm.models.qwen3_next import gated_delta_update\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    stock_attn = mlx_base.scaled_dot_product_attention
    with cmlx.patch(verify=False):
        user = importlib.import_module("user_model_mod")
        assert user.scaled_dot_product_attention is cmlx._INSTALLED_ATTENTION
        assert user.gated_delta_update is cmlx._INSTALLED_GDN
    assert user.scaled_dot_product_attention is stock_attn
    assert user.gated_delta_update is STOCK
    for name in ("scaled_dot_product_attention", "gated_delta_update"):  # its own stay
        assert getattr(cmlx, name).__module__ == "chunkscan.mlx_lm", name
    sys.modules.pop("user_model_mod", None)


def test_undo_leaves_a_module_that_imported_the_drop_ins_on_purpose(tmp_path, monkeypatch):
    """A module that imports chunkscan's drop-ins itself keeps them through any patch and
    undo (undo rebound every module holding them to mlx-lm's; found by probing)."""
    import importlib
    import pickle
    import sys

    (tmp_path / "user_dropin_mod.py").write_text(
        "from chunkscan.mlx_lm import gated_delta_update, scaled_dot_product_attention\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    user = importlib.import_module("user_dropin_mod")
    with cmlx.patch(verify=False):
        # The wrappers pickle by their own names (functools.wraps gave them the drop-ins'
        # names, which pickle refused as "not the same object"; found by review).
        for fn in (qwen3_next.gated_delta_update, mlx_base.scaled_dot_product_attention):
            assert pickle.loads(pickle.dumps(fn)) is fn
    handle = cmlx.patch(verify=False)
    handle.undo()
    assert user.gated_delta_update is cmlx.gated_delta_update
    assert user.scaled_dot_product_attention is cmlx.scaled_dot_product_attention
    sys.modules.pop("user_dropin_mod", None)


def test_undo_keeps_a_family_module_s_own_gdn_drop_in(monkeypatch):
    """A family module given the public Gated DeltaNet drop-in by hand keeps it through
    a patch and its undo (undo gave it mlx-lm's function back, silently: its model then
    trained through mlx-lm's loop; found by probing, session 54), as attention's do."""
    monkeypatch.setattr(qwen3_next, "gated_delta_update", cmlx.gated_delta_update)
    with cmlx.patch(verify=False):
        assert qwen3_next.gated_delta_update is cmlx.gated_delta_update
        assert "qwen3_next" in cmlx.patched_families()
    assert qwen3_next.gated_delta_update is cmlx.gated_delta_update


def test_undo_unbinds_a_wrapper_of_what_patch_bound(monkeypatch):
    """A profiler that wraps (``functools.wraps``) what ``patch()`` bound in a family
    module kept routing to chunkscan after the undo, with no patch's settings (the
    undo matched the wrapper it bound by identity; found by review, session 54). And a
    module given the public attention drop-in by hand is listed as patched while a patch
    is live, as such a Gated DeltaNet module is."""
    stock = qwen3_next.gated_delta_update
    monkeypatch.setattr(llama, "scaled_dot_product_attention", cmlx.scaled_dot_product_attention)
    with cmlx.patch(verify=False):
        installed = qwen3_next.gated_delta_update
        profiled = functools.wraps(installed)(lambda *a, **k: installed(*a, **k))
        profiled.__qualname__ = "profiled"  # (the chain, not the name, tells)
        qwen3_next.gated_delta_update = profiled
        assert "llama" in cmlx.attention_patched_modules()
    assert qwen3_next.gated_delta_update is stock
    assert llama.scaled_dot_product_attention is cmlx.scaled_dot_product_attention


def test_a_wrapper_of_the_drop_in_is_not_taken_for_it(monkeypatch):
    """A ``functools.wraps`` wrapper of the public drop-in has its name but code of its
    own: one that routes to mlx-lm was taken for the drop-in, and the module listed as
    patched while nothing reached chunkscan (found by review, session 54). It is other
    code's, as any replacement is."""

    @functools.wraps(cmlx.gated_delta_update)
    def mine(*args, **kwargs):
        return gd.gated_delta_update(*args, **kwargs)

    monkeypatch.setattr(qwen3_next, "gated_delta_update", mine)
    where = re.escape("mlx_lm.models.qwen3_next.gated_delta_update is")
    with pytest.raises(cmlx.IncompatibleMlxLmError, match=where):
        cmlx.patch(verify=False)
    assert not cmlx.patched_families()


@pytest.mark.parametrize("wrapped", [False, True])
@pytest.mark.parametrize("seam", ["gdn", "attention"])
def test_a_drop_in_bound_where_mlx_lm_defines_it_is_refused(monkeypatch, seam, wrapped):
    """The public drop-ins bound by hand in mlx-lm's own modules (``gated_delta``,
    ``base``) found themselves there as "mlx-lm's function": with no patch, a call they
    hand to mlx-lm (a cache, ``use_kernel=True``) called itself until Python's recursion
    limit; ``patch()`` took the attention one as mlx-lm's (then every call with a cache
    recursed) and called the Gated DeltaNet one another mlx-lm version (found by
    probing, session 54). Both now say where it is bound and what to do; so for a
    wrapper of a drop-in (a profiler's, ``functools.wraps``)."""
    from mlx_lm.models import base, gated_delta
    from mlx_lm.models.cache import KVCache

    def bound(fn):
        return functools.wraps(fn)(lambda *a, **k: fn(*a, **k)) if wrapped else fn

    monkeypatch.setattr(cmlx, "_stock", {})  # as in a process with no patch() yet
    monkeypatch.setattr(cmlx, "_attn_stock", {})
    keys = mx.random.split(mx.random.key(5), 4)
    if seam == "gdn":
        monkeypatch.setattr(gated_delta, "gated_delta_update", bound(cmlx.gated_delta_update))
        q = mx.random.normal((1, 4, 2, 32), key=keys[0])
        v = mx.random.normal((1, 4, 2, 16), key=keys[1])
        a = mx.random.normal((1, 4, 2), key=keys[2])
        args = (q, q, v, a, a, mx.zeros(2), mx.ones(2), None, None)
        call = functools.partial(cmlx.gated_delta_update, *args, use_kernel=True)
        where = "mlx_lm.models.gated_delta.gated_delta_update holds "
    else:
        attention = bound(cmlx.scaled_dot_product_attention)
        monkeypatch.setattr(base, "scaled_dot_product_attention", attention)
        x = mx.random.normal((1, 2, 4, 32), key=keys[3])
        cache = KVCache()
        kk, vv = cache.update_and_fetch(x, x)
        call = functools.partial(cmlx.scaled_dot_product_attention, x, kk, vv, cache, 0.2, "causal")
        where = "mlx_lm.models.base.scaled_dot_product_attention holds "
    what = r"<function \w+ at 0x\w+>, a wrapper of " if wrapped else ""
    where = re.escape(where) + what + re.escape("chunkscan.mlx_lm's")
    with pytest.raises(RuntimeError, match=where):
        call()
    with pytest.raises(cmlx.IncompatibleMlxLmError, match=where):
        cmlx.patch(verify=False)
    assert not cmlx.patched_families() and not cmlx.attention_patched_modules()


def test_a_reload_of_the_seam_while_patched_keeps_its_state():
    """``importlib.reload(chunkscan.mlx_lm)`` (a notebook's autoreload) while a patch was
    live lost the patch's records: ``undo()`` did nothing, mlx-lm stayed patched until
    Python exited, and the next ``patch()`` called the wrappers it had installed other
    code's (found by probing, session 54); and a drop-in bound by hand before a reload
    was refused by ``patch()`` after it (found by review). A fresh process: a reload
    replaces the module's functions and classes for every later test."""
    import subprocess
    import sys

    code = """
import importlib
import chunkscan.mlx_lm as cmlx
from mlx_lm.models import base, gated_delta, llama, qwen3_next
stock = (gated_delta.gated_delta_update, base.scaled_dot_product_attention)
handle = cmlx.patch(verify=False)
importlib.reload(cmlx)
assert handle.active and "qwen3_next" in cmlx.patched_families(), "records lost"
handle.undo()
assert (qwen3_next.gated_delta_update, llama.scaled_dot_product_attention) == stock, "patched"
with cmlx.patch(verify=False):
    assert qwen3_next.gated_delta_update is not stock[0]
assert (qwen3_next.gated_delta_update, llama.scaled_dot_product_attention) == stock
# A drop-in bound by hand before a reload is still the drop-in after it (by module,
# name and code)
old_drop_in = cmlx.gated_delta_update
qwen3_next.gated_delta_update = old_drop_in
importlib.reload(cmlx)
assert cmlx.gated_delta_update is not old_drop_in
with cmlx.patch(verify=False):
    assert qwen3_next.gated_delta_update is old_drop_in
assert qwen3_next.gated_delta_update is old_drop_in, "undo took the drop-in"
qwen3_next.gated_delta_update = stock[0]
print("ok")
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.stdout.strip() == "ok", out.stdout + out.stderr[-2000:]


def test_bad_chunk_size():
    fn = "[chunkscan.mlx_lm.patch]"
    with pytest.raises(
        ValueError, match=re.escape(f"{fn} chunk_size must be at least 1 but got 0.")
    ):
        cmlx.patch(chunk_size=0)
    with pytest.raises(TypeError, match=re.escape(f"{fn} chunk_size must be an int or None but")):
        cmlx.patch(chunk_size="8")
    # A string would read as True: "no" must not patch attention.
    with pytest.raises(
        TypeError, match=re.escape(f"{fn} attention must be True or False but got 'no'")
    ):
        cmlx.patch(attention="no")
    with pytest.raises(
        TypeError, match=re.escape(f"{fn} verify must be True or False but got 0 (int)")
    ):
        cmlx.patch(verify=0)
    rule = f"{fn} save_states must be 'chunks' or 'groups'"
    with pytest.raises(ValueError, match=re.escape(rule)):
        cmlx.patch(save_states="all")
    with pytest.raises(TypeError, match=re.escape("but got 1 (int). Pass save_states='chunks'")):
        cmlx.patch(save_states=1)  # a ValueError without a fix (found by probing)


@pytest.mark.parametrize("save", ["groups", "chunks", None])
def test_save_states_reach_the_op(monkeypatch, save):
    """patch() hands its save_states (default "groups") to every call of the op."""
    calls = _record_calls(monkeypatch, "_op", "save_states")
    model = lora_model(small_config("qwen3_next"))
    batch, lengths = padded_batch(16)
    kwargs = {} if save == "groups" else {"save_states": save}
    with cmlx.patch(chunk_size=CHUNK, verify=False, **kwargs) as handle:
        assert handle.save_states == save and f"save_states={save!r}" in repr(handle)
        loss_and_grads(model, batch, lengths)
    assert calls and set(calls) == {save}


@pytest.mark.parametrize("save", ["groups", "chunks"])
def test_patch_with_save_states_does_not_read_the_environment(monkeypatch, save):
    """``patch(save_states="groups")`` (or "chunks") hands its value to the op, the
    probe's calls included: the probe ran with no handle live, so its op read
    ``CHUNKSCAN_GDN_SAVE``, and an invalid value broke a patch that never reads it
    (found by probing, session 47). ``save_states=None`` leaves it to the variable,
    whose invalid value raises, naming it."""
    monkeypatch.setattr(cmlx, "_verified", set())  # the probes run again
    monkeypatch.setenv("CHUNKSCAN_GDN_SAVE", "bogus")
    with cmlx.patch(save_states=save) as handle:
        assert handle.save_states == save
    monkeypatch.setattr(cmlx, "_verified", set())
    with pytest.raises(ValueError, match="CHUNKSCAN_GDN_SAVE"):
        cmlx.patch(save_states=None)
    assert cmlx._stack == []
    # Under a live handle that did not probe, the probe of the one being made takes its
    # own save_states, not the outer handle's (it did; found by review).
    monkeypatch.delenv("CHUNKSCAN_GDN_SAVE")
    monkeypatch.setattr(cmlx, "_verified", set())
    other = "chunks" if save == "groups" else "groups"
    with cmlx.patch(verify=False, save_states=other, chunk_size=2):
        calls = _record_calls(monkeypatch, "_op", "save_states")
        sizes = _record_calls(monkeypatch, "_op", "chunk_size")
        with cmlx.patch(save_states=save, chunk_size=3):
            pass
    assert calls and set(calls) == {save} and set(sizes) == {3}  # (its chunk_size too)


def _expect_incompatible(*needles):
    version = re.escape(mlx_lm.__version__)
    with pytest.raises(cmlx.IncompatibleMlxLmError, match=version) as info:
        cmlx.patch()
    for needle in needles:
        assert needle in str(info.value)


def test_loud_failure_changed_signature(monkeypatch):
    def changed(q, k, v, g, beta, state=None, mask=None, *, use_kernel=True):
        raise AssertionError("never called")

    monkeypatch.setattr(gd, "gated_delta_update", changed)
    _expect_incompatible("positional parameters are (q, k, v, g, beta, state, mask)")
    assert qwen3_next.gated_delta_update is STOCK


def test_loud_failure_unknown_option(monkeypatch):
    def changed(q, k, v, a, b, A_log, dt_bias, state=None, mask=None, *, use_kernel=True,
                new_knob=False):  # fmt: skip
        raise AssertionError("never called")

    monkeypatch.setattr(gd, "gated_delta_update", changed)
    _expect_incompatible("unknown keyword-only parameter 'new_knob'")


def test_loud_failure_missing_module(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "mlx_lm.models.gated_delta", None)
    _expect_incompatible("cannot be imported")


def test_loud_failure_name_not_imported(monkeypatch):
    monkeypatch.setattr(qwen3_next, "gated_delta_update", lambda *a, **k: None)
    _expect_incompatible("mlx_lm.models.qwen3_next.gated_delta_update is")


def _copy_of(fn):
    """Another function object of ``fn``'s code, module and name: what a family module
    holds after ``importlib.reload(mlx_lm.models.gated_delta)``."""
    import types

    return types.FunctionType(fn.__code__, fn.__globals__, fn.__name__, fn.__defaults__,
                              fn.__closure__)  # fmt: skip


@pytest.mark.parametrize("kind", ["wrapper", "reloaded", "replaced"])
def test_a_name_other_code_rebound_is_not_called_a_version_mismatch(monkeypatch, kind):
    """On the very mlx-lm the patch was written for, a family's name wrapped (a
    profiler's ``functools.wraps``), another copy of mlx-lm's function (a reload) or
    replaced: the error said the version did not match, that qwen3_next imported no
    such name, and to pin mlx-lm (found by probing, session 52). It names what
    happened and the fix that works; mlx-lm's own other function is still a version
    mismatch."""
    bound = {"wrapper": functools.wraps(STOCK)(lambda *a, **k: STOCK(*a, **k)),
             "reloaded": _copy_of(STOCK), "replaced": lambda *a, **k: None}[kind]  # fmt: skip
    monkeypatch.setattr(qwen3_next, "gated_delta_update", bound)
    what = {"wrapper": "a wrapper", "reloaded": "another copy of mlx_lm.models.gated_delta",
            "replaced": "(other code replaced it)"}[kind]  # fmt: skip
    fix = "Call chunkscan.mlx_lm.patch() before other code wraps or replaces"
    _expect_incompatible("has the seam this patch was written for", what, fix)
    with pytest.raises(cmlx.IncompatibleMlxLmError) as info:
        cmlx.patch()
    assert "Pin mlx-lm" not in str(info.value) and "neither imports" not in str(info.value)
    # mlx-lm's own other function, a wrapper of one, a missing name: a version mismatch
    # (the first form of this check called them rebound: found by review, session 52)
    version = ("does not match the seam", "Pin mlx-lm to a version with this seam.")
    for other in (gd.compute_g, functools.wraps(gd.compute_g)(lambda *a, **k: None), None):
        monkeypatch.setattr(qwen3_next, "gated_delta_update", other)
        _expect_incompatible(*version)


def test_a_wrapped_seam_function_at_its_home_is_named(monkeypatch):
    """``mlx_lm.models.gated_delta.gated_delta_update`` itself wrapped (the families
    keep mlx-lm's function): named as the wrapper at home, not as every family holding
    "another copy" (found by review, session 52)."""
    monkeypatch.setattr(gd, "gated_delta_update", functools.wraps(STOCK)(lambda *a, **k: None))
    held = "a wrapper of what mlx_lm.models.qwen3_next.gated_delta_update holds"
    _expect_incompatible("mlx_lm.models.gated_delta.gated_delta_update is <function", held)
    # replaced there, not wrapped (with mlx-lm's signature): the same (it was called a
    # version mismatch; found by review, session 52)

    def own_fix(q, k, v, a, b, A_log, dt_bias, state=None, mask=None, *, use_kernel=True,
                lower_bound=None, allow_neg_eigval=False):  # fmt: skip
        raise AssertionError("never called")

    monkeypatch.setattr(gd, "gated_delta_update", own_fix)
    held = "not mlx-lm's, which mlx_lm.models.qwen3_next.gated_delta_update holds"
    _expect_incompatible("has the seam this patch was written for", held)
    with pytest.raises(cmlx.IncompatibleMlxLmError) as info:
        cmlx.patch()
    assert "another copy" not in str(info.value)


def test_loud_failure_changed_semantics(monkeypatch):
    """Same signature, different convention (no folded q scale): the probe catches it."""
    sig = inspect.signature(STOCK)

    def rescaled(*args, **kwargs):
        bound = sig.bind(*args, **kwargs)
        bound.arguments["q"] = bound.arguments["q"] * 2.0
        return STOCK(*bound.args, **bound.kwargs)

    rescaled.__signature__ = sig
    monkeypatch.setattr(gd, "gated_delta_update", rescaled)
    # The family modules hold the stock function by name: point them at it as well.
    import importlib

    for mod in ("qwen3_next", "qwen3_5", "kimi_linear", "kimi_k3", "bailing_moe_v3",
                "olmo_hybrid"):  # fmt: skip
        try:
            m = importlib.import_module(f"mlx_lm.models.{mod}")
        except ImportError:
            continue
        if getattr(m, "gated_delta_update", None) is STOCK:
            monkeypatch.setattr(m, "gated_delta_update", rescaled)
    _expect_incompatible("does not reproduce the stock one")


def _point_families_at(monkeypatch, fn):
    """Make ``fn`` the stock function for patch(): in gated_delta and every family
    module that holds mlx-lm's function by name."""
    import importlib

    monkeypatch.setattr(gd, "gated_delta_update", fn)
    for path in sorted(pathlib.Path(gd.__file__).parent.glob("*.py")):
        if "gated_delta_update" not in path.read_text(encoding="utf-8"):
            continue
        try:
            m = importlib.import_module(f"mlx_lm.models.{path.stem}")
        except ImportError:
            continue
        if getattr(m, "gated_delta_update", None) is STOCK:
            monkeypatch.setattr(m, "gated_delta_update", fn)


def test_loud_failure_changed_mask_convention(monkeypatch):
    """Same signature and numbers without a mask, but True now marks padding: only the
    probe's masked run can see it (before it ran no mask, and patch() succeeded)."""
    sig = inspect.signature(STOCK)

    def inverted(*args, **kwargs):
        bound = sig.bind(*args, **kwargs)
        if bound.arguments.get("mask") is not None:
            bound.arguments["mask"] = ~bound.arguments["mask"]
        return STOCK(*bound.args, **bound.kwargs)

    inverted.__signature__ = sig
    _point_families_at(monkeypatch, inverted)
    _expect_incompatible(
        "does not reproduce the stock one: with defaults and a padding mask the output differs by",
        "mask convention changed",
    )
    assert qwen3_next.gated_delta_update is inverted  # nothing was patched


def test_loud_failure_changed_head_mapping(monkeypatch):
    """Same signature, value head ``h`` reading key head ``h % Hk`` (tiled) instead of
    ``h // (Hv // Hk)``: the probe's two key heads catch it (with one it passed, and a
    model with two key heads trained on other gradients; found by probing)."""
    sig = inspect.signature(STOCK)

    def tiled(*args, **kwargs):
        bound = sig.bind(*args, **kwargs)
        q, k, v = (bound.arguments[n] for n in "qkv")
        reps = v.shape[2] // q.shape[2]
        if reps > 1:  # give each value head its own key head, tiled: STOCK's repeat is then 1
            bound.arguments["q"], bound.arguments["k"] = (
                mx.tile(x, (1, 1, reps, 1)) for x in (q, k)
            )
        return STOCK(*bound.args, **bound.kwargs)

    tiled.__signature__ = sig
    _point_families_at(monkeypatch, tiled)
    _expect_incompatible("does not reproduce the stock one: with defaults the output differs by")


def kimi_config(**kw):
    """Kimi Linear, 4 layers: KDA (per-channel gate) in layer 1, MLA attention in the
    others, MoE from layer 2 on; 2 heads, head_dim 32."""
    cfg = dict(
        model_type="kimi_linear", vocab_size=64, hidden_size=64, num_hidden_layers=4,
        num_attention_heads=2, num_key_value_heads=2, intermediate_size=96, head_dim=32,
        rope_theta=10000.0, rms_norm_eps=1e-5, model_max_length=512, num_experts=4,
        num_experts_per_token=2, num_shared_experts=1, moe_intermediate_size=32,
        first_k_dense_replace=1, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8,
        v_head_dim=16, mla_use_nope=True,
        linear_attn_config={"kda_layers": [1], "full_attn_layers": [2, 3, 4], "num_heads": 2,
                            "head_dim": 32, "short_conv_kernel_size": 4},
    )  # fmt: skip
    cfg.update(kw)
    return cfg


@pytest.fixture
def no_stock_loop(monkeypatch):
    """Call to make mlx-lm's per-token training loop raise (after patch()'s probe)."""

    def forbid():
        def loop(*args, **kwargs):
            raise AssertionError("mlx-lm's per-token loop was called")

        monkeypatch.setattr(gd, "gated_delta_ops", loop)
        monkeypatch.setattr(gd, "_gated_delta_step_ops", loop)

    return forbid


def test_per_channel_gate_runs_the_op(spy, no_stock_loop):
    """Kimi-style per-channel gates (a [B, T, Hv, Dk]) train through the chunked op,
    with mlx-lm's gate functions (compute_g, lower_bound) and a padding mask."""
    B, T, H, D = 2, 21, 2, 32
    ks = mx.random.split(mx.random.key(3), 7)
    q = mx.random.normal((B, T, H, D), key=ks[0]) * D**-0.5
    k = mx.random.normal((B, T, H, D), key=ks[1])
    k = k / mx.linalg.norm(k, axis=-1, keepdims=True)
    v = mx.random.normal((B, T, H, D), key=ks[2])
    a = mx.random.normal((B, T, H, D), key=ks[3])
    b = mx.random.normal((B, T, H), key=ks[4])
    A_log = mx.random.uniform(0.0, 2.7, (H, 1), key=ks[5])
    dt_bias = mx.random.normal((H, D), key=ks[6])
    mask = mx.arange(T)[None] < mx.array([[T], [13]])
    variants = (({}, None), ({"lower_bound": -5.0}, None), ({}, mask))
    stock = [
        STOCK(q, k, v, a, b, A_log, dt_bias, None, m, use_kernel=False, **options)
        for options, m in variants
    ]
    with cmlx.patch(chunk_size=8), warnings.catch_warnings():
        warnings.simplefilter("error")  # no fallback warning any more
        no_stock_loop()
        spy.clear()  # (patch()'s probe ran with its chunk_size too)
        for (options, m), (y0, s0) in zip(variants, stock):
            args = (q, k, v, a, b, A_log, dt_bias, None, m)
            y1, s1 = cmlx.gated_delta_update(*args, use_kernel=False, **options)
            keep = mx.ones((B, T), dtype=mx.bool_) if m is None else m
            keep = keep[..., None, None]
            assert rel(mx.where(keep, y1, 0), mx.where(keep, y0, 0)) <= RTOL, options
            assert rel(s1, s0) <= RTOL, options
    assert spy.count(8) == 3


def test_an_unknown_option_raises_in_training_as_stock():
    """``lower_bnd=-5.0`` (a typo of ``lower_bound``): mlx-lm's function raises, in both
    modes; the drop-in's training path dropped it and trained with no bound (found by
    probing, session 51). Now its ``TypeError``, in both modes, before any op runs."""
    B, T, H, D = 1, 5, 2, 8
    args = [mx.zeros((B, T, H, D))] * 3 + [mx.zeros((B, T, H))] * 2 + [mx.zeros((H,))] * 2
    for use_kernel in (False, True):
        with pytest.raises(TypeError, match="unexpected keyword argument 'lower_bnd'"):
            STOCK(*args, use_kernel=use_kernel, lower_bnd=-5.0)
        with pytest.raises(TypeError, match="unexpected keyword argument 'lower_bnd'"):
            cmlx.gated_delta_update(*args, use_kernel=use_kernel, lower_bnd=-5.0)


@float64_on_cpu
def test_training_calls_of_mixed_or_float64_dtypes(spy):
    """The drop-in's training path with ``q``, ``k``, ``v`` of mixed dtypes promotes
    them as mlx-lm's loop does and runs the op (it raised: the op takes one dtype; found
    by probing), the output in ``q``'s dtype as mlx-lm's (it came back promoted; found by
    review), within 1.2e-6 of stock (10x the measured error: outputs 1.2e-7 and 0 for
    the bfloat16 one, states 8.1e-8 and 7.7e-8); with any
    array in float64 (CPU only), which the op does not take, it is mlx-lm's function,
    bit for bit (a float64 state came back float32; found by review)."""
    B, T, Hk, Hv, D = 1, 9, 2, 4, 8
    ks = mx.random.split(mx.random.key(8), 6)
    q, k = (mx.random.normal((B, T, Hk, D), key=key) * D**-0.5 for key in ks[:2])
    v = mx.random.normal((B, T, Hv, D), key=ks[2])
    a, b = (mx.random.normal((B, T, Hv), key=key) for key in ks[3:5])
    state = mx.random.normal((B, Hv, D, D), key=ks[5])
    bf16, f64 = mx.bfloat16, mx.float64
    gates = (mx.zeros(Hv), mx.ones(Hv))
    mixes = [(q, k, v.astype(bf16)), (q.astype(bf16), k.astype(bf16), v)]
    for qkv in mixes:
        y0, s0 = STOCK(*qkv, a, b, *gates, state, None, use_kernel=False)
        with cmlx.patch():
            del spy[:]  # (the probe's calls)
            y1, s1 = cmlx.gated_delta_update(*qkv, a, b, *gates, state, None, use_kernel=False)
            assert len(spy) == 1
        assert (y1.dtype, s1.dtype) == (y0.dtype, s0.dtype)
        assert rel(y1, y0) <= 1.2e-6 and rel(s1, s0) <= 1.2e-6
    calls = [
        (*(x.astype(f64) for x in (q, k, v)), a, b, *gates, state, None),
        (q, k, v, a, b, *gates, state.astype(f64), None),
        (q, k, v, a.astype(f64), b, *gates, None, None),
    ]
    _stays_stock(lambda *args: cmlx.gated_delta_update(*args, use_kernel=False), calls, spy,
                 stock=lambda *args: STOCK(*args, use_kernel=False))  # fmt: skip


def test_training_calls_broadcast_over_the_batch(spy, no_stock_loop):
    """A state shared over the batch (``[1, Hv, Dv, Dk]``: a learned initial state) and
    a gate ``a`` of one row, which mlx-lm's loop broadcasts, run the op broadcast (they
    raised in it, naming ``initial_state``; found by probing, session 50): outputs,
    final states and the gradients of the shared state, ``a`` and ``q`` within 2.5e-6
    of stock's (about 10x the measured 8.4e-8 to 2.3e-7). Shapes that do not broadcast
    go to mlx-lm's function."""
    B, T, Hk, Hv, Dk, Dv = 2, 11, 1, 2, 8, 4
    ks = mx.random.split(mx.random.key(9), 6)
    q = mx.random.normal((B, T, Hk, Dk), key=ks[0]) * Dk**-0.5
    k = mx.random.normal((B, T, Hk, Dk), key=ks[1])
    k = k / mx.linalg.norm(k, axis=-1, keepdims=True)
    v = mx.random.normal((B, T, Hv, Dv), key=ks[2])
    a = mx.random.normal((1, T, Hv), key=ks[3])
    b = mx.random.normal((B, T, Hv), key=ks[4])
    shared = mx.random.normal((1, Hv, Dv, Dk), key=ks[5])
    gates = (mx.zeros(Hv), mx.ones(Hv))
    w = mx.random.normal((B, T, Hv, Dv), key=mx.random.key(10))

    def loss(update, state, a, q):
        y, s = update(q, k, v, a, b, *gates, state, None, use_kernel=False)
        return mx.sum(y * w) + mx.sum(s * s)

    def outputs_and_grads(update):
        y, s = update(q, k, v, a, b, *gates, shared, None, use_kernel=False)
        grads = mx.grad(functools.partial(loss, update), argnums=(0, 1, 2))(shared, a, q)
        return [y, s, *grads]

    want = outputs_and_grads(STOCK)
    with cmlx.patch(chunk_size=4):
        no_stock_loop()
        del spy[:]  # (the probe's calls)
        got = outputs_and_grads(cmlx.gated_delta_update)
        assert spy == [4, 4]  # the values and the gradients' forward
    for name, x, y in zip(("o", "state", "d_shared", "d_a", "d_q"), got, want):
        assert x.shape == y.shape and rel(x, y) <= 2.5e-6, (name, rel(x, y))
    # a gate one token short, a state of the wrong head count: mlx-lm's function
    assert cmlx._call_shaped(q, k, v, a[:, :-1], b, shared) is None
    assert cmlx._call_shaped(q, k, v, a, b, shared[:, :1].reshape(1, 1, Dv, Dk, 1)) is None
    assert cmlx._call_shaped(q, k, v, a, b, mx.zeros((1, 3, Dv, Dk))) is None


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_kimi_linear_lora_grads_match_stock(compiled, spy, no_stock_loop):
    """mlx-lm's kimi_linear (KDA layer 1, MoE) trains patched with the loss and LoRA
    gradients of the stock per-token loop, which is never called patched."""
    model = lora_model(kimi_config())
    assert model.layers[0].is_linear and not any(x.is_linear for x in model.layers[1:])
    batch, lengths = padded_batch(64)
    loss0, g0 = loss_and_grads(model, batch, lengths, compiled=compiled)
    with cmlx.patch(chunk_size=CHUNK):
        assert "kimi_linear" in cmlx.patched_families()
        no_stock_loop()
        loss1, g1 = loss_and_grads(model, batch, lengths, compiled=compiled)
    assert CHUNK in spy
    assert abs(loss1 - loss0) <= RTOL * abs(loss0)
    assert g0.keys() == g1.keys() and any("self_attn.f_b_proj" in k for k in g0)
    for name in g0:
        assert rel(g1[name], g0[name]) <= RTOL, name


# ------------------------------------------------------------------------ attention


def llama_config(**kw):
    """A plain llama-style model: 2 layers, 4 query heads on 2 kv heads."""
    cfg = dict(model_type="llama", hidden_size=64, num_hidden_layers=2, intermediate_size=96,
               num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-6, vocab_size=64,
               rope_theta=10000.0, tie_word_embeddings=False)  # fmt: skip
    cfg.update(kw)
    return cfg


@pytest.fixture
def attn_spy(monkeypatch):
    """Count calls of chunkscan.attention through the seam; force its blocked path
    (these calls are short enough for the shortcut to mx.fast)."""
    from chunkscan.ops.attention import blocked

    monkeypatch.setattr(blocked, "FAST_MAX_SCORES", 0)
    return _record_calls(monkeypatch, "_attention_op", "mask")


@float64_on_cpu
def test_float64_attention_and_numpy_scales_go_to_stock(attn_spy):
    """Calls ``chunkscan.attention`` refuses go to mlx-lm's function: a float64 model's
    (CPU only; every full-attention layer raised ``ValueError``, found by probing,
    session 49) and a scale given as a 0-d NumPy array (``TypeError``). Bit for bit
    mlx-lm's; the float32 model still runs the op (the negative control)."""
    import numpy as np

    q = mx.random.normal((1, 2, 5, 8), key=mx.random.key(1))
    with cmlx.patch():
        for args in ((q.astype(mx.float64), 0.3), (q, np.array(0.3, dtype=np.float32)), (q, True)):
            qq, scale = args
            out = cmlx.scaled_dot_product_attention(qq, qq, qq, None, scale, "causal")
            assert mx.array_equal(out, STOCK_ATTN(qq, qq, qq, None, scale, "causal")).item()
        assert attn_spy == []
    model = build_model(llama_config(), seed=3)
    prompt = mx.array([[5, 6, 7, 8, 9, 10, 11]])
    for dtype, routed in ((mx.float64, False), (mx.float32, True)):
        model.set_dtype(dtype)
        ref = model(prompt)
        with cmlx.patch():
            out = model(prompt)
        assert bool(attn_spy) == routed
        assert out.dtype == dtype and mx.allclose(out, ref, rtol=1e-5, atol=1e-6).item()


@pytest.mark.parametrize("model_type", ["llama", "qwen3_next", "qwen3_5"])
def test_attention_lora_grads_match_stock(model_type, attn_spy):
    """Loss and LoRA gradients with both patches against stock mlx-lm (rel <= 1e-4;
    measured: llama 5e-7, qwen3_next and qwen3_5 6e-6, the Gated DeltaNet share)."""
    config = llama_config() if model_type == "llama" else small_config(model_type)
    model = lora_model(config)
    batch, lengths = padded_batch(64)
    loss0, g0 = loss_and_grads(model, batch, lengths)
    with cmlx.patch(chunk_size=CHUNK) as handle:
        assert handle.attention and "llama" in cmlx.attention_patched_modules()
        loss1, g1 = loss_and_grads(model, batch, lengths)
    n_layers = sum(1 for layer in model.layers if not getattr(layer, "is_linear", False))
    assert attn_spy.count("causal") >= n_layers  # every attention layer ran the op
    assert abs(loss1 - loss0) <= RTOL * abs(loss0)
    assert g0.keys() == g1.keys() and any("self_attn" in k for k in g0)
    for name in g0:
        assert rel(g1[name], g0[name]) <= RTOL, name


def test_attention_false_keeps_mlx(attn_spy):
    model = lora_model(llama_config())
    batch, lengths = padded_batch(64)
    with cmlx.patch(attention=False) as handle:
        assert not handle.attention and cmlx.attention_patched_modules() == ()
        assert llama.scaled_dot_product_attention is STOCK_ATTN
        loss_and_grads(model, batch, lengths)
    assert attn_spy == []


def test_a_module_imported_while_patched_is_listed(monkeypatch):
    """A model module imported inside ``patch()`` (as ``mlx_lm.load`` does) imports the
    replacement from ``base`` and is listed by :func:`attention_patched_modules` (it was
    not: the list was the modules patched at the start; found by probing), and not
    after the patch is undone."""
    name = "mlx_lm.models.gemma3_text"
    monkeypatch.delitem(sys.modules, name, raising=False)  # restored after the test
    with cmlx.patch():
        module = importlib.import_module(name)
        assert module.scaled_dot_product_attention is cmlx._INSTALLED_ATTENTION
        assert "gemma3_text" in cmlx.attention_patched_modules()
    assert module.scaled_dot_product_attention is STOCK_ATTN
    assert cmlx.attention_patched_modules() == ()


def test_attention_nesting(attn_spy):
    with cmlx.patch(attention=False):
        with cmlx.patch() as inner:
            assert llama.scaled_dot_product_attention is cmlx._INSTALLED_ATTENTION
            assert mlx_base.scaled_dot_product_attention is cmlx._INSTALLED_ATTENTION
        assert not inner.active
        assert llama.scaled_dot_product_attention is STOCK_ATTN
        assert qwen3_next.gated_delta_update is cmlx._INSTALLED_GDN  # outer still live


def test_attention_reaches_modules_imported_later():
    import importlib
    import sys

    name = next(
        (f"mlx_lm.models.{m}" for m in ("starcoder2", "stablelm", "olmo2", "exaone", "mimo")
         if f"mlx_lm.models.{m}" not in sys.modules),
        None,
    )  # fmt: skip
    if name is None:
        pytest.skip("every candidate module is imported already")
    with cmlx.patch():
        module = importlib.import_module(name)
        assert module.scaled_dot_product_attention is cmlx._INSTALLED_ATTENTION
    assert module.scaled_dot_product_attention is STOCK_ATTN


def test_attention_with_cache_or_sinks_goes_to_stock(attn_spy):
    """Generation (a KV cache) and attention sinks stay on mlx-lm's function."""
    model = build_model(llama_config(), seed=3)
    model.eval()
    prompt = mx.array([[5, 6, 7, 8, 9, 10, 11]])

    toks0, last0 = greedy_tokens(model, prompt, 4)
    with cmlx.patch():
        toks1, last1 = greedy_tokens(model, prompt, 4)
        assert attn_spy == []
        q = mx.random.normal((1, 2, 5, 8))
        sinks = mx.zeros((2,))
        out = cmlx.scaled_dot_product_attention(q, q, q, None, 0.3, "causal", sinks)
        ref = STOCK_ATTN(q, q, q, None, 0.3, "causal", sinks)
        assert attn_spy == [] and mx.array_equal(out, ref).item()
        # Mixed dtypes: mlx-lm's function promotes them; chunkscan.attention wants one.
        kv = q.astype(mx.bfloat16)
        out = cmlx.scaled_dot_product_attention(q, kv, kv, None, 0.3, "causal")
        ref = STOCK_ATTN(q, kv, kv, None, 0.3, "causal")
        assert attn_spy == [] and mx.array_equal(out, ref).item()
        # A scale as an mx.array (chunkscan.attention raised TypeError; found by probing).
        out = cmlx.scaled_dot_product_attention(q, q, q, None, mx.array(0.3), "causal")
        ref = STOCK_ATTN(q, q, q, None, mx.array(0.3), "causal")
        assert attn_spy == [] and mx.array_equal(out, ref).item()
        model(prompt)  # no cache: the op
        assert attn_spy
        # Counted as mlx-lm's where no KV cache is given: None, or the list of Nones
        # deepseek_v32 passes in training (uncounted before; found by probing); not a
        # generation's cache.
        cmlx.routed_calls.clear()
        mask = mx.zeros((5, 5))  # floating: mlx-lm's
        for cache in (None, [None, None]):
            cmlx.scaled_dot_product_attention(q, q, q, cache, 0.3, mask)
        assert cmlx.routed_calls["mlx-lm's attention"] == 2
        from mlx_lm.models.cache import make_prompt_cache

        model(prompt, cache=make_prompt_cache(model))  # a generation's: not counted
        assert cmlx.routed_calls["mlx-lm's attention"] == 2
    assert toks1 == toks0 and mx.array_equal(last1, last0).item()


def _expect_attention_incompatible(*needles):
    with pytest.raises(cmlx.IncompatibleMlxLmError, match=re.escape(mlx_lm.__version__)) as info:
        cmlx.patch()
    assert "attention seam" in str(info.value)
    for needle in needles:
        assert needle in str(info.value)
    with cmlx.patch(attention=False):  # the Gated DeltaNet seam alone still patches
        pass


def test_attention_loud_failure_changed_signature(monkeypatch):
    def changed(queries, keys, values, cache, scale, mask, sinks=None, window=None):
        raise AssertionError("never called")

    monkeypatch.setattr(mlx_base, "scaled_dot_product_attention", changed)
    _expect_attention_incompatible("its parameters are (queries, keys, values, cache, scale, "
                                   "mask, sinks, window)")  # fmt: skip


def test_attention_loud_failure_name_not_imported(monkeypatch):
    monkeypatch.setattr(llama, "scaled_dot_product_attention", lambda *a, **k: None)
    _expect_attention_incompatible("mlx_lm.models.llama.scaled_dot_product_attention is")


def test_attention_name_other_code_wrapped_is_not_called_a_version_mismatch(monkeypatch):
    """The attention seam's name wrapped by other code (a profiler): the error said to
    pin mlx-lm (found by probing, session 52); it names the wrapper and the fix."""
    wrapped = functools.wraps(STOCK_ATTN)(lambda *a, **k: STOCK_ATTN(*a, **k))
    monkeypatch.setattr(llama, "scaled_dot_product_attention", wrapped)
    _expect_attention_incompatible("has the attention seam this patch was written for",
                                   "a wrapper", "Call chunkscan.mlx_lm.patch() before")  # fmt: skip


def test_attention_loud_failure_changed_semantics(monkeypatch):
    """Same signature, another convention (scale applied twice): the probe catches it."""

    def rescaled(queries, keys, values, cache, scale, mask, sinks=None):
        return STOCK_ATTN(queries, keys, values, cache, scale * scale, mask, sinks)

    for module in (mlx_base, llama, qwen3_next):
        monkeypatch.setattr(module, "scaled_dot_product_attention", rescaled)
    _expect_attention_incompatible("does not reproduce the stock function")


def test_probes_run_on_the_cpu(monkeypatch):
    """The numerical probes compare conventions, not backend arithmetic: they run on the
    CPU (on CUDA, TF32 matmuls put the attention probe at 4e-4, above its bound, and
    patch() failed there)."""
    seen = []
    real_gdn, real_attn = cmlx._probe, cmlx._probe_attention

    def recording(real):
        def probe(*args, **kwargs):
            seen.append(mx.default_device())
            return real(*args, **kwargs)

        return probe

    monkeypatch.setattr(cmlx, "_probe", recording(real_gdn))
    monkeypatch.setattr(cmlx, "_probe_attention", recording(real_attn))
    monkeypatch.setattr(rec, "_probe_lightning", recording(rec._probe_lightning))
    monkeypatch.setattr(rec, "_probe_ssd", recording(rec._probe_ssd))
    monkeypatch.setattr(rec, "_probe_mamba", recording(rec._probe_mamba))
    monkeypatch.setattr(rec, "_probe_jamba", recording(rec._probe_jamba))
    monkeypatch.setattr(rec, "_probe_rwkv7", recording(rec._probe_rwkv7))
    monkeypatch.setattr(rec, "_probe_rnn_scan", recording(rec._probe_rnn_scan))
    entered = []
    real_on_cpu = cmlx.on_cpu

    @contextlib.contextmanager
    def on_cpu():
        entered.append(True)
        with real_on_cpu():
            yield

    monkeypatch.setattr(cmlx, "on_cpu", on_cpu)
    with cmlx.patch():
        pass
    # Gated DeltaNet, attention, each Lightning module (two), SSD, Mamba, Jamba, RWKV-7,
    # RG-LRU
    assert len(seen) == 9 and len(entered) == 9
    assert all(d == mx.cpu for d in seen)
    previous = mx.default_device()
    with real_on_cpu():
        assert mx.default_device() == mx.cpu
    assert mx.default_device() == previous


def test_patch_leaves_the_random_stream_alone():
    """A seeded run draws the same numbers with and without ``patch()``: the probes
    build layers whose initial weights drew from MLX's global key, so LoRA
    initializations and dropout masks changed under the patch (found by probing)."""
    mx.random.seed(0)
    want = mx.random.normal((4,))
    mx.random.seed(0)
    with cmlx.patch():
        got = mx.random.normal((4,))
    assert mx.array_equal(got, want).item()


def test_nested_verify_runs_the_probes_once(monkeypatch):
    """``patch(verify=True)`` inside a ``patch(verify=False)`` probes the seams it asks
    to verify (it skipped both, the seams being installed already; found by probing);
    a third handle, the probes passed, does not repeat them; after the last undo a new
    patch probes again."""
    ran = []

    def spy(which, real):
        def probe(*args, **kwargs):
            ran.append(which)
            return real(*args, **kwargs)

        return probe

    monkeypatch.setattr(cmlx, "_probe", spy("gdn", cmlx._probe))
    monkeypatch.setattr(cmlx, "_probe_attention", spy("attention", cmlx._probe_attention))
    with cmlx.patch(verify=False):
        assert ran == []
        with cmlx.patch(verify=True):
            assert sorted(ran) == ["attention", "gdn"]
            with cmlx.patch(verify=True):
                assert sorted(ran) == ["attention", "gdn"]
    with cmlx.patch():
        assert sorted(ran) == ["attention", "attention", "gdn", "gdn"]


def test_drop_ins_run_mlx_lm_with_no_patch_made(monkeypatch):
    """The public drop-ins, imported by a model file of one's own, send inference to
    mlx-lm's functions in a process that never patched (a ``KeyError: 'fn'`` before;
    found by probing): the same values as mlx-lm's."""
    from mlx_lm.models import base, gated_delta
    from mlx_lm.models.cache import KVCache

    monkeypatch.setattr(cmlx, "_stock", {})  # as in a process with no patch() yet
    monkeypatch.setattr(cmlx, "_attn_stock", {})
    keys = mx.random.split(mx.random.key(5), 4)
    q = mx.random.normal((1, 4, 2, 32), key=keys[0])
    v = mx.random.normal((1, 4, 2, 16), key=keys[1])
    a = mx.random.normal((1, 4, 2), key=keys[2])
    args = (q, q, v, a, a, mx.zeros(2), mx.ones(2), None, None)
    got = cmlx.gated_delta_update(*args, use_kernel=True)
    ref = gated_delta.gated_delta_update(*args, use_kernel=True)
    for x, y in zip(got, ref):
        assert mx.array_equal(x, y)
    x = mx.random.normal((1, 2, 4, 32), key=keys[3])
    cache = KVCache()
    kk, vv = cache.update_and_fetch(x, x)
    got = cmlx.scaled_dot_product_attention(x, kk, vv, cache, 0.2, "causal")
    ref = base.scaled_dot_product_attention(x, kk, vv, cache, 0.2, "causal")
    assert mx.array_equal(got, ref)


# -------------------------------------------------------- Lightning attention (Bailing)


def bailing_linear_config(**kw):
    """Bailing MoE linear (Ring / Ling linear), 4 layers: Lightning attention in layers
    0-2, softmax attention in layer 3, MoE from layer 1 on; 2 heads of 32."""
    cfg = dict(
        model_type="bailing_moe_linear", hidden_size=64, intermediate_size=96,
        max_position_embeddings=512, moe_intermediate_size=32, num_experts=4,
        num_shared_experts=1, norm_topk_prob=True, num_attention_heads=2,
        num_experts_per_tok=2, num_hidden_layers=4, num_key_value_heads=2,
        rms_norm_eps=1e-6, rope_theta=10000.0, vocab_size=64, first_k_dense_replace=1,
        layer_group_size=4, group_norm_size=1, head_dim=32, use_qk_norm=True,
    )  # fmt: skip
    cfg.update(kw)
    return cfg


# The Lightning seam's modules in mlx-lm 0.32.2 (bailing_hybrid's signature takes scale,
# mask and chunk by keyword) and the op's calls of their probes (two each).
LIGHTNING_MODULES = ("bailing_hybrid", "bailing_moe_linear")
PROBE_CALLS = 2 * len(LIGHTNING_MODULES)


@pytest.fixture
def gla_spy(monkeypatch):
    """Record the chunk_size of each call of chunkscan.linear_attention via the seam."""
    return _record_calls(monkeypatch, "_lightning_op", "chunk_size")


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_bailing_linear_lora_grads_match_stock(compiled, gla_spy):
    """mlx-lm's bailing_moe_linear trains patched with the loss and LoRA gradients of
    its per-token loop: each of the three Lightning-attention layers calls
    chunkscan.linear_attention once (a compiled step: in its one trace)."""
    import mlx_lm.models.bailing_moe_linear as bl

    stock = bl.recurrent_gla
    model = lora_model(bailing_linear_config())
    assert sum(not layer.is_global for layer in model.model.layers) == 3
    batch, lengths = padded_batch(64)
    loss0, g0 = loss_and_grads(model, batch, lengths, compiled=compiled)
    with cmlx.patch(chunk_size=CHUNK):
        assert cmlx.lightning_patched_modules() == LIGHTNING_MODULES
        assert bl.recurrent_gla is not stock
        loss1, g1 = loss_and_grads(model, batch, lengths, compiled=compiled)
    assert bl.recurrent_gla is stock and cmlx.lightning_patched_modules() == ()
    # the probes' two calls per module, then one per layer (the op's own chunk: no
    # chunk_size given)
    assert gla_spy == [None] * (PROBE_CALLS + 3)
    assert abs(loss1 - loss0) <= RTOL * abs(loss0)
    assert g0.keys() == g1.keys() and any("query_key_value" in k for k in g0)
    for name in g0:
        assert rel(g1[name], g0[name]) <= RTOL, name


def bailing_hybrid_config(**kw):
    """mlx-lm's bailing_hybrid (Bailing's Lightning attention beside MLA), 4 layers:
    Lightning attention in layers 0-2 (chunks of 128 in mlx-lm), MLA in layer 3, MoE
    from layer 1 on; 2 heads of 32."""
    cfg = dict(
        model_type="bailing_hybrid", hidden_size=64, intermediate_size=96,
        moe_intermediate_size=32, num_hidden_layers=4, num_attention_heads=2,
        num_key_value_heads=2, num_experts=4, num_experts_per_tok=2, num_shared_experts=1,
        n_group=1, topk_group=1, first_k_dense_replace=1, layer_group_size=4,
        group_norm_size=1, vocab_size=64, rms_norm_eps=1e-6, rope_theta=10000.0,
        max_position_embeddings=512, routed_scaling_factor=1.0, head_dim=32,
        kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
    )  # fmt: skip
    cfg.update(kw)
    return cfg


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_bailing_hybrid_lora_grads_match_stock(compiled, gla_spy):
    """bailing_hybrid's Lightning attention (its own chunked recurrent_gla, keyword
    arguments and a padding mask) trains patched with the loss and LoRA gradients of
    mlx-lm's: each of its three layers calls chunkscan.linear_attention once (T - 1 =
    149 spans two of mlx-lm's chunks and three of the op's); generation keeps stock's
    tokens."""
    import mlx_lm.models.bailing_hybrid as bh

    stock = bh.recurrent_gla
    model = lora_model(bailing_hybrid_config())
    assert sum(not layer.is_global for layer in model.model.layers) == 3
    batch, lengths = padded_batch(64, lengths=(150, 97))
    loss0, g0 = loss_and_grads(model, batch, lengths, compiled=compiled)
    with cmlx.patch():
        assert bh.recurrent_gla is not stock
        loss1, g1 = loss_and_grads(model, batch, lengths, compiled=compiled)
    assert bh.recurrent_gla is stock
    assert gla_spy == [None] * (PROBE_CALLS + 3)
    assert abs(loss1 - loss0) <= RTOL * abs(loss0)
    assert g0.keys() == g1.keys() and any("query_key_value" in k for k in g0)
    for name in g0:
        assert rel(g1[name], g0[name]) <= RTOL, name
    if compiled:
        return
    model.eval()
    prompt = mx.array([list(range(3, 40))])
    toks0, last0 = greedy_tokens(model, prompt, 5)
    with cmlx.patch():
        toks1, last1 = greedy_tokens(model, prompt, 5)
    assert toks1 == toks0 and rel(last1, last0) <= RTOL


def test_bailing_hybrid_padded_calls_stay_mlx_lms(gla_spy):
    """bailing_hybrid's calls with a padding mask (a left-padded batch of prompts), or
    of one token, go to mlx-lm's function: the same arrays; its results' dtypes are
    mlx-lm's (``q``'s; the state float32) where the op takes the call."""
    import mlx_lm.models.bailing_hybrid as bh

    stock = bh.recurrent_gla
    keys = mx.random.split(mx.random.key(6), 4)
    q, k, v = (mx.random.normal((2, 2, 9, 8), key=kk).astype(mx.bfloat16) for kk in keys[:3])
    h = mx.random.normal((2, 2, 8, 8), key=keys[3])
    g = -mx.array([0.2, 0.6])
    mask = mx.array([[True] * 9, [False] * 3 + [True] * 6])
    calls = [
        ((q, k, v, g), {"scale": 0.3, "mask": mask}),
        ((q[:, :, :1], k[:, :, :1], v[:, :, :1], g), {"scale": 0.3, "h": h}),
    ]
    refs = [stock(*a, **kw) for a, kw in calls]
    with cmlx.patch():
        for (args, kwargs), ref in zip(calls, refs):
            got = bh.recurrent_gla(*args, **kwargs)
            assert all(mx.array_equal(a, b).item() for a, b in zip(got, ref))
        assert gla_spy == [None] * PROBE_CALLS
        y, state = bh.recurrent_gla(q, k, v, g, scale=0.3, h=h)
    ref_y, ref_state = stock(q, k, v, g, scale=0.3, h=h)
    assert y.dtype == ref_y.dtype == mx.bfloat16 and state.dtype == ref_state.dtype == mx.float32
    assert rel(state, ref_state) <= RTOL and len(gla_spy) == PROBE_CALLS + 1


def test_bailing_linear_generation_keeps_its_tokens(gla_spy):
    """Generation patched: the prompt (more than one token, no other sign of training)
    goes through the op, each decoded token through mlx-lm's function; the tokens are
    stock's, the last logits within rounding, the cache's state in mlx-lm's dtype."""
    model = build_model(bailing_linear_config(), 0)
    model.eval()
    prompt = mx.array([[5, 6, 7, 8, 9, 10, 11, 12, 13]])
    toks0, last0 = greedy_tokens(model, prompt, 5)
    with cmlx.patch(chunk_size=4):
        toks1, last1 = greedy_tokens(model, prompt, 5)
        cache = model.make_cache()
        model(prompt, cache=cache)
    assert toks1 == toks0 and rel(last1, last0) <= RTOL
    assert len(gla_spy) == PROBE_CALLS + 6  # the probes', then two prompts of three layers
    assert cache[0][0].dtype == mx.float32


def test_bailing_linear_seam_that_changed_is_left_alone(monkeypatch):
    """A ``recurrent_gla`` of the seam's signature that the patched call does not
    reproduce (here: a scale applied twice) stays mlx-lm's, with a warning naming it;
    the rest of the patch applies. Another signature is not the seam: untouched."""
    import mlx_lm.models.bailing_moe_linear as bl

    real = bl.recurrent_gla

    def changed(q, k, v, g, scale, h=None):
        return real(q, k, v, g, scale * scale, h)

    monkeypatch.setattr(bl, "recurrent_gla", changed)
    with pytest.warns(RuntimeWarning, match="bailing_moe_linear.recurrent_gla is left"):
        with cmlx.patch():
            assert cmlx.lightning_patched_modules() == ("bailing_hybrid",)
            assert bl.recurrent_gla is changed and "qwen3_next" in cmlx.patched_families()

    def other(q, k, v, g, *, scale, h=None):
        return real(q, k, v, g, scale, h)

    monkeypatch.setattr(bl, "recurrent_gla", other)
    with cmlx.patch():
        assert cmlx.lightning_patched_modules() == ("bailing_hybrid",)
        assert bl.recurrent_gla is other


def test_a_probe_that_raises_leaves_nothing_behind(monkeypatch):
    """A Lightning seam whose function raises under the probe, or returns another layout
    (the probe names the shapes: it raised broadcasting them before), is left alone
    with a warning, the rest applies; a first patch() whose Gated
    DeltaNet probe fails leaves no seam bound and no probe marked as passed (both left
    mlx-lm patched with no handle, or skipped the attention probe next time; found by
    review)."""
    import mlx_lm.models.bailing_moe_linear as bl

    real = bl.recurrent_gla

    def heads_last(q, k, v, g, scale, h=None):
        y, s = real(q, k, v, g, scale, h)
        return y.transpose(0, 2, 1, 3), s

    def raising(q, k, v, g, scale, h=None):
        raise ValueError("another convention")

    monkeypatch.setattr(bl, "recurrent_gla", raising)
    with pytest.warns(RuntimeWarning, match="recurrent_gla is left as it is.*probe raised"):
        with cmlx.patch():
            assert cmlx.lightning_patched_modules() == ("bailing_hybrid",)
            assert bl.recurrent_gla is raising
    monkeypatch.setattr(bl, "recurrent_gla", heads_last)
    shapes = r"the output is mlx.core.float32 \(2, 3, 5, 4\) where mlx-lm's is .* \(2, 5, 3, 4\)"
    with pytest.warns(RuntimeWarning, match="recurrent_gla is left as it is.*" + shapes):
        with cmlx.patch():
            assert cmlx.lightning_patched_modules() == ("bailing_hybrid",)
            assert bl.recurrent_gla is heads_last
    monkeypatch.setattr(bl, "recurrent_gla", real)

    ran = []

    def failing(stock, options, chunk_size, save_states):
        raise cmlx.IncompatibleMlxLmError("probe failed")

    def attention_probe(stock):
        ran.append("attention")

    monkeypatch.setattr(cmlx, "_probe", failing)
    monkeypatch.setattr(cmlx, "_probe_attention", attention_probe)
    with pytest.raises(cmlx.IncompatibleMlxLmError, match="probe failed"):
        cmlx.patch()
    assert ran == ["attention"] and cmlx._verified == set()
    assert cmlx.patched_families() == () and cmlx.lightning_patched_modules() == ()
    assert bl.recurrent_gla is real and qwen3_next.gated_delta_update is STOCK
    monkeypatch.setattr(cmlx, "_probe", lambda stock, options, chunk_size, save_states: None)
    with cmlx.patch():
        assert ran == ["attention", "attention"]


def test_bailing_linear_mixed_dtypes_stay_mlx_lms(gla_spy):
    """q and k in float32 beside bfloat16 v (a bfloat16 model whose q / k norms are
    float32) go to mlx-lm's function, which promotes them: the op refuses mixed dtypes,
    and the patched model raised where stock ran (found by probing)."""
    import mlx_lm.models.bailing_moe_linear as bl

    stock = bl.recurrent_gla
    keys = mx.random.split(mx.random.key(2), 3)
    q, k = (mx.random.normal((1, 2, 9, 8), key=kk) for kk in keys[:2])
    v = mx.random.normal((1, 2, 9, 8), key=keys[2]).astype(mx.bfloat16)
    g = -mx.array([0.2, 0.6])
    ref = stock(q, k, v, g, 0.3)
    with cmlx.patch():
        got = bl.recurrent_gla(q, k, v, g, 0.3)
    assert all(mx.array_equal(a, b).item() for a, b in zip(got, ref))
    assert gla_spy == [None] * PROBE_CALLS  # the probes' calls only


@pytest.mark.parametrize("family", LIGHTNING_MODULES)
@float64_on_cpu
def test_bailing_linear_float64_stays_mlx_lms(family, gla_spy):
    """float64 ``q``, ``k``, ``v`` or state (CPU only), which mlx-lm's function takes
    and the op does not (the patched call raised; found by probing): mlx-lm's function,
    bit for bit."""
    module = importlib.import_module(f"mlx_lm.models.{family}")
    keys = mx.random.split(mx.random.key(4), 4)
    q, k, v = (mx.random.normal((1, 2, 9, 8), key=kk) for kk in keys[:3])
    h = mx.random.normal((1, 2, 8, 8), key=keys[3])
    g, f64 = -mx.array([0.2, 0.6]), mx.float64
    calls = [(q, k, v, g, 0.3, h.astype(f64)), (*(x.astype(f64) for x in (q, k, v)), g, 0.3, None)]

    def call(q, k, v, g, scale, h):  # (bailing_hybrid's scale and state are keywords)
        return module.recurrent_gla(q, k, v, g, scale=scale, h=h)

    _stays_stock(call, calls, gla_spy)


def test_bailing_linear_broadcast_state_stays_mlx_lms(gla_spy):
    """A state broadcast over the batch (``h`` of batch 1 beside ``q`` of batch 2), which
    mlx-lm's loop takes, goes to mlx-lm's function: the op raised, naming the state's
    layout (found by probing). The handle's repr names the rebound module."""
    import mlx_lm.models.bailing_moe_linear as bl

    stock = bl.recurrent_gla
    keys = mx.random.split(mx.random.key(3), 4)
    q, k, v = (mx.random.normal((2, 2, 9, 8), key=kk) for kk in keys[:3])
    h = mx.random.normal((1, 2, 8, 8), key=keys[3])
    g = -mx.array([0.2, 0.6])
    ref = stock(q, k, v, g, 0.3, h)
    with cmlx.patch() as handle:
        got = bl.recurrent_gla(q, k, v, g, 0.3, h)
        assert f"lightning={LIGHTNING_MODULES}" in repr(handle)
    assert all(mx.array_equal(a, b).item() for a, b in zip(got, ref))
    assert gla_spy == [None] * PROBE_CALLS  # the probes' calls only


def test_a_first_patch_that_raises_after_installing_rolls_back(monkeypatch):
    """With warnings as errors, a Lightning seam that fails its probe raises from
    patch() after the Gated DeltaNet and Lightning seams were bound: everything is put
    back and no probe stays marked (a patch with no handle stayed before; review)."""
    import mlx_lm.models.bailing_moe_linear as bl

    real = bl.recurrent_gla

    def changed(q, k, v, g, scale, h=None):
        return real(q, k, v, g, 2.0 * scale, h)

    monkeypatch.setattr(bl, "recurrent_gla", changed)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(RuntimeWarning, match="recurrent_gla is left as it is"):
            cmlx.patch()
    assert cmlx._stack == [] and cmlx._verified == set()
    assert cmlx.patched_families() == () and cmlx.lightning_patched_modules() == ()
    assert bl.recurrent_gla is changed and qwen3_next.gated_delta_update is STOCK
    assert cmlx.attention_patched_modules() == ()


def test_an_interrupted_nested_patch_leaves_no_handle(monkeypatch):
    """A nested patch() interrupted after its handle joined the stack (in the attention
    routing) takes the handle off again: the outer handle's undo restores everything (it
    left a handle no one could undo; found by review)."""
    real = cmlx._sync_attention
    calls = []

    def interrupted():
        calls.append(1)
        if len(calls) == 1:
            raise KeyboardInterrupt
        real()

    outer = cmlx.patch(verify=False, attention=False)
    monkeypatch.setattr(cmlx, "_sync_attention", interrupted)
    with pytest.raises(KeyboardInterrupt):
        cmlx.patch(verify=False, attention=True)
    assert cmlx._stack == [outer]
    outer.undo()
    assert cmlx._stack == [] and cmlx.patched_families() == ()
    assert cmlx.attention_patched_modules() == ()


# ------------------------------------------------------------- Mamba2 SSD (ssm_attn)


def mamba2_config(**kw):
    """mlx-lm's mamba2, 2 layers: 4 heads of 16 in 2 groups, a state of 16 per head."""
    cfg = dict(
        model_type="mamba2", num_heads=4, head_dim=16, vocab_size=64, hidden_size=32,
        intermediate_size=64, state_size=16, num_hidden_layers=2, layer_norm_epsilon=1e-5,
        conv_kernel=4, n_groups=2, use_bias=False, use_conv_bias=True,
        tie_word_embeddings=False, time_step_limit=(0.0, float("inf")), time_step_rank="auto",
    )  # fmt: skip
    cfg.update(kw)
    return cfg


def nemotron_h_config(**kw):
    """mlx-lm's nemotron_h, 4 blocks: Mamba2 (4 heads of 8, 2 groups), attention (2 heads,
    1 KV head), Mamba2, MLP."""
    cfg = dict(
        model_type="nemotron_h", vocab_size=64, hidden_size=32, intermediate_size=64,
        max_position_embeddings=512, num_attention_heads=2, num_key_value_heads=1,
        attention_bias=False, mamba_num_heads=4, mamba_head_dim=8, mamba_proj_bias=False,
        ssm_state_size=16, conv_kernel=4, n_groups=2, mlp_bias=False,
        layer_norm_epsilon=1e-5, use_bias=False, use_conv_bias=True, head_dim=16,
        hybrid_override_pattern=["M", "*", "M", "-"], time_step_limit=(0.0, float("inf")),
    )  # fmt: skip
    cfg.update(kw)
    return cfg


def granitemoehybrid_config(**kw):
    """mlx-lm's granitemoehybrid (Granite 4.0 H), 3 layers: Mamba2 (4 heads of 8, 2
    groups), attention (2 heads, 1 KV head), Mamba2; dense MLPs."""
    cfg = dict(
        model_type="granitemoehybrid", vocab_size=64, hidden_size=32, intermediate_size=64,
        num_hidden_layers=3, max_position_embeddings=512, num_attention_heads=2,
        num_key_value_heads=1, attention_bias=False, embedding_multiplier=1.0,
        attention_multiplier=0.25, logits_scaling=1.0, residual_multiplier=1.0,
        layer_types=["mamba", "attention", "mamba"], rms_norm_eps=1e-5, mamba_n_heads=4,
        mamba_d_head=8, mamba_proj_bias=False, mamba_d_state=16, mamba_d_conv=4,
        mamba_n_groups=2, mamba_conv_bias=True, shared_intermediate_size=64,
    )  # fmt: skip
    cfg.update(kw)
    return cfg


@pytest.fixture
def ssd_spy(monkeypatch):
    """Record each call of chunkscan.linear_attention through the SSD seam."""
    return _record_calls(monkeypatch, "_ssd_op", "chunk_size")


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize(
    "config", [mamba2_config, nemotron_h_config, granitemoehybrid_config], ids=lambda c: c.__name__
)
def test_mamba2_lora_grads_match_stock(config, compiled, ssd_spy):
    """Mamba2 families (mamba2; nemotron_h and granitemoehybrid with their attention and
    MLP blocks) train
    patched with the loss and LoRA gradients of mlx-lm's chunked SSD: each Mamba2 layer
    calls chunkscan.linear_attention once, over several of its chunks (T - 1 = 149)."""
    model = lora_model(config())
    batch, lengths = padded_batch(64, lengths=(150, 97))
    loss0, g0 = loss_and_grads(model, batch, lengths, compiled=compiled)
    with cmlx.patch() as handle:
        assert cmlx.ssd_patched_modules() == ("ssm",) and ssm.ssm_attn is not STOCK_SSD
        assert "ssd=('ssm',)" in repr(handle)
        loss1, g1 = loss_and_grads(model, batch, lengths, compiled=compiled)
    assert ssd_spy == [None] * 2 + [None] * 2  # the probe's two calls, then two layers
    assert abs(loss1 - loss0) <= RTOL * abs(loss0)
    assert g0.keys() == g1.keys() and any("in_proj" in k for k in g0)
    for name in g0:
        assert rel(g1[name], g0[name]) <= RTOL, name


def test_mamba2_generation_keeps_its_tokens(ssd_spy):
    """Generation patched: the prompt's prefill (no padding) goes through the op, each
    decoded token through mlx-lm's function; the tokens are stock's, the cache's state
    float32 as mlx-lm's."""
    model = build_model(nemotron_h_config(), 0)
    model.eval()
    prompt = mx.array([list(range(3, 40))])
    toks0, last0 = greedy_tokens(model, prompt, 5)
    with cmlx.patch():
        toks1, last1 = greedy_tokens(model, prompt, 5)
        cache = model.make_cache()
        model(prompt, cache=cache)
    assert toks1 == toks0 and rel(last1, last0) <= RTOL
    assert len(ssd_spy) == 2 + 4  # the probe's two, then two prompts of two layers
    assert all(c[1].dtype == mx.float32 for c in cache if hasattr(c, "lengths"))


@float64_on_cpu
def test_ssd_calls_the_op_cannot_take_stay_mlx_lms(ssd_spy):
    """A padding mask or lengths (left-padded or ragged batch prompts), one token, or a
    float64 state or input (the op does not take it; a float64 state came back float32,
    found by review) go to mlx-lm's function: the same arrays and dtypes."""
    keys = mx.random.split(mx.random.key(4), 8)
    x = mx.random.normal((2, 7, 4, 3), key=keys[0])
    B, C = (mx.random.normal((2, 7, 2, 5), key=kk) for kk in keys[1:3])
    dt = mx.random.normal((2, 7, 4), key=keys[3])
    A_log, D, dt_bias = (mx.random.normal((4,), key=kk) for kk in keys[4:7])
    state = mx.random.normal((2, 4, 3, 5), key=keys[7])
    mask = mx.array([[True] * 7, [False, False] + [True] * 5])
    limit = (0.001, 100.0)
    calls = [
        ((x, A_log, B, C, D, dt, dt_bias), {"mask": mask}),
        ((x, A_log, B, C, D, dt, dt_bias, None, limit, None, mx.array([7, 5])), {}),
        ((x[:, :1], A_log, B[:, :1], C[:, :1], D, dt[:, :1], dt_bias, state), {}),
    ]
    calls += [  # float64 (on the CPU's stream: float64_on_cpu)
        ((x, A_log, B, C, D, dt, dt_bias, state.astype(mx.float64)), {}),
        ((x.astype(mx.float64), A_log, B, C, D, dt, dt_bias, state), {}),
    ]
    refs = [STOCK_SSD(*a, **kw) for a, kw in calls]
    with cmlx.patch():
        del ssd_spy[:]  # the probe's
        for (args, kwargs), ref in zip(calls, refs):
            got = ssm.ssm_attn(*args, **kwargs)
            assert all(mx.array_equal(a, b).item() and a.dtype == b.dtype
                       for a, b in zip(got, ref))  # fmt: skip
        assert ssd_spy == []
    with cmlx.patch():
        del ssd_spy[:]
        ssm.ssm_attn(x, A_log, B, C, D, dt, dt_bias, state)
        assert len(ssd_spy) == 1


def test_ssd_seam_that_changed_is_left_alone(monkeypatch):
    """An ``ssm_attn`` of the seam's signature that the patched call does not reproduce
    (here: its skip term ``D x`` doubled) stays mlx-lm's, with a warning naming it; the
    rest of the patch applies."""
    real = ssm.ssm_attn

    def changed(x, A_log, B, C, D, dt, dt_bias, state=None, time_step_limit=(0.001, 100.0),
                mask=None, lengths=None, step=256):  # fmt: skip
        return real(x, A_log, B, C, 2 * D, dt, dt_bias, state, time_step_limit, mask, lengths, step)

    monkeypatch.setattr(ssm, "ssm_attn", changed)
    with pytest.warns(RuntimeWarning, match="ssm.ssm_attn is left as it is.*output differs"):
        with cmlx.patch():
            assert cmlx.ssd_patched_modules() == () and ssm.ssm_attn is changed
            assert "qwen3_next" in cmlx.patched_families()
    monkeypatch.setattr(ssm, "ssm_attn", real)


def test_a_module_that_imported_a_rebound_function_gets_mlx_lms_back():
    """A module that imported ``ssm_attn`` (or ``recurrent_gla``) by name while patched
    holds mlx-lm's function again after the last undo (it kept the wrapper before; found
    by probing), as for the Gated DeltaNet and attention seams."""
    import types

    import mlx_lm.models.bailing_moe_linear as bl

    stock_gla = bl.recurrent_gla
    user = types.ModuleType("user_module_of_mamba2")
    sys.modules[user.__name__] = user
    try:
        with cmlx.patch():
            user.ssm_attn, user.recurrent_gla = ssm.ssm_attn, bl.recurrent_gla
            assert user.ssm_attn is not STOCK_SSD
        assert user.ssm_attn is STOCK_SSD and user.recurrent_gla is stock_gla
    finally:
        del sys.modules[user.__name__]


# ------------------------------------------------- Mamba's selective scan (S6)


def mamba_config(**kw):
    """mlx-lm's mamba, 2 layers of 64 channels, a state of 8 per channel."""
    cfg = dict(
        model_type="mamba", vocab_size=64, hidden_size=32, intermediate_size=64, state_size=8,
        num_hidden_layers=2, conv_kernel=4, use_bias=False, use_conv_bias=True,
        time_step_rank=4,
    )  # fmt: skip
    cfg.update(kw)
    return cfg


def falcon_mamba_config():
    """mamba with falcon_mamba's RMS norms of delta, B and C (``use_bcdt_rms``)."""
    return mamba_config(use_bcdt_rms=True)


def jamba_config(**kw):
    """mlx-lm's jamba, 4 layers: Mamba in 0, 2, 3 (64 channels, a state of 8), attention
    in 1, MoE in 1 and 3."""
    cfg = dict(
        model_type="jamba", hidden_size=32, intermediate_size=64, num_hidden_layers=4,
        num_attention_heads=2, num_key_value_heads=1, attn_layer_offset=1,
        attn_layer_period=4, expert_layer_offset=1, expert_layer_period=2, mamba_d_conv=4,
        mamba_d_state=8, mamba_expand=2, num_experts=4, num_experts_per_tok=2,
        rms_norm_eps=1e-6, max_position_embeddings=512, vocab_size=64,
    )  # fmt: skip
    cfg.update(kw)
    return cfg


@pytest.fixture
def s6_spy(monkeypatch):
    """Record each call of chunkscan.selective_scan through the Mamba seams."""
    return _record_calls(monkeypatch, "_s6_op", "chunk_size")


MAMBA_CONFIGS = [mamba_config, falcon_mamba_config, jamba_config]


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("config", MAMBA_CONFIGS, ids=lambda c: c.__name__)
def test_mamba_lora_grads_match_stock(config, compiled, s6_spy):
    """Mamba (and falcon_mamba's norms) and Jamba train patched with the loss and LoRA
    gradients of mlx-lm's per-token loops: each Mamba layer calls
    chunkscan.selective_scan once (T - 1 = 149)."""
    _mamba_trains_as_stock(lora_model(config()), config, s6_spy, compiled)


def _mamba_trains_as_stock(model, config, s6_spy, compiled=False) -> None:
    """``model``'s loss and LoRA gradients patched are stock's, each Mamba layer one
    call of the op."""
    batch, lengths = padded_batch(64, lengths=(150, 97))
    loss0, g0 = loss_and_grads(model, batch, lengths, compiled=compiled)
    with cmlx.patch() as handle:
        assert cmlx.mamba_patched_modules() == ("jamba", "mamba")
        assert "mamba=('jamba', 'mamba')" in repr(handle)
        loss1, g1 = loss_and_grads(model, batch, lengths, compiled=compiled)
    layers = 3 if config is jamba_config else 2
    assert s6_spy == [None] * (4 + layers)  # the two probes' two calls, then one per layer
    assert abs(loss1 - loss0) <= RTOL * abs(loss0)
    assert g0.keys() == g1.keys() and any("x_proj" in k or "in_proj" in k for k in g0)
    for name in g0:
        assert rel(g1[name], g0[name]) <= RTOL, name


@pytest.mark.parametrize("config", MAMBA_CONFIGS, ids=lambda c: c.__name__)
def test_quantized_mamba_trains_through_the_op(config, s6_spy):
    """QLoRA: a 4-bit base Mamba or Jamba model goes to chunkscan.selective_scan (the
    quantized weights, uint32, counted as parameters the op cannot take: every call
    was mlx-lm's per-token loop, silently; found by probing, session 47), with stock's
    loss and LoRA gradients."""
    _mamba_trains_as_stock(lora_model(config(), quantize=True), config, s6_spy)


def _generation_as_stock(model) -> int:
    """Greedy generation (5 tokens after a 37-token prompt) of ``model`` (put in eval
    mode), patched, has stock's tokens and last logits within RTOL, and the prompt's
    prefill fills the recurrent layers' caches (those with a ``cache`` list: convolution
    and scan states, token shifts; attention's KV caches are not compared) in stock's
    dtypes and shapes, within RTOL. Returns how many cache arrays it compared."""
    model.eval()
    prompt = mx.array([list(range(3, 40))])
    toks0, last0 = greedy_tokens(model, prompt, 5)
    ref = model.make_cache()
    model(prompt, cache=ref)
    with cmlx.patch():
        toks1, last1 = greedy_tokens(model, prompt, 5)
        cache = model.make_cache()
        model(prompt, cache=cache)
    assert toks1 == toks0 and rel(last1, last0) <= RTOL
    compared = 0
    for got, want in zip(cache, ref):
        if not hasattr(want, "cache"):  # (an attention layer: a KV cache)
            continue
        for a, b in zip(got.cache, want.cache):
            assert a.dtype == b.dtype and a.shape == b.shape and rel(a, b) <= RTOL
            compared += 1
    return compared


@pytest.mark.parametrize("config", MAMBA_CONFIGS, ids=lambda c: c.__name__)
def test_mamba_generation_keeps_its_tokens(config, s6_spy):
    """Generation patched: the prompt's prefill goes through the op (with its caches
    filled as mlx-lm fills them), each decoded token through mlx-lm's method; the tokens
    are stock's, the caches in mlx-lm's dtypes."""
    model = build_model(config(), 0)
    compared = _generation_as_stock(model)
    layers = 3 if config is jamba_config else 2
    assert len(s6_spy) == 4 + 2 * layers
    assert compared == 2 * layers


@float64_on_cpu
def test_mamba_float64_stays_mlx_lms(s6_spy):
    """A float64 state, float64 weights or Jamba's ``A`` in float64 (mlx-lm's loop
    promotes them; the op does not take them and the patched call raised, naming an
    argument the caller never passed; found by probing and review): mlx-lm's method, bit
    for bit, for Mamba's block and Jamba's step."""
    import mlx_lm.models.jamba as jamba
    import mlx_lm.models.mamba as mamba

    block = mamba.MambaBlock(mamba.ModelArgs(**mamba_config()))
    x = mx.random.normal((1, 6, block.hidden_size), key=mx.random.key(6))
    state = mx.zeros((1, block.intermediate_size, block.ssm_state_size), dtype=mx.float64)
    calls = [(block, x, None, state)]
    _stays_stock(lambda *args: mamba.MambaBlock._process_sequence(*args), calls, s6_spy)
    wide = mamba.MambaBlock(mamba.ModelArgs(**mamba_config()))
    wide.set_dtype(mx.float64)  # float64 weights, a float32 input (review)
    calls = [(wide, x, None, None)]
    _stays_stock(lambda *args: mamba.MambaBlock._process_sequence(*args), calls, s6_spy)
    mixer = jamba.JambaMambaMixer(jamba.ModelArgs(**jamba_config()))
    x = mx.random.normal((1, 6, mixer.intermediate_size), key=mx.random.key(7))
    A = -mx.exp(mixer.A_log)
    calls = [(mixer, x, A, state), (mixer, x, A.astype(mx.float64), None)]
    _stays_stock(lambda *args: jamba.JambaMambaMixer.ssm_step(*args), calls, s6_spy)


def test_mamba_seam_that_changed_is_left_alone(monkeypatch):
    """A ``MambaBlock._process_sequence`` that the routed call does not reproduce (here:
    its output doubled) stays mlx-lm's, with a warning naming it; the rest applies, and
    the decorator's later calls (``verify=False``) do not bind it again (they did; found
    by review)."""
    import mlx_lm.models.mamba as mamba

    real = mamba.MambaBlock._process_sequence

    def changed(self, x, conv_cache, state_cache):
        z, caches = real(self, x, conv_cache, state_cache)
        return 2 * z, caches

    monkeypatch.setattr(mamba.MambaBlock, "_process_sequence", changed)
    with pytest.warns(RuntimeWarning, match="mamba.MambaBlock._process_sequence is left"):
        with cmlx.patch():
            assert cmlx.mamba_patched_modules() == ("jamba",)
            assert mamba.MambaBlock._process_sequence is changed
    assert mamba.MambaBlock._process_sequence is changed

    @cmlx.patch()
    def step():
        return cmlx.mamba_patched_modules(), mamba.MambaBlock._process_sequence

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert step() == (("jamba",), changed)  # probed: left alone
    assert step() == (("jamba",), changed)  # unprobed (verify=False): still left alone


# ------------------------------------------- RWKV-7 (the generalized delta rule)


def rwkv7_config(**kw):
    """mlx-lm's rwkv7, 2 layers of 4 heads of 8."""
    cfg = dict(
        model_type="rwkv7", vocab_size=64, hidden_size=32, intermediate_size=64, norm_eps=1e-5,
        head_dim=8, num_hidden_layers=2, a_low_rank_dim=4, v_low_rank_dim=4,
        gate_low_rank_dim=4, decay_low_rank_dim=4,
    )  # fmt: skip
    cfg.update(kw)
    return cfg


def with_rwkv7_mixing(model, seed=3):
    """Random values for the parameters rwkv7 initializes to zero (the token-shift mixes
    ``x_*``, ``k_k``, ``k_a``, ``r_k``): with ``k_k = 0`` the low-rank term ``a b^T``
    vanishes and a test would not exercise it."""
    zeros = [(k, v) for k, v in tree_flatten(model.parameters()) if not mx.any(v != 0).item()]
    assert any(k.endswith("k_k") for k, _ in zeros)
    keys = mx.random.split(mx.random.key(seed), len(zeros))
    model.update(tree_unflatten([(k, 0.5 * mx.random.normal(v.shape, key=kk))
                                 for (k, v), kk in zip(zeros, keys)]))  # fmt: skip
    mx.eval(model.parameters())
    return model


@pytest.fixture
def dplr_spy(monkeypatch):
    """Record each call of chunkscan.dplr_delta_rule through the RWKV-7 seam."""
    return _record_calls(monkeypatch, "_dplr_op", "chunk_size")


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_rwkv7_lora_grads_match_stock(compiled, dplr_spy):
    """RWKV-7 trains patched with the loss and LoRA gradients of mlx-lm's per-token loop:
    each layer calls chunkscan.dplr_delta_rule once (T - 1 = 149)."""
    model = lora_model(rwkv7_config())
    with_rwkv7_mixing(model)
    batch, lengths = padded_batch(64, lengths=(150, 97))
    loss0, g0 = loss_and_grads(model, batch, lengths, compiled=compiled)
    with cmlx.patch() as handle:
        assert cmlx.rwkv7_patched_modules() == ("rwkv7",)
        assert "rwkv7=('rwkv7',)" in repr(handle)
        loss1, g1 = loss_and_grads(model, batch, lengths, compiled=compiled)
    assert dplr_spy == [None] * (2 + 2)  # the probe's two calls, then one per layer
    assert abs(loss1 - loss0) <= RTOL * abs(loss0)
    assert any("a_lora" in k for k in g0) and any("r_proj" in k for k in g0)
    assert g0.keys() == g1.keys()
    for name in g0:
        assert rel(g1[name], g0[name]) <= RTOL, name


def test_rwkv7_generation_keeps_its_tokens(dplr_spy):
    """Generation patched: the prompt's prefill goes through the op, each decoded token
    through mlx-lm's method; the tokens are stock's, the caches (token shifts and the
    state) in mlx-lm's dtypes and within RTOL of its values."""
    model = with_rwkv7_mixing(build_model(rwkv7_config(), 0))
    compared = _generation_as_stock(model)
    assert len(dplr_spy) == 2 + 2 * 2  # the probe's, then the two prefills' per layer
    assert compared == 3 * 2


def _stays_stock(call, calls, spy, stock=None):
    """``call(*args)`` (which looks the seam's function up when called: mlx-lm's, then
    the patched one; or ``stock(*args)`` unpatched, where given) of each of ``calls``
    (argument tuples) is, patched, mlx-lm's bit for bit (values and dtypes), and none
    reaches the op (``spy``). Float64 calls need the CPU's stream (``float64_on_cpu``)."""

    def run(fn, args):
        outputs = fn(*args)
        mx.eval(outputs)
        return outputs

    want = [run(stock or call, args) for args in calls]
    with cmlx.patch():
        del spy[:]  # (the probe's calls)
        got = [run(call, args) for args in calls]
    assert spy == []
    for theirs, ours in zip(want, got):
        for (_, x), (_, y) in zip(tree_flatten(theirs), tree_flatten(ours), strict=True):
            assert x.dtype == y.dtype and mx.array_equal(x, y).item()


@float64_on_cpu
def test_rwkv7_calls_the_op_cannot_take_stay_mlx_lms(dplr_spy):
    """One token; ``r``, ``k``, ``v`` of mixed dtypes (mlx-lm's loop promotes them; the
    op requires one dtype and the patched call raised; found by review); ``a``, ``b`` or
    the state in float64, which the op does not take (the patched call raised, naming
    ``a`` or ``initial_state``; found by probing): mlx-lm's method, bit for bit."""
    import mlx_lm.models.rwkv7 as rwkv7

    layer = rwkv7.Rwkv7TimeMixing(rwkv7.ModelArgs(**rwkv7_config()), layer_idx=0)
    keys = mx.random.split(mx.random.key(3), 6)
    r, k, v, kk, lr, d = (mx.random.normal((1, 6, 4, 8), key=key) for key in keys)
    kk = kk / mx.linalg.norm(kk, axis=-1, keepdims=True)
    w = mx.exp(-0.606531 * mx.sigmoid(d))
    a, b = -kk, kk * mx.sigmoid(lr)
    f64, state = mx.float64, mx.zeros((1, 4, 8, 8))
    low = [x.astype(mx.bfloat16) for x in (r, w, v, a, b)]  # k stays float32
    calls = [
        (layer, low[0], low[1], k, low[2], low[3], low[4], None),
        (layer, r[:, :1], w[:, :1], k[:, :1], v[:, :1], a[:, :1], b[:, :1], None),
        (layer, r, w, k, v, a.astype(f64), b.astype(f64), None),
        (layer, r, w, k, v, a, b, state.astype(f64)),
    ]
    _stays_stock(lambda *args: rwkv7.Rwkv7TimeMixing._wkv7(*args), calls, dplr_spy)


def test_rwkv7_seam_that_changed_is_left_alone(monkeypatch):
    """An ``Rwkv7TimeMixing._wkv7`` that the routed call does not reproduce (here: its
    state doubled) stays mlx-lm's, with a warning naming it; the rest applies."""
    import mlx_lm.models.rwkv7 as rwkv7

    real = rwkv7.Rwkv7TimeMixing._wkv7

    def changed(self, r, w, k, v, a, b, state):
        y, state = real(self, r, w, k, v, a, b, state)
        return y, 2 * state

    monkeypatch.setattr(rwkv7.Rwkv7TimeMixing, "_wkv7", changed)
    with pytest.warns(RuntimeWarning, match="rwkv7.Rwkv7TimeMixing._wkv7 is left"):
        with cmlx.patch():
            assert cmlx.rwkv7_patched_modules() == ()
            assert cmlx.mamba_patched_modules() == ("jamba", "mamba")
            assert rwkv7.Rwkv7TimeMixing._wkv7 is changed
    assert rwkv7.Rwkv7TimeMixing._wkv7 is changed


# ------------------------------------------------ RG-LRU (recurrent_gemma's rnn_scan)


def recurrent_gemma_model(seed=0):
    """mlx-lm's recurrent_gemma, 3 layers (two recurrent, one local attention), its
    zero-initialized parameters (the RG-LRU's gates and decay, the convolutions) made
    random."""
    cfg = dict(
        model_type="recurrent_gemma", attention_bias=False, conv1d_width=4, hidden_size=32,
        intermediate_size=64, logits_soft_cap=30.0, num_attention_heads=2,
        num_hidden_layers=3, num_key_value_heads=1, rms_norm_eps=1e-6, rope_theta=10000.0,
        attention_window_size=16, vocab_size=64, embeddings_scale_by_sqrt_dim=True,
        block_types=["recurrent", "recurrent", "attention"],
    )  # fmt: skip
    model = build_model(cfg, seed)
    zeros = [(k, v) for k, v in tree_flatten(model.parameters()) if not mx.any(v != 0).item()]
    assert any(k.endswith("recurrent_param") for k, _ in zeros)
    keys = mx.random.split(mx.random.key(seed + 5), len(zeros))
    model.update(tree_unflatten([(k, 0.3 * mx.random.normal(v.shape, key=kk))
                                 for (k, v), kk in zip(zeros, keys)]))  # fmt: skip
    mx.eval(model.parameters())
    return model


def parameter_loss_and_grads(model, batch, lengths, compiled):
    """The loss and the gradient of every parameter (mlx-lm's recurrent_gemma.Model does
    not call ``nn.Module.__init__``, so ``nn.value_and_grad``, ``freeze`` and LoRA fail
    on it in mlx-lm 0.32.2: differentiate ``model.parameters()`` directly)."""

    def loss(params):
        kept = model.parameters()
        model.update(params)
        value = trainer.default_loss(model, batch, lengths)[0]
        model.update(kept)  # (under compile the model must not keep the traced arrays)
        return value

    step = mx.value_and_grad(loss)
    if compiled:
        step = mx.compile(step)
    value, grad = step(model.parameters())
    mx.eval(value, grad)
    return value.item(), dict(tree_flatten(grad))


@pytest.fixture
def diagonal_spy(monkeypatch):
    """Record each call of chunkscan.diagonal_recurrence through the RG-LRU seam."""
    return _record_calls(monkeypatch, "_diagonal_op", "chunk_size")


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_rg_lru_grads_match_stock(compiled, diagonal_spy):
    """recurrent_gemma trains patched with the loss and gradients of mlx-lm's loop of
    slice updates: each recurrent layer calls chunkscan.diagonal_recurrence once."""
    model = recurrent_gemma_model()
    batch, lengths = padded_batch(64, lengths=(150, 97))
    loss0, g0 = parameter_loss_and_grads(model, batch, lengths, compiled)
    with cmlx.patch() as handle:
        assert cmlx.rg_lru_patched_modules() == ("recurrent_gemma",)
        assert "rg_lru=('recurrent_gemma',)" in repr(handle)
        loss1, g1 = parameter_loss_and_grads(model, batch, lengths, compiled)
    assert diagonal_spy == [None] * (2 + 2)  # the probe's two calls, then one per layer
    assert abs(loss1 - loss0) <= RTOL * abs(loss0)
    assert g0.keys() == g1.keys() and any("rg_lru.recurrent_param" in k for k in g0)
    for name in g0:
        assert rel(g1[name], g0[name]) <= RTOL, name


def test_rg_lru_generation_keeps_its_tokens(diagonal_spy):
    """Generation patched: the prompt's prefill goes through the op, each decoded token
    through mlx-lm's function; the tokens are stock's, the recurrent caches (the
    convolution's and the RG-LRU's states) in mlx-lm's dtypes and within RTOL."""
    model = recurrent_gemma_model()
    compared = _generation_as_stock(model)
    assert len(diagonal_spy) == 2 + 2 * 2  # the probe's, then the two prefills' per layer
    assert compared == 2 * 2


@float64_on_cpu
def test_rg_lru_calls_the_op_cannot_take_stay_mlx_lms(diagonal_spy):
    """One token, or a float64 state (mlx-lm's loop promotes it; the op does not take
    it and the patched call raised, naming ``initial_state``; found by probing):
    mlx-lm's function, bit for bit."""
    import mlx_lm.models.recurrent_gemma as rg

    keys = mx.random.split(mx.random.key(5), 3)
    x = mx.random.normal((2, 6, 4), key=keys[0])
    a = mx.sigmoid(mx.random.normal((2, 6, 4), key=keys[1]))
    h0 = mx.random.normal((2, 4), key=keys[2])
    calls = [(x[:, :1], a[:, :1], h0), (x, a, h0.astype(mx.float64))]
    _stays_stock(lambda *args: rg.rnn_scan(*args), calls, diagonal_spy)
    # an a of another dtype than x: mlx-lm's function asserts they match, and so the
    # patched call (it trained such a model, which failed at its first decoding step;
    # found by probing, session 49)
    with cmlx.patch():
        del diagonal_spy[:]
        with pytest.raises(AssertionError):
            rg.rnn_scan(x.astype(mx.bfloat16), a, h0)
    assert diagonal_spy == []


def test_rg_lru_seam_that_changed_is_left_alone(monkeypatch):
    """An ``rnn_scan`` that the routed call does not reproduce (here: its last state
    doubled) stays mlx-lm's, with a warning naming it; the rest applies."""
    import mlx_lm.models.recurrent_gemma as rg

    real = rg.rnn_scan

    def rnn_scan(x, a, h0):
        y, last = real(x, a, h0)
        return y, 2 * last

    monkeypatch.setattr(rg, "rnn_scan", rnn_scan)
    with pytest.warns(RuntimeWarning, match="recurrent_gemma.rnn_scan is left"):
        with cmlx.patch():
            assert cmlx.rg_lru_patched_modules() == ()
            assert cmlx.rwkv7_patched_modules() == ("rwkv7",)
            assert rg.rnn_scan is rnn_scan
    assert rg.rnn_scan is rnn_scan


# bfloat16 models, prefill with a cache, patched against stock (RWKV-7, RG-LRU): the
# caches' dtypes and shapes are stock's; patched and stock differ by bfloat16 rounding
# (measured at most 1.0e-2 relative RMSE over the caches and logits of three prompts,
# the test's the first; bound about 4x), and patched is as near the float32 model as
# stock is (its error at most 1.09x stock's over the same; bound 1.5x).
BF16_TOL, BF16_RATIO = 4e-2, 1.5


@pytest.mark.parametrize("family", ["rwkv7", "recurrent_gemma"])
def test_bfloat16_prefill_keeps_stocks_caches(family):
    if family == "rwkv7":
        model = with_rwkv7_mixing(build_model(rwkv7_config(), 0))
    else:
        model = recurrent_gemma_model()
    model.set_dtype(mx.bfloat16)
    model.eval()
    prompt = mx.array([list(range(3, 40))])
    ref = model.make_cache()
    logits0 = model(prompt, cache=ref)
    key = "chunkscan.dplr_delta_rule" if family == "rwkv7" else "chunkscan.diagonal_recurrence"
    with cmlx.patch():
        before = cmlx.routed_calls[key]  # (after the probes)
        cache = model.make_cache()
        logits1 = model(prompt, cache=cache)
        assert cmlx.routed_calls[key] == before + 2  # the seam ran (two layers each)
    model.set_dtype(mx.float32)
    exact = model.make_cache()
    logits_f = model(prompt, cache=exact)
    pairs = [(logits1, logits0, logits_f)]
    for got, want, f32 in zip(cache, ref, exact):
        if hasattr(want, "cache"):  # (recurrent_gemma's attention layer: a KV cache)
            pairs += list(zip(got.cache, want.cache, f32.cache))
    assert len(pairs) == 1 + (6 if family == "rwkv7" else 4)
    for ours, theirs, f32 in pairs:
        assert ours.dtype == theirs.dtype and ours.shape == theirs.shape
        assert rel(ours, theirs) <= BF16_TOL
        near, stock_near = rel(ours.astype(mx.float32), f32), rel(theirs.astype(mx.float32), f32)
        assert near <= BF16_RATIO * stock_near + 1e-6
