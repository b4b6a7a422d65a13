"""Compile the lookup path's, the tables' sparse Adam's and the MoE training step's Triton kernels for a GPU
architecture on a machine without a GPU.

CI has no GPU and runs kernels through the interpreter, which never invokes Triton's
compiler, so a kernel the compiler rejects passes every CPU test (Triton 3.6, for one, fails
a layout pass on a scattered store that the interpreter and Triton 3.9 accept).
`python -m condmem.ops.compile_check`
compiles each kernel variant the engine launches (to PTX and a cubin, with the ptxas
Triton ships) for sm_90 and prints one line per variant; a test runs it under the installed
Triton. To check another Triton: ``pip install --target DIR triton==X`` and run with
``PYTHONPATH=DIR``.

Must run with ``TRITON_INTERPRET`` unset (the interpreter replaces the compiled kernels).
"""

from __future__ import annotations

import argparse
import os
import sys


def variants() -> list[tuple[str, object, dict, dict, dict]]:
    """(name, kernel, signature, constexprs, compile options) of every kernel variant the lookup
    path, the sparse Adam and the MoE training step compile."""
    plain = [(*v, {}) for v in _gather_variants() + _row_cache_variants()]
    return plain + _sparse_adam_variants() + _moe_variants()


def _gather_variants() -> list[tuple[str, object, dict, dict]]:
    """The row gather's variants: 4-byte words and packed fp8 rows, each with and without a scatter."""
    from condmem.ops.gather.triton import _gather_kernel
    from condmem.ops.triton_util import next_pow2

    out = []
    gather_sig = {
        "ids_ptr": "*i64",
        "tab_ptr": "*fp32",
        "scale_ptr": "*fp32",
        "out_ptr": "*fp32",
        "dst_ptr": "*i64",
        "n_rows": "i64",
        "lo": "i64",
        "n_local": "i64",
        "n_out": "i64",
    }
    # Plain 4-byte words of 264 B rows (the engine's row moves), and packed fp8 rows expanded to bf16.
    for mode, d, nb, sig in (
        (0, 66, 1, gather_sig),
        (2, 256, 8, dict(gather_sig, tab_ptr="*u8", scale_ptr="*u8", out_ptr="*bf16")),
    ):
        for scatter in (False, True):
            consts = {
                "ROW_STRIDE": d + (d // 32 if mode == 2 else 0),
                "SCALE_STRIDE": 0 if mode == 0 else 264,
                "SCALE_OFF": 0 if mode == 0 else 256,
                "D": d,
                "NB": nb,
                "BLOCK_NB": next_pow2(nb),
                "BLOCK_D": next_pow2(d),
                "BLOCK_R": 32,
                "MODE": mode,
                "EXACT": False,
                "SCATTER": scatter,
            }
            out.append((f"gather mode={mode} scatter={scatter}", _gather_kernel, sig, consts))
    return out


def _row_cache_variants() -> list[tuple[str, object, dict, dict]]:
    """The HBM row cache's kernels: probe, slot choice and write."""
    from condmem.ops.row_cache import triton as rc

    return [
        (
            "cache probe",
            rc.probe_kernel,
            {
                "ids_ptr": "*i64",
                "valid_ptr": "*i1",
                "keys_ptr": "*i64",
                "freq_ptr": "*i32",
                "slot_ptr": "*i64",
                "n": "i64",
                "n_sets": "i64",
            },
            {"WAYS": 16, "HAS_VALID": True, "COUNT": True, "BLOCK": rc.BLOCK_IDS},
        ),
        (
            "cache choose slots",
            rc.choose_slots_kernel,
            {
                "sorted_sets_ptr": "*i64",
                "rank_ptr": "*i64",
                "order_ptr": "*i64",
                "ids_ptr": "*i64",
                "keys_ptr": "*i64",
                "freq_ptr": "*i32",
                "slot_ptr": "*i64",
                "n": "i64",
                "n_sets": "i64",
            },
            {"WAYS": 16, "BLOCK": rc.SLOT_CHOICE_BLOCK},
        ),
        (
            "cache write",
            rc.write_kernel,
            {
                "slot_ptr": "*i64",
                "order_ptr": "*i64",
                "ids_ptr": "*i64",
                "src_index_ptr": "*i64",
                "src_ptr": "*i64",
                "keys_ptr": "*i64",
                "freq_ptr": "*i32",
                "data_ptr": "*i64",
                "n": "i64",
                "row_words": "i64",
            },
            {"WORDS": 64, "HAS_INDEX": True, "BLOCK": rc.BLOCK_IDS},
        ),
    ]


def _sparse_adam_variants() -> list[tuple[str, object, dict, dict, dict]]:
    """The tables' fused Adam: fresh-row flags, and the step on fp32, bf16 and fp16 tables (with the
    launch's options: no fp contraction)."""
    from condmem.ops import sparse_adam_triton as sa

    adam_sig = {
        "rows_ptr": "*i64",
        "grad_ptr": "*fp32",
        "p_ptr": "*fp32",
        "slot_ptr": "*i32",
        "rank_ptr": "*i32",
        "n_slots_ptr": "*i64",
        "m_ptr": "*fp32",
        "v_ptr": "*fp32",
        "step_ptr": "*fp32",
        "pow1_ptr": "*fp32",
        "pow2_ptr": "*fp32",
        "k": "i64",
        "n_rows": "i64",
        "capacity": "i64",
        "p_stride": "i64",
        **{name: "fp32" for name in ("w", "beta2", "one_minus_beta2", "eps", "neg_lr")},
    }
    out = [
        (
            "sparse adam fresh rows",
            sa._fresh_kernel,
            {"rows_ptr": "*i64", "slot_ptr": "*i32", "fresh_ptr": "*i32", "k": "i64", "n_rows": "i64"},
            {"BLOCK": sa.FRESH_BLOCK},
            {},
        )
    ]
    for dtype, kind in (("fp32", 0), ("bf16", 1), ("fp16", 2)):
        consts = {"D": 64, "BLOCK_R": 32, "BLOCK_D": 64, "LERP_SMALL": True, "V_CUDA": True, "P_KIND": kind}
        sig = dict(adam_sig, p_ptr=f"*{dtype}", grad_ptr=f"*{dtype}")
        out.append((f"sparse adam step {dtype}", sa._adam_kernel, sig, {**consts, "EXACT": False}, sa.COMPILE_OPTIONS))
    return out


def _moe_variants() -> list[tuple[str, object, dict, dict, dict]]:
    """The MoE step's: the layout's two passes (62 and 256 experts: one-hot widths 64 and 256) and the experts' weight
    gradient in the tilings of both of a layer's GEMMs (fp32 and bf16 out, int32 and int64 ends)."""
    from condmem.ops.grouped_weight_grad import triton as wg
    from condmem.ops.moe_layout.triton import _block_counts, _place, one_hot_shape

    out = []
    for n_experts in (62, 256):
        width, block = one_hot_shape(n_experts)
        consts = {"BLOCK": block, "EXPERTS": width}
        counts_sig = {
            "experts_ptr": "*i64",
            "counts_ptr": "*i32",
            "pairs": "i32",
            "n_blocks": "i32",
            "n_experts": "i32",
        }
        place_sig = {f"{name}_ptr": "*i64" for name in ("experts", "base", "dest", "src")}
        out.append((f"moe layout counts E<={width}", _block_counts, counts_sig, consts, {}))
        out.append(
            (f"moe layout place E<={width}", _place, {**place_sig, "pairs": "i32", "n_blocks": "i32"}, consts, {})
        )
    for k in (256, 512):
        block_n, block_k, block_m, warps, stages = wg.tiling(k)
        consts = {"BLOCK_N": block_n, "BLOCK_K": block_k, "BLOCK_M": block_m, "UPCAST": False}
        for out_dtype, ends in (("fp32", "i32"), ("bf16", "i64")):
            sig = {"dy_ptr": "*bf16", "x_ptr": "*bf16", "ends_ptr": f"*{ends}", "out_ptr": f"*{out_dtype}"}
            sig.update({name: "i32" for name in ("n", "k", "stride_dy", "stride_x")})
            options = {"num_warps": warps, "num_stages": stages}
            out.append((f"weight grad k={k} {out_dtype} ends {ends}", wg._weight_grad, sig, consts, options))
    return out


def compile_all(arch: int = 90) -> list[tuple[str, str | None]]:
    """(variant, None or the compiler's error) for every variant, compiled for sm_<arch>."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    results = []
    for name, kernel, signature, constexprs, options in variants():
        source = ASTSource(
            fn=kernel, signature={**signature, **{c: "constexpr" for c in constexprs}}, constexprs=constexprs
        )
        try:
            triton.compile(source, target=GPUTarget("cuda", arch, 32), options={"num_warps": 4, **options})
            results.append((name, None))
        except Exception as exc:  # noqa: BLE001 - any compiler failure is the finding
            results.append((name, f"{type(exc).__name__}: {str(exc).strip().splitlines()[-1][:300]}"))
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", type=int, default=90, help="compute capability to compile for (90: H100/H200)")
    args = parser.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print("compile_check: unset TRITON_INTERPRET (the interpreter replaces compiled kernels)", file=sys.stderr)
        return 2
    import triton

    results = compile_all(args.arch)
    for name, error in results:
        print(f"{'ok    ' if error is None else 'FAILED'} {name}" + (f": {error}" if error else ""))
    failed = sum(error is not None for _, error in results)
    print(f"triton {triton.__version__}, sm_{args.arch}: {failed} of {len(results)} variants failed to compile")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
