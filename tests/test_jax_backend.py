"""JaxBackend's gates against the reference backend, and its compile/round contracts.

On a CPU these run the jax.numpy twins (float32 layout, and the GPU's packed layout), plus one
whole-model run of the Pallas kernels in interpret mode; on a GPU the default path is the
kernels. Bounds are the gates': identical argmax (up to numerical near-ties, gates.argmax_check)
and NMSE <= 1e-4 at every prefill and decode position; a scrambled block table bitwise equal to
the identity table; batched mixed-length eval equal to isolated within the same bound.
"""

import contextlib
import dataclasses
import functools

import numpy as np
import pytest

jax = pytest.importorskip("jax")

from kipp import gates  # noqa: E402
from kipp.backend import EvalError, EvalItem  # noqa: E402
from kipp.cuda import select  # noqa: E402
from kipp.cuda.backend import JaxBackend  # noqa: E402
from kipp.formats.artifact import open_artifact  # noqa: E402
from kipp.reference.backend import ReferenceBackend  # noqa: E402

TINY = "kipp-synthetic/qwen3-tiny"
UNTIED = "kipp-synthetic/qwen3-tiny-untied"
SCHEMES = ["bf16", "q8_0", "affine4_gs32", "scale4_gs32"]
BLOCKS = 12
BOUND = 1e-4


def _backends(artifacts, checkpoint_id, scheme, **options):
    """The reference and the JAX backend on one artifact; the reference rounds the
    projections' inputs where the JAX backend's CPU dots do (gates.activation_dots)."""
    artifact = open_artifact(artifacts(checkpoint_id, scheme))
    jb = JaxBackend(artifact, BLOCKS, **options)
    return ReferenceBackend(artifact, BLOCKS, activations=gates.activation_dots(jb)), jb


def _tokens(seed, n):
    return tuple(int(t) for t in np.random.default_rng(seed).integers(0, 151_643, n))


def _check_rows(got, want, what, bound=BOUND):
    result = gates.gate_rows(what, got, want, bound)
    assert result.passed, f"{what}: {result.detail}"


def _gate(ref, jb, prompt_len=30, decode_steps=4, seed=0, bound=BOUND):
    """Prefill (every position's logits) then decode across the 31/32/33 block boundary, on a
    scrambled table; the reference sees the same items."""
    table = np.random.default_rng(seed).permutation(BLOCKS)[:3]
    result = gates.gate_backends(ref, jb, _tokens(seed, prompt_len), table,
                                 logits_rows=prompt_len, decode_steps=decode_steps, bound=bound)
    assert result.passed, result.detail


# the untied checkpoint at affine4_gs32 in CI's artifacts step (its other schemes and the tied
# checkpoint's affine4_gs32 stay in the default suite)
@pytest.mark.parametrize("checkpoint_id,scheme", [
    pytest.param(c, s, id=f"{s}-{c}",
                 marks=[pytest.mark.slow] if (c, s) == (UNTIED, "affine4_gs32") else [])
    for s in SCHEMES for c in (TINY, UNTIED)])
def test_jax_matches_reference(artifacts, checkpoint_id, scheme):
    """The default path for this machine (CPU: twins on float32 weights)."""
    ref, jb = _backends(artifacts, checkpoint_id, scheme)
    _gate(ref, jb)


@pytest.mark.parametrize("scheme", SCHEMES)
def test_packed_layout_twins_match_reference(artifacts, scheme):
    """The GPU's layout (BF16 / packed planes, dequantized in the step) through the twins."""
    ref, jb = _backends(artifacts, UNTIED, scheme, path="twins", weight_layout="device")
    assert "device weights" in jb.describe()
    _gate(ref, jb, prompt_len=20, decode_steps=2)


@pytest.mark.parametrize("weight_memory,kv_scheme,decode_only", [  # CI runs the slow ones
    pytest.param("stored", "q8_0", False, marks=pytest.mark.slow),
    pytest.param("float32", "bf16", False, marks=pytest.mark.slow),
    ("float32", "bf16", True), ("stored", "bf16", True)])
def test_scanned_step_is_bitwise_the_per_layer_step(artifacts, weight_memory, kv_scheme,
                                                     decode_only):
    """The CPU twins' stored and panel layouts stack the layers and scan one layer's code over
    them (kipp.cuda.forward.step); the same weights and slab split into per-layer arrays,
    through the unrolled step, give bitwise the same logits and slab, for a round mixing a
    prefill chunk and a decode row, and a decode-only round (Kipp's CPU attention on a BF16
    slab), over a slab that already holds KV."""
    from kipp.cuda import forward, rounds
    from kipp.cuda.cpu import matmul as cpu_matmul

    if weight_memory == "float32" and not cpu_matmul.available()[0]:
        pytest.skip(f"Kipp's CPU matmul: {cpu_matmul.available()[1]}")
    _, jb = _backends(artifacts, UNTIED, "q8_0", path="twins", weight_memory=weight_memory,
                      kv_scheme=kv_scheme)
    assert jb.stacked and isinstance(jb.params["layers"], dict)
    assert jb.layout == ("device" if weight_memory == "stored" else "panels")
    jb.eval([EvalItem(_tokens(3, 40), 0, (4, 2)), EvalItem(_tokens(5, 40), 0, (8, 9))])
    items = [EvalItem((5,), 40, (4, 2))]  # decode rows over that KV
    items = items + ([EvalItem((6,), 40, (8, 9))] if decode_only else
                     [EvalItem(_tokens(4, 9), 0, (7,), 9)])
    bucket, arrays, _ = rounds.pack_round(items, rounds.plan_rounds(items, 64)[0], BLOCKS)
    layers = jb.entry.layers
    per_layer = dict(jb.params, layers=[jax.tree.map(lambda a: a[i], jb.params["layers"])
                                        for i in range(layers)])
    k_all, v_all = jax.tree.map(np.asarray, jb.kv)
    kv = tuple((jax.tree.map(lambda a: jax.numpy.asarray(a[i]), k_all),
                jax.tree.map(lambda a: jax.numpy.asarray(a[i]), v_all)) for i in range(layers))
    step = jax.jit(functools.partial(forward.step, ops=jb._ops()))  # as the backend compiles it
    scanned, (k_new, v_new) = step(jb.params, jb.kv, jb.rope, arrays)
    unrolled, kv_new = step(per_layer, kv, jb.rope, arrays)
    assert np.array_equal(np.asarray(scanned).view(np.uint32),
                          np.asarray(unrolled).view(np.uint32))
    for i, (k, v) in enumerate(kv_new):
        for stacked, own in ((k_new, k), (v_new, v)):
            for a, b in zip(jax.tree.leaves(stacked), jax.tree.leaves(own)):
                assert np.array_equal(np.asarray(a[i]), np.asarray(b)), f"layer {i}'s slab"
    # and the round changed the slab: this compares written KV, not zeros
    assert not np.array_equal(np.asarray(jax.tree.leaves(k_new)[0]), jax.tree.leaves(k_all)[0])


@pytest.mark.slow  # Pallas interpret mode runs every kernel in Python (CI's interpret step)
def test_kernels_in_interpret_mode_match_reference(artifacts):
    """The whole model through the Pallas kernels (interpret mode): GQA group 5, 4-bit."""
    ref, jb = _backends(artifacts, UNTIED, "scale4_gs32", path="interpret",
                        weight_layout="device", fallback=False)
    assert "Pallas kernels (interpret mode)" in jb.describe()
    _gate(ref, jb, prompt_len=20, decode_steps=1,
          bound=gates.calibrated_bound(jb, "reference"))  # BF16 operands (kipp.gates.BOUNDS)


def test_scrambled_block_table_is_bitwise_identity(artifacts):
    _, jb = _backends(artifacts, TINY, "q8_0")
    prompt = _tokens(1, 70)
    identity = (0, 1, 2, 3)
    scrambled = (9, 4, 7, 1)
    [a] = jb.eval([EvalItem(prompt, 0, identity, 4)])
    [b] = jb.eval([EvalItem(prompt, 0, scrambled, 4)])
    assert np.array_equal(a.view(np.uint32), b.view(np.uint32))
    [a] = jb.eval([EvalItem((5,), 70, identity)])
    [b] = jb.eval([EvalItem((5,), 70, scrambled)])
    assert np.array_equal(a.view(np.uint32), b.view(np.uint32))


def test_batched_mixed_lengths_equal_isolated(artifacts):
    _, jb = _backends(artifacts, UNTIED, "bf16")
    lengths = (37, 5, 1, 20)
    prompts = [_tokens(10 + i, n) for i, n in enumerate(lengths)]
    tables = [(0, 1), (2,), (3,), (4,)]
    alone = [jb.eval([EvalItem(p, 0, t, min(2, len(p)))])[0] for p, t in zip(prompts, tables)]
    moved = [(5, 6), (7,), (8,), (9,)]  # same content in other blocks
    together = jb.eval([EvalItem(p, 0, t, min(2, len(p))) for p, t in zip(prompts, moved)])
    for a, b in zip(together, alone):
        assert gates.nmse(a, b) <= BOUND and np.array_equal(a.argmax(-1), b.argmax(-1))
    # then one decode token per sequence, batched vs alone
    steps = [EvalItem((int(a[-1].argmax()),), n, t) for a, n, t in zip(alone, lengths, tables)]
    alone = [jb.eval([item])[0] for item in steps]
    together = jb.eval([EvalItem(s.tokens, s.start_position, t) for s, t in zip(steps, moved)])
    for a, b in zip(together, alone):
        assert gates.nmse(a, b) <= BOUND


def test_rounds_split_long_items_and_rows(artifacts):
    """A 45-token item under a 16-token round budget, with logits rows spanning rounds, and a
    second item that waits for budget: equal to one round within the bound."""
    artifact = open_artifact(artifacts(TINY, "bf16"))
    wide, narrow = JaxBackend(artifact, BLOCKS), JaxBackend(artifact, BLOCKS, max_round_tokens=16)
    items = [EvalItem(_tokens(3, 45), 0, (0, 1), 20), EvalItem(_tokens(4, 9), 0, (2,), 9)]
    for a, b in zip(narrow.eval(items), wide.eval(items)):
        _check_rows(a, b, "split rounds")
    assert {bucket.tokens for bucket, _ in narrow.compile_log} <= {16, 8, 4, 2, 1}


@contextlib.contextmanager
def compile_events():
    """The JAX compile events recorded while the block runs (a list, filled in place)."""
    from jax import monitoring

    events = []

    def listener(event, duration, **kwargs):
        if "compile" in event:
            events.append(event)

    monitoring.register_event_duration_secs_listener(listener)
    try:
        yield events
    finally:
        monitoring.unregister_event_duration_listener(listener)


def _attention_backend(artifacts, monkeypatch, cpu_attention: bool) -> JaxBackend:
    """The tiny BF16 checkpoint's JAX backend with Kipp's CPU attention, or with the twin's
    (its kernel switched off); skipped where the kernel does not build."""
    from kipp.cuda.cpu import attention

    if cpu_attention and not attention.available()[0]:
        pytest.skip(f"Kipp's CPU attention: {attention.available()[1]}")
    if not cpu_attention:
        monkeypatch.setenv(attention.ENV, "0")
    _, jb = _backends(artifacts, TINY, "bf16")
    assert jb.cpu_attention == cpu_attention
    return jb


@pytest.mark.parametrize("cpu_attention", [True, False], ids=["cpu attention", "twin"])
def test_steady_state_decode_does_not_recompile(artifacts, monkeypatch, cpu_attention):
    """Decode within a block-table bucket never compiles. Past it: Kipp's CPU attention reads
    only the positions a query sees, so its rounds all take the pool's table width and run the
    program they have (planted: a width per context, and the 65th position compiled); the
    twin's gathers every position of the table, so its width follows the context."""
    from kipp.cuda import rounds

    jb = _attention_backend(artifacts, monkeypatch, cpu_attention)
    table = (3, 1, 4)
    [logits] = jb.eval([EvalItem(_tokens(5, 40), 0, table)])
    [logits] = jb.eval([EvalItem((int(logits[0].argmax()),), 40, table)])  # compiles decode
    buckets = jb.buckets
    with compile_events() as events:
        for position in range(41, 64):  # same bucket: 2 blocks of 32 positions
            [logits] = jb.eval([EvalItem((int(logits[0].argmax()),), position, table)])
    assert events == [] and jb.buckets == buckets
    with compile_events() as events:
        [logits] = jb.eval([EvalItem((1,), 64, table)])  # 3 blocks
    if cpu_attention:
        assert events == [] and jb.buckets == buckets
        assert {b.blocks for b in jb.buckets} == {rounds.fixed_table_width(BLOCKS)}
    else:  # the next bucket (B=4)
        assert len(jb.buckets) == len(buckets) + 1 and max(b.blocks for b in jb.buckets) == 4


@pytest.mark.parametrize("cpu_attention", [True, False], ids=["cpu attention", "twin"])
def test_a_prefill_round_compiles_its_one_token_program(artifacts, monkeypatch, cpu_attention):
    """A repeated prompt adopts all but its last token (kipp.engine.blocks' tails) and evaluates
    that one with the decode program of the prompt's block width: compiled with the prefill, so
    the cache hit never waits on a compile."""
    from kipp.cuda import rounds
    from kipp.cuda.rounds import Bucket

    jb = _attention_backend(artifacts, monkeypatch, cpu_attention)
    table = (2, 0, 1)
    jb.eval([EvalItem(_tokens(6, 70), 0, table)])  # one round: T=128, B=4 (the twin's)
    width = rounds.fixed_table_width(BLOCKS) if cpu_attention else 4
    assert Bucket(1, 1, 1, width, 1) in jb.buckets
    with compile_events() as events:
        jb.eval([EvalItem(_tokens(6, 70)[-1:], 69, table)])  # the hit: the last token again
    assert events == []


def test_bad_items_are_rejected_before_any_work(artifacts):
    _, jb = _backends(artifacts, TINY, "bf16")
    with pytest.raises(EvalError):
        jb.eval([EvalItem((1,), 0, (BLOCKS,))])
    with pytest.raises(EvalError):
        jb.eval([EvalItem((151_936,), 0, (0,))])
    # the RoPE table covers the slab's positions: a block table that repeats a block reaches
    # past them, and would read a clamped row of the table instead of failing
    artifact = open_artifact(artifacts(TINY, "bf16"))
    small = JaxBackend(artifact, 2)
    assert small.rope_positions == 64
    for backend in (small, ReferenceBackend(artifact, 2)):  # Backend.check, for every backend
        with pytest.raises(EvalError, match="position 70 is past what the KV slab holds"):
            backend.eval([EvalItem((1,), 70, (0, 1, 0))])


def test_path_selection_and_twins_switch(monkeypatch):
    assert not select.choose_path("auto", "cpu").kernels
    assert "no GPU" in select.choose_path("auto", "cpu").reason
    monkeypatch.delenv(select.TWINS_ENV, raising=False)
    assert select.choose_path("auto", "gpu").kernels
    monkeypatch.setenv(select.TWINS_ENV, "1")
    choice = select.choose_path("auto", "gpu")
    assert not choice.kernels and select.TWINS_ENV in choice.reason
    assert select.choose_path("interpret", "cpu").interpret


def test_platform_plan_without_a_device():
    """kipp.cuda.plan derives every platform flag from the facts alone: one CPU device, a CPU
    without Kipp's kernels, a mesh, a GPU (and its twins switch), interpret mode."""
    from kipp.cuda.plan import Facts, make_plan
    from kipp.errors import KippError
    from kipp.memory import WeightMemory

    built, missing = (True, "built"), (False, "no C++ compiler")
    stored, wide = WeightMemory("stored", "test"), WeightMemory("float32", "test")
    cpu = Facts("cpu", cpu_matmul=built, cpu_attention=built, cpu_stored=built)
    p = make_plan(cpu, scheme="q8_0", weight_memory=stored)
    assert (p.layout, p.bits, p.stacked, p.cpu_attention, p.lean_compile, p.cpu_steps,
            p.cpu_stored) == ("device", True, True, True, True, True, True)
    assert not p.choice.kernels and not p.first_step and p.probe_formats == () and not p.warnings
    p = make_plan(cpu, scheme="bf16", weight_memory=wide, kv_scheme="q8_0")
    assert (p.layout, p.bits, p.stacked, p.cpu_attention, p.lean_compile) == (
        "panels", False, True, False, False)
    bare = Facts("cpu", cpu_matmul=missing, cpu_attention=missing)
    p = make_plan(bare, scheme="bf16", weight_memory=wide)
    assert (p.layout, p.stacked, p.cpu_attention) == ("f32", False, False)
    assert len(p.warnings) == 2 and all("no C++ compiler" in w for w in p.warnings)
    p = make_plan(Facts("cpu", cpu_stored=missing), scheme="q8_0", weight_memory=stored)
    assert not p.cpu_stored and "stored CPU matmul is unavailable (no C++" in p.warnings[-1]
    with pytest.raises(KippError, match="panels .* one CPU device \\(no C\\+\\+ compiler"):
        make_plan(bare, scheme="bf16", weight_layout="panels")
    mesh = Facts("cpu", sharded=True)
    p = make_plan(mesh, scheme="bf16", path="interpret", weight_memory=wide)
    assert (p.choice.kernels, p.choice.reason, p.layout, p.stacked, p.bits) == (
        False, "sharded over a mesh: twins", "f32", False, False)
    gpu = Facts("gpu", device_kind="NVIDIA H200")
    p = make_plan(gpu, scheme="q8_0", weight_memory=stored)
    assert p.choice.kernels and "NVIDIA H200" in p.choice.reason and p.first_step
    assert (p.layout, p.bits, p.stacked, p.lean_compile, p.cpu_steps) == (
        "device", False, False, False, False)
    assert p.probe_formats == ("q8_0", "bf16")
    p = make_plan(Facts("gpu", device_kind="x", twins_env="1"), scheme="q8_0",
                  weight_memory=stored)
    assert not p.choice.kernels and select.TWINS_ENV in p.choice.reason
    with pytest.raises(KippError, match="panels .* one CPU device \\(gpu\\)"):
        make_plan(gpu, scheme="bf16", weight_layout="panels")
    p = make_plan(cpu, scheme="bf16", path="interpret", weight_memory=wide)
    assert p.choice.interpret and not p.first_step and p.layout == "f32"
    assert p.probe_formats == ("f32",) and not p.stacked and not p.cpu_attention
    p = make_plan(cpu, scheme="scale4_gs32", weight_layout="device")
    assert p.memory.mode == "stored" and "weight_layout='device'" in p.memory.reason


def test_jax_starts_without_the_cuda_plugins_driver_lines():
    """Without an NVIDIA driver, JAX's start through Kipp prints none of the CUDA plugin's
    "Could not find cuda drivers" lines; anything else written to stderr meanwhile is kept."""
    import subprocess
    import sys

    from kipp.cuda import startup

    line = (b"I0000 00:00:1796139631.699815    6450 cudart_stub.cc:31] Could not find cuda "
            b"drivers on your machine, GPU will not be used.\n")
    noise = startup.ABSL_PREAMBLE + b"\n" + line
    assert startup.drop_driver_lines(b"a\n" + noise + b"b\n" + noise) == b"a\nb\n"
    assert startup.drop_driver_lines(startup.ABSL_PREAMBLE + b"\nreal\n") == (
        startup.ABSL_PREAMBLE + b"\nreal\n")
    if startup.nvidia_driver_present():
        pytest.skip("a driver is present: the plugin's lines are news here")
    code = ("import os, kipp.cuda.backend, jax; jax.devices()\n"
            "from kipp.cuda import startup\n"
            "with startup.without_driver_lines():\n"
            f"    os.write(2, {noise!r} + b'kept\\n')\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stderr == b"kept\n"


@pytest.mark.parametrize("scheme", ["bf16", "affine4_gs32"])
def test_whole_step_with_kernels_lowers_for_cuda(artifacts, scheme):
    """The GPU program (device layout, kernels, BF16 slab) lowers for CUDA on this machine:
    every kernel goes through Pallas' Triton lowering inside the real step."""
    import functools

    import jax.numpy as jnp
    from jax import export

    from kipp.cuda import forward, layout, rounds
    from kipp.cuda.aot import gpu_target

    artifact = open_artifact(artifacts(UNTIED, scheme))
    params = layout.prepare_weights(artifact, "device")
    spec = lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype)  # noqa: E731
    params = jax.tree.map(spec, params)
    slab = jax.ShapeDtypeStruct((BLOCKS, 32, 8, 128), jnp.bfloat16)
    kv = tuple((slab, slab) for _ in artifact.weights.layers)
    rope = (jax.ShapeDtypeStruct((4096, 128), jnp.float32),) * 2
    step = jax.jit(functools.partial(forward.step, ops=forward.Ops(kernels=True)))
    triton = export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")
    for items in ([EvalItem(_tokens(0, 40), 0, (1, 2), 3)], [EvalItem((7,), 40, (1, 2))]):
        _, arrays, _ = rounds.pack_round(items, rounds.plan_rounds(items, 512)[0], BLOCKS)
        with gpu_target():  # jax >= 0.11: the target GPU comes from a scoped abstract mesh
            exported = export.export(step, platforms=["cuda"], disabled_checks=[triton])(
                params, kv, rope, jax.tree.map(spec, arrays))
        assert exported.mlir_module().count("xla.gpu.triton") >= 3


def test_kernels_that_fail_to_compile_fall_back_to_twins(artifacts, monkeypatch, caplog):
    """On a CPU, compiled (non-interpret) Pallas kernels cannot lower: the stand-in for a
    Triton failure on a GPU. Every kernel's probe must fail, warn, and the twins run."""
    from kipp import probe

    probe.clear_cache()
    monkeypatch.setattr(select, "choose_path",
                        lambda *a: select.Choice(True, False, "forced by the test"))
    with caplog.at_level("WARNING", logger="kipp.cuda"):
        ref, jb = _backends(artifacts, TINY, "q8_0", weight_layout="device")
    assert "kernel matvec/q8_0 failed" in caplog.text
    assert jb.kernel_report().running == [] and "fell back to twins" in jb.describe()
    assert set(jb.kernel_report().fell_back) == {
        "matvec/q8_0", "matmul/q8_0", "matvec/bf16", "matmul/bf16", "decode_attention/bf16",
        "prefill_attention/bf16"}
    item = EvalItem(_tokens(6, 5), 0, (2,))
    [got] = jb.eval([item])
    _check_rows(got, ref.eval([item])[0], "fallback")
    probe.clear_cache()


def test_round_planning_and_packing():
    from kipp.cuda import rounds

    items = [EvalItem(tuple(range(1, 41)), 0, (3, 5), 3), EvalItem((7,), 33, (1, 0)),
             EvalItem((8, 9), 0, (2,), 2)]
    plan = rounds.plan_rounds(items, 16)
    assert [[(p.item, p.start, p.stop) for p in r] for r in plan] == [
        [(1, 0, 1), (2, 0, 2), (0, 0, 13)], [(0, 13, 29)], [(0, 29, 40)]]
    bucket, a, dests = rounds.pack_round(items, plan[0], num_blocks=6)
    assert bucket == rounds.Bucket(tokens=16, seqs=4, queries=16, blocks=2, rows=4)
    assert list(a.tokens[:4]) == [7, 8, 9, 1]
    assert a.slots[0] == 0 * 32 + 1  # position 33 -> block_table[1] = 0, offset 1
    assert list(a.slots[1:3]) == [64, 65] and a.slots[3] == 3 * 32
    assert list(a.query_pos[0, :2]) == [33, -1] and a.query_pos[3, 0] == -1
    assert dests == [(1, 0), (2, 0), (2, 1)]  # item 0's rows come in its last round
    bucket, a, dests = rounds.pack_round(items, plan[2], num_blocks=6)
    assert bucket.tokens == 16 and a.tokens[15] == 0
    assert a.slots[15] == 6 * 32  # padding rows store past the slab's end: dropped
    assert list(a.slots[:4]) == [3 * 32 + 29, 3 * 32 + 30, 3 * 32 + 31, 5 * 32]  # table (3, 5)
    assert dests == [(0, 0), (0, 1), (0, 2)]


def test_a_fixed_table_width_pads_every_table_to_it():
    from kipp.cuda import rounds

    items = [EvalItem((7,), 33, (1, 0)), EvalItem((8, 9), 0, (2,), 2)]
    pieces = rounds.plan_rounds(items, 16)[0]
    bucket, a, _ = rounds.pack_round(items, pieces, num_blocks=6,
                                     table_width=rounds.fixed_table_width(6))
    assert bucket.blocks == 8 and a.block_tables.shape == (2, 8)
    assert a.block_tables.tolist() == [[1, 0] + [0] * 6, [2] + [0] * 7]
    narrow, _, _ = rounds.pack_round(items, pieces, num_blocks=6)
    assert narrow.blocks == 2 and dataclasses.replace(narrow, blocks=8) == bucket
    with pytest.raises(ValueError, match="needs 2 blocks, past its table width 1"):
        rounds.pack_round(items, pieces, num_blocks=6, table_width=1)


def test_a_broken_jax_backend_is_an_error_not_no_gpu(monkeypatch):
    """backend="auto" asks jax_sees_gpu: JAX failing to initialise must not read as "no GPU"."""
    import kipp.cuda
    from kipp.errors import KippError

    def broken():
        raise RuntimeError("Unable to initialize backend 'cuda'")

    monkeypatch.setattr(jax, "default_backend", broken)
    with pytest.raises(KippError, match="could not initialise"):
        kipp.cuda.jax_sees_gpu()
    monkeypatch.setattr(jax, "default_backend", lambda: "cpu")
    assert kipp.cuda.jax_sees_gpu() is False
