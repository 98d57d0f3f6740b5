"""`kipp doctor`: runs here on the reference, JAX and MLX twins, prints its report and a
pasteable summary, writes valid JSON, and reports kernels that fell back as not healthy."""

import json
from pathlib import Path

import pytest

from kipp import doctor, probe
from kipp.cli import main as cli_main
from kipp.formats.registry import get as registry_entry

TINY = "kipp-synthetic/qwen3-tiny"


@pytest.fixture(autouse=True)
def short_checks(monkeypatch):
    """The report is under test, not the gates (tests/test_reference.py runs `kipp gates`) nor
    the speed: two short prompts, a short timing."""
    monkeypatch.setattr(doctor, "GATE_PROMPTS", ("The capital of France is Paris. The capital "
                                                 "of Germany is", "1, 2, 3, 5, 8, 13, 21"))
    monkeypatch.setattr(doctor, "SPEED_PROMPT", 32)
    monkeypatch.setattr(doctor, "SPEED_DECODE", 4)
    monkeypatch.setattr(doctor, "SPEED_RUNS", 1)


@pytest.fixture
def kipp_home(tmp_path, monkeypatch, artifacts, synthetic_dir):
    """A KIPP_HOME holding the tiny checkpoint's artifact and source (no synthesis here)."""
    entry = registry_entry(TINY)
    slug = TINY.replace("/", "--")
    artifact = tmp_path / "artifacts" / slug / entry.revision / "bf16.gguf"
    source = tmp_path / "sources" / slug / entry.revision
    artifact.parent.mkdir(parents=True)
    source.parent.mkdir(parents=True)
    artifact.symlink_to(artifacts(TINY, "bf16"))
    source.symlink_to(synthetic_dir(TINY), target_is_directory=True)
    monkeypatch.setenv("KIPP_HOME", str(tmp_path))
    return tmp_path


def test_cli_prints_the_report_and_writes_json(kipp_home, tmp_path, capsys):
    out = tmp_path / "doctor.json"
    assert cli_main(["doctor", "--backend", "reference", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    for section in ("platform:", "packages:", "devices:", "backend:", "kernel probes:",
                    "gates (tiny synthetic checkpoint):", "speed:", "summary (paste this):"):
        assert section in printed
    report = json.loads(out.read_text())
    assert report["backend"]["chosen"] == "reference" and report["healthy"] is True
    assert [g["passed"] for g in report["gates"]] == [True] * 4  # reference: no self-gate
    assert report["speed"]["decode_tok_s"] > 0 and report["speed"]["prefill_tok_s"] > 0
    assert report["summary"][-1] == "verdict: healthy" and report["summary"][-1] in printed
    assert_gate_rows_say_what_they_measured(report, printed)


def assert_gate_rows_say_what_they_measured(report: dict, printed: str) -> None:
    """Each gate row prints its measure, the figure and its bound, then a non-empty detail."""
    rows = {line.split(":", 1)[0].split(None, 1)[1]: line.split(":", 1)[1]
            for line in printed.splitlines() if line.startswith(("  PASS", "  FAIL", "  skip"))}
    assert list(rows) == [g["name"] for g in report["gates"]]
    for g in report["gates"]:
        assert g["detail"].strip(), g
        if g["metric"] is not None:
            assert f"{g['measure']} {g['metric']:.2e} (bound {g['bound']:g}); {g['detail']}" \
                in rows[g["name"]]
    assert "batched vs isolated" in rows and "argmax identical" in rows["batched vs isolated"]


@pytest.mark.slow  # CI's longest default checks
@pytest.mark.parametrize("backend", ["jax", "mlx"])
def test_doctor_on_the_twins(artifacts, synthetic_dir, backend):
    pytest.importorskip({"jax": "jax", "mlx": "mlx.core"}[backend])
    report = doctor.collect(None, backend, tiny=artifacts(TINY), tiny_source=synthetic_dir(TINY))
    assert report["backend"]["describe"].startswith(f"{backend} (")
    names = [g["name"] for g in report["gates"]]
    assert names[0] == f"{backend} vs reference, decode position 43" or "vs reference" in names[0]
    assert all(g["passed"] for g in report["gates"]), report["gates"]
    assert report["kernels"]["probes"] == [] and report["healthy"]
    assert json.loads(json.dumps(report))["summary"] == report["summary"]
    assert any(line.startswith("kernels: none") for line in report["summary"])
    assert_gate_rows_say_what_they_measured(report, doctor.format_report(report))


@pytest.mark.slow  # CI's longest default checks
def test_doctor_reports_kernels_that_fell_back(artifacts, synthetic_dir, monkeypatch):
    """JAX asked for compiled Pallas kernels on a CPU: every probe fails to lower, the twins
    run and pass the gates, and the doctor says which kernels fell back: not healthy."""
    pytest.importorskip("jax")
    from kipp.cuda import select

    probe.clear_cache()
    monkeypatch.setattr(select, "choose_path",
                        lambda *a: select.Choice(True, False, "forced by the test"))
    report = doctor.collect(None, "jax", tiny=artifacts(TINY), tiny_source=synthetic_dir(TINY))
    probe.clear_cache()
    assert report["kernels"]["running"] == [] and "matvec/f32" in report["kernels"]["fell_back"]
    assert all(g["passed"] for g in report["gates"]) and not report["healthy"]
    text = doctor.format_report(report)
    assert "FELL BACK" in text and "verdict: NOT healthy" in text


def test_doctor_lists_every_switch_the_docs_name():
    """docs/backends.md says `kipp doctor` lists the switches of its table that are set: each
    variable named there is in doctor.SWITCHES."""
    import re

    text = (Path(__file__).resolve().parents[1] / "docs" / "backends.md").read_text()
    table = text[text.index("| variable | effect |"):].split("\n\n")[0]
    named = set(re.findall(r"`([A-Z][A-Z0-9_]+)[=`]", table))
    assert {"KIPP_HOME", "KIPP_JAX_CPU_DOT", "KIPP_CPU_ISA"} <= named  # the table was read
    assert named <= set(doctor.SWITCHES), named - set(doctor.SWITCHES)
