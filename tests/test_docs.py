"""The documentation's links: every relative link (and #anchor) in README.md, docs/*.md and benchmark/README.md
points at a file in the repository and, for an anchor, at a heading of it as GitHub names them; README.md stays
short (the rest lives in docs/). Pure Python, no network: web links are not followed."""
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README_MAX_LINES = 250

FENCE = re.compile(r"^\s*(```|~~~)")
# [text](target) and ![alt](target), text with one level of nested brackets; an optional "title" after the target
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
REFERENCE = re.compile(r"^\s{0,3}\[[^\]]+\]:\s+<?(\S+?)>?(?:\s+\"[^\"]*\")?\s*$")  # [name]: target
INLINE_CODE = re.compile(r"(`+).*?\1")
HEADING = re.compile(r"^\s{0,3}(#{1,6})\s+(.*?)\s*#*\s*$")


def documents() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "benchmark" / "README.md"]


def prose_lines(text: str):
    """(line number, line) outside fenced code blocks."""
    fenced = False
    for n, line in enumerate(text.splitlines(), 1):
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            yield n, line


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: its text (inline markup and links reduced to their text) lowercased, every
    character but letters, digits, spaces, hyphens and underscores dropped, spaces turned into hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)
    text = re.sub(r"<[^>]+>", "", text).lower()
    text = "".join(c for c in text if c.isalnum() or c in " -_")
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every heading's anchor in a markdown file, a repeated one numbered as GitHub numbers it (-1, -2, ...)."""
    seen: dict[str, int] = {}
    out = set()
    for _, line in prose_lines(path.read_text()):
        m = HEADING.match(line)
        if not m:
            continue
        base = slug(m.group(2))
        count = seen.get(base, 0)
        out.add(base if count == 0 else f"{base}-{count}")
        seen[base] = count + 1
    return out


def links(path: Path):
    """(line number, target) of every link in a markdown file's prose; a link's text may run over lines."""
    numbered = list(prose_lines(path.read_text()))
    text, starts = "", []
    for n, line in numbered:
        reference = REFERENCE.match(line)
        if reference:
            yield n, reference.group(1)
            line = ""
        starts.append((len(text), n))
        text += INLINE_CODE.sub(lambda m: " " * len(m.group(0)), line) + "\n"  # (code blanked, offsets kept)
    for m in LINK.finditer(text):
        yield next(n for at, n in reversed(starts) if at <= m.start()), m.group(1)


def broken(path: Path, target: str, cache: dict) -> str | None:
    """Why a link from `path` does not resolve, or None."""
    if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I):  # https:, mailto:, ...: not followed here
        return None
    file_part, _, anchor = target.partition("#")
    dest = (path.parent / file_part).resolve() if file_part else path
    if not dest.is_relative_to(ROOT):
        return f"{target}: leaves the repository (it would not resolve on GitHub)"
    if not dest.exists():
        return f"{target}: no such file or folder ({dest.relative_to(ROOT)})"
    if not anchor:
        return None
    if dest.suffix.lower() != ".md":
        return None if re.fullmatch(r"L\d+(-L\d+)?", anchor) else f"{target}: an anchor into a file that is not markdown"
    if dest not in cache:
        cache[dest] = anchors(dest)
    if anchor not in cache[dest]:
        return f"{target}: no heading '#{anchor}' in {dest.relative_to(ROOT)}"
    return None


@pytest.mark.parametrize("doc", documents(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(doc):
    assert doc.exists(), f"{doc.relative_to(ROOT)} is missing"
    cache: dict = {}
    problems = [f"{doc.relative_to(ROOT)}:{n}: {why}" for n, target in links(doc)
                if (why := broken(doc, target, cache)) is not None]
    assert problems == []


def test_readme_is_short():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines: move detail into docs/"


def test_every_docs_page_is_in_the_index():
    listed = {t.partition("#")[0] for _, t in links(ROOT / "docs" / "README.md")}
    missing = [p.name for p in sorted((ROOT / "docs").glob("*.md")) if p.name != "README.md" and p.name not in listed]
    assert missing == [], f"docs/README.md does not list {missing}"


def test_the_checker_sees_broken_links(tmp_path, monkeypatch):
    """The checks themselves: a missing file, a missing heading, a link out of the repository, and the links in a
    code block left alone."""
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    (tmp_path / "a.md").write_text("# Title\n\n## The `x` step: one (two)\n\n## Title\n")
    doc = tmp_path / "b.md"
    doc.write_text("[ok](a.md#the-x-step-one-two) [dup](a.md#title-1) [self](#here) [web](https://example.com)\n"
                   "# Here\n[gone](nope.md) [bad](a.md#nowhere) [out](../x.md)\n```\n[in code](nope.md)\n```\n"
                   "`[in inline code](nope.md)` and [a text over\ntwo lines](nope.md)\n")
    cache: dict = {}
    assert [n for n, t in links(doc) if broken(doc, t, cache)] == [3, 3, 3, 7]
