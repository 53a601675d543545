"""The README stays a short product page, every relative link in it and in docs/ resolves, and
docs/results holds what the pages show (the earlier runs named in history.md with their commits)."""
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README_MAX_LINES = 200
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

FENCE = re.compile(r"^```.*?^```[^\n]*$", re.S | re.M)
INLINE_CODE = re.compile(r"`[^`\n]*`")
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")  # [text](target) and ![alt](target)
HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*#*\s*$", re.M)


def _prose(text: str) -> str:
    """The text outside fenced code blocks (links and headings there are not markdown)."""
    return FENCE.sub("", text)


def _slug(heading: str) -> str:
    """The anchor GitHub gives a heading: inline markup dropped, lowercased, punctuation removed,
    spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).replace("`", "").replace("*", "")
    return re.sub(r"[^\w\- ]", "", text.strip().lower()).replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    anchors = set()
    for heading in HEADING.findall(_prose(path.read_text())):
        slug = _slug(heading)
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        anchors.add(slug if count == 0 else f"{slug}-{count}")
    return anchors


def _relative_links(path: Path) -> list[str]:
    text = INLINE_CODE.sub("", _prose(path.read_text()))
    return [t for t in LINK.findall(text) if not re.match(r"^[a-z][a-z0-9+.-]*:", t, re.I)]


def test_readme_is_short():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= README_MAX_LINES, \
        f"README.md has {len(lines)} lines (at most {README_MAX_LINES}): move detail into docs/"


def test_docs_exist():
    names = {p.name for p in DOCS}
    assert {"benchmarks.md", "semantics.md", "llama.md", "testing.md", "design.md"} <= names


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(doc):
    broken = []
    for target in _relative_links(doc):
        file_part, _, anchor = target.partition("#")
        dest = (doc.parent / file_part).resolve() if file_part else doc
        if not dest.exists():
            broken.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            broken.append(f"{target}: no heading with anchor #{anchor} in {dest.relative_to(ROOT)}")
    assert not broken, f"{doc.relative_to(ROOT)}: " + "; ".join(broken)


def test_link_checker_sees_links():
    """The checker is not vacuous: it finds the README's links into docs/ and the plot."""
    links = _relative_links(ROOT / "README.md")
    assert "docs/benchmarks.md" in links and any(t.endswith(".png") for t in links)


RESULTS = ROOT / "docs" / "results"
# A results file named in prose or code: docs/results/NAME or results/NAME (not benchmarks/results/,
# where a run writes its output).
RESULT_MENTION = re.compile(r"(?<![\w/])(?:docs/)?results/([\w.-]+\.(?:json|png))")
# history.md names a file that is no longer in docs/results with the commit that has it.
IN_GIT = re.compile(r"`([\w.-]+\.(?:json|png))` \(at ([0-9a-f]{7,40})\)")


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_results_files_named_in_docs_exist(doc):
    """Every docs/results file a page names, in a link, in code or in prose, is there."""
    missing = sorted({name for name in RESULT_MENTION.findall(doc.read_text()) if not (RESULTS / name).exists()})
    assert not missing, f"{doc.relative_to(ROOT)} names results files that are not in docs/results: {missing}"


def test_every_results_file_is_linked():
    """docs/results keeps only what a page shows: each file there is linked from README.md or docs/."""
    linked = {(doc.parent / target.partition("#")[0]).resolve() for doc in DOCS for target in _relative_links(doc)}
    orphans = sorted(p.name for p in RESULTS.iterdir() if p.resolve() not in linked)
    assert not orphans, f"docs/results files no page links (remove them, history.md names their commit): {orphans}"


def test_history_names_the_commit_of_each_removed_results_file():
    """A results file history.md names as removed is not in docs/results, and is in git at the commit named."""
    import subprocess

    named = IN_GIT.findall((ROOT / "docs" / "history.md").read_text())
    assert named, "history.md names no removed results file: the pattern no longer matches its text"
    assert not [name for name, _ in named if (RESULTS / name).exists()]
    git = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--is-shallow-repository"], capture_output=True, text=True)
    if git.returncode != 0 or git.stdout.strip() != "false":
        pytest.skip("not a full git checkout: the commits cannot be checked")
    absent = [f"{name} at {commit}" for name, commit in sorted(set(named))
              if subprocess.run(["git", "-C", str(ROOT), "cat-file", "-e", f"{commit}:docs/results/{name}"],
                                capture_output=True).returncode != 0]
    assert not absent, f"history.md names commits that do not have these files: {absent}"
