"""Every relative link of the documentation resolves: README.md, docs/*.md and every Markdown file they
link to (the design notes, configs/ and scripts/ READMEs). A link's file must exist inside the repository
(a clone has nothing outside it), and its #anchor must name a heading of that file by GitHub's slug rules.
Reads files only: no processes, well under a second."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# Fenced code blocks and inline code spans hold no links (a `[a](b)` there is text, not a link).
_FENCE = re.compile(r"^ {0,3}(```|~~~)[^\n]*\n.*?^ {0,3}\1[^\n]*$", re.M | re.S)
_CODE_SPAN = re.compile(r"(`+)(.+?)(?<!`)\1(?!`)", re.S)
# [text](target) and ![alt](target); link text may hold one level of brackets, a target an optional "title".
_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*<?([^()\s<>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_HEADING = re.compile(r"^ {0,3}#{1,6}[ \t]+(.+?)[ \t]*#*[ \t]*$", re.M)
_SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")


def github_slug(heading: str) -> str:
    """The anchor GitHub gives a heading: its rendered text lower-cased, punctuation dropped (letters, digits,
    '_', '-' and spaces stay), each space a '-'."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link renders as its text
    text = text.replace("`", "").replace("*", "")
    text = re.sub(r"<[^>]+>", "", text)  # inline HTML renders without its tags
    return re.sub(r"[^\w\- ]", "", text.strip().lower()).replace(" ", "-")


def _without_code(markdown: str) -> str:
    markdown = _FENCE.sub("", markdown)
    return _CODE_SPAN.sub(lambda m: "code", markdown)


def anchors(markdown: str) -> set[str]:
    """Every heading's anchor; a repeated slug gets -1, -2, ... as on GitHub."""
    seen: dict[str, int] = {}
    out = set()
    for heading in _HEADING.findall(_FENCE.sub("", markdown)):
        slug = github_slug(heading)
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def links(markdown: str) -> list[str]:
    return _LINK.findall(_without_code(markdown))


def check_links(start: list[Path], root: Path) -> tuple[list[str], list[Path]]:
    """Follows relative links from the start files through every Markdown file they reach. Returns the
    problems (file: link: why) and the Markdown files checked."""
    root = root.resolve()
    problems: list[str] = []
    queue = [p.resolve() for p in start]
    checked: list[Path] = []
    while queue:
        page = queue.pop(0)
        if page in checked:
            continue
        checked.append(page)
        text = page.read_text(encoding="utf-8")
        where = page.relative_to(root)
        for target in links(text):
            if _SCHEME.match(target):
                continue  # http(s), mailto: not this test's business
            path_part, _, anchor = target.partition("#")
            if path_part.startswith("/"):
                problems.append(f"{where}: {target}: absolute path (write it relative to {where})")
                continue
            dest = (page.parent / path_part).resolve() if path_part else page
            if dest != root and root not in dest.parents:
                problems.append(f"{where}: {target}: leaves the repository ({dest}); a clone does not have it")
                continue
            if not dest.exists():
                problems.append(f"{where}: {target}: no such file {dest.relative_to(root)}")
                continue
            if dest.suffix == ".md" and dest.is_file():
                queue.append(dest)
            if anchor:
                if dest.suffix != ".md" or not dest.is_file():
                    problems.append(f"{where}: {target}: an anchor into a file that is not Markdown")
                elif anchor not in anchors(dest.read_text(encoding="utf-8")):
                    problems.append(f"{where}: {target}: no heading with anchor #{anchor} in {dest.relative_to(root)}")
    return problems, checked


def test_every_relative_link_in_readme_and_docs_resolves():
    docs = sorted((ROOT / "docs").glob("*.md"))
    problems, checked = check_links([ROOT / "README.md", *docs], ROOT)
    assert problems == [], "broken links:\n" + "\n".join(problems)
    # the crawl reached the design notes through the docs (so their links were checked too)
    for note in ("megarl/weight_sync/DESIGN.md", "megarl/plan/DESIGN.md", "configs/README.md"):
        assert (ROOT / note).resolve() in checked, f"{note} is no longer linked from README.md or docs/"


def test_every_docs_page_is_linked_from_the_readme():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    linked = {(ROOT / t.partition("#")[0]).resolve() for t in links(readme) if not _SCHEME.match(t)}
    # docs/README.md is the folder's own index (what GitHub shows in docs/); it points back to the front page
    pages = [p for p in sorted((ROOT / "docs").glob("*.md")) if p.name != "README.md"]
    orphans = [p.name for p in pages if p.resolve() not in linked]
    assert orphans == [], f"docs pages the front page does not link to: {orphans}"


def test_github_slugs_of_known_headings():
    # anchors as GitHub renders them for these headings
    assert github_slug("Training: `megarl train`") == "training-megarl-train"
    assert github_slug("Weights & Biases") == "weights--biases"
    assert github_slug("AIPO vs GSPO vs the PPO clip on the demo") == "aipo-vs-gspo-vs-the-ppo-clip-on-the-demo"
    assert github_slug("The configs' predicted step times") == "the-configs-predicted-step-times"
    assert github_slug("`dtype: auto`") == "dtype-auto"
    assert github_slug("CPU machines: `make setup`") == "cpu-machines-make-setup"
    assert github_slug("Per-step metrics (`tokens_per_s`)") == "per-step-metrics-tokens_per_s"
    assert anchors("# A\n## A\n```\n# not a heading\n```\n## A\n") == {"a", "a-1", "a-2"}


def test_broken_links_and_anchors_are_reported(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "b.md").write_text("# Real heading\n\ntext\n")
    (tmp_path / "a.md").write_text(
        "ok [b](docs/b.md#real-heading), [self](#top)\n"
        "# Top\n"
        "[gone](docs/missing.md) [bad anchor](docs/b.md#no-such) [outside](../elsewhere.md)\n"
        "`[in code](docs/missing.md)`\n\n```\n[fenced](docs/missing.md)\n```\n"
        "[web](https://example.com/x.md)\n"
    )
    problems, checked = check_links([tmp_path / "a.md"], tmp_path)
    assert [p.split(": ")[1] for p in problems] == ["docs/missing.md", "docs/b.md#no-such", "../elsewhere.md"]
    assert checked == [(tmp_path / "a.md").resolve(), (tmp_path / "docs" / "b.md").resolve()]
