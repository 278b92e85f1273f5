"""What one Gated DeltaNet fwd+bwd on the fused CUDA path allocates, kernel by kernel.

On a CUDA GPU MLX keeps every buffer a committed command graph uses until that graph
has run, and the CPU encodes the whole call long before the GPU finishes it
(``docs/benchmarks.md``, "group budget and MLX's command graphs"), so a buffer freed
early is not reused within the call: the call's peak is close to the sum of everything
it allocates. This adds that sum up without a GPU. It builds the op's fwd+bwd
(``mx.vjp`` given the outputs' cotangents: ``bench/gdn_vs_fla.py``'s harness) at the
Qwen3-Next layer shape (B=1, Hk=16, Hv=32, Dk=Dv=128, bf16) with the kernels faked
(``tests/helpers.py``'s ``fake_fused_kernels``: each launch returns lazy zeros of its
outputs' shapes) and the shared memory of an H100 / H200 (227 KiB per block, which picks
the kernels' tiling), records every launch's outputs, and prints KiB per token by kernel
and output, in launch order. Nothing runs; any machine, the CPU included.

    python bench/memory_breakdown.py --T 16384 --json bench-out/memory_breakdown.json

``--chunk-size`` 32 or 64, the sizes the fused kernels take (at any other the batched
MLX ops run, whose buffers this does not see). Not counted: MLX's own ops around the
kernels (masks, the zero cotangents, a few reshapes that copy), which are small at this
shape, and the inputs and their cotangents (the benchmarks' peak is measured above
them). ``CHUNKSCAN_GDN_SAVE=groups`` counts that form (the header says which).
"""

from __future__ import annotations

import argparse

from _common import OUT, check_outputs, meta, positive_int, write_json

KiB = 1024.0
# Output names of each kernel (``_chunk_cuda``'s and ``_pass_cuda``'s order), for the
# table only; other outputs are listed by index.
_NAMES = {
    "prepare": ("a", "p", "w", "u", "kt", "decay"),
    "output": ("o, or unused", "unused, or h"),
    # the forward's states, or the backward's cotangents of them
    "state_pass": ("states per chunk", "state leaving", "states stored"),
    "state_grads": ("d_vnew", "d_w", "d_qg", "d_kt", "d_p", "m2", "d_decay"),
    "input_grads": ("dq", "dk", "dv", "dg", "dbeta"),
}


def _base_name(kernel: str) -> str:
    for prefix in ("chunkscan_gdn_", "chunkscan_"):
        kernel = kernel.removeprefix(prefix)
    return kernel.removesuffix("_tc")


def allocations(T: int, group_mib: int, chunk_size: int) -> tuple[list[dict], int, str, int]:
    """One row per launch and output, in launch order; the number of groups; the
    ``save_states`` in effect; the chunk the kernels ran at (``chunk_size`` cut to ``T``,
    rounded up to a size they take). The fakes are undone on return (they had stayed:
    the op returned zeros for the rest of the process; found by probing)."""
    from chunkscan import _backend
    from chunkscan.ops.gated_delta import _passes
    from chunkscan.ops.gated_delta import chunk as chunk_module

    faked = [(_backend, "RUNNER"), (_backend, "_LIMITS"), (_backend, "_CAPABILITY"),
             (chunk_module, "_fused"), (chunk_module, "_GROUP_BYTES"),
             (_passes, "use_kernels")]  # fmt: skip
    saved = [(module, name, getattr(module, name)) for module, name in faked]
    try:
        return _allocations(T, group_mib, chunk_size)
    finally:
        for module, name, value in saved:
            setattr(module, name, value)


def _allocations(T: int, group_mib: int, chunk_size: int) -> tuple[list[dict], int, str, int]:
    from _common import gdn_chunking, import_test_helpers
    from gated_delta import _inputs, make_step

    fake_fused_kernels = import_test_helpers().fake_fused_kernels

    import chunkscan
    from chunkscan import _backend
    from chunkscan.ops.gated_delta import chunk as chunk_module

    fake_fused_kernels()
    _backend._LIMITS = {0: _backend.CudaLimits(227 * 1024, 228 * 1024, 132, "H100/H200")}
    _backend._CAPABILITY = {}
    fake = _backend.RUNNER
    launches: list[tuple[str, list]] = []

    def recording(name, header, source, inputs, outputs, template, grid, group, smem):
        launches.append((name, [(tuple(shape), dtype) for _, shape, dtype in outputs]))
        return fake(name, header, source, inputs, outputs, template, grid, group, smem)

    _backend.RUNNER = recording
    chunk_module._GROUP_BYTES = group_mib << 20
    xs, w, w_s = _inputs(T, 1, 16, 32, 128, 128, "bfloat16", 0)

    def op(q, k, v, g, beta, h0):
        return chunkscan.gated_delta_rule(q, k, v, g, beta, initial_state=h0, chunk_size=chunk_size)

    make_step(op, w, w_s, "cotangents")(*xs)
    spec = chunk_module.Spec(1, T, 16, 32, 128, 128, 1.0, chunk_size, None)
    # the chunk the kernels ran at, as the op picks it (the fakes on): at T = 20 the
    # header said C=64 where they ran C=32 (found by probing), and the groups were
    # counted at the size asked for
    chunks = gdn_chunking(*xs[:5], chunk_size=chunk_size)
    save = chunk_module._saved_states()
    size = chunk_module._group_size(spec, chunks.C, fused=True, save=save)
    groups = len(chunks.groups(size))
    rows = []
    for j, (name, outs) in enumerate(launches):
        names = _NAMES.get(_base_name(name), ())
        for i, (shape, dtype) in enumerate(outs):
            size = dtype.size
            for d in shape:
                size *= d
            rows.append({
                "launch": j, "kernel": name, "output": names[i] if i < len(names) else f"#{i}",
                "shape": list(shape), "dtype": str(dtype), "kib_per_token": size / KiB / T,
            })  # fmt: skip
    return rows, groups, save, chunks.C


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--T", type=positive_int, default=16384)
    # the fused kernels' sizes only: at any other C the batched MLX ops run, whose
    # buffers this does not count (C = 128 read 34.2 KiB/token: the state pass alone)
    p.add_argument("--chunk-size", type=int, default=64, choices=(32, 64))
    p.add_argument("--group-mib", type=positive_int, default=16384,
                   help="the group budget (default 16384: an H200's, 1/8 of its memory "
                   "capped at 16 GiB)")  # fmt: skip
    p.add_argument("--json", default=str(OUT / "memory_breakdown.json"))
    args = p.parse_args(argv)
    check_outputs(p, {"--json": args.json})
    rows, groups, save, ran = allocations(args.T, args.group_mib, args.chunk_size)
    total = sum(r["kib_per_token"] for r in rows)
    # written before the table, which a pipe may cut (`| head -1` in run 99 did);
    # chunk_size as asked, chunk_run as run
    write_json(args.json, meta(__file__, argv, T=args.T, chunk_size=args.chunk_size, chunk_run=ran,
                               groups=groups, save_states=save, total_kib_per_token=total),
               rows)  # fmt: skip
    asked = f" (--chunk-size {args.chunk_size} cut to T, to a size the kernels take)"
    asked = asked if ran != args.chunk_size else ""
    print(f"T={args.T} C={ran}{asked}, {groups} group(s), save_states={save!r}: kernel "
          f"outputs allocated in one fwd+bwd, KiB per token (total {total:.1f})")  # fmt: skip
    for r in rows:
        if r["kib_per_token"] >= 0.05:
            print(f"  {r['launch']:2d} {_base_name(r['kernel']):<16s} {r['output']:<18s} "
                  f"{r['kib_per_token']:6.1f}  {r['shape']} {r['dtype']}")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
