"""The CUDA path compiled for an H200 (sm_90a) on this machine, without a GPU (kipp.cuda.aot).

Every Pallas kernel in every weight format and KV scheme at the shapes of every registry
checkpoint (kipp.cuda.pallas.kernel_shapes), and the whole step with kernels on, go through Triton's
GPU passes and ptxas as on the GPU machine; each kernel must also be free of register spills
(ptxas -v), fit the H200's shared memory, and run its multi-row dots on the tensor cores (BF16
`wgmma`/`mma` in its PTX) while one-row matvecs stay on the CUDA cores. A kernel over the
shared-memory limit must fail here as it would there. The default run compiles the 0.6B
shapes; the other checkpoints' shapes, the other steps and the sharded steps are marked slow
(.ci/run runs them). A table of every kernel compiled is printed at the end of the run.
"""

import functools

import numpy as np
import pytest

jax = pytest.importorskip("jax")

from kipp.cuda import aot  # noqa: E402  (before JAX starts: kipp.cuda.aot.host_setup)

REASON = aot.unavailable_reason()
pytestmark = pytest.mark.skipif(REASON is not None, reason=f"no H200 compile here: {REASON}")

import jax.numpy as jnp  # noqa: E402

from kipp.cuda import forward, sharding  # noqa: E402
from kipp.cuda.pallas import kernel_shapes
from kipp.formats import registry  # noqa: E402

SHARED_MEMORY_LIMIT = 232448  # bytes per block, opt-in (aot.H200_TARGET_CONFIG)
COMPILED: list[tuple[str, str]] = []  # (case id, outcome): printed by conftest at the end


def _default(case) -> bool:
    """0.6B's two extreme projections (gate/up: widest N, down: longest K), its head at one
    row, and its attention (16 heads): the default run; everything else is slow."""
    if case.kernel == "matmul":
        where = case.where.split(" ")
        if "0.6B" not in where[1].split(","):
            return False
        return where[0] in ("gate/up", "down") or (where[0] == "head" and "M=1 " in case.shape)
    return "H=16" in case.shape


def _params(cases):
    return [pytest.param(c, id=c.id, marks=() if _default(c) else pytest.mark.slow)
            for c in cases]


@pytest.mark.parametrize("case", _params(kernel_shapes.all_cases()))
def test_kernel_compiles_for_h200(case):
    fn, args = case.build()
    try:
        build = aot.compile_for_h200(fn, *args)
    except Exception as e:
        COMPILED.append((case.id, f"FAILED {type(e).__name__}"))
        raise
    [kernel] = build.kernels
    COMPILED.append((case.id, _summary(kernel, build.seconds)))
    assert kernel.name.startswith("kipp_"), kernel
    assert kernel.spill_stores == kernel.spill_loads == kernel.stack == 0, kernel
    assert kernel.shared_memory <= SHARED_MEMORY_LIMIT, kernel
    if case.kernel == "matmul" and case.shape.startswith("M=1 "):
        assert not kernel.mma, f"one-row matvec on the tensor cores: {kernel}"
    else:
        assert set(kernel.mma) <= {"wgmma.bf16", "mma.bf16"} and kernel.mma, kernel


def _summary(k, seconds) -> str:
    tensor = ",".join(f"{n}x{c}" for n, c in k.mma.items()) or "CUDA cores"
    return (f"ok {seconds:5.1f} s  {k.registers:3d} regs  spill {k.spills} B  "
            f"smem {k.shared_memory // 1024} KiB  {tensor}")


def _mm_kernel(a_ref, b_ref, o_ref):
    o_ref[...] = jnp.dot(a_ref[...], b_ref[...], preferred_element_type=jnp.float32)


def _tiled_matmul(block: int, k: int, grid: int = 2, warps: int = 4, dtype=jnp.float32):
    """a [grid * block, k] @ b [k, grid * block] with whole-K tiles of `block` rows and
    columns, on `warps` warps."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as pltriton

    size = grid * block

    def f(a, b):
        return pl.pallas_call(
            _mm_kernel, out_shape=jax.ShapeDtypeStruct((size, size), jnp.float32),
            grid=(grid, grid), in_specs=[pl.BlockSpec((block, k), lambda i, j: (i, 0)),
                                         pl.BlockSpec((k, block), lambda i, j: (0, j))],
            out_specs=pl.BlockSpec((block, block), lambda i, j: (i, j)),
            compiler_params=pltriton.CompilerParams(num_warps=warps, num_stages=1))(a, b)

    S = jax.ShapeDtypeStruct
    return f, (S((size, k), dtype), S((k, size), dtype))


def test_kernel_over_the_shared_memory_limit_fails():
    """Negative control: 64 x 2048 float32 tiles of A and B need 512 KiB of shared memory, over
    the H200's 227 KiB; the same kernel with 64 x 64 tiles compiles (so the failure is the
    limit, nothing else)."""
    fn, args = _tiled_matmul(64, 64)
    assert aot.compile_for_h200(fn, *args).kernels
    fn, args = _tiled_matmul(64, 2048)
    with pytest.raises(Exception, match="[Ss]hared memory size limit exceeded"):
        aot.compile_for_h200(fn, *args)


def test_spilling_kernel_is_reported():
    """Negative control of the spill check: a 128 x 128 float32 accumulator on one warp (512
    values per thread) cannot live in 255 registers, and the report must say so."""
    fn, args = _tiled_matmul(128, 16, grid=1, warps=1, dtype=jnp.bfloat16)
    [kernel] = aot.compile_for_h200(fn, *args).kernels
    assert kernel.spill_stores > 0 and kernel.spill_loads > 0 and kernel.stack > 0, kernel
    assert kernel.mma == {"mma.bf16": kernel.mma["mma.bf16"]}  # BF16 tensor-core dots seen


STEP_ROUNDS = {"prefill": dict(tokens=512, seqs=1, queries=512),  # one 512-token chunk
               "decode": dict(tokens=8, seqs=8, queries=1)}  # 8 sequences, one token each


def _step_params():
    """Every weight scheme at 0.6B and 4B, each in one round kind (prefill for bf16 and scale4,
    decode for q8_0 and affine4: each size runs both attention kernels and both dot tilings),
    plus the q8_0 KV slab in both; every kernel shape alone is test_kernel_compiles_for_h200's."""
    cases = []
    for size in ("0.6B", "4B"):
        for scheme in kernel_shapes.WEIGHT_FORMATS:
            round_ = "prefill" if scheme in ("bf16", "scale4_gs32") else "decode"
            cases.append((size, scheme, "bf16", round_))
    cases += [("0.6B", "q8_0", "q8_0", "prefill"), ("0.6B", "q8_0", "q8_0", "decode")]
    # all in CI's H200 compile step: even the cheapest whole step is among the default suite's
    # longest tests
    return [pytest.param(*c, id="-".join(c[:2]) + f"-kv_{c[2]}-{c[3]}", marks=pytest.mark.slow)
            for c in cases]


@pytest.mark.parametrize("size,scheme,kv_scheme,round_", _step_params())
def test_whole_step_with_kernels_compiles_for_h200(size, scheme, kv_scheme, round_):
    """forward.step with the Pallas kernels, every layer, at the checkpoint's real shapes."""
    entry = registry.get(f"Qwen/Qwen3-{size}")
    specs = kernel_shapes.step_specs(entry, scheme, kv_scheme, **STEP_ROUNDS[round_])
    step = jax.jit(functools.partial(forward.step, ops=forward.Ops(kernels=True)),
                   donate_argnums=(1,))
    build = aot.compile_for_h200(step, *specs)
    attention = "kipp_prefill_attention" if round_ == "prefill" else "kipp_decode_attention"
    names = {k.name for k in build.kernels}
    assert {attention, f"kipp_matmul_{scheme}", "kipp_matmul_bf16"} <= names, names
    assert all(k.spills == 0 and k.stack == 0 for k in build.kernels), build.kernels
    COMPILED.append((f"step {size} {scheme} kv {kv_scheme} {round_}",
                     f"ok {build.seconds:5.1f} s  {len(build.kernels)} Pallas kernels"))


@pytest.mark.slow
@pytest.mark.parametrize("devices", [2, 8])
def test_sharded_step_compiles_for_h200_mesh(devices):
    """The tensor-parallel step (kipp.cuda.sharding; JaxBackend runs it with the twins) on an
    abstract node of 2 and 8 H200s, at 4B's shapes (32 query heads over 8 KV heads)."""
    entry = registry.get("Qwen/Qwen3-4B")
    params, kv, rope, arrays = kernel_shapes.step_specs(entry, "q8_0", **STEP_ROUNDS["decode"])
    mesh = jax.sharding.Mesh(np.array(aot.devices(devices)), (sharding.AXIS,))

    def put(a, where):
        return jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=where)

    params = jax.tree.map(put, params, sharding.param_shardings(params, mesh))
    kv = jax.tree.map(lambda a: put(a, sharding.kv_sharding(mesh)), kv)
    rope, arrays = jax.tree.map(lambda a: put(a, sharding.replicated(mesh)), (rope, arrays))
    step = jax.jit(functools.partial(forward.step, ops=forward.Ops()), donate_argnums=(1,))
    build = aot.compile_for_h200(step, params, kv, rope, arrays, report=False)
    hlo = build.compiled.as_text()
    assert "all-reduce" in hlo  # the row-parallel projections' partial sums meet
    q = build.compiled.input_shardings[0][0]["layers"][0]["q"].w
    assert q.shard_shape((entry.attention_width, entry.hidden))[0] * devices == \
        entry.attention_width
    COMPILED.append((f"sharded step 4B q8_0 decode on {devices} H200s",
                     f"ok {build.seconds:5.1f} s"))
