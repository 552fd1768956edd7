"""The documentation cannot drift: generated pages equal their rendering, and every relative link resolves."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PAGES = [REPO / "README.md", REPO / "benchmarks" / "README.md", *sorted((REPO / "docs").glob("*.md"))]
LINK = re.compile(r"\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")  # [text](target) or [text](target "title")
FENCE = re.compile(r"^```.*?^```", re.S | re.M)


def test_params_page_is_rendered_from_the_models():
    from eaglepipe.params_doc import render

    assert (REPO / "docs" / "params.md").read_text() == render(), \
        "docs/params.md is stale: python -m eaglepipe.params_doc > docs/params.md"


def test_conventions_page_is_rendered_from_the_rules():
    from eaglepipe.contract.convention_doc import render

    assert (REPO / "docs" / "conventions.md").read_text() == render(), \
        "docs/conventions.md is stale: python -m eaglepipe.contract.convention_doc > docs/conventions.md"


def test_every_params_field_has_a_description():
    from pydantic import BaseModel

    from eaglepipe.params import Params

    missing = []
    for name, field in Params.model_fields.items():
        section = field.annotation
        if isinstance(section, type) and issubclass(section, BaseModel):
            missing += [f"{field.alias or name}.{n}" for n, f in section.model_fields.items() if not f.description]
        elif not field.description:
            missing.append(name)
    assert not missing, f"params without a Field(description=...): {missing}"


def relative_links(page: Path) -> list[str]:
    """The link targets of a markdown page that name a file of the repository (no URL, no bare #anchor)."""
    text = FENCE.sub("", page.read_text())
    return [t for t in LINK.findall(text) if not re.match(r"[a-z][a-z0-9+.-]*:|#", t)]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_relative_links_point_to_existing_files(page):
    assert page.is_file(), f"{page.relative_to(REPO)} is missing"
    broken = [t for t in relative_links(page) if not (page.parent / t.split("#")[0]).exists()]
    assert not broken, f"{page.relative_to(REPO)}: links to missing files: {broken}"


def test_the_link_check_sees_links():
    """The pattern finds what it is for (a check that finds nothing passes vacuously)."""
    assert relative_links(REPO / "README.md"), "README.md has no relative link: is the pattern broken?"
