"""The package metadata builds without setuptools' warnings: the license is an SPDX expression
(setuptools >= 77 warns at every install about the older `license = { text = ... }` table)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

BUILD = """
import json, warnings
from setuptools import build_meta
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    build_meta.prepare_metadata_for_build_wheel("meta")
print(json.dumps([f"{w.category.__name__}: {w.message}" for w in caught]))
"""


def metadata_warnings(folder: Path, pyproject: str) -> list[str]:
    """The warnings setuptools raises while preparing the wheel metadata of `pyproject`."""
    (folder / "kipp").mkdir()
    (folder / "kipp" / "__init__.py").write_text("")
    (folder / "meta").mkdir()
    shutil.copy(ROOT / "README.md", folder / "README.md")
    (folder / "pyproject.toml").write_text(pyproject)
    done = subprocess.run([sys.executable, "-c", BUILD], cwd=folder, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_the_metadata_builds_without_warnings(tmp_path):
    pyproject = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    assert 'license = "Apache-2.0"' in pyproject
    assert metadata_warnings(tmp_path, pyproject) == []


def test_the_old_license_table_would_be_caught(tmp_path):
    """The check above can fail: the pre-PEP 639 table form makes setuptools warn."""
    pyproject = (ROOT / "pyproject.toml").read_text(encoding="utf-8").replace(
        'license = "Apache-2.0"', 'license = { text = "Apache-2.0" }')
    found = metadata_warnings(tmp_path, pyproject)
    assert any("license" in w.lower() for w in found), found
