"""The documentation against the code: the README stays a front page, and docs/configuration.md lists every setting
the services read, each under its real name, and nothing they do not read."""
from __future__ import annotations

import re
from pathlib import Path

from services.settings import OUTSIDE_VARIABLES, CommonSettings, _settings_classes

ROOT = Path(__file__).resolve().parent.parent
CONFIGURATION = ROOT / "docs" / "configuration.md"
OUTSIDE_HEADING = "## Variables outside the services"
NAME = re.compile(r"`(HYBRIDSERVE_[A-Z0-9_]+)`")


def table_rows(text: str) -> list[list[str]]:
    """The cells of every markdown table row (separator rows left out)."""
    rows = []
    for line in text.splitlines():
        if line.startswith("|") and not set(line) <= set("|-: "):
            rows.append([c.strip() for c in line.strip().strip("|").split(" | ")])
    return rows


def first_cell_names(text: str) -> set[str]:
    return {name for row in table_rows(text) for name in NAME.findall(row[0])}


def settings_names() -> set[str]:
    return {c.env_name(f) for c in [CommonSettings, *_settings_classes()] for f in c.model_fields}


def old_names() -> set[str]:
    return {old for c in _settings_classes() for old in c.old_env_names()}


def test_the_readme_is_a_front_page():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 200
    assert [n for n, line in enumerate(lines, 1) if len(line) > 120] == []
    text = "\n".join(lines)
    assert "make run" in text and "make test" in text
    assert "docs/configuration.md" in text and "docs/api.md" in text


def test_every_setting_has_its_row_under_its_real_name():
    services_part = CONFIGURATION.read_text().split(OUTSIDE_HEADING)[0]
    documented = first_cell_names(services_part)
    assert sorted(settings_names() - documented) == []
    # and nothing documented as a setting that no process reads (an old name only in the old-names table)
    assert sorted(documented - settings_names() - old_names()) == []


def test_the_variables_outside_the_services_are_read_where_the_page_says():
    outside = CONFIGURATION.read_text().split(OUTSIDE_HEADING)[1]
    rows = [row for row in table_rows(outside) if NAME.search(row[0])]
    assert rows
    # the services leave exactly these alone (services/settings.py)
    assert {NAME.search(row[0]).group(1) for row in rows} == set(OUTSIDE_VARIABLES)
    for row in rows:
        name, reader = NAME.search(row[0]).group(1), row[1].strip("`")
        assert name not in settings_names()
        assert name in (ROOT / reader).read_text(), f"{reader} does not read {name}"


def test_every_metric_is_on_the_observability_page():
    metric = re.compile(r"\b(?:Counter|Gauge|Histogram)\(\s*\"(hybridserve_[a-z0-9_]+)\"")
    names = {m for path in (ROOT / "services").rglob("*.py") for m in metric.findall(path.read_text())}
    assert len(names) > 40  # the scan found the metrics
    page = (ROOT / "docs" / "observability.md").read_text()
    assert sorted(n for n in names if n not in page) == []
