"""Kipp's CPU matmul (kipp/cuda/cpu/matmul.*): kernel vs jax.numpy twin vs numpy in float64,
row independence (bitwise), the panel layout, the build's failure path, and the backend's
choice of layout.

Bound: the kernel accumulates in float32 over K, so against float64 its error is a few float32
ulps of the row's scale; measured max |err| / max |y| 3.7e-7 .. 2.9e-6 for K up to 1,024; the
gate is 1e-5 (the twin, XLA's float32 dot, sits in the same range).
"""

import platform

import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402

from kipp.cuda.cpu import matmul as cpu_matmul  # noqa: E402

BOUND = 1e-5

# Without a compiler the kernel tests skip (saying why); the fallback tests below still run.
needs_kernel = pytest.mark.skipif(not cpu_matmul.available()[0],
                                  reason=f"Kipp's CPU matmul: {cpu_matmul.available()[1]}")


def _case(rng, m, n, k):
    return rng.standard_normal((n, k)).astype(np.float32), \
        rng.standard_normal((m, k)).astype(np.float32)


def _rel(got, want):
    return float(np.max(np.abs(np.asarray(got, np.float64) - want)) / np.max(np.abs(want)))


@needs_kernel
@pytest.mark.parametrize("m,n,k", [(1, 8, 1), (1, 200, 64), (2, 40, 96), (3, 72, 33),
                                   (5, 24, 130), (8, 1024, 256), (9, 136, 64), (17, 64, 100),
                                   (64, 96, 48)])
def test_kernel_matches_twin_and_numpy(m, n, k):
    """Row counts on every tile shape (1..8 rows, the 6 x 2 prefill tiles past 8), panel counts
    that leave partial units and partial tile widths."""
    w, x = _case(np.random.default_rng(m * 1000 + n), m, n, k)
    panels = cpu_matmul.pack(w)
    want = x.astype(np.float64) @ w.T.astype(np.float64)
    got = jax.jit(cpu_matmul.matmul)(x, panels)
    twin = jax.jit(cpu_matmul.matmul_reference)(x, panels)
    assert got.shape == (m, n) and got.dtype == jnp.float32
    assert _rel(got, want) <= BOUND and _rel(twin, want) <= BOUND


@needs_kernel
def test_each_row_is_bitwise_the_same_alone_or_batched():
    """One FMA chain per output whatever the tile: a batched decode row equals its isolated
    step exactly, for every batch size the scheduler makes."""
    w, x = _case(np.random.default_rng(7), 20, 264, 200)
    panels = cpu_matmul.pack(w)
    call = jax.jit(cpu_matmul.matmul)
    alone = np.stack([np.asarray(call(x[i:i + 1], panels))[0] for i in range(len(x))])
    for m in (2, 3, 4, 5, 6, 7, 8, 9, 13, 20):
        batched = np.asarray(call(x[:m], panels))
        assert np.array_equal(batched.view(np.uint32), alone[:m].view(np.uint32)), m


def test_panel_layout_roundtrip_and_row_lookup():
    w = np.arange(24 * 5, dtype=np.float32).reshape(24, 5)
    panels = cpu_matmul.pack(w)
    assert panels.shape == (3, 5, 8) and panels[1, 2, 3] == w[11, 2]
    assert np.array_equal(cpu_matmul.unpack(panels), w)
    rows = cpu_matmul.rows(jnp.asarray(panels), jnp.asarray([0, 11, 23, 11]))
    assert np.array_equal(np.asarray(rows), w[[0, 11, 23, 11]])
    with pytest.raises(ValueError, match="multiple of 8"):
        cpu_matmul.pack(np.zeros((12, 4), np.float32))


def test_build_without_a_compiler_says_what_is_missing(monkeypatch, tmp_path):
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    monkeypatch.setattr(cpu_matmul, "COMPILERS", ())
    with pytest.raises(RuntimeError, match=r"no C\+\+ compiler found"):
        cpu_matmul.build(tmp_path)


def test_a_failed_compile_names_the_error(monkeypatch, tmp_path):
    broken = tmp_path / "broken.cc"
    broken.write_text("this is not C++\n")
    monkeypatch.setattr(cpu_matmul, "SOURCES", (broken,))
    if not cpu_matmul.available()[0]:
        pytest.skip("no compiler")
    with pytest.raises(RuntimeError, match="failed"):
        cpu_matmul.build(tmp_path)
    assert not list(tmp_path.glob("*.so"))


def test_switch_off_and_backend_layout(monkeypatch, artifacts):
    from kipp.cuda.backend import JaxBackend
    from kipp.formats.artifact import open_artifact

    artifact = open_artifact(artifacts("kipp-synthetic/qwen3-tiny", "bf16"))
    monkeypatch.setenv(cpu_matmul.ENV, "0")
    assert cpu_matmul.available() == (False, f"{cpu_matmul.ENV}=0 turns it off")
    off = JaxBackend(artifact, 4, weight_memory="float32")
    assert off.layout == "f32" and "f32 weights" in off.describe()
    with pytest.raises(Exception, match="panels weight layout needs"):
        JaxBackend(artifact, 4, weight_layout="panels")
    monkeypatch.delenv(cpu_matmul.ENV)
    if cpu_matmul.available()[0]:
        on = JaxBackend(artifact, 4, weight_memory="float32")
        assert on.layout == "panels" and "Kipp CPU matmul" in on.describe()
        assert on.weight_bytes == off.weight_bytes  # the same float32 values, repacked


@needs_kernel
def test_a_stacked_weight_is_read_at_its_layer():
    """The scanned step passes a weight stacked over layers, [L, N/8, K, 8], and a traced layer
    index: bitwise what each layer's own panels give."""
    rng = np.random.default_rng(9)
    stack = np.stack([cpu_matmul.pack(rng.standard_normal((24, 40)).astype(np.float32))
                      for _ in range(3)])
    x = rng.standard_normal((5, 40)).astype(np.float32)
    stacked = jax.jit(lambda i: cpu_matmul.matmul(x, stack, i))
    for i in range(3):
        assert np.array_equal(np.asarray(stacked(jnp.int32(i))),
                              np.asarray(jax.jit(cpu_matmul.matmul)(x, stack[i]))), i
    with pytest.raises(Exception, match="kipp_cpu_matmul: layer out of range"):
        jax.block_until_ready(stacked(jnp.int32(3)))


def test_the_build_is_the_widest_set_the_cpu_reports():
    """cpu_isa() (the CPU's own answer, isa.cc) against the kernel's flags in /proc/cpuinfo, and
    the library loaded is that build."""
    from pathlib import Path

    cpuinfo = Path("/proc/cpuinfo")
    if platform.machine() not in ("x86_64", "AMD64") or not cpuinfo.is_file():
        pytest.skip("x86 Linux")
    if not cpu_matmul.available()[0]:
        pytest.skip(cpu_matmul.available()[1])
    line = next(x for x in cpuinfo.read_text().splitlines() if x.startswith("flags"))
    flags = set(line.split(":", 1)[1].split())
    avx512 = {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni"}
    if avx512 | {"amx_tile", "amx_bf16", "avx512_bf16"} <= flags:
        want = cpu_matmul.Isa.AMX  # Linux lists AMX only where it hands out the tile state
    elif avx512 <= flags:
        want = cpu_matmul.Isa.AVX512_VNNI
    elif {"avx2", "fma", "f16c"} <= flags:
        want = cpu_matmul.Isa.AVX2
    else:
        want = cpu_matmul.Isa.PORTABLE
    assert cpu_matmul.cpu_isa() is want
    assert cpu_matmul.available()[1].startswith(f"built for {want.value} at ")
    assert cpu_matmul.cpu_has_avx512_bf16() is ("avx512_bf16" in flags)  # the BF16 dot's check


def test_a_narrower_build_is_chosen_by_name(monkeypatch):
    """$KIPP_CPU_ISA picks a build no wider than the CPU's; a wider one, or a name that is
    none, is an error naming the variable."""
    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("x86 builds")
    widest = cpu_matmul.widest_isa()
    monkeypatch.setenv(cpu_matmul.ISA_ENV, "portable")
    assert cpu_matmul.cpu_isa() is cpu_matmul.Isa.PORTABLE
    monkeypatch.setenv(cpu_matmul.ISA_ENV, "avx1024")
    with pytest.raises(RuntimeError, match="KIPP_CPU_ISA='avx1024': expected one of amx, "):
        cpu_matmul.cpu_isa()
    if widest is not cpu_matmul.Isa.AMX:
        monkeypatch.setenv(cpu_matmul.ISA_ENV, "amx")
        with pytest.raises(RuntimeError, match=f"this CPU runs at most {widest.value}"):
            cpu_matmul.cpu_isa()


def test_a_failed_amx_build_falls_back_to_avx512(monkeypatch, caplog):
    """A compiler that rejects the AMX flags leaves the AVX-512 build, with a warning, not the
    backend without Kipp's kernels."""
    if cpu_matmul.widest_isa() is not cpu_matmul.Isa.AMX:
        pytest.skip("a CPU with AMX")
    real = cpu_matmul.build

    def build(directory=None, extra_flags=(), isa=None):
        if isa is cpu_matmul.Isa.AMX:
            raise RuntimeError("c++: error: unrecognized command-line option '-mamx-tile'")
        return real(directory, extra_flags, isa)

    monkeypatch.setattr(cpu_matmul, "build", build)
    chosen, path = cpu_matmul._chosen_build()
    assert chosen is cpu_matmul.Isa.AVX512_VNNI and path.is_file()
    assert "the AMX build failed (c++: error: unrecognized" in caplog.text
