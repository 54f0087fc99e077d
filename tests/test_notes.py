"""notes/ (the state of the design per topic) against the code that cites it.

Comments, docstrings, notebooks, scripts, tests and the README cite the notes by file name, often with a
section in quotes right after it (`notes/decoding.md, "Open"`, `notes/attention.md ("Tried and rejected")`).
A file renamed or merged away leaves those citations pointing nowhere, as the 37 that named a deleted
attention notes file did; so every cited file must exist, and a quoted section must be a heading (`## Open`)
or a bold lead (`**The early combine**`) of it. And notes/ stays short enough to be read: 800 lines in all.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NOTES = ROOT / "notes"
MAX_LINES = 800
SCANNED = ("course_lib", "scripts", "tests", "notebooks")
SUFFIXES = {".py", ".ipynb", ".md", ".txt", ".cfg", ".toml", ".sh"}
# notes/<name>.md, then optionally a section: `, "Heading"` or ` ("Heading"`, across a line break and the
# comment marks of the next line (`#`, a docstring's indent).
CITATION = re.compile(r'notes/([\w.-]+\.md)`?(?:(?:,|\s\()[\s#]*"([^"\n]+)")?')


def _sources() -> list[Path]:
    files = [ROOT / "README.md"]
    for top in SCANNED:
        for path in sorted((ROOT / top).rglob("*")):
            hidden = any(part.startswith((".", "__")) for part in path.relative_to(ROOT).parts)
            if path.is_file() and path.suffix in SUFFIXES and not hidden:
                files.append(path)
    return files


def _text(path: Path) -> str:
    """The file's text; a notebook's cells joined, so that quotes are unescaped as in the .py twin."""
    text = path.read_text(encoding="utf-8")
    if path.suffix == ".ipynb":
        cells = json.loads(text)["cells"]
        return "\n".join("".join(cell["source"]) for cell in cells)
    return text


def _citations() -> list[tuple[str, str, str | None]]:
    """(citing file, cited notes file, quoted section or None) for every citation in the scanned files."""
    found = []
    for path in _sources():
        for match in CITATION.finditer(_text(path)):
            found.append((str(path.relative_to(ROOT)), match.group(1), match.group(2)))
    return found


def _has_section(note: Path, section: str) -> bool:
    text = note.read_text(encoding="utf-8")
    heading = re.compile(r"^#+ " + re.escape(section) + r"\b", re.MULTILINE)
    return bool(heading.search(text)) or f"**{section}" in text


def test_the_scan_finds_citations():
    cited = {name for _, name, _ in _citations()}
    assert {"attention.md", "decoding.md", "fused.md"} <= cited, cited


def test_every_cited_notes_file_exists():
    missing = sorted({(src, name) for src, name, _ in _citations() if not (NOTES / name).is_file()})
    lines = [f"  {src}: notes/{name}" for src, name in missing]
    assert not missing, "citations of notes files that do not exist:\n" + "\n".join(lines)


def test_every_cited_section_exists():
    missing = sorted(
        {
            (src, name, section)
            for src, name, section in _citations()
            if section and (NOTES / name).is_file() and not _has_section(NOTES / name, section)
        }
    )
    assert not missing, "cited sections that are no heading or bold lead of the file:\n" + "\n".join(
        f'  {s}: notes/{n}, "{sec}"' for s, n, sec in missing
    )


def test_notes_stay_under_the_line_budget():
    counts = {p.name: len(p.read_text(encoding="utf-8").splitlines()) for p in sorted(NOTES.glob("*.md"))}
    total = sum(counts.values())
    assert total <= MAX_LINES, f"notes/ holds {total} lines (at most {MAX_LINES}): {counts}"
