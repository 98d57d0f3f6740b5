"""weight_memory: twins that fit where the kernels fit (kipp.memory and the two backends).

"stored" keeps the artifact's format (BF16 widened per chunk inside each matmul), "float32"
widens once at load, "auto" is "stored" on a GPU and where Kipp's stored CPU matmul runs, else
"float32" on a CPU when the copy fits the budget. Both modes are gated against the reference;
the choice and its reason are in describe(). Peak RSS and decode speed of both at the 0.6B
shape are bench records.
"""

import subprocess
import sys

import numpy as np
import pytest

from kipp import gates, memory
from kipp.errors import KippError
from kipp.formats.artifact import open_artifact
from kipp.reference.backend import ReferenceBackend

TINY = "kipp-synthetic/qwen3-tiny"
UNTIED = "kipp-synthetic/qwen3-tiny-untied"
BLOCKS = 12


def _gate(ref, backend, prompt_len=30, decode_steps=3, rows=4):
    table = np.random.default_rng(0).permutation(BLOCKS)[:3]
    tokens = tuple(int(t) for t in np.random.default_rng(2).integers(0, 151_643, prompt_len))
    result = gates.gate_backends(ref, backend, tokens, table, logits_rows=rows,
                                 decode_steps=decode_steps)  # the backend's calibrated bound
    assert result.passed, result.detail


def test_choice(monkeypatch):
    assert memory.choose_weight_memory("auto", gpu=True, float32_bytes=1).mode == "stored"
    with pytest.raises(KippError, match="float32' is a CPU layout"):
        memory.choose_weight_memory("float32", gpu=True, float32_bytes=1)
    monkeypatch.setattr(memory, "weight_budget", lambda: 2 * 2**30)
    fits = memory.choose_weight_memory("auto", gpu=False, float32_bytes=2**30)
    assert fits.mode == "float32" and "fits the budget (2.0 GiB" in fits.reason
    big = memory.choose_weight_memory("auto", gpu=False, float32_bytes=3 * 2**30)
    assert big.mode == "stored" and "would exceed the budget" in big.reason
    assert memory.choose_weight_memory("float32", gpu=False, float32_bytes=3 * 2**30).mode == \
        "float32"  # an explicit request wins
    kernel = memory.choose_weight_memory("auto", gpu=False, float32_bytes=2**30,
                                         stored_kernel=True)  # fits, but buys no speed
    assert kernel.mode == "stored" and "stored CPU matmul" in kernel.reason
    assert memory.choose_weight_memory("float32", gpu=False, float32_bytes=1,
                                       stored_kernel=True).mode == "float32"
    with pytest.raises(KippError, match="unknown weight_memory 'half'"):
        memory.choose_weight_memory("half", gpu=False, float32_bytes=1)
    assert 0 < memory.weight_budget() < memory.available_bytes()


def _rss_file_kib() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("RssFile:"))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
def test_release_drops_mapped_pages_and_keeps_the_data(artifacts):
    rss_file_kib = _rss_file_kib
    artifact = open_artifact(artifacts(TINY, "bf16"))
    table = artifact.weights.token_embd  # 151,936 x 256 BF16: 74 MiB
    before = float(table.bf16()[::97].astype(np.float32).sum())
    touched = rss_file_kib()
    assert int(table.raw.sum(dtype=np.uint64)) > 0  # every page resident
    resident = rss_file_kib()
    artifact.release(table)
    released = rss_file_kib()
    assert resident - released > 60 * 1024, (touched, resident, released)
    assert float(table.bf16()[::97].astype(np.float32).sum()) == before  # read back unchanged


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
def test_mlx_head_pages_go_as_they_are_copied(artifacts):
    """The stored twin of the head copies its rows chunk by chunk and releases each chunk's
    mapped pages at once, so the file's copy of the head is never resident beside the twin's
    (planted: no release, the whole 74 MiB head resident by the last chunk)."""
    pytest.importorskip("mlx.core")
    from kipp.apple import layout

    artifact = open_artifact(artifacts(TINY, "bf16"))
    head = artifact.weights.output  # tied: the 151,936 x 256 embedding, 74 MiB
    artifact.release(head)
    base = _rss_file_kib()
    resident = []

    def release(rows):
        assert np.shares_memory(rows, head.raw)  # the mapping's own rows, not a copy
        resident.append(_rss_file_kib() - base)  # this chunk still resident
        artifact.release_view(rows)

    twin = layout.prepare_twin([head], 2, True, release)
    chunk_kib = layout.CHUNK_ELEMENTS * 2 // 1024  # BF16 rows per chunk
    # a chunk and its neighbour's fault-around pages (more of them where another process has
    # the file cached); without the release the head grows to 74 MiB, 9 chunks
    assert len(resident) >= 8 and max(resident) < 3 * chunk_kib, (resident, chunk_kib)
    assert twin.rows == head.shape[0]
    artifact.release_view(np.zeros(4096))  # not the mapping's: nothing to drop


# ---- MLX ---------------------------------------------------------------------------------


@pytest.mark.parametrize("checkpoint_id, scheme", [(TINY, "bf16"), (UNTIED, "q8_0")])
def test_mlx_stored_twins_match_reference(artifacts, checkpoint_id, scheme):
    pytest.importorskip("mlx.core")
    from kipp.apple.backend import MLXBackend

    artifact = open_artifact(artifacts(checkpoint_id, scheme))
    stored = MLXBackend(artifact, BLOCKS, weight_memory="stored")
    described = stored.describe()
    assert stored.memory.mode == "stored" and "requested" in described
    assert ("bf16 weights as stored" if scheme == "bf16" else "bf16 as stored head") in described
    _gate(ReferenceBackend(artifact, BLOCKS), stored)
    wide = MLXBackend(artifact, BLOCKS, weight_memory="float32")
    head = artifact.weights.output.shape[0] * artifact.weights.output.shape[1]
    assert wide.weight_bytes - stored.weight_bytes >= 2 * head  # the head widened: 4 vs 2 B


def test_mlx_auto_follows_the_budget(artifacts, monkeypatch):
    pytest.importorskip("mlx.core")
    from kipp.apple.backend import MLXBackend

    artifact = open_artifact(artifacts(TINY, "bf16"))
    monkeypatch.setattr(memory, "weight_budget", lambda: 2**40)
    assert MLXBackend(artifact, 2).memory.mode == "float32"
    monkeypatch.setattr(memory, "weight_budget", lambda: 2**20)
    mb = MLXBackend(artifact, 2)
    assert mb.memory.mode == "stored" and "would exceed the budget" in mb.describe()


@pytest.mark.parametrize("fmt", ["bf16", "q8_0", "affine4_gs32", "scale4_gs32"])
def test_mlx_planes_twin_is_the_numpy_dequantizer(fmt):
    """The per-kernel fallback on Metal multiplies the kernels' own planes, chunked: equal
    to x @ dequantize(W)^T in float64 within float32 summation noise, whatever the chunk."""
    mx = pytest.importorskip("mlx.core")
    from kipp.apple import linear
    from kipp.apple import probe as mlx_probe
    from kipp.formats import quant

    w = mlx_probe.probe_weight(fmt, np.random.default_rng(3))  # the same draw as `raw`
    raw = quant.quantize((np.random.default_rng(3).standard_normal((64, 256)) * 0.05)
                         .astype(np.float32), fmt)
    dense = quant.dequantize(raw, fmt, 256).astype(np.float64)
    x = np.random.default_rng(4).standard_normal((5, 256)).astype(np.float32)
    want = x.astype(np.float64) @ dense.T
    for chunk in (linear.CHUNK_ELEMENTS, 256 * 7):  # one chunk; ragged chunks of 7 rows
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(linear, "CHUNK_ELEMENTS", chunk)
            got = np.array(linear.planes_twin(mx.array(x), w))
        assert gates.nmse(got, want) <= 1e-12


# ---- JAX ---------------------------------------------------------------------------------


def test_jax_weight_memory(artifacts, monkeypatch):
    pytest.importorskip("jax")
    from kipp.cuda.backend import LEAN_CPU_COMPILE, JaxBackend
    from kipp.cuda.cpu import matmul as cpu_matmul
    from kipp.cuda.cpu import stored_matmul

    artifact = open_artifact(artifacts(UNTIED, "bf16"))
    # auto on one CPU: stored where Kipp's stored CPU matmul runs, whatever the budget
    kernel = stored_matmul.available()[0]
    assert JaxBackend(artifact, 2).layout == ("device" if kernel else "panels"
                                              if cpu_matmul.available()[0] else "f32")
    monkeypatch.setattr(memory, "weight_budget", lambda: 2**20)
    stored = JaxBackend(artifact, BLOCKS)
    assert stored.layout == "device" and ("stored CPU matmul reads" if kernel else
                                          "would exceed the budget") in stored.describe()
    _gate(ReferenceBackend(artifact, BLOCKS), stored)
    wide = JaxBackend(artifact, BLOCKS, weight_memory="float32")
    # float32 on one CPU device: Kipp's CPU matmul panels where it builds, else plain float32
    panels = "panels" if cpu_matmul.available()[0] else "f32"
    assert wide.layout == panels and wide.weight_bytes > 1.9 * stored.weight_bytes
    # stored on a CPU compiles lean (test_jax_stored_steps_compile_lean_and_compute_the_same)
    assert stored.compiler_options == LEAN_CPU_COMPILE and wide.compiler_options == {}
    assert JaxBackend(artifact, 2, weight_layout="device").memory.mode == "stored"


def test_jax_stored_steps_compile_lean_and_compute_the_same(artifacts, monkeypatch):
    """Stored weights on a CPU (the choice for memory) compile their steps with
    LEAN_CPU_COMPILE, XLA's older CPU fusion code generator, where this jaxlib has it (far less
    compiler scratch; the bench's weight-memory records measure it): the logits are bitwise
    those of the default compile, for a prefill round and a decode round."""
    pytest.importorskip("jax")
    from kipp.backend import EvalItem
    from kipp.cuda import backend as jb

    artifact = open_artifact(artifacts(UNTIED, "bf16"))
    lean = jb.JaxBackend(artifact, BLOCKS, weight_memory="stored")
    assert lean.compiler_options == jb.LEAN_CPU_COMPILE
    monkeypatch.setattr(jb, "LEAN_CPU_COMPILE", {})
    plain = jb.JaxBackend(artifact, BLOCKS, weight_memory="stored")
    prompt = tuple(int(t) for t in np.random.default_rng(5).integers(0, 151_643, 20))
    rounds = [[EvalItem(prompt, 0, (3, 1), 4)], [EvalItem((77,), 20, (3, 1))]]
    runs = [[backend.eval(items) for items in rounds] for backend in (lean, plain)]
    for got, want in zip(*runs):
        assert all(np.array_equal(g, w) for g, w in zip(got, want))
    # compiled for itself: the options are part of the shared program cache's key (lean's
    # programs may come from that cache, compiled by an earlier stored backend)
    assert plain.compile_log


def test_compile_drops_an_option_the_jaxlib_lacks(monkeypatch, caplog):
    """An XLA option this jaxlib does not know (jax 0.11 dropped LEAN_CPU_COMPILE's) is logged
    once and left out; any other compile error is raised."""
    jax = pytest.importorskip("jax")
    from kipp.cuda import backend as jb

    monkeypatch.setattr(jb, "_UNKNOWN_OPTIONS", set())
    lowered = jax.jit(lambda x: x * 2.0 + 1.0).lower(np.ones(4, np.float32))
    with caplog.at_level("INFO", logger="kipp.cuda"):
        program = jb._compile_with(lowered, {"xla_cpu_kipp_no_such_option": True})
        jb._compile_with(lowered, {"xla_cpu_kipp_no_such_option": True})
    assert np.array_equal(np.asarray(program(np.ones(4, np.float32))), np.full(4, 3.0))
    assert jb._UNKNOWN_OPTIONS == {"xla_cpu_kipp_no_such_option"}
    assert caplog.text.count("no compiler option xla_cpu_kipp_no_such_option") == 1
    with pytest.raises(Exception, match="xla_cpu_parallel_codegen_split_count"):
        jb._compile_with(lowered, {"xla_cpu_parallel_codegen_split_count": "many"})


@pytest.mark.parametrize("weight_memory", ["stored", "float32"])
def test_jax_stacked_layers_are_placed_without_a_copy(artifacts, monkeypatch, weight_memory):
    """The CPU twins' stored and panel layouts stack each layer tensor in a host array that
    becomes the device array itself (XLA's CPU aliases a 64-byte aligned buffer): the weights
    are resident once, not as a host stack plus its copy."""
    jax = pytest.importorskip("jax")
    from kipp.cuda import layout
    from kipp.cuda.backend import JaxBackend

    stacks = []
    made = layout._aligned_empty

    def recorded(*args, **kwargs):
        stacks.append(made(*args, **kwargs))
        return stacks[-1]

    monkeypatch.setattr(layout, "_aligned_empty", recorded)
    jb = JaxBackend(open_artifact(artifacts(UNTIED, "q8_0")), BLOCKS,
                    weight_memory=weight_memory)
    if weight_memory == "float32" and jb.layout != "panels":
        pytest.skip("no Kipp CPU matmul here: the float32 layout is not stacked")
    assert jb.stacked
    placed = jax.tree.leaves(jb.params["layers"])
    # q8_0 projections: w and d each (panels: w); four norms
    assert len(placed) == 7 * (2 if weight_memory == "stored" else 1) + 4
    assert all(a.shape[0] == jb.entry.layers for a in placed)
    # each placed stack is one of the host arrays made for it (the embedding's and head's own
    # copies, kipp.cuda.layout.to_device, are made there too)
    assert ({(a.unsafe_buffer_pointer(), a.shape) for a in placed}
            <= {(a.ctypes.data, a.shape) for a in stacks})


@pytest.mark.parametrize("weight_memory", ["stored", "float32"])
def test_jax_weights_are_never_the_artifact_files_pages(artifacts, weight_memory):
    """XLA's CPU takes an aligned numpy buffer as the device array itself, whatever device_put
    is told: a placed tensor that was a view of the file mapping (the stored embedding, head and
    norms) would be the file's pages. Every placed array lies outside the mapping."""
    jax = pytest.importorskip("jax")
    from kipp.cuda.backend import JaxBackend

    artifact = open_artifact(artifacts(UNTIED, "bf16"))
    jb = JaxBackend(artifact, BLOCKS, weight_memory=weight_memory)
    mapping = artifact.file.mapping
    start, stop = mapping.ctypes.data, mapping.ctypes.data + mapping.nbytes
    inside = [a.shape for a in jax.tree.leaves(jb.params)
              if start <= a.unsafe_buffer_pointer() < stop]
    assert not inside, f"placed arrays in the artifact's mapping: {inside}"


def _mapped_rss_kib(path) -> int:
    """This process's resident KiB of the mappings of `path` (/proc/self/smaps)."""
    total, inside = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            fields = line.split()
            if "-" in fields[0] and len(fields) >= 5:  # a mapping's first line
                inside = len(fields) == 6 and fields[5] == str(path)
            elif inside and fields[0] == "Rss:":
                total += int(fields[1])
    return total


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/smaps")
def test_a_jax_load_leaves_none_of_the_file_resident(artifacts):
    """Once the JAX backend has its copies, no page of the artifact's mapping is in the
    process's resident set: not the header (parsed into objects by the reader) and not pages a
    later copy's faults mapped around its own tensor, in a tensor already released (planted:
    without the reader's header release 5,824 KiB stay, without the final release of the
    whole file 744 KiB)."""
    pytest.importorskip("jax")
    from kipp.cuda.backend import JaxBackend

    path = artifacts(UNTIED, "bf16")
    artifact = open_artifact(path)
    assert _mapped_rss_kib(artifact.path.resolve()) < 64  # the header, gone already
    JaxBackend(artifact, BLOCKS, weight_memory="stored")
    assert _mapped_rss_kib(artifact.path.resolve()) == 0


@pytest.mark.parametrize("checkpoint_id", [TINY, UNTIED])
@pytest.mark.parametrize("weight_layout", ["f32", "device"])
def test_jax_placement_holds_one_packed_tensor_at_a_time(artifacts, checkpoint_id,
                                                          weight_layout):
    """place_weights hands each packed tensor to `place` and keeps no host copy of it: when a
    tensor is placed, every host array placed before it is gone (a packed value held in a local
    until the end once kept the 0.6B's tied float32 head, 594 MiB, beside every layer)."""
    import weakref

    pytest.importorskip("jax")
    import jax

    from kipp.cuda import layout

    alive = []

    def place(name, value):  # numpy arrays hold no cycles: the last reference frees them
        held = [name for name, ref in alive if ref() is not None]
        assert not held, f"placing {name}: the host copies of {held} are still alive"
        if name not in layout.NORMS + ("output_norm",):  # norms: the file's own F32 rows
            alive.extend((name, weakref.ref(a)) for a in jax.tree.leaves(value))
        return jax.tree.map(np.copy, value)

    tree = layout.place_weights(open_artifact(artifacts(checkpoint_id, "bf16")), weight_layout,
                                place)
    assert len(alive) == 1 + (checkpoint_id == UNTIED) + 7 * len(tree["layers"])


def test_load_passes_weight_memory(artifacts):
    pytest.importorskip("jax")
    import kipp

    path = artifacts(TINY, "bf16")
    model = kipp.load(path, backend="jax", weight_memory="stored", kv_tokens=64, progress=False)
    assert model.backend.layout == "device" and "weight_memory='stored'" in model.backend.describe()
    with pytest.raises(KippError, match="reads the artifact in place"):
        kipp.load(path, backend="reference", weight_memory="float32", progress=False)
    with pytest.raises(KippError, match="unknown weight_memory"):
        kipp.load(path, backend="reference", weight_memory="f16", progress=False)


def test_mlx_stored_twins_widen_one_chunk_at_a_time(monkeypatch):
    """MLX left alone widens every chunk of a graph before any product (all of W in float32);
    the twins chain the chunks so the peak is about one chunk (planted: the chain removed,
    32 MiB)."""
    mx = pytest.importorskip("mlx.core")
    import ml_dtypes

    from kipp.apple import layout, linear
    from kipp.apple import probe as mlx_probe

    monkeypatch.setattr(linear, "CHUNK_ELEMENTS", 1 << 18)  # 1 MiB of float32 per chunk
    rows = (np.random.default_rng(0).standard_normal((32768, 256)) * 0.05).astype(np.float32)
    stored = layout.twin_of(rows.astype(ml_dtypes.bfloat16), "bf16", 256)  # 32 MiB widened
    probe_planes = mlx_probe.probe_weight("q8_0", np.random.default_rng(0)).planes
    planes = layout.Linear("q8_0", 64 * 512, 256, planes=tuple(  # the probe weight, 512 times
        mx.array(np.tile(np.array(p), (512, 1))) for p in probe_planes))
    x = mx.array(np.random.default_rng(1).standard_normal((4, 256)).astype(np.float32))
    mx.eval(x)
    for twin in (lambda: linear.linear_twin(x, stored), lambda: linear.planes_twin(x, planes)):
        mx.reset_peak_memory()
        base = mx.get_active_memory()
        mx.eval(twin())
        assert mx.get_peak_memory() - base < 8 * 2**20


@pytest.mark.parametrize("fmt", ["bf16", "q8_0", "affine4_gs32"])
def test_jax_twin_matmul_blocks_equal_the_reference(fmt, monkeypatch):
    pytest.importorskip("jax")
    import jax

    from kipp.cuda import probe as jax_probe
    from kipp.cuda import twin_matmul
    from kipp.cuda.pallas import quant_matmul

    w = jax_probe.probe_weight(fmt, np.random.default_rng(5))  # [64, 256]
    x = np.random.default_rng(6).standard_normal((5, 256)).astype(np.float32)
    want = np.asarray(quant_matmul.quant_matmul_reference(x, w))
    monkeypatch.setattr(twin_matmul, "CHUNK_ELEMENTS", 256 * 16)  # four blocks of 16 rows
    assert twin_matmul.block_rows(64, 256) == 16
    got = np.asarray(jax.jit(twin_matmul.linear)(x, w))
    assert gates.nmse(got, want) <= 1e-12
    one = np.asarray(twin_matmul.linear(x[:1], w))  # one row: the fused path
    assert gates.nmse(one, want[:1]) <= 1e-12


def test_jax_stored_twins_widen_when_their_layer_runs():
    """Four chained layers of stored BF16 weights (as the CPU twins hold them: uint16 bits;
    16 MiB each in float32) and one large one (64 MiB, widened in 16 MiB blocks), two rows:
    XLA's temporaries stay near one block instead of every widened weight (planted: the
    anchor removed, 64 MiB)."""
    pytest.importorskip("jax")
    import jax
    import jax.numpy as jnp

    from kipp.cuda import layout, twin_matmul

    small = layout.Linear(jax.ShapeDtypeStruct((2048, 2048), jnp.uint16), fmt="bf16")
    large = layout.Linear(jax.ShapeDtypeStruct((2048, 8192), jnp.uint16), fmt="bf16")

    def layers(x, big, *weights):
        for w in weights:
            x = twin_matmul.linear(x, w)
        return twin_matmul.linear(jnp.tile(x, (1, 4)), big)

    x = jax.ShapeDtypeStruct((2, 2048), jnp.float32)
    compiled = jax.jit(layers).lower(x, large, small, small, small, small).compile()
    temp = compiled.memory_analysis().temp_size_in_bytes
    assert temp <= 24 * 2**20, temp / 2**20


def test_cli_flag_reaches_load(artifacts, capsys):
    from kipp.cli import main as cli_main

    path = str(artifacts(TINY, "bf16"))
    assert cli_main(["run", path, "--prompt", "Hi", "--max-tokens", "1", "--backend",
                     "reference", "--weight-memory", "float32"]) == 1
    assert "weight_memory='float32' applies to the jax and mlx backends" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # argparse: not a choice
        cli_main(["run", path, "--prompt", "Hi", "--weight-memory", "half"])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's heap, /proc")
def test_trim_heap_returns_freed_heap_memory():
    """What a compile or the packing frees stays in glibc's heap, resident, until trimmed
    (planted: trim_heap a no-op, nothing came back)."""
    if memory._libc_function("malloc_trim") is None:
        pytest.skip("not glibc")

    def anon_kib():
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("RssAnon:"))

    chunks = [bytearray(b"\x01" * 60_000) for _ in range(3000)]  # 180 MB of small blocks
    keep = bytearray(b"\x01" * 60_000)  # allocated last: the heap cannot shrink from its top
    del chunks
    freed = anon_kib()
    memory.trim_heap()
    assert freed - anon_kib() > 100 * 1024, (freed, anon_kib())
    del keep


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's heap, /proc")
def test_large_blocks_go_back_to_the_os_inside_a_step_only():
    """After a 16 MiB block is freed glibc serves blocks up to that size from its heap and keeps
    them resident when freed (XLA's per-execution temporaries stayed so, one per thread); those
    allocated inside large_blocks_returned leave on free (planted: a no-op, 0 MiB came back);
    after it the process allocates as glibc does (planted: the threshold left at 1 MiB, 16 MiB
    came back). In its own process: the setting is process-wide."""
    code = (
        "import sys\n"
        "from kipp import memory\n"
        "def anon_mib():\n"
        "    with open('/proc/self/status') as f:\n"
        "        return next(int(l.split()[1]) for l in f if l.startswith('RssAnon:')) / 1024\n"
        "big = bytearray(16 << 20)\n"
        "del big\n"
        "def blocks():\n"
        "    return [bytearray(8 << 20) for _ in range(4)]\n"
        "if sys.argv[1] == 'inside':\n"
        "    with memory.large_blocks_returned():\n"
        "        made = blocks()\n"
        "else:\n"
        "    if sys.argv[1] == 'after':\n"
        "        with memory.large_blocks_returned():\n"
        "            pass\n"
        "    made = blocks()\n"
        "held = anon_mib()\n"
        "del made[1:3]\n"
        "print(held - anon_mib())\n")
    if memory._libc_function("mallopt") is None:
        pytest.skip("not glibc")
    back = {mode: float(subprocess.run([sys.executable, "-c", code, mode], check=True,
                                       capture_output=True, text=True).stdout)
            for mode in ("default", "inside", "after")}
    assert back["default"] < 4, back  # the premise: glibc's own behaviour keeps them
    assert back["inside"] > 15, back
    assert back["after"] < 4, back


def test_large_blocks_leave_a_users_malloc_settings_alone(monkeypatch, request):
    """A user who set glibc's thresholds keeps them: the context then sets nothing."""
    request.addfinalizer(memory._user_malloc_settings.cache_clear)  # read with this test's env
    calls = []
    monkeypatch.setattr(memory, "_libc_function", lambda name: lambda *args: calls.append(args))
    for name in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "GLIBC_TUNABLES"):
        monkeypatch.delenv(name, raising=False)
    for name, value in (("MALLOC_MMAP_THRESHOLD_", "131072"), ("MALLOC_TRIM_THRESHOLD_", "0"),
                        ("GLIBC_TUNABLES", "glibc.malloc.mmap_threshold=131072")):
        with monkeypatch.context() as env:
            env.setenv(name, value)
            memory._user_malloc_settings.cache_clear()
            with memory.large_blocks_returned():
                pass
    assert calls == []
    memory._user_malloc_settings.cache_clear()
    with memory.large_blocks_returned():
        assert calls == [(-3, memory.STEP_MMAP_THRESHOLD)]
    assert calls[1:] == [(-3, memory.GLIBC_MMAP_CEILING), (-1, 2 * memory.GLIBC_MMAP_CEILING)]
