"""bench/kernels.py's arithmetic and rendering, on made-up compile rows (no compile here: the
compile itself is tests/test_cuda_compile.py's)."""

import sys
from pathlib import Path

import pytest

pytest.importorskip("jax")

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # bench/ is a directory of the repo, not an installed package
    sys.path.insert(0, str(REPO))

from bench import kernels  # noqa: E402
from kipp.cuda.pallas import kernel_shapes as ks  # noqa: E402
from kipp.formats import registry  # noqa: E402


def _rows(spill=0):
    rows = []
    for case in ks.all_cases():
        matvec = case.kernel == "matmul" and case.shape.startswith("M=1 ")
        row = {"kernel": case.kernel, "variant": case.variant, "shape": case.shape,
               "where": case.where, "flops": case.flops, "bytes": case.bytes, "status": "ok",
               "name": "kipp_x", "registers": 64, "spill_stores": spill, "spill_loads": spill,
               "stack": 0, "shared_memory": 8192, "grid": [1, 1, 1], "threads": 128,
               "mma": {} if matvec else {"wgmma.bf16": 4}, "f32_ops": 0, "compile_s": 1.0}
        row.update(kernels.roofline(row))
        rows.append(row)
    return rows


def test_every_registry_shape_is_a_case():
    cases = ks.all_cases()
    assert len({c.id for c in cases}) == len(cases)
    for c in ks.hub_checkpoints():
        for name, (n, k) in ks.projections(c).items():
            fmts = ["bf16"] if name == "head" else list(ks.WEIGHT_FORMATS)
            for fmt in fmts:
                for m in ks.ROWS:
                    assert f"matmul {fmt} M={m} N={n} K={k}" in {x.id for x in cases}
        for scheme in ks.KV_SCHEMES:
            assert any(x.kernel == "prefill_attention" and x.variant == scheme
                       and f"H={c.query_heads} " in x.shape for x in cases)


def test_decode_prediction_is_the_weight_stream_at_hbm_bandwidth():
    """0.6B BF16 decode is memory-bound: every projection's weights, the head's, the KV of
    2,048 positions and the activations, once per token at 4.8 TB/s (arithmetic redone here
    from the registry's fields)."""
    e = registry.get("Qwen/Qwen3-0.6B")
    a, h, i = e.attention_width, e.hidden, e.intermediate
    nk = [(a, h), (1024, h), (1024, h), (h, a), (i, h), (i, h), (h, i)]
    per_layer = sum(2 * n * k + 4 * (n + k) for n, k in nk)
    per_layer += 2 * 2048 * 8 * 128 * 2 + 8 * e.query_heads * 128  # K and V, q in and out
    head = 2 * 151936 * h + 4 * (151936 + h)
    want = 4.8e12 / (e.layers * per_layer + head)
    [got] = [p for p in kernels.predictions(_rows())
             if p["checkpoint"] == "0.6B" and p["scheme"] == "bf16"]
    assert got["decode_tok_s"] == pytest.approx(want, rel=1e-9)
    assert 0 < got["prefill_tok_s"] < 1e6


def test_roofline_bound_follows_intensity():
    row = {"flops": 2 * 512 * 3072 * 1024, "bytes": 3072 * 1024 * 2, "mma": {"wgmma.bf16": 1}}
    assert kernels.roofline(row)["bound"] == "compute"
    row["mma"] = {}
    assert kernels.roofline(row)["roofline_s"] == pytest.approx(row["flops"] / kernels.F32_FLOPS)
    row["flops"] = 2 * 3072 * 1024
    assert kernels.roofline(row)["bound"] == "memory"


def test_render_and_readme_markers(tmp_path):
    rec = {"kernels": _rows(spill=8), "predicted": kernels.predictions(_rows()),
           "command": "python -m bench kernels",
           "provenance": {"git": "abc", "jax": "0.10.2", "ptxas": "V12.9"},
           "roofline": {"hbm_bytes_per_s": 4.8e12, "bf16_tensor_flops": 989e12}}
    text = kernels.render(rec)
    assert f"spill and stack bytes in all: {16 * len(rec['kernels'])}" in text
    assert "| matmul | q8_0 | M=512 |" in text and "| 8B | affine4_gs32 |" in text
    readme = tmp_path / "README.md"
    readme.write_text(f"before\n{kernels.BEGIN} x -->\nold\n{kernels.END}\nafter\n")
    kernels.update_page(rec, readme)
    out = readme.read_text()
    assert "old" not in out and out.startswith("before\n") and out.endswith("after\n")
    assert text in out


def test_the_multihost_step_renders_between_its_markers(tmp_path):
    step = {"checkpoint": "Qwen/Qwen3-32B", "scheme": "bf16", "hosts": 2, "per_host": 8,
            "step": "decode, 8 sequences", "layers_per_host": 32, "status": "ok",
            "compile_s": 7.3, "kernels": 98, "registers": 48, "spill_bytes": 0,
            "stack_bytes": 0, "collectives": {"all-reduce": 9, "collective-permute": 1,
                                              "all-gather": 0}}
    rec = {"command": "python -m bench kernels --multihost", "step": step,
           "provenance": {"git": "abc", "jax": "0.10.2", "ptxas": "V12.9"}}
    text = kernels.render_hosts(rec)
    assert "over 2 hosts (32 layers each)" in text and "each host's 8 H200s" in text
    assert "all-reduce 9, collective-permute 1." in text and "all-gather" not in text
    failed = kernels.render_hosts(dict(rec, step=dict(step, status="failed", error="E: no")))
    assert failed.endswith("failed: E: no")
    page = tmp_path / "kernels-h200.md"
    page.write_text(f"{kernels.BEGIN} x -->\nkernels\n{kernels.END}\n"
                    f"{kernels.HOSTS_BEGIN} x -->\nold\n{kernels.HOSTS_END}\n")
    kernels.update_page(rec, page, kernels.HOSTS_BEGIN, kernels.HOSTS_END, kernels.render_hosts)
    out = page.read_text()
    assert "kernels\n" in out and "old" not in out and text in out
