"""Every markdown document in the repository refers only to things that exist, and keeps no diary.

For each *.md file (git's tracked files and the untracked ones it does not ignore):
- each relative markdown link resolves to a file or folder beside the document, and a
  `#anchor` to a heading of its target;
- each repository path, in backticks or in plain text (a word starting with `kipp/`, `tests/`,
  `bench/`, `docs/`, `tools/`, `examples/` or `.ci/`; `*` globs), exists under the repository
  root, and a `path.py::name` names something defined in that file;
- each backticked `kipp.` name resolves to a module, followed by at most one name that the
  module's source defines (GGUF metadata keys such as `kipp.source.revision` are known);
- no document cites an issue number ("issue 14", "#14") or DESIGN.md;
- outside the benchmark records (bench/results/): no "this box", no load averages, no "next
  commit", no date standing alone (a date inside a file name is fine) and no time of day in
  prose.

`problems` is the whole check for one document; the last test plants each fault once.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
RECORDS = "bench/results/"  # benchmark records and their rendering: the diary rules do not apply
PATH = re.compile(r"(?<![\w./~$-])((?:kipp|tests|bench|docs|tools|examples|\.ci)/[\w./*-]*)"
                  r"(?:::(\w+))?")
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
CODE_SPAN = re.compile(r"`+([^`]+)`+")
FENCE = re.compile(r"^(```+)[^\n]*\n.*?^\1[ \t]*$", re.DOTALL | re.MULTILINE)
MODULE_NAME = re.compile(r"(?<![\w.-])kipp(?:\.[A-Za-z_]\w*)+(?![\w=@])")  # not `--set kipp.x=1`
ISSUE = re.compile(r"\bissues?\s+#?\d+|(?<![\w&/#])#\d+\b", re.IGNORECASE)
DIARY = re.compile(r"this box|load average|load avg|next commit", re.IGNORECASE)
LONE_DATE = re.compile(r"(?<![\w/-])20\d\d-\d\d-\d\d(?![\w-])")
TIME_OF_DAY = re.compile(r"(?<![\w:.])(?:[01]?\d|2[0-3]):[0-5]\d(?![\w:])")


def documents(root: Path = ROOT) -> list[Path]:
    """Every markdown file git tracks or would track (untracked, not ignored)."""
    if shutil.which("git") and (root / ".git").exists():
        listed = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard",
                                 "-z", "--", "*.md"], cwd=root, capture_output=True, text=True,
                                check=True).stdout.split("\0")
        return sorted(root / name for name in set(listed) if name and (root / name).is_file())
    skip = (".git", ".venv", "build", "dist")
    return sorted(p for p in root.rglob("*.md")
                  if not any(part.startswith(skip) or part.endswith(".egg-info")
                             for part in p.relative_to(root).parts))


def slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    text = re.sub(r"[`*_]|\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


HEADING = re.compile(r"^#+\s+(.*)$", re.MULTILINE)


def anchors(text: str) -> set[str]:
    return {slug(m.group(1)) for m in HEADING.finditer(FENCE.sub("", text))}


def metadata_keys(root: Path) -> set[str]:
    """`kipp.*` GGUF metadata keys: the string literals of the artifact table."""
    source = root / "kipp" / "formats" / "artifact.py"
    return set(re.findall(r"\"(kipp\.[\w.]+)\"", source.read_text())) if source.is_file() else set()


def _module_problem(name: str, root: Path, keys: set[str]) -> str | None:
    if name in keys:
        return None
    parts = name.split(".")
    found, source = 1, root / "kipp" / "__init__.py"
    for i in range(2, len(parts) + 1):
        base = root.joinpath(*parts[:i])
        if base.with_suffix(".py").is_file():
            found, source = i, base.with_suffix(".py")
        elif (base / "__init__.py").is_file():
            found, source = i, base / "__init__.py"
        else:
            break
    rest = parts[found:]
    if not rest:
        return None
    defined = source.is_file() and re.search(rf"\b{re.escape(rest[0])}\b", source.read_text())
    if defined and (len(rest) == 1 or rest[0][0].isupper() or rest[0].startswith("_")):
        return None  # a module, then a name it defines (a class's member after it)
    return f"`{name}`: {'.'.join(parts[:found])} defines no {rest[0]!r}"


def problems(document: Path, root: Path = ROOT, text: str | None = None) -> list[str]:
    """Everything `document` (a path under `root`) says that the repository contradicts."""
    text = document.read_text(encoding="utf-8") if text is None else text
    where = document.relative_to(root).as_posix()
    found = []
    for target in LINK.findall(text):
        if re.match(r"[a-z][\w+.-]*:", target) or target.startswith("/"):
            continue  # a URL or an absolute path
        path, _, anchor = target.partition("#")
        resolved = (document.parent / path).resolve()
        if path and not resolved.exists():
            found.append(f"link {target}: no such file")
        elif anchor and (not path or resolved.suffix == ".md") and anchor not in anchors(
                resolved.read_text(encoding="utf-8") if path else text):
            found.append(f"link {target}: no heading #{anchor}")
    for m in PATH.finditer(text):
        path, name = m.group(1).rstrip(".,:;"), m.group(2)
        hits = list(root.glob(path.rstrip("/"))) if "*" in path else [root / path]
        if not any(p.exists() for p in hits):
            found.append(f"path {path}: no such file")
        elif name and not re.search(rf"\bdef {name}\b|\bclass {name}\b", hits[0].read_text()):
            found.append(f"path {path}::{name}: not defined there")
    keys = metadata_keys(root)
    for span in CODE_SPAN.findall(text):
        for name in MODULE_NAME.findall(span):
            problem = _module_problem(name, root, keys)
            found += [problem] if problem else []
    found += [f"cites {m.group(0)!r}" for m in ISSUE.finditer(text)]
    found += ["cites DESIGN.md"] if "DESIGN.md" in text else []
    if not where.startswith(RECORDS):
        prose = CODE_SPAN.sub("", FENCE.sub("", text))
        found += [f"diary: {m.group(0)!r}" for m in DIARY.finditer(text)]
        found += [f"diary: date {m.group(0)}" for m in LONE_DATE.finditer(text)]
        found += [f"diary: time of day {m.group(0)}" for m in TIME_OF_DAY.finditer(prose)]
    return [f"{where}: {p}" for p in found]


def test_the_documents_are_found():
    names = {p.relative_to(ROOT).as_posix() for p in documents()}
    assert {"README.md", "bench/README.md", "docs/testing.md"} <= names


@pytest.mark.parametrize("document", documents(), ids=lambda p: p.relative_to(ROOT).as_posix())
def test_a_document_refers_only_to_what_exists(document):
    assert problems(document) == []


def test_every_planted_fault_is_caught(tmp_path):
    (tmp_path / "kipp" / "formats").mkdir(parents=True)
    (tmp_path / "kipp" / "__init__.py").write_text("from kipp.model import load\n")
    (tmp_path / "kipp" / "model.py").write_text("class Model:\n    pass\n\ndef load():\n    pass\n")
    (tmp_path / "kipp" / "formats" / "artifact.py").write_text('KEY = "kipp.source.revision"\n')
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_x.py").write_text("def test_one():\n    pass\n")
    (tmp_path / "docs").mkdir()
    page = tmp_path / "docs" / "page.md"
    clean = ("# A page\n\n## Two words\n\nSee [it](../kipp/model.py), [here](#two-words), "
             "`kipp/model.py`, tests/test_x.py::test_one, `kipp/*.py`, `kipp.load`, "
             "`kipp.model.Model.run`, `kipp.source.revision`, `--set kipp.runs=1`, the record "
             "`bench-2026-11-30-101855.json`, and <https://example.org/kipp/gone.py>.\n\n"
             "```python\nx = y[1:30]\n```\n")
    assert problems(page, tmp_path, clean) == []
    planted = {
        "[broken](gone.md)": "link gone.md: no such file",
        "[anchor](#nowhere)": "link #nowhere: no heading #nowhere",
        "`kipp/gone.py`": "path kipp/gone.py: no such file",
        "tests/test_x.py::test_two": "path tests/test_x.py::test_two: not defined there",
        "`kipp.sampling.SamplingParams`": "`kipp.sampling.SamplingParams`: kipp defines no "
                                          "'sampling'",
        "`kipp.model.generate`": "`kipp.model.generate`: kipp.model defines no 'generate'",
        "as issue 17 says": "cites 'issue 17'",
        "fixed (#14)": "cites '#14'",
        "see DESIGN.md": "cites DESIGN.md",
        "measured on this box": "diary: 'this box'",
        "at load average 17": "diary: 'load average'",
        "measured 2026-11-30 at night": "diary: date 2026-11-30",
        "the run at 15:09 took": "diary: time of day 15:09",
    }
    for fault, message in planted.items():
        assert problems(page, tmp_path, clean + fault + "\n") == [f"docs/page.md: {message}"], fault
    record = tmp_path / "bench" / "results" / "report.md"
    record.parent.mkdir(parents=True)
    assert problems(record, tmp_path, "at load average 1.4, 2026-11-30 15:09\n") == []
