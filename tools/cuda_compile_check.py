"""Compile every CUDA kernel of chunkscan with NVRTC, without a GPU, as MLX would.

``mx.fast.cuda_kernel`` compiles its source when a kernel is first called, so a typo
costs a device run. This script builds each kernel's full source the way MLX 0.32's
``build_kernel`` does (MLX's default header, the signature from the input and output
names, the template constants), compiles it for ``sm_90a`` with NVRTC and, where
``ptxas`` is found, reports registers and spills. It then compiles the form the package
itself builds by default (``chunkscan._precompile.build_source``: no MLX header, a cubin
for ``sm_90``) with the package's own NVRTC call, and reports both compile times; where
``ptxas`` is found, it reports that form's registers too and fails a kernel whose
registers times its threads per block (``NT``) pass 65536, which CUDA cannot launch
("too many resources requested for launch": run 41). Without ``--mlx-src`` only the
package's form is compiled. It needs no GPU and no MLX CUDA build:

    pip install nvidia-cuda-nvrtc-cu12 nvidia-cuda-runtime-cu12 nvidia-cuda-cccl-cu12 \\
        nvidia-cuda-nvcc-cu12                       # NVRTC, headers, ptxas
    git clone --depth 1 --branch v0.32.4 https://github.com/ml-explore/mlx /tmp/mlx-src  # .cuh
    PYTHONPATH=src python tools/cuda_compile_check.py --mlx-src /tmp/mlx-src

Exit status 1 if any kernel fails to compile. Compiling is not running: the kernels are
tested on a CUDA device (``bash bench/h200_suite.sh tests``).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import glob
import os
import re
import subprocess
import sys
import tempfile
import time

import mlx.core as mx

from chunkscan._precompile import template_lines  # MLX's template lines, one writer

CUDA_TYPES = {"float32": "float", "bfloat16": "__nv_bfloat16", "float16": "__half",
              "int32": "int32_t", "bool": "bool"}  # fmt: skip
MX_DTYPES = {"float32": mx.float32, "bfloat16": mx.bfloat16, "float16": mx.float16,
             "int32": mx.int32, "bool": mx.bool_}  # fmt: skip


def _nvidia_root() -> str:
    import nvidia  # the namespace package of the pip wheels

    return next(p for p in nvidia.__path__ if os.path.isdir(os.path.join(p, "cuda_nvrtc")))


def build_source(name, header, source, inputs, outputs, template) -> str:
    """MLX's kernel source: ``inputs`` [(name, dtype, ndim)], ``outputs`` [(name,
    dtype)], ``template`` [(name, int | bool | dtype name)]."""
    parts = []
    for n, dt, nd in inputs:
        parts.append(f"    const {CUDA_TYPES[dt]}* {n}")
        for suffix, kind in (("shape", "Shape"), ("strides", "Strides"), ("ndim", "int")):
            if nd > 0 and f"{n}_{suffix}" in source:
                parts.append(f"    const __grid_constant__ {kind} {n}_{suffix}")
    parts += [f"    {CUDA_TYPES[dt]}* {n}" for n, dt in outputs]
    consts = template_lines(template, CUDA_TYPES.__getitem__)
    return (
        '#include "mlx/backend/cuda/device/utils.cuh"\n#include <cooperative_groups.h>\n'
        + header
        + "\nnamespace mlx::core::cu {\nnamespace cg = cooperative_groups;\n"
        + f"__global__ void {name}(\n" + ",\n".join(parts) + ") {\n"
        + "\n".join(consts) + "\n" + source + "\n}\n}  // namespace mlx::core::cu\n"
    )  # fmt: skip


def compile_ptx(nvrtc, src: str, includes: list[str]) -> tuple[bool, str, bytes]:
    prog = ctypes.c_void_p()
    if nvrtc.nvrtcCreateProgram(ctypes.byref(prog), src.encode(), b"k.cu", 0, None, None):
        return False, "nvrtcCreateProgram failed", b""
    opts = [b"--device-as-default-execution-space", b"--gpu-architecture=compute_90a",
            b"-std=c++17"] + [f"-I{i}".encode() for i in includes]  # fmt: skip
    ok = nvrtc.nvrtcCompileProgram(prog, len(opts), (ctypes.c_char_p * len(opts))(*opts)) == 0
    size = ctypes.c_size_t()
    nvrtc.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
    log = ctypes.create_string_buffer(size.value)
    nvrtc.nvrtcGetProgramLog(prog, log)
    ptx = b""
    if ok:
        nvrtc.nvrtcGetPTXSize(prog, ctypes.byref(size))
        buf = ctypes.create_string_buffer(size.value)
        nvrtc.nvrtcGetPTX(prog, buf)
        ptx = buf.value
    return ok, log.value.decode(errors="replace"), ptx


def kernels():
    """(label, name, header, source, inputs, outputs, template) of every kernel at the
    shapes the tests and benchmarks use."""
    from chunkscan.ops.attention import _cuda as attn
    from chunkscan.ops.attention._checks import Spec
    from chunkscan.ops.gated_delta import _pass_cuda as sp

    out = []
    passes = [(64, 128, 128, True, False), (64, 128, 128, False, False),
              (128, 128, 128, False, True), (16, 32, 32, True, True),
              (128, 256, 32, True, False)]  # fmt: skip
    for C, Dk, R, has_e, channel in passes:
        cfg = sp.choose_config(C, Dk, R, has_e, L=32)
        t = sp.template(cfg, C, Dk, R, has_x=True, has_e=has_e, has_h=not has_e,
                        reverse=not has_e, channel=channel)  # fmt: skip
        ins = [(n, "int32" if n in ("loads", "stores") else "float32", 3) for n in sp._INPUTS]
        outs = [(n, "float32") for n in sp._OUTPUTS]
        label = f"state_pass C={C} Dk={Dk} R={R} E={has_e} channel={channel}"
        out.append((label, "chunkscan_state_pass", sp._HEADER, sp._SOURCE, ins, outs, t))
        for tf32 in (False, True):  # the tensor-core kernel, where it takes the shape
            tc = (
                None
                if channel
                else sp.choose_tc_config(C, Dk, R, has_e, False, tf32, has_h=not has_e)
            )
            if tc is None:
                continue
            t = sp.tc_template(tc, C, Dk, R, has_x=True, has_e=has_e, has_h=not has_e,
                               reverse=not has_e)  # fmt: skip
            out.append((label.replace("state_pass", "state_pass_tc")
                        + f" TR={tc.TR}" + (" tf32" if tf32 else ""),
                        "chunkscan_state_pass_tc", sp._HEADER_TC, sp._SOURCE_TC, ins, outs,
                        t))  # fmt: skip
            if tf32:  # and TF32's default, the mma.sync kernel
                out.append((label.replace("state_pass", "state_pass_mma") + f" TR={tc.TR}",
                            "chunkscan_state_pass_mma", sp._HEADER_MMA, sp._SOURCE_MMA, ins,
                            outs, t))  # fmt: skip
    for D, Dv, causal, dt in ((256, 256, True, "bfloat16"), (64, 128, False, "float16"),
                              (128, 64, True, "bfloat16"), (64, 256, True, "float16")):  # fmt: skip
        spec = Spec(1, 16, 2, 1000, 1000, D, Dv, 0.06, "causal" if causal else "none", None,
                    None)  # fmt: skip
        t = [(n, str(v).split(".")[-1] if isinstance(v, mx.Dtype) else v)
             for n, v in attn.template(spec, getattr(mx, dt))]  # fmt: skip
        for which, (names, outs) in attn._KERNEL_ARGS.items():
            # inputs: the arrays in the input dtype, the statistics and params float32
            ins = [(n, dt if n in ("q", "k", "v", "dout", "o") else "float32", 4) for n in names]
            outs = [(n, "float32" if n in ("lse", "delta_out") else dt) for n in outs]
            label = f"attention {which} D={D} Dv={Dv} causal={causal} {dt}"
            out.append((label, f"chunkscan_attn_{which}", attn._HEADER, attn._SOURCES[which],
                        ins, outs, t))  # fmt: skip
    from chunkscan.ops.gated_delta import _chunk_cuda as cc

    # (C, Dk, Dv, G, dtype, threads per block, columns per state_grads block; None: the
    # defaults, cc.threads and cc.slice_columns)
    for C, Dk, Dv, G, dt, nt_, tv_ in ((64, 128, 128, 2, "bfloat16", None, None),
                                       (64, 128, 128, 2, "float32", None, None),
                                       (32, 128, 128, 2, "bfloat16", None, None),
                                       (32, 64, 96, 1, "float32", None, None),
                                       (64, 96, 96, 1, "bfloat16", None, None),
                                       (64, 96, 96, 2, "float32", None, None),
                                       (64, 128, 128, 2, "bfloat16", None, 64),
                                       (64, 64, 128, 2, "bfloat16", None, None),
                                       (64, 128, 64, 4, "float16", None, None),
                                       (64, 128, 128, 1, "bfloat16", 256, 32),
                                       (64, 128, 128, 1, "bfloat16", 512, 64),
                                       (32, 128, 128, 1, "bfloat16", 512, 32),
                                       (64, 128, 128, 2, "bfloat16", None, 128),
                                       (64, 128, 128, 2, "bfloat16", 512, 128),
                                       (64, 128, 128, 2, "bfloat16", 256, 128)):  # fmt: skip
        for which, (names, outs, _) in cc._KERNELS.items():
            source = cc.kernel_source(which)
            own = cc.kernel_defines(which)  # ahead of each header below
            tv = tv_ or cc.slice_columns(Dv, C, Dk)
            raw = {"q", "k", "v", "g", "beta", "dout"}
            ins = [(x, dt if x in raw else "bool" if x == "obad" else "float32", 4)
                   for x in names]  # fmt: skip
            odt = {"out": dt, "DQ": dt, "DKm": dt, "dv": dt, "dg": dt, "dbeta": dt}
            outs_t = [(x, odt.get(x, "float32")) for x in outs]

            label, nt, t = _gdn_variant(which, C, Dk, Dv, G, dt, nt_, tv, tf32=False)
            out.append((label, f"chunkscan_gdn_{which}", own + cc._HEADER, source,
                        ins, outs_t, t))  # fmt: skip
            if which in cc._TC_KERNELS:  # the q / k products on tensor cores (the default)
                out.append((label + " tc", f"chunkscan_gdn_{which}_tc",
                            own + cc._HEADER + cc._HEADER_TC, source, ins, outs_t, t))  # fmt: skip
            if nt == 512 and C == 64:  # the phase clocks (CHUNKSCAN_GDN_PROFILE=1)
                out.append((label + " profile", f"chunkscan_gdn_{which}",
                            "#define CS_PROFILE 1\n" + own + cc._HEADER, source,
                            ins, outs_t, t))  # fmt: skip
            if which in cc._TF32_KERNELS:  # one tf32 product per tile (CS_TF32)
                label, nt, t = _gdn_variant(which, C, Dk, Dv, G, dt, nt_, tv, tf32=True)
                header = own + "#define CS_TF32 1\n" + cc._HEADER + cc._HEADER_TC
                out.append((label + " tf32", f"chunkscan_gdn_{which}_tf32_tc", header,
                            source, ins, outs_t, t))  # fmt: skip
                if nt == 512 and C == 64:  # and with the phase clocks, as on a CUDA device
                    out.append(
                        (
                            label + " tf32 profile",
                            f"chunkscan_gdn_{which}_tf32_tc",
                            "#define CS_PROFILE 1\n" + header,
                            source,
                            ins,
                            outs_t,
                            t,
                        )
                    )
    from chunkscan.ops.gated_delta import _rows_cuda as rc

    for Hk, G, D, DG, dt in ((16, 2, 128, 1, "bfloat16"), (3, 3, 40, 40, "float32")):
        ins = [(x, dt, 4 if x in "qkv" else 3) for x in ("q", "k", "v", "g", "beta")]
        t = [("HK", Hk), ("G", G), ("DK", D), ("DV", D), ("DG", DG)]
        out.append((f"gated_delta non_finite_rows Hk={Hk} G={G} D={D} DG={DG} {dt}",
                    "chunkscan_gdn_non_finite_rows", rc._HEADER, rc._ROWS, ins,
                    [("state_bad", "int32"), ("q_bad", "bool")], t))  # fmt: skip
    for packed in (False, True):
        out.append((f"gated_delta non_finite_reach packed={packed}",
                    "chunkscan_gdn_non_finite_reach", "", rc._REACH,
                    [("state_bad", "int32", 3), ("q_bad", "bool", 3), ("seq_of", "int32", 1)],
                    [("o_bad", "bool"), ("seq_bad", "bool")], [("PACKED", packed)]))  # fmt: skip
    return out


REGISTERS_PER_BLOCK = 65536  # sm_80 .. sm_90: a kernel of NT threads launches with <= 65536 / NT


def _gdn_variant(which, C, Dk, Dv, G, dt, nt_, tv, tf32: bool) -> tuple[str, int, list]:
    """(label, threads, template) of a Gated DeltaNet kernel, with the threads a device
    takes for that build (``nt_``, else ``cc.threads`` under the settings that give
    ``tv``: input_grads' are 512 or 256 by its products and slices)."""
    from chunkscan.ops.gated_delta import _chunk_cuda as cc

    with _settings(
        CHUNKSCAN_GDN_TF32="1" if tf32 else "0",
        CHUNKSCAN_GDN_TV=str(tv) if tv != cc.slice_columns(Dv, C, Dk) else None,
    ):
        nt = nt_ or cc.threads(which, C, Dk, Dv, tv)
    base = [("NT", nt), ("C", C), ("DK", Dk), ("DV", Dv), ("G", G), ("HK", 4), ("HV", 4 * G)]
    scale = 0.0 if which == "state_grads" else Dk**-0.5  # as cc.state_gradients
    base.append(("SCALE_BITS", cc.scale_bits(scale)))
    extra = {"prepare": [("WRITE_A", dt != "float32")],
             "output": [("MODE_H", dt == "float32"), ("TO", dt), ("TV", tv),
                        ("TH", cc.output_step_columns(tv))],
             "state_grads": [("TV", tv), ("KS", cc.piece_columns(C, Dk, Dv, tv, nt))],
             "input_grads": [("NV", Dv // tv), ("TG", dt), ("TB", dt)]}[which]  # fmt: skip
    label = f"gated_delta {which} C={C} Dk={Dk} Dv={Dv} G={G} {dt} NT={nt} TV={tv}"
    return label, nt, base + extra


@contextlib.contextmanager
def _settings(**env: str | None):
    """The environment variables ``env`` set inside (None: left as they are): the
    settings under which a device builds a variant (TF32 products, columns per block)."""
    before = {k: os.environ.get(k) for k in env}
    os.environ.update({k: v for k, v in env.items() if v is not None})
    try:
        yield
    finally:
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def ptxas_info(ptxas: str, ptx: bytes, arch: str) -> str:
    """ptxas -v's register, stack and spill line for ``ptx``."""
    with tempfile.TemporaryDirectory() as d:
        with open(f"{d}/k.ptx", "wb") as fh:
            fh.write(ptx)
        res = subprocess.run([ptxas, f"-arch={arch}", "-v", f"{d}/k.ptx", "-o", f"{d}/k.cubin"],
                             capture_output=True, text=True)  # fmt: skip
    return " | ".join(ln.split(":", 1)[-1].strip() for ln in res.stderr.splitlines()
                      if "registers" in ln or "spill" in ln)  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mlx-src", default=None,
                   help="an MLX source checkout (its headers); without it only the precompiled "
                        "form is compiled")  # fmt: skip
    p.add_argument("--only", nargs="+", default=None,
                   help="compile only the kernels whose label contains one of these")  # fmt: skip
    p.add_argument("--dump", default=None,
                   help="write each precompiled cubin into this folder (to compare two versions "
                        "of a source: `cmp` the files of two runs)")  # fmt: skip
    args = p.parse_args(argv)
    root = _nvidia_root()
    nvrtc = ctypes.CDLL(sorted(glob.glob(f"{root}/cuda_nvrtc/lib/libnvrtc.so*"))[0])
    cuda_includes = [f"{root}/{pkg}/include" for pkg in ("cuda_runtime", "cuda_cccl", "cuda_nvcc")
                     if os.path.isdir(f"{root}/{pkg}/include")]  # fmt: skip
    includes = ([args.mlx_src] if args.mlx_src else []) + cuda_includes
    ptxas = next(iter(glob.glob(f"{root}/cuda_nvcc/bin/ptxas")), None)
    from chunkscan import _precompile

    ours = _precompile.Nvrtc(nvrtc, includes)
    failed, totals = 0, [0.0, 0.0]
    chosen = [k for k in kernels() if not args.only or any(o in k[0] for o in args.only)]
    for label, name, header, source, ins, outs, t in chosen:
        if args.mlx_src:
            start = time.perf_counter()
            ok, log, ptx = compile_ptx(nvrtc, build_source(name, header, source, ins, outs, t),
                                       includes)  # fmt: skip
            seconds = time.perf_counter() - start
            totals[0] += seconds
            info = ptxas_info(ptxas, ptx, "sm_90a") if ok and ptxas else ""
            print(f"{'ok  ' if ok else 'FAIL'} {label}  {info}  [MLX form {seconds:.2f} s]")
            if not ok:
                failed += 1
                print(log)
        src = _precompile.build_source(
            name, header, source, [(n, MX_DTYPES[d], nd) for n, d, nd in ins],
            [(n, MX_DTYPES[d]) for n, d in outs],
            [(n, MX_DTYPES[v] if isinstance(v, str) else v) for n, v in t],
        )  # fmt: skip
        start = time.perf_counter()
        try:
            cubin = ours.compile(src, "90")
            totals[1] += time.perf_counter() - start
            if args.dump:
                os.makedirs(args.dump, exist_ok=True)
                safe = "".join(ch if ch.isalnum() or ch in "=_-" else "_" for ch in label)
                with open(os.path.join(args.dump, safe + ".cubin"), "wb") as fh:
                    fh.write(cubin)
            seconds = time.perf_counter() - start
        except RuntimeError as e:
            failed += 1
            print(f"FAIL {label}  [precompiled form]\n{e}")
            continue
        info, over = "", ""
        if ptxas:  # the same source through PTX: registers against the block's threads
            info = ptxas_info(ptxas, ours.compile(src, "90", ptx=True), "sm_90")
            nt = dict(t).get("NT")
            regs = re.search(r"Used (\d+) registers", info)
            if nt and regs and int(regs.group(1)) * nt > REGISTERS_PER_BLOCK:
                over = f"  {regs.group(1)} registers x {nt} threads: too many for one block"
                failed += 1
        print(f"{'FAIL' if over else 'ok  '} {label}  {info}{over}  [precompiled form "
              f"{seconds:.2f} s]")  # fmt: skip
    print(f"compile time in total: MLX form (PTX) {totals[0]:.1f} s, precompiled form (cubin) "
          f"{totals[1]:.1f} s, {len(chosen)} kernels")  # fmt: skip
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
