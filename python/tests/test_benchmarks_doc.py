"""docs/BENCHMARKS.md never leaves a target unmet without saying why: every
figure its tables (the main one and the event plane's) mark **no** has its
note under "Targets not met" in
docs/benchmark-findings.md (the text scripts/bench.py puts under the table),
which says why and what meeting it would take."""

import pathlib
import re

DOCS = pathlib.Path(__file__).resolve().parents[2] / "docs"


def unmet(table: str) -> list[str]:
    # A name may carry a label after it: `events_store_ratio_4KiB` (1000-byte keys).
    return re.findall(r"^\| `([A-Za-z0-9_]+)`(?: [^|]*)? \| [^|]+ \| [^|]+ \| \*\*no\*\* \|$", table, re.M)


def tables(doc: str) -> str:
    """The main table (before the first section) and the event plane's,
    which scripts/bench_events.py appends after the raw figures."""
    events = doc.split("\n## Event plane\n", 1)
    return doc.split("## ", 1)[0] + (events[1].split("\n## ", 1)[0] if len(events) == 2 else "")


def noted(findings: str) -> str:
    part = findings.split("## Targets not met", 1)
    assert len(part) == 2, "benchmark-findings.md has no 'Targets not met' section"
    section = part[1].split("\n## ", 1)[0]
    return "\n".join(line for line in section.splitlines() if line.startswith("- **"))


def test_every_target_the_benchmarks_table_marks_unmet_has_its_note():
    table = tables((DOCS / "BENCHMARKS.md").read_text())
    missing = [f for f in unmet(table) if f"`{f}`" not in noted((DOCS / "benchmark-findings.md").read_text())]
    assert not missing, f"unmet in docs/BENCHMARKS.md without a note under 'Targets not met': {missing}"


def test_the_check_reads_the_table_as_bench_py_writes_it():
    rows = "| `a_ratio_2MiB` | 0.6 | >= 0.8 | **no** |\n| `b_ratio` | 1.2 | >= 0.8 | yes |\n| `c` | 3 | (reference) | |"
    assert unmet(rows) == ["a_ratio_2MiB"]
    assert unmet("| `d_ratio_4KiB` (1000-byte keys) | 0.886 | >= 0.9 | **no** |") == ["d_ratio_4KiB"]
    doc = "# t\n| `a` | 1 | >= 2 | **no** |\n## S\n| `b` | 1 | >= 2 | **no** |\n## Event plane\n| `c` | 1 | >= 2 | **no** |\n"
    assert unmet(tables(doc)) == ["a", "c"]
    assert "`a_ratio`" in noted("x\n## Targets not met\n\n- **`a_ratio` ≥ 0.8** — why\n\n## Next\n- **`b`**")
    assert "`b`" not in noted("x\n## Targets not met\n\n- **`a_ratio` ≥ 0.8** — why\n\n## Next\n- **`b`**")
