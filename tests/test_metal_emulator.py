"""The Metal emulator itself (tools/metal_emulator): Metal's semantics in the shim, MLX's dispatch
(partial threadgroups), the checks it promises (divergence, Metal's limits, bounds, unwritten
outputs, strict address spaces, races) and its toolchain (compile cache, a missing compiler).
Each kernel here is small and written for the property it checks; Kipp's own kernels are in
test_metal_kernels.py."""

import platform
import sys
from pathlib import Path

import numpy as np
import pytest

mx = pytest.importorskip("mlx.core")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))
pytestmark = pytest.mark.skipif(
    platform.machine() not in ("x86_64", "AMD64"),
    reason="the Metal emulator's fiber switch is written for x86-64; on Apple silicon the "
           "kernels run on Metal itself (bench/mac_check.sh)")

import ml_dtypes  # noqa: E402
from metal_emulator import (  # noqa: E402
    CompileError,
    CompilerMissing,
    Emulator,
    EmulatorError,
    KernelFault,
    check_strict,
    toolchain,
)

from kipp.apple.metal import KernelSpec  # noqa: E402

ASAN = Emulator("asan")


def run(source, inputs, outputs, grid, threadgroup, header="", emulator=ASAN, **extra):
    """Run `source` with numpy `inputs` (name -> array); `outputs` name -> (shape, mx dtype)."""
    spec = KernelSpec("probe", tuple(inputs), tuple(outputs), source, header)
    got = emulator(spec)(inputs=[mx.array(a) for a in inputs.values()], grid=grid,
                         threadgroup=threadgroup, output_shapes=[s for s, _ in outputs.values()],
                         output_dtypes=[d for _, d in outputs.values()], **extra)
    return [np.array(a) for a in got]


def test_bfloat_and_half_round_to_nearest_even_and_as_type_keeps_bits():
    rng = np.random.default_rng(0)
    x = np.concatenate([
        rng.standard_normal(200).astype(np.float32) * 1e3,
        np.array([1 + 2 ** -8, 1 + 3 * 2 ** -8, 1 + 2 ** -11, 1 + 3 * 2 ** -11,  # ties
                  65504.0, 65520.0, 1e-8, 6e-8, -0.0, np.inf, -np.inf, np.nan,
                  3.4e38, 1.17e-38], np.float32)])
    source = """
        uint i = thread_position_in_grid.x;
        b[i] = as_type<ushort>(bfloat(x[i]));
        h[i] = as_type<ushort>(half(x[i]));
        back[i] = float(as_type<bfloat>(b[i])) + float(as_type<half>(h[i]));
    """
    n = len(x)
    b, h, back = run(source, {"x": x}, {"b": ((n,), mx.uint16), "h": ((n,), mx.uint16),
                                       "back": ((n,), mx.float32)}, (n, 1, 1), (64, 1, 1))
    want_b = x.astype(ml_dtypes.bfloat16).view(np.uint16)
    with np.errstate(over="ignore"):
        want_h = x.astype(np.float16).view(np.uint16)
    finite = ~np.isnan(x)
    assert np.array_equal(b[finite], want_b[finite]) and np.array_equal(h[finite], want_h[finite])
    assert np.isnan(b.view(ml_dtypes.bfloat16)[~finite].astype(np.float32)).all()
    want_back = want_b.view(ml_dtypes.bfloat16).astype(np.float32) + want_h.view(np.float16)
    assert np.array_equal(back[finite], want_back.astype(np.float32)[finite])


SIMD_SOURCE = """
    const uint i = thread_position_in_grid.x;
    const uint lane = thread_index_in_simdgroup;
    const float v = x[i];
    const float4 w = float4(v, 2.0f * v, -v, 1.0f) * 0.5f + float4(1.0f);
    out[i * 8 + 0] = simd_sum(v);
    out[i * 8 + 1] = simd_max(v);
    out[i * 8 + 2] = simd_prefix_exclusive_sum(v);
    out[i * 8 + 3] = simd_shuffle_xor(v, 1);
    out[i * 8 + 4] = simd_shuffle_up(v, 1);
    out[i * 8 + 5] = simd_broadcast(v, 3);
    out[i * 8 + 6] = dot(w, float4(1.0f, 2.0f, 3.0f, 4.0f));
    out[i * 8 + 7] = simd_sum(w).y;
    ids[i * 4 + 0] = threads_per_threadgroup.x;
    ids[i * 4 + 1] = thread_index_in_threadgroup;
    ids[i * 4 + 2] = threadgroup_position_in_grid.x;
    ids[i * 4 + 3] = simdgroup_index_in_threadgroup * 32 + lane;
"""


def test_simd_operations_and_partial_threadgroups_follow_metal():
    """80 threads in threadgroups of 64: the second threadgroup is partial (16 threads, one
    half-live simdgroup); simd operations cover the live lanes only."""
    x = np.random.default_rng(1).integers(-50, 50, 80).astype(np.float32)
    out, ids = run(SIMD_SOURCE, {"x": x}, {"out": ((80 * 8,), mx.float32),
                                          "ids": ((80 * 4,), mx.uint32)}, (80, 1, 1), (64, 1, 1))
    out, ids = out.reshape(80, 8), ids.reshape(80, 4)
    for lo, hi in ((0, 32), (32, 64), (64, 80)):
        group = x[lo:hi]
        lanes = np.arange(hi - lo)
        assert (out[lo:hi, 0] == group.sum()).all() and (out[lo:hi, 1] == group.max()).all()
        assert np.array_equal(out[lo:hi, 2], np.concatenate([[0], np.cumsum(group)[:-1]]))
        assert np.array_equal(out[lo:hi, 3], group[lanes ^ 1])
        assert np.array_equal(out[lo:hi, 4], group[np.maximum(lanes - 1, 0)])
        assert (out[lo:hi, 5] == group[3]).all()
        w = np.stack([group, 2 * group, -group, np.ones_like(group)], 1) * 0.5 + 1
        assert np.array_equal(out[lo:hi, 6], (w * [1, 2, 3, 4]).sum(1).astype(np.float32))
        assert (out[lo:hi, 7] == w[:, 1].sum()).all()
    assert np.array_equal(ids[:, 0], [64] * 64 + [16] * 16)
    assert np.array_equal(ids[:, 1], np.r_[0:64, 0:16])
    assert np.array_equal(ids[:, 2], [0] * 64 + [1] * 16)
    assert np.array_equal(ids[:, 3], np.r_[0:64, 0:16])


def test_simdgroup_matrices_and_threadgroup_memory():
    """One simdgroup stages A in threadgroup memory, then D = A B^T + C with 8x8 simdgroup
    matrices (B loaded transposed from device memory)."""
    rng = np.random.default_rng(2)
    a, b, c = (rng.standard_normal((8, 8)).astype(np.float32) for _ in range(3))
    source = """
        threadgroup float staged[64];
        const uint lane = thread_index_in_simdgroup;
        staged[lane] = a[lane];
        staged[lane + 32] = a[lane + 32];
        threadgroup_barrier(mem_flags::mem_threadgroup);
        simdgroup_float8x8 ma, mb, mc;
        simdgroup_load(ma, staged, 8);
        simdgroup_load(mb, b, 8, ulong2(0, 0), true);
        simdgroup_load(mc, c, 8);
        simdgroup_multiply_accumulate(mc, ma, mb, mc);
        simdgroup_store(mc, d, 8);
    """
    [d] = run(source, {"a": a.ravel(), "b": b.ravel(), "c": c.ravel()},
              {"d": ((64,), mx.float32)}, (32, 1, 1), (32, 1, 1))
    want = a.astype(np.float64) @ b.T.astype(np.float64) + c
    assert np.abs(d.reshape(8, 8) - want).max() <= 8 * np.finfo(np.float32).eps * np.abs(want).max()


def test_barrier_in_divergent_control_flow_is_reported():
    source = """
        const uint i = thread_position_in_grid.x;
        if (i < 16) threadgroup_barrier(mem_flags::mem_threadgroup);
        y[i] = 1.0f;
    """
    with pytest.raises(KernelFault, match=r"divergent control flow.*16 of 64 threads arrived"):
        run(source, {"x": np.zeros(64, np.float32)}, {"y": ((64,), mx.float32)}, (64, 1, 1),
            (64, 1, 1))


def test_lanes_at_different_simd_operations_are_reported():
    source = """
        const uint i = thread_position_in_grid.x;
        y[i] = (i % 2) ? simd_sum(x[i]) : simd_max(x[i]);
    """
    with pytest.raises(KernelFault, match="divergent simd operation"):
        run(source, {"x": np.zeros(32, np.float32)}, {"y": ((32,), mx.float32)}, (32, 1, 1),
            (32, 1, 1))


def test_metal_limits_are_checked():
    big = """
        threadgroup float big[8193];  // one float over 32 KiB
        big[thread_position_in_grid.x] = 0.0f;
        y[thread_position_in_grid.x] = x[thread_position_in_grid.x];
    """
    args = ({"x": np.zeros(32, np.float32)}, {"y": ((32,), mx.float32)})
    with pytest.raises(KernelFault, match="threadgroup memory: 32772 bytes.*32768"):
        run(big, *args, (32, 1, 1), (32, 1, 1))
    copy = "y[thread_position_in_grid.x] = x[thread_position_in_grid.x];"
    with pytest.raises(KernelFault, match="at most 1024"):
        run(copy, *args, (32, 1, 1), (32, 33, 1))
    many = {f"x{i}": np.zeros(8, np.float32) for i in range(31)}
    with pytest.raises(EmulatorError, match="32 buffers: Metal allows 31"):
        run("y[0] = " + " + ".join(f"x{i}[0]" for i in range(31)) + ";", many,
            {"y": ((1,), mx.float32)}, (1, 1, 1), (1, 1, 1))


def test_out_of_bounds_and_unwritten_outputs_are_reported():
    args = ({"x": np.zeros(64, np.float32)}, {"y": ((64,), mx.float32)}, (64, 1, 1), (32, 1, 1))
    with pytest.raises(KernelFault, match="AddressSanitizer: heap-buffer-overflow.*kernel.metal"):
        run("uint i = thread_position_in_grid.x; y[i] = x[i + 1];", *args)
    with pytest.raises(KernelFault, match="32 of 64 elements of output 'y' were never written"):
        run("uint i = thread_position_in_grid.x; if (i < 32) y[i] = x[i];", *args)
    # init_value: the caller asked for a filled output, so untouched elements are not a fault
    [y] = run("uint i = thread_position_in_grid.x; if (i < 32) y[i] = x[i];", *args,
              init_value=7.0)
    assert (y[32:] == 7.0).all() and (y[:32] == 0.0).all()


def test_threadgroup_memory_starts_as_nan():
    source = """
        threadgroup float scratch[32];
        y[thread_position_in_grid.x] = scratch[thread_index_in_threadgroup];
    """
    [y] = run(source, {"x": np.zeros(32, np.float32)}, {"y": ((32,), mx.float32)}, (32, 1, 1),
              (32, 1, 1))
    assert np.isnan(y).all()


def test_strict_mode_rejects_address_space_misuse_and_double():
    ok = "uint i = thread_position_in_grid.x; y[i] = x[i];"
    check_strict(_source(ok))
    with pytest.raises(CompileError, match="address space"):
        check_strict(_source("const constant float* p = x; y[0] = p[0];"))
    with pytest.raises(CompileError, match="metal_has_no_double"):
        check_strict(_source("double d = x[0]; y[0] = float(d);"))


def _source(body):
    spec = KernelSpec("strict", ("x",), ("y",), body)
    return ASAN(spec).source([mx.zeros((64,))], dict(
        template=[], grid=(64, 1, 1), threadgroup=(32, 1, 1), output_shapes=[(64,)],
        output_dtypes=[mx.float32]))


def test_compile_cache_reuses_binaries(monkeypatch, tmp_path):
    monkeypatch.setenv(toolchain.CACHE_ENV, str(tmp_path))
    source = _source("uint i = thread_position_in_grid.x; y[i] = 2.0f * x[i];")
    first = toolchain.build(source, "fast")
    assert first.parent == tmp_path and first.exists()
    monkeypatch.setattr(toolchain, "_compile", lambda *a: pytest.fail("compiled again"))
    assert toolchain.build(source, "fast") == first


def test_a_missing_compiler_is_a_clear_error(monkeypatch):
    monkeypatch.setenv(toolchain.CXX_ENV, "no-such-c++-compiler")
    toolchain.compiler.cache_clear()
    try:
        with pytest.raises(CompilerMissing, match="needs a C\\+\\+17 compiler.*apt-get install g"):
            toolchain.build(_source("y[0] = x[0];"), "fast")
    finally:
        toolchain.compiler.cache_clear()


@pytest.mark.slow
def test_threadsanitizer_sees_a_missing_barrier():
    """Thread 0 publishes through threadgroup memory; without a barrier the others' reads race
    with its write. With the barrier the same kernel is clean."""
    body = """
        threadgroup float shared[1];
        const uint t = thread_index_in_threadgroup;
        if (t == 0) shared[0] = x[0];
        {BARRIER}
        y[thread_position_in_grid.x] = shared[0];
    """
    args = ({"x": np.ones(64, np.float32)}, {"y": ((64,), mx.float32)}, (64, 1, 1), (64, 1, 1))
    tsan = Emulator("tsan")
    [y] = run(body.replace("{BARRIER}", "threadgroup_barrier(mem_flags::mem_threadgroup);"),
              *args, emulator=tsan)
    assert (y == 1.0).all()
    with pytest.raises(KernelFault, match="ThreadSanitizer: data race"):
        run(body.replace("{BARRIER}", ""), *args, emulator=tsan)
