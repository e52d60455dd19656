"""README.md, docs/ and the code are the product's reference, not its history (that is CHANGELOG.md):
no issue numbers and no commit hashes of this repository in them, no dates in README.md and docs/*.md,
and every relative link in README.md and docs/*.md points at a file, and a heading, that exists. README.md
is the front door: at most 250 lines, and its results table gives every figure with the command that
measures it, a script that exists.

The scanners are plain functions, so each check is also shown to fire on a planted violation."""

from __future__ import annotations

import bisect
import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# CHANGELOG.md is where issue numbers and hashes belong; tests/ quote upstream sources by commit.
SCANNED = ("README.md", "docs", "nereus", "benchmarks", "examples")
SUFFIXES = {".md", ".py", ".yaml", ".yml", ".toml", ".csv"}

ISSUE = re.compile(r"\bissues?[ -]?#?[0-9]{1,3}\b", re.IGNORECASE)
NAMED_COMMIT = re.compile(r"\b(?:at|commit) [0-9a-f]{7,40}\b")
HEX_WORD = re.compile(r"\b[0-9a-f]{7,40}\b")
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
FENCE = re.compile(r"^(```|~~~).*?^\1", re.MULTILINE | re.DOTALL)
INLINE_CODE = re.compile(r"`[^`\n]*`")
HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*\s*$", re.MULTILINE)
ISO_DATE = re.compile(r"\d{4}-\d{2}-\d{2}")
MAX_README_LINES = 250
SCRIPT = re.compile(r"\bpython\s+((?:benchmarks|tests|examples)/[\w/.-]+\.py)")


def scanned_files() -> list[Path]:
    files = []
    for name in SCANNED:
        path = ROOT / name
        if path.is_file():
            files.append(path)
        elif path.is_dir():
            files += sorted(p for p in path.rglob("*") if p.suffix in SUFFIXES and p.is_file())
    return files


def repo_commits() -> list[str]:
    """Every commit hash of this repository, sorted (empty outside a git checkout)."""
    try:
        out = subprocess.run(["git", "rev-list", "--all"], cwd=ROOT, capture_output=True, text=True,
                             timeout=60, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return sorted(out.split())


def names_a_commit(word: str, commits: list[str]) -> bool:
    """True when ``word`` (7+ hex digits, at least one letter) is a prefix of one of ``commits``."""
    if not re.search(r"[a-f]", word):
        return False  # a plain number
    i = bisect.bisect_left(commits, word)
    return i < len(commits) and commits[i].startswith(word)


def history_marks(text: str, commits: list[str]) -> list[str]:
    """Issue numbers and commit hashes of this repository found in ``text``, as ``line: match``."""
    found = []
    for n, line in enumerate(text.splitlines(), 1):
        for m in ISSUE.finditer(line):
            found.append(f"{n}: {m.group(0)}")
        for m in NAMED_COMMIT.finditer(line):
            found.append(f"{n}: {m.group(0)}")
        for m in HEX_WORD.finditer(line):
            if names_a_commit(m.group(0), commits) and not NAMED_COMMIT.search(line[max(0, m.start() - 7):m.end()]):
                found.append(f"{n}: {m.group(0)}")
    return found


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link in a heading keeps its text
    return re.sub(r"[^\w\- ]", "", text.strip().lower()).replace(" ", "-")


def anchors(markdown: str) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for m in HEADING.finditer(FENCE.sub("", markdown)):
        base = slug(m.group(1))
        k = seen.get(base, 0)
        seen[base] = k + 1
        out.add(base if k == 0 else f"{base}-{k}")
    return out


def broken_links(path: Path) -> list[str]:
    """Relative links of a Markdown file whose file or heading does not exist."""
    text = INLINE_CODE.sub("", FENCE.sub("", path.read_text()))
    bad = []
    for m in LINK.finditer(text):
        target = m.group(1)
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.IGNORECASE):
            continue  # https:, mailto:, ...
        file_part, _, anchor = target.partition("#")
        dest = (path.parent / file_part).resolve() if file_part else path
        if not dest.exists():
            bad.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest.read_text()):
            bad.append(f"{target}: no heading #{anchor} in {dest.name}")
    return bad


def dates(text: str) -> list[str]:
    """ISO dates in ``text``, as ``line: date`` (a page's dates are its history: CHANGELOG.md keeps them)."""
    return [f"{n}: {m.group(0)}" for n, line in enumerate(text.splitlines(), 1) for m in ISO_DATE.finditer(line)]


def results_rows(readme: str) -> list[list[str]]:
    """The cells of the rows of README's "Results" tables (each table's header and rule left out)."""
    section = readme.partition("\n## Results\n")[2].partition("\n## ")[0]
    tables: list[list[str]] = [[]]
    for line in section.splitlines():
        if line.startswith("|"):
            tables[-1].append(line)
        elif tables[-1]:
            tables.append([])
    return [[cell.strip() for cell in row.strip("|").split("|")] for table in tables for row in table[2:]]


def readme_problems(readme: str, root: Path = ROOT) -> list[str]:
    """What keeps ``readme`` from being a front door: over ``MAX_README_LINES`` lines, dates, a results table
    missing or with a row without a command and a figure, a `python <script>` that does not exist."""
    problems = []
    if len(readme.splitlines()) > MAX_README_LINES:
        problems.append(f"{len(readme.splitlines())} lines (at most {MAX_README_LINES}): move detail to docs/")
    problems += [f"date {d}: history belongs in CHANGELOG.md" for d in dates(readme)]
    rows = results_rows(readme)
    if not rows:
        problems.append("no results table under '## Results'")
    for cells in rows:
        if len(cells) < 3 or "`" not in cells[1] or not re.search(r"\d", cells[2]):
            problems.append(f"results row without a command and a figure: {cells[0][:60]}")
    problems += [f"no such script: {m.group(1)}" for m in SCRIPT.finditer(readme) if not (root / m.group(1)).is_file()]
    return problems


def test_readme_is_a_front_door() -> None:
    readme = (ROOT / "README.md").read_text()
    assert not readme_problems(readme), readme_problems(readme)
    assert len(results_rows(readme)) >= 10
    for command in ("make demo", "make test", "nereus report"):
        assert command in readme


def test_no_dates_in_readme_and_docs() -> None:
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    found = {str(p.relative_to(ROOT)): d for p in pages if (d := dates(p.read_text()))}
    assert not found, f"dates belong in CHANGELOG.md: {found}"


def test_the_readme_rules_fire_on_planted_violations(tmp_path: Path) -> None:
    good = ("# X\n\n## Results\n\n| what | command | figures |\n|---|---|---|\n"
            "| search | `python benchmarks/a.py` | 0.3 s |\n\n## Next\n")
    (tmp_path / "benchmarks").mkdir()
    (tmp_path / "benchmarks" / "a.py").write_text("")
    assert readme_problems(good, tmp_path) == []
    long = good + "line\n" * MAX_README_LINES
    assert readme_problems(long, tmp_path) == [f"{len(long.splitlines())} lines (at most {MAX_README_LINES}): "
                                               "move detail to docs/"]
    assert readme_problems(good.replace("0.3 s", "0.3 s (measured 2026-12-04)"), tmp_path) == \
        ["date 7: 2026-12-04: history belongs in CHANGELOG.md"]
    assert readme_problems(good.replace("`python benchmarks/a.py`", "the script"), tmp_path) == \
        ["results row without a command and a figure: search"]
    assert readme_problems(good.replace("a.py", "gone.py"), tmp_path) == ["no such script: benchmarks/gone.py"]
    assert readme_problems("# X\n", tmp_path) == ["no results table under '## Results'"]
    assert dates("runs of 1,024 GPUs; 2024 and 12-04") == []


def test_no_issue_numbers_or_commit_hashes_in_readme_docs_and_code() -> None:
    commits = repo_commits()
    found = {}
    for path in scanned_files():
        marks = history_marks(path.read_text(errors="replace"), commits)
        if marks:
            found[str(path.relative_to(ROOT))] = marks
    assert not found, f"history belongs in CHANGELOG.md: {found}"


def test_every_relative_link_in_readme_and_docs_resolves() -> None:
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    bad = {str(p.relative_to(ROOT)): b for p in pages if (b := broken_links(p))}
    assert not bad, bad


def test_the_scanners_fire_on_planted_violations(tmp_path: Path) -> None:
    commits = repo_commits()
    planted = "bounded waits (" + "issue" + " 19)\nthe demo at " + "181f948" + ": 11 moves\n"
    assert len(history_marks(planted, commits)) == 2
    if commits:  # a bare hash of this repository, with no word before it that names it
        assert history_marks(f"measured on {commits[0][:9]} today", commits)
    assert not history_marks("a 1024000-token run; sha256 of 0x9e3779b97f4a7c15", commits)
    page = tmp_path / "page.md"
    (tmp_path / "other.md").write_text("# Title\n\n## Mid-step moves (`run.rollout.midstep`)\n")
    page.write_text("[ok](other.md#mid-step-moves-runrolloutmidstep) [web](https://x.org/a)\n"
                    "[gone](missing.md) [bad anchor](other.md#nowhere) `[in code](nowhere.md)`\n"
                    "```\n[in a block](nowhere.md)\n```\n")
    assert broken_links(page) == ["missing.md: no such file", "other.md#nowhere: no heading #nowhere in other.md"]
