"""The benchmark harness (bench/): statistics, provenance, fallback refusal, records, schedule,
report. Fast and peer-free: every Kipp run uses the tiny synthetic checkpoint."""

import json
import math
import os
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # bench/ is a directory of the repo, not an installed package
    sys.path.insert(0, str(REPO))

from bench import (  # noqa: E402  # noqa: E402
    arms,
    ceiling,
    fallback,
    ppl,
    provenance,
    records,
    report,
    runner,
    stats,
    workloads,
)
from bench.engines.base import ArmSpec  # noqa: E402

TINY = "kipp-synthetic/qwen3-tiny"


def test_median_mad_min_max_on_known_data():
    s = stats.summarize([10.0, 12.0, 11.0, 50.0])
    assert s == {"n": 4, "median": 11.5, "mad": 1.0, "min": 10.0, "max": 50.0}
    odd = stats.summarize([3, 1, 2, 9, 5])
    assert odd["median"] == 3 and odd["mad"] == 2  # deviations 0,2,1,6,2 -> median 2
    assert stats.summarize([7.0]) == {"n": 1, "median": 7.0, "mad": 0.0, "min": 7.0, "max": 7.0}


def test_statistics_refuse_empty_and_non_finite_and_zero_durations():
    with pytest.raises(ValueError):
        stats.summarize([])
    with pytest.raises(ValueError):
        stats.summarize([1.0, math.nan])
    with pytest.raises(ValueError):
        stats.rate(10, 0.0)
    assert stats.rate(10, 2.0) == 5.0


def test_the_reference_path_is_accepted():
    described = "reference (numpy, q8_0 weights)"
    assert fallback.check_kernel_path("reference", "q8_0", described) == described


@pytest.mark.parametrize("backend, scheme, described, why", [
    ("mlx", "bf16", "reference (numpy, bf16 weights)", "requested"),  # another backend ran
    ("reference", "q8_0", "reference (numpy, bf16 weights)", "scheme"),  # converted on load
    ("mlx", "q8_0", "mlx (plain mx ops, q8_0)", "metal"),  # the kernel path is missing
    ("mlx", "q8_0", "mlx (metal, q8_0, fell back to mx.matmul)", "fallback"),
    ("jax", "bf16", "jax (bf16, jnp twin on cpu)", "pallas"),
])
def test_a_slower_path_than_requested_is_refused(backend, scheme, described, why):
    with pytest.raises(fallback.FallbackError, match=why):
        fallback.check_kernel_path(backend, scheme, described)


def test_the_jax_backends_own_descriptions():
    kernels = ("jax (Pallas kernels (Triton) on gpu: auto: JAX sees a GPU (NVIDIA H200); "
               "q8_0 weights, q8_0 artifact)")
    assert fallback.check_kernel_path("jax", "q8_0", kernels) == kernels
    for slower in ("jax (jax.numpy twins on cpu: JAX platform is cpu, no GPU for the kernels; "
                   "bf16 weights, bf16 artifact)",
                   "jax (Pallas kernels (interpret mode) on cpu: interpret mode requested; "
                   "bf16 weights, bf16 artifact)"):
        with pytest.raises(fallback.FallbackError):
            fallback.check_kernel_path("jax", "bf16", slower)


def test_an_explicit_expectation_permits_the_named_slower_path():
    described = "jax (bf16, jnp twin on cpu)"
    assert fallback.check_kernel_path("jax", "bf16", described, expect=("twin",)) == described
    with pytest.raises(fallback.FallbackError):
        fallback.check_kernel_path("jax", "bf16", described, expect=("pallas",))


def test_without_a_gpu_the_jax_twins_are_the_expected_path():
    assert fallback.expected_path("jax", has_gpu=False) == ("twin",)
    assert fallback.expected_path("jax", has_gpu=True) is None  # the Pallas path is required
    assert fallback.expected_path("jax", ("pallas",), has_gpu=False) == ("pallas",)
    assert fallback.expected_path("reference", has_gpu=False) is None
    twins = ("jax (jax.numpy twins on cpu: JAX platform is cpu, no GPU for the kernels; "
             "bf16 weights, bf16 artifact)")
    expect = fallback.expected_path("jax", has_gpu=False)
    assert fallback.check_kernel_path("jax", "bf16", twins, expect) == twins


def test_a_gpu_machine_running_the_twins_is_refused_with_the_flag_to_add(monkeypatch):
    monkeypatch.setattr(fallback, "gpu_present", lambda: True)
    [arm] = arms.plan(TINY, ["kipp"], ["bf16"], ["jax"], threads=1, context=64)
    assert arm.expect_path is None
    twins = "jax (jax.numpy twins on gpu: KIPP_JAX_TWINS=1 forces the twins; bf16 artifact)"
    with pytest.raises(fallback.FallbackError, match="add --expect-path jax=twin\\)"):
        fallback.check_kernel_path("jax", "bf16", twins, arm.expect_path)
    monkeypatch.setattr(fallback, "gpu_present", lambda: False)
    planned = arms.plan(TINY, ["kipp"], ["bf16"], ["jax", "reference"], threads=1, context=64)
    assert [a.expect_path for a in planned] == [("twin",), None]


def test_llama_cpp_must_run_the_artifacts_own_type():
    assert fallback.check_llama_cpp_type("scale4_gs32", "qwen3 0.6B Q4_0")
    assert fallback.check_llama_cpp_type("affine4_gs32", "qwen3 0.6B Q4_1")
    with pytest.raises(fallback.FallbackError, match="Q8_0"):
        fallback.check_llama_cpp_type("q8_0", "qwen3 0.6B BF16")


def test_a_kipp_arm_refuses_when_its_backend_falls_back(artifacts):
    from bench.engines.kipp_engine import KippEngine

    spec = ArmSpec("kipp", "bf16", TINY, backend="reference",
                   artifact=str(artifacts(TINY, "bf16")), context=64)
    engine = KippEngine(spec)
    assert engine.load()["describe"].startswith("reference")
    prompt = list(range(100, 116))
    result = workloads.measure(workloads.get("decode").with_params(decode_tokens=3), engine, prompt)
    assert result["tokens"] == 3 and result["value"] > 0 and len(result["generated"]) == 4
    short_prefill = workloads.Workload("prefill32", "prefill", "test", {"prompt_tokens": 32})
    assert workloads.measure(short_prefill, engine, list(range(32)))["value"] > 0
    engine.model.backend.describe = lambda: "reference (numpy, bf16 weights, fallback path)"
    with pytest.raises(fallback.FallbackError):
        engine.recheck()


def test_workload_registry_leaves_room_for_later_workloads():
    assert {"decode", "prefill512", "prefill2048"} <= set(workloads.WORKLOADS)
    decode = workloads.get("decode")
    assert decode.params == {"prompt_tokens": 16, "decode_tokens": 128}
    assert workloads.get("prefill2048").prompt_tokens == 2048
    for planned in ("server_aggregate", "ttft_prefix"):
        assert workloads.WORKLOADS[planned].planned
        with pytest.raises(ValueError, match="bench server"):
            workloads.get(planned)
    with pytest.raises(ValueError, match="no parameter"):
        decode.with_params(clients=4)


def test_rounds_interleave_arms_a_b_a_b():
    order = arms.interleave(["A", "B", "C"], {"A": 3, "B": 2, "C": 3})
    assert order == [(0, "A"), (0, "B"), (0, "C"), (1, "A"), (1, "B"), (1, "C"),
                     (2, "A"), (2, "C")]
    assert arms.interleave([], {}) == []


def test_per_arm_overrides():
    kipp = ArmSpec("kipp", "q8_0", TINY, backend="reference")
    llama = ArmSpec("llama_cpp", "q8_0", TINY)
    assert kipp.name == "kipp-reference/q8_0" and llama.name == "llama.cpp/q8_0"
    overrides = [arms.parse_override("kipp.decode_tokens=8"),
                 arms.parse_override("kipp-reference.skip=prefill2048,prefill512"),
                 arms.parse_override("llama.cpp/q8_0.runs=7")]
    base = arms.Sizing(runs=3, warmup=1, decode_tokens=128)
    assert arms.sizing_for(kipp, base, overrides) == arms.Sizing(
        3, 1, 8, frozenset({"prefill2048", "prefill512"}))
    assert arms.sizing_for(llama, base, overrides) == arms.Sizing(7, 1, 128)
    one_workload = [arms.parse_override("kipp.runs=3"),
                    arms.parse_override("kipp@prefill512.runs=1")]
    assert arms.sizing_for(kipp, base, one_workload, "prefill512").runs == 1
    assert arms.sizing_for(kipp, base, one_workload, "decode").runs == 3
    with pytest.raises(ValueError):
        arms.parse_override("kipp.threads=4")
    with pytest.raises(ValueError):
        arms.parse_override("kipp@.runs=4")
    with pytest.raises(ValueError):
        arms.Sizing(runs=0)


def test_provenance_fields_and_types():
    p = provenance.collect()
    assert isinstance(p["collected"], str)
    git = p["git"]
    assert isinstance(git["commit"], str) and len(git["commit"]) == 40
    assert isinstance(git["dirty"], bool) and isinstance(git["changed_files"], list)
    host = p["host"]
    assert isinstance(host["cpu_model"], str) and host["cpu_model"]
    assert isinstance(host["cpu_flags"], list)
    if "avx2" in Path("/proc/cpuinfo").read_text():
        assert "avx2" in host["cpu_flags"]
    assert isinstance(host["cpu_count"], int) and isinstance(host["usable_cores"], int)
    assert isinstance(host["memory_bytes"], int) and host["memory_bytes"] > 2**28
    assert isinstance(host["os"], str) and isinstance(p["python"]["version"], str)
    assert isinstance(p["packages"]["kipp"], str) and isinstance(p["packages"]["numpy"], str)
    assert isinstance(p["blas"], list) and isinstance(p["environment"], dict)
    json.dumps(p)  # everything serialises


def test_bytes_per_token_match_the_artifacts_tensors(artifacts):
    from kipp.formats import gguf

    for scheme in ("bf16", "q8_0"):
        file = gguf.read(artifacts(TINY, scheme))
        streamed = ceiling.decode_bytes_per_token(TINY, scheme, context=10)
        everything = sum(info.nbytes for info in file.tensors.values())
        embedding = file.tensors["token_embd.weight"].nbytes
        # tied: every tensor is read (the embedding as the output head) plus one embedding row
        assert streamed["weights"] == everything + embedding // 151936
        assert streamed["kv"] == 10 * 2 * 2 * 8 * 128 * 2
    implied = ceiling.implied_decode(50.0, 10**9)
    assert implied == pytest.approx(50.0)


def test_bandwidth_measurement_is_positive_and_complete():
    result = ceiling.measure_bandwidth(size_mb=8, runs=2, threads=1, kernels=("max_f32",))
    assert result["gb_s"] > 0 and result["best_kernel"] == "max_f32"
    assert len(result["kernels"]["max_f32"]["runs"]) == 2


def test_perplexity_against_bf16_uses_multi_row_logits(models):
    tokens = list(range(1000, 1007))
    result = ppl.evaluate({"bf16": models(TINY, "bf16"), "q8_0": models(TINY, "q8_0")},
                          tokens, window=3)
    assert result["windows"] == 2  # 3 + 3 tokens, then a lone token with nothing to predict
    bf16, q8 = result["schemes"]["bf16"], result["schemes"]["q8_0"]
    assert bf16["tokens"] == q8["tokens"] == 2 + 2
    assert "kl_mean" not in bf16
    assert q8["kl_mean"] >= 0 and 0 <= q8["top1_agreement"] <= 1 and q8["logits_nmse"] < 2e-3
    assert q8["ppl_ratio"] == pytest.approx(math.exp(q8["nll_change"]))


def test_log_softmax_normalises():
    import numpy as np

    logp = ppl.log_softmax(np.array([[1.0, 2.0, 3.0], [1000.0, 0.0, -1000.0]]))
    assert np.allclose(np.exp(logp).sum(-1), 1.0)


def _arm(name, engine, scheme, values, backend=""):
    spec = ArmSpec(engine, scheme, TINY, backend=backend)
    assert spec.name == name
    return {"arm": name, "engine": engine, "backend": backend, "scheme": scheme,
            "spec": spec.to_json(), "python": sys.executable,
            "sizing": {"runs": len(values), "warmup": 1, "decode_tokens": 8, "skip": []},
            "status": "ok", "info": {"describe": name}, "params": {"prompt_tokens": 16,
                                                                   "decode_tokens": 8},
            "warmup_runs": [{"value": 1.0}], "runs": [{"value": v} for v in values],
            "values": values, "summary": stats.summarize(values),
            "peak_rss_bytes": 3 * 2**30, "rusage": None}


def fixture_record():
    arms_ = [_arm("kipp-reference/bf16", "kipp", "bf16", [2.0, 2.2, 1.8], "reference"),
             _arm("llama.cpp/bf16", "llama_cpp", "bf16", [40.0, 44.0, 42.0]),
             {"arm": "vllm/bf16", "engine": "vllm", "backend": "", "scheme": "bf16",
              "spec": ArmSpec("vllm", "bf16", TINY).to_json(), "status": "unavailable",
              "reason": "vllm not importable"}]
    workload = workloads.get("decode").with_params(decode_tokens=128)
    bandwidth = {"gb_s": 50.0, "mad": 1.0, "best_kernel": "max_f32", "threads": 2, "runs": []}
    return records.new("throughput", "python -m bench run --runs 3",
                       records.checkpoint_block(TINY), provenance.collect(),
                       workload=runner._workload_json(workload),
                       protocol={"order": ["kipp-reference/bf16", "llama.cpp/bf16"]}, arms=arms_,
                       ceiling=ceiling.ceiling_block(bandwidth, TINY, ["bf16"], 80))


def test_record_schema():
    record = fixture_record()
    assert records.validate(record) == []
    name = records.file_name(record)
    assert "decode" in name and name.startswith(record["created"][:10])
    broken = json.loads(json.dumps(record))
    del broken["provenance"]
    broken["arms"][0]["values"] = [1.0]  # disagrees with its runs
    broken["arms"][2]["values"] = [3.0]  # an unavailable arm with numbers
    problems = records.validate(broken)
    assert any("provenance" in p for p in problems)
    assert any("disagree" in p for p in problems)
    assert any("no measurements" in p for p in problems)
    with pytest.raises(ValueError, match="invalid record"):
        records.write(broken, Path("/nonexistent"))


def test_report_from_a_fixture_record(tmp_path):
    record = fixture_record()
    path = records.write(record, tmp_path)
    assert json.loads(path.read_text()) == record
    readme = tmp_path / "README.md"
    readme.write_text("# Results\n\nhand-written intro\n")
    generated = report.main(tmp_path, readme, tmp_path / "throughput.png")
    text = readme.read_text()
    assert text.startswith("# Results\n\nhand-written intro") and report.BEGIN in text
    assert "| kipp-reference | 2 ± 0.2 (n=3) |" in generated
    assert "| llama.cpp | 42 ± 2 (n=3) |" in generated
    assert "unavailable [1]" in generated and "[1] vllm/bf16: unavailable" in generated
    assert "| kipp-reference/bf16 | llama.cpp/bf16 | 0.0476 | behind by 21x |" in generated
    assert "bandwidth ceiling (50 GB/s)" in generated
    assert "### prefill512\n\nNot yet measured." in generated
    report.main(tmp_path, readme, tmp_path / "throughput.png")  # idempotent: one block
    assert readme.read_text().count(report.BEGIN) == 1
    if _has_matplotlib():
        assert (tmp_path / "throughput.png").read_bytes()[:4] == b"\x89PNG"


def _has_matplotlib() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.fixture
def tiny_home(tmp_path, monkeypatch, artifacts):
    """A KIPP_HOME whose store paths point at the session's tiny artifacts."""
    from kipp.formats import store

    monkeypatch.setenv("KIPP_HOME", str(tmp_path / "home"))
    for scheme in ("bf16",):
        target = store.artifact_path(TINY, scheme)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.symlink_to(artifacts(TINY, scheme))
    return tmp_path


def _config(home, **kw):
    base = dict(checkpoint=TINY, engines=["kipp"], schemes=["bf16"], workloads=["decode"],
                sizing=arms.Sizing(runs=2, warmup=1, decode_tokens=2), threads=1,
                results=home / "results", logs=home / "logs", ceiling=False, timeout=120,
                command="python -m bench run (test)")
    base.update(kw)
    return runner.RunConfig(**base)


def test_runner_records_interleaved_runs_with_peak_rss(tiny_home):
    [path] = runner.run(_config(tiny_home))
    record = json.loads(path.read_text())
    assert records.validate(record) == []
    [arm] = record["arms"]
    assert arm["status"] == "ok" and len(arm["values"]) == 2 and len(arm["warmup_runs"]) == 1
    assert arm["params"]["decode_tokens"] == 2 and arm["info"]["describe"].startswith("reference")
    assert arm["peak_rss_bytes"] > 10 * 2**20
    assert record["protocol"]["order"] == ["kipp-reference/bf16 (warm-up)",
                                           "kipp-reference/bf16", "kipp-reference/bf16"]
    assert runner.exit_status([path]) == 0


def test_runner_refuses_to_record_a_fallback(tiny_home):
    config = _config(tiny_home, expect_paths={"reference": ("metal",)})
    [path] = runner.run(config)
    [arm] = json.loads(path.read_text())["arms"]
    assert arm["status"] == "refused" and "metal" in arm["reason"]
    assert "values" not in arm and "summary" not in arm
    assert runner.exit_status([path]) == 3


@pytest.mark.slow  # one of the default suite's longest (CI: 'longest default checks')
def test_a_jax_arm_without_a_gpu_measures_the_twins_unasked(tiny_home, monkeypatch):
    """`bench run --backends jax` on a CPU machine: no --expect-path needed, and the record
    says which path it expected."""
    jax = pytest.importorskip("jax")
    if jax.default_backend() != "cpu":
        pytest.skip("JAX sees an accelerator here")
    monkeypatch.setattr(fallback, "gpu_present", lambda: False)
    [path] = runner.run(_config(tiny_home, backends=["jax"]))
    [arm] = json.loads(path.read_text())["arms"]
    assert arm["status"] == "ok", arm.get("reason")
    assert "twins" in arm["info"]["describe"] and arm["spec"]["expect_path"] == ["twin"]


def test_the_summary_peak_rss_is_the_newest_runs(tmp_path):
    """An arm's row mixes records (each workload's newest run); its peak RSS is the newest
    run's, with that record's mark, not the largest of every run the row shows."""
    old, new = fixture_record(), fixture_record()
    old["workload"]["name"] = "prefill512"
    old["arms"][0]["peak_rss_bytes"], new["arms"][0]["peak_rss_bytes"] = 5 * 2**30, 2**30
    paths = [tmp_path / "2026-01-01-000000-prefill512-x.json",
             tmp_path / "2026-01-02-000000-decode-x.json"]
    refs = report._Refs(tmp_path)
    lines = report.throughput_summary(list(zip(paths, (old, new))), refs)
    row = next(line for line in lines if line.startswith("| kipp-reference/bf16 |"))
    assert row.endswith(f"| 1.00 GiB {refs.mark(paths[1])} |"), row


def test_the_kernels_page_keeps_the_multi_host_section(tmp_path):
    """`bench report` rewrites results/kernels-h200.md from the newest compile record: the
    multi-host step's section (its own record, from `bench kernels --multihost`) is kept."""
    import shutil

    from bench import kernels

    results = Path(__file__).resolve().parent.parent / "bench" / "results"
    shutil.copy(sorted(results.glob("*-kernels-h200.json"))[-1], tmp_path)
    page = report.kernels_page(tmp_path).read_text()
    assert kernels.BEGIN in page and kernels.HOSTS_BEGIN not in page
    hosts = sorted(results.glob("*-multihost-h200.json"))[-1]
    shutil.copy(hosts, tmp_path)
    page = report.kernels_page(tmp_path).read_text()
    rendered = kernels.render_hosts(json.loads(hosts.read_text()))
    assert page.count(kernels.HOSTS_BEGIN) == 1 and rendered in page
    assert page.index(kernels.END) < page.index(kernels.HOSTS_BEGIN) < page.index(rendered)


def test_runner_reports_missing_artifacts_as_unavailable(tiny_home):
    [path] = runner.run(_config(tiny_home, schemes=["q8_0"]))
    [arm] = json.loads(path.read_text())["arms"]
    assert arm["status"] == "unavailable" and "bench prepare" in arm["reason"]


def test_a_peers_own_fallback_is_recorded_from_its_log(tmp_path):
    log = tmp_path / "arm.log"
    log.write_text("loading\nWARNING Failed to create oneDNN linear, fallback to torch linear.\n"
                   "ok\nfalling back to the slow path\n")
    assert runner.fallback_lines(log) == [
        "WARNING Failed to create oneDNN linear, fallback to torch linear.",
        "falling back to the slow path"]
    assert runner.fallback_lines(tmp_path / "missing.log") == []


def test_the_campaign_is_four_explicit_commands(tmp_path, monkeypatch):
    import bench.__main__ as cli

    steps = []
    monkeypatch.setattr(cli, "main", lambda argv: steps.append(argv) or 0)
    args = cli._parser().parse_args(["campaign", "--checkpoint", TINY, "--results", str(tmp_path),
                                     "--with", "vllm", "--python", "vllm=/x/python"])
    assert cli.cmd_campaign(args) == 0
    assert [s[0] for s in steps] == ["run", "ppl", "interop", "report"]
    for step in steps:
        cli._parser().parse_args(step)  # every step is a valid command line
    run = steps[0]
    assert run[run.index("--checkpoint") + 1] == TINY and "kipp.skip=prefill2048" in run
    assert run[run.index("--python") + 1] == "vllm=/x/python"
    assert steps[3] == ["report", "--results", str(tmp_path)]
    readme = (REPO / "bench" / "README.md").read_text()
    for flag in cli.CAMPAIGN_RUN[1:] + cli.CAMPAIGN_PPL[1:]:
        assert flag in readme  # the page shows the commands the campaign really runs


def test_report_renders_server_and_spec_records():
    from bench import report

    summary = {"median": 12.5, "mad": 0.5, "n": 3}
    server = {"workload": {"unit": "tok/s"}, "arms": [
        {"arm": "kipp-jax/bf16 c=4", "status": "ok", "summary": summary, "params": {"clients": 4},
         "per_client_decode_tok_s": {"median": 3.25},
         "spec": {"batching": "continuous batching: up to 8 sequences"}},
        {"arm": "vllm/bf16 cold", "status": "failed", "reason": "did not start",
         "params": {"phase": "cold"}, "spec": {}}]}
    lines = report.server_lines(server)
    assert "| kipp-jax/bf16 c=4 | 12.5 ± 0.5 (n=3) | per-client decode 3.25 tok/s; " \
           "continuous batching |" in lines
    assert any(line.startswith("| vllm/bf16 cold | failed [1]") for line in lines)
    assert lines[-1] == "[1] vllm/bf16 cold: failed: did not start"
    spec = {"speedups": {"copy": {"speedup": summary, "acceptance_rate": 0.75, "evals_spec": 9,
                                  "evals_plain": 63, "identical": False}}}
    assert report.spec_lines(spec)[-1] == "| copy | 12.5 ± 0.5 (n=3) | 75% | 9 / 63 | NO |"


def test_a_crashed_peer_fails_the_run_by_name(tmp_path, monkeypatch, stock_store):
    """A peer's worker that dies of a signal (llama.cpp's AMX path segfaulted this way) is a
    failed arm named in the record, and the run exits non-zero; the Kipp arm still measures."""
    home = stock_store(tmp_path / "home", TINY, ("bf16",))
    monkeypatch.setenv("KIPP_HOME", str(home))
    crashing = tmp_path / "crashing-python"
    crashing.write_text(
        "#!/bin/sh\n"
        'if [ "$1" = "-m" ] && [ "$2" = "bench.worker" ]; then\n'
        f'  exec "{sys.executable}" -c "import os, signal; os.kill(os.getpid(), signal.SIGSEGV)"\n'
        "fi\n"
        f'exec "{sys.executable}" "$@"\n')  # the import probe sees a working interpreter
    crashing.chmod(0o755)
    config = _config(tmp_path, engines=["kipp", "transformers"],
                     pythons={"transformers": str(crashing)})
    [path] = runner.run(config)
    arms_by_engine = {a["engine"]: a for a in json.loads(path.read_text())["arms"]}
    assert arms_by_engine["kipp"]["status"] == "ok"
    crashed = arms_by_engine["transformers"]
    assert crashed["status"] == "failed" and "crashed: SIGSEGV" in crashed["reason"]
    assert runner.exit_status([path]) == 3
    [line] = runner.failures([path])
    assert line.startswith("transformers/bf16 decode: failed: load: worker exited (-11")


def test_a_spec_run_is_measured_against_the_plain_runs_around_it():
    """bench spec's round speed-up is the spec run over the geometric mean of the plain runs
    before and after it (the host's load drifts over a round), each round against its own."""
    from bench import draft_bench

    def run(tok_s, ids=(1, 2)):
        return {"tok_s": tok_s, "ids": list(ids), "drafted": 4, "accepted": 3,
                "verify_evals": 2, "plain_evals": 1}

    key = (95, None, 0.0, 1)
    results = {key: [(False, run(500.0)), (False, run(500.0)),  # the warm-up round's
                     (True, run(100.0)), (True, run(64.0)), (True, run(90.0)), (True, run(40.0))],
               (95, "full", 0.0, 1): [(False, run(1.0)), (True, run(120.0)), (True, run(30.0))]}
    [row] = draft_bench.summarize(results)
    assert row["ratios"] == [120.0 / 80.0, 30.0 / 60.0]
    assert row["identical"] and row["acceptance_rate"] == 0.75


def test_the_spec_prediction_uses_the_compile_reports_step_times():
    """bench spec's H200 rows take their step times from the newest kernels-h200 record: the
    8B decode step is the one that record predicted when it was written, and the speed-up grows
    with acceptance on every machine and target."""
    from bench import draft_bench

    rows = draft_bench.predict()
    h200 = [r for r in rows if r["machine"] == "H200 SXM"]
    assert h200, "no kernels-h200 record in bench/results"
    report = json.loads((draft_bench.records.RESULTS / h200[0]["model"]).read_text())
    [want] = [p for p in report["predicted"] if p["checkpoint"] == "8B" and p["scheme"] == "bf16"]
    step = next(r["step_ms"] for r in h200 if r["target"] == "Qwen/Qwen3-8B")
    assert math.isclose(step, 1e3 / want["decode_tok_s"], rel_tol=1e-9)
    for machine in {r["machine"] for r in rows}:
        for target in ("Qwen/Qwen3-8B", "Qwen/Qwen3-32B"):
            gains = [r["speedup"] for r in sorted(rows, key=lambda r: r["acceptance"])
                     if r["machine"] == machine and r["target"] == target]
            assert len(gains) == 3 and gains == sorted(gains) and gains[-1] > 2


def test_the_spec_prediction_prices_a_cut_draft_head():
    """A draft vocabulary's rows: the draft step loses the BF16 bytes of the head rows past
    the cut (Qwen3-0.6B's tied head, 1,024 wide), and the acceptance is scaled by the share of
    text below the cut; at a coverage of 1 the cut can only gain, and at the measured 93% it
    loses at 95% acceptance, where every drafted token counts most."""
    from bench import draft_bench
    from kipp.formats import registry

    rows = draft_bench.predict(coverage={"32768": 0.931, "65536": 1.0, "151936": 1.0})
    assert {r["draft_vocab"] for r in rows} == {"full", 32768, 65536, 151936}
    draft_bytes = 2 * registry.get("Qwen/Qwen3-0.6B").parameter_count
    cut_bytes = 2 * (151_936 - 32_768) * 1024
    for full in (r for r in rows if r["draft_vocab"] == "full"):
        def same(vocab):
            [row] = [r for r in rows if r["draft_vocab"] == vocab and r["machine"] ==
                     full["machine"] and r["target"] == full["target"] and
                     r["acceptance"] == full["acceptance"]]
            return row
        cut, covered, whole = same(32768), same(65536), same(151936)
        assert math.isclose(cut["draft_acceptance"], 0.931 * full["acceptance"])
        assert math.isclose(cut["draft_step_ms"],
                            full["draft_step_ms"] * (draft_bytes - cut_bytes) / draft_bytes)
        assert covered["speedup"] >= full["speedup"]
        assert whole["speedup"] == full["speedup"]  # a cut at the vocabulary cuts nothing
        assert cut["step_ms"] == full["step_ms"]
        if full["acceptance"] == 0.95:
            assert cut["speedup"] < full["speedup"]


def test_kipp_arms_per_cpu_dot_load_with_that_dot(artifacts, monkeypatch):
    """`bench run --cpu-dot f32,bf16`: one Kipp arm per dot, named by it; each loads with
    $KIPP_JAX_CPU_DOT set to its dot (the backend says which it runs) and restores the
    caller's setting after the load."""
    from bench.engines.kipp_engine import KippEngine
    from kipp.cuda.cpu import stored_matmul

    planned = arms.plan(TINY, ["kipp"], ["bf16"], ["jax"], threads=1, context=64,
                        weight_memory=["stored"], cpu_dots=["f32", "int8"])
    assert [a.name for a in planned] == ["kipp-jax/bf16 (stored weights, f32 dot)",
                                         "kipp-jax/bf16 (stored weights, int8 dot)"]
    if not stored_matmul.available()[0]:
        pytest.skip(stored_matmul.available()[1])
    # a dot this CPU runs, on a scheme it meets (a BF16 artifact keeps float32 under int8)
    scheme, dot = ("bf16", "bf16") if stored_matmul.bf16_dot_supported()[0] else ("q8_0", "int8")
    monkeypatch.setenv(stored_matmul.DOT_ENV, "f32")
    spec = ArmSpec("kipp", scheme, TINY, backend="jax", artifact=str(artifacts(TINY, scheme)),
                   context=64, options={"weight_memory": "stored", "cpu_dot": dot},
                   expect_path=("twin",))
    described = KippEngine(spec).load()["describe"]
    assert f"({dot} dot)" in described and os.environ[stored_matmul.DOT_ENV] == "f32"


def test_engine_records_say_their_scheme_and_dot(artifacts, monkeypatch, tmp_path):
    """`bench engine`'s rows name the scheme and, from the server backend's own description,
    the stored CPU matmul's dot it ran (records made under $KIPP_JAX_CPU_DOT included); a
    --cpu-dot value the backend does not know fails before any process starts, in one line
    naming the flag from the command line."""
    import kipp
    from bench import engine_bench
    from bench.tables import engine_setup
    from kipp.cuda.cpu import stored_matmul

    def arm(scheme, model):
        return {"scheme": scheme, "info": {"server": {"describe": model.backend.describe()}}}

    path = artifacts(TINY, "q8_0")
    reference = kipp.load(path, backend="reference", kv_tokens=64, progress=False)
    assert engine_setup(arm("q8_0", reference)) == "q8_0"
    if not stored_matmul.available()[0]:
        pytest.skip(stored_matmul.available()[1])
    for dot in ("f32", "int8"):
        monkeypatch.setenv(stored_matmul.DOT_ENV, dot)
        model = kipp.load(path, backend="jax", kv_tokens=64, progress=False,
                          weight_memory="stored")
        assert engine_setup(arm("q8_0", model)) == f"q8_0, {dot} dot"
    config = engine_bench.EngineBenchConfig(TINY, scheme="q8_0", artifact=str(path),
                                            cpu_dot="int4", logs=tmp_path)
    with pytest.raises(ValueError, match=stored_matmul.DOT_ENV):
        engine_bench.start(config, engine_bench.Under(None))
    from bench.__main__ import main

    with pytest.raises(SystemExit, match=f"--cpu-dot: {stored_matmul.DOT_ENV}='int4'"):
        main(["engine", "--checkpoint", TINY, "--cpu-dot", "int4"])


def test_new_records_do_not_make_the_measured_checkout_dirty(tmp_path):
    """A run beside an earlier run's new records (or a regenerated report) measured the commit
    as it is; a changed or new file anywhere else is a dirty checkout."""
    import subprocess

    def git(*args):
        subprocess.run(["git", "-C", str(tmp_path), *args], check=True, capture_output=True)

    git("init", "-q")
    (tmp_path / "kipp.py").write_text("x = 1\n")
    (tmp_path / "bench" / "results").mkdir(parents=True)
    (tmp_path / "bench" / "results" / "report.md").write_text("old\n")
    git("add", ".")
    git("-c", "user.name=k", "-c", "user.email=k@k", "commit", "-q", "-m", "base")
    assert provenance.git_state(tmp_path)["dirty"] is False
    (tmp_path / "bench" / "results" / "new-record.json").write_text("{}\n")
    (tmp_path / "bench" / "results" / "report.md").write_text("new\n")
    state = provenance.git_state(tmp_path)
    assert state["dirty"] is False and state["changed_count"] == 2
    (tmp_path / "kipp.py").write_text("x = 2\n")
    assert provenance.git_state(tmp_path)["dirty"] is True
