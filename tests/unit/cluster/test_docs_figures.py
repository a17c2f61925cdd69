"""Every measured figure has one home: a number with a unit (s, min, GiB, MB, %, tokens/s, ...) or a ratio
(``0.41x``) in README.md must appear in docs/results.md or docs/benchmarks.md, where it stands with its command,
commit, date and CPU; README quotes it with a link. And the docs name no issue of this project's tracker (a
reader has no access to it): ``#39``, "issue 41", "the issue's targets"."""

from __future__ import annotations

import re
from pathlib import Path

from tests.helpers import REPO_ROOT

HOMES = ("docs/results.md", "docs/benchmarks.md")
UNIT = r"(?:x|%|s|ms|min|minutes|h|hours|GiB|GB|MiB|MB|KB|tokens/s|points)"
NUM = r"\d[\d,]*(?:\.\d+)?"
FIGURE = re.compile(rf"(?<![\w.\-/])({NUM}(?:\s*(?:-|to)\s*{NUM})?)\s?({UNIT})(?![\w/])")
# Figures in README that are settings or specifications, not measurements, with the reason.
NOT_MEASURED = {
    "80 GB": "the GPU configs' target hardware",
    "60%": "the warm start's demonstrations' slip rate, a setting of configs/tiny_moe.yaml",
    "150x": "a setting of the routing study (learner.router_lr_scale)",
}
# An upstream project's issue, named with its project: not ours.
UPSTREAM = re.compile(r"\b(?:pytorch|vllm|ray|deepspeed|transformers|trl|verl)\s+(?:issue\s+|#)\d+", re.I)
ISSUE = re.compile(r"(?<![\w/\]&#])#\d+\b(?!-)|\b[Ii]ssues?\s+#?\d+|\b[Tt]he issue(?:'s)?\b|\bPR\s*#?\d+")


def readme_figures(text: str) -> list[tuple[int, str]]:
    """``(line, figure)`` for each number with a unit or ratio in ``text`` outside code and link targets."""
    out = []
    inside = False
    for n, line in enumerate(text.splitlines(), 1):
        if line.lstrip().startswith("```"):
            inside = not inside
            continue
        if inside:
            continue
        prose = re.sub(r"`[^`]*`|\]\([^)]*\)", "", line)
        for m in FIGURE.finditer(prose):
            out.append((n, f"{m.group(1)}{'' if m.group(2) in ('x', '%') else ' '}{m.group(2)}"))
    return out


def _variants(figure: str) -> set[str]:
    """The ways a home may write ``figure``: with or without the blank before the unit, ``-`` or `` to ``."""
    out = {figure, figure.replace(" ", ""), re.sub(r"(\d) (\w)", r"\1\2", figure)}
    out |= {re.sub(r"\s*-\s*", " to ", f) for f in out} | {f.replace(" to ", "-") for f in out}
    return out


def missing_figures(readme: str, homes: str) -> list[str]:
    """README's figures (``line: figure``) that no home holds."""
    flat = " ".join(homes.split())
    return [f"README.md:{n}: {fig}" for n, fig in readme_figures(readme)
            if fig not in NOT_MEASURED and not any(v in flat for v in _variants(fig))]


def test_every_readme_figure_lives_in_results_or_benchmarks():
    homes = " ".join((REPO_ROOT / h).read_text() for h in HOMES)
    bad = missing_figures((REPO_ROOT / "README.md").read_text(), homes)
    assert not bad, ("figures in README that docs/results.md and docs/benchmarks.md do not hold (measure them "
                     "there with command, commit, date and CPU, or drop them):\n" + "\n".join(bad))


def test_figure_check_can_fail():
    readme = "A step takes 0.41x the time, 12 min 3 s in all; `lr 3e-4` and [x](a.md) are no figures.\n"
    assert missing_figures(readme, "took 12 min on the Zen 4") == ["README.md:1: 0.41x", "README.md:1: 3 s"]
    assert missing_figures(readme, "0.41x and 12 min 3 s") == []


def doc_paths() -> list[Path]:
    return [REPO_ROOT / "README.md", REPO_ROOT / "CONTRIBUTING.md", *sorted((REPO_ROOT / "docs").rglob("*.md"))]


def issue_mentions(path: Path, root: Path = REPO_ROOT) -> list[str]:
    """``file:line: text`` for each mention of this project's issue tracker in ``path``."""
    out = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        line = UPSTREAM.sub("", re.sub(r"https?://\S+", "", line))
        for m in ISSUE.finditer(line):
            out.append(f"{path.relative_to(root)}:{n}: {m.group(0)!r}")
    return out


def test_docs_name_no_issue_numbers():
    bad = [m for p in doc_paths() for m in issue_mentions(p)]
    assert not bad, "the docs refer to the issue tracker (say what it is instead):\n" + "\n".join(bad)


def test_issue_check_can_fail(tmp_path):
    p = tmp_path / "d.md"
    p.write_text("fixed (#39); see issue 41 and the issue's targets\n[a](#3-start) pytorch issue 174763 "
                 "https://x/issues/7\n")
    assert issue_mentions(p, tmp_path) == ["d.md:1: '#39'", "d.md:1: 'issue 41'", "d.md:1: \"the issue's\""]
