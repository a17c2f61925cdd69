"""Every command a reader meets in README.md, CONTRIBUTING.md and docs/*.md is checked by kind
(``tests/helpers/doc_commands.py`` collects them with their file and line):

- a training command (``make train|submit|compare CONFIG=... ARGS=...``, ``gspo-train``, ``python -m cluster.train``,
  ``gspo-submit``, ``gspo-compare``) goes through the config load with its overrides and ``--dry-run``'s plan, in
  this process, through the front doors' own functions; a user module the command names (``myrew:score``,
  ``myenv:Guess``) is the docs' own ``# myenv.py`` block or here-document where there is one, else a stub, in a
  temporary folder on ``sys.path`` that is also the working directory;
- every ``make`` target and variable exists in the Makefile;
- every ``python bench/...``, ``gspo-*`` and ``python -m ...`` answers ``--help`` (subprocesses, concurrently);
- every config key named in an inline code span exists in the schema (docs/config.md, generated from it);
- every relative link and ``#anchor`` resolves (GitHub's heading anchors).

A command the text marks as meant to fail (``<!-- fails -->`` before its block, or ``# fails: ...`` after it) must
fail. Commands with words for the reader to fill in (``CONFIG``, ``<run>``, ``...``) have only their program
checked. Shell variables in overrides (``trainer.ray_address=$A``) are the reader's: those overrides are left out.
"""

from __future__ import annotations

import io
import logging
import os
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import pytest

from tests.helpers import REPO_ROOT
from tests.helpers.doc_commands import (
    REPO_STANDIN,
    SCRIPTS,
    Command,
    all_commands,
    block_commands,
    broken_links,
    inline_commands,
    prose_keys,
    python_blocks,
    schema_keys,
    unknown_key,
)

COMMANDS = all_commands()
FRONT_DOORS = {"-m cluster.train": "train", "gspo-train": "train", "-m cluster.submit": "submit",
               "gspo-submit": "submit", "-m cluster.compare": "compare", "gspo-compare": "compare"}
MAKE_DOORS = {"train": "train", "submit": "submit", "compare": "compare"}
# Programs whose --help is not their check, with the reason.
NO_HELP = {"-m cluster.tools.config_reference": "takes no arguments; tests/unit/cluster/test_config.py runs it"}


def door(cmd: Command) -> str | None:
    """``train``, ``submit`` or ``compare`` for a training command with a config to check, else None."""
    if cmd.template:
        return None
    if cmd.program == "make":
        target = next((a for a in cmd.args if "=" not in a), "")
        return MAKE_DOORS.get(target)
    kind = FRONT_DOORS.get(cmd.program)
    configs = [a for a in cmd.args if a.endswith((".yaml", ".yml"))]
    # A config of the reader's own (myconf.yaml) is not ours to load; one of configs/ is.
    ours = [a for a in configs if a.startswith(("configs/", REPO_STANDIN)) or a in cmd.files]
    return kind if kind and ours else None


def _unique(cmds: list[Command]) -> dict[str, list[Command]]:
    """Commands by their words (the same command in several places is checked once, all places named)."""
    out: dict[str, list[Command]] = {}
    for c in cmds:
        out.setdefault(" ".join(c.argv) + (" [fails]" if c.expect_fail else ""), []).append(c)
    return out


TRAINING = _unique([c for c in COMMANDS if door(c)])


def front_door_args(cmd: Command) -> list[str]:
    """The arguments the front door gets: ``make``'s ``CONFIG`` and ``ARGS`` unpacked, the docs' stand-in for the
    checkout made the real one, overrides holding a shell variable left out."""
    import shlex

    if cmd.program == "make":
        var = dict(a.split("=", 1) for a in cmd.args if "=" in a)
        args = [var.get("CONFIG", "configs/tiny_moe.yaml"), *shlex.split(var.get("ARGS", ""))]
    else:
        args = list(cmd.args)
    args = [a.replace(REPO_STANDIN, str(REPO_ROOT)) for a in args if "$" not in a]
    return [str(REPO_ROOT / a) if a.endswith((".yaml", ".yml")) and (REPO_ROOT / a).exists() else a for a in args]


STUB_VERIFIER = "def {attr}(response: str, row: dict) -> float:\n    return 0.0\n"
STUB_ENV = ("from reward.environment import Environment\n\n\nclass {attr}(Environment):\n"
            "    def initial_messages(self) -> list[dict]:\n        return [{{'role': 'user', 'content': 'hi'}}]\n")


def user_modules(cmd: Command, args: list[str], folder: Path) -> list[str]:
    """Write the user modules ``args`` name (``key=module:attr`` whose module is not importable from the checkout)
    into ``folder``: the block's here-documents, the docs' ``# name.py`` blocks, else a stub by key. Returns
    their module names."""
    for name, text in cmd.files.items():
        (folder / name).write_text(text)
    examples = python_blocks()
    names = []
    for a in args:
        m = re.match(r"^([\w.]+)=([A-Za-z_]\w*):([A-Za-z_]\w*)$", a)
        if not m or (REPO_ROOT / m.group(2).replace(".", "/")).with_suffix(".py").exists():
            continue
        key, mod, attr = m.groups()
        names.append(mod)
        if (folder / f"{mod}.py").exists():
            continue
        if mod in examples:
            text = examples[mod]
        elif key.endswith("verifier"):
            text = STUB_VERIFIER.format(attr=attr)
        elif key == "env.cls":
            text = STUB_ENV.format(attr=attr)
        else:
            raise AssertionError(f"{cmd.where}: no stub for {a} (add one to user_modules)")
        (folder / f"{mod}.py").write_text(text)
    return names


class _Stop(Exception):
    """Raised in place of ``gspo-compare``'s first run: every arm's config was checked before it."""


def check_front_door(kind: str, args: list[str], tmp: Path, monkeypatch) -> tuple[int, str]:
    """Run ``kind``'s checks on ``args`` in this process: the exit code (0 when the command would start its job)
    and what it wrote."""
    from cluster import train

    out = io.StringIO()
    with redirect_stdout(out), redirect_stderr(out):
        try:
            if kind == "train":
                code = train.main(args if "--dry-run" in args else [*args, "--dry-run"])
            elif kind == "submit":
                from cluster.submit.job import build_parser, prepare_config

                ns = build_parser().parse_args(args)
                prep = prepare_config(ns.config, list(ns.overrides), ns.folder)
                code = train.main([ns.config, *prep["overrides"], "--dry-run"])
            else:
                from cluster.compare import runs as compare

                monkeypatch.setattr(compare, "run_one", lambda *a, **k: (_ for _ in ()).throw(_Stop()))
                code = compare.main([*args, "--output-dir", str(tmp / "compare")])
        except _Stop:
            code = 0
        except SystemExit as e:  # argparse
            code = e.code if isinstance(e.code, int) else 2
        except Exception as e:  # noqa: BLE001 - a refusal (ConfigError from submit's checks) is the answer
            code, _ = 2, print(f"{type(e).__name__}: {e}", file=out)
    return code, out.getvalue()


@pytest.fixture
def isolated_logging():
    """The front doors configure the root logger (``cluster.runtime.console``); put it back afterwards."""
    root = logging.getLogger()
    handlers, level, env = list(root.handlers), root.level, dict(os.environ)
    yield
    root.handlers[:] = handlers
    root.setLevel(level)
    logging.captureWarnings(False)
    os.environ.clear()
    os.environ.update(env)


@pytest.mark.parametrize("key", list(TRAINING), ids=[v[0].where for v in TRAINING.values()])
def test_training_command_loads_and_plans(key, tmp_path, monkeypatch, isolated_logging):
    cmds = TRAINING[key]
    cmd = cmds[0]
    args = front_door_args(cmd)
    mods = user_modules(cmd, args, tmp_path)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        code, out = check_front_door(door(cmd), args, tmp_path, monkeypatch)
    finally:
        for m in mods:
            sys.modules.pop(m, None)
    where = ", ".join(c.where for c in cmds)
    tail = "\n".join(out.strip().splitlines()[-6:])
    if cmd.expect_fail:
        assert code != 0, f"{where}: `{cmd.text}` is marked to fail but passes the config load and the plan"
    else:
        assert code == 0, f"{where}: `{cmd.text}` fails the config load or the plan (exit {code}):\n{tail}"


def makefile() -> tuple[set[str], set[str]]:
    """The Makefile's targets and variables."""
    text = (REPO_ROOT / "Makefile").read_text()
    targets = set(re.findall(r"^([\w.-]+)\s*:(?!=)", text, re.M))
    variables = set(re.findall(r"^([A-Z_]+)\s*[?:]?=", text, re.M)) | set(re.findall(r"\$\(([A-Z_]+)\)", text))
    return targets, variables


def test_make_targets_and_variables_exist():
    targets, variables = makefile()
    bad = []
    for c in COMMANDS:
        if c.program != "make":
            continue
        words = [a for a in c.args if not a.startswith("-")]
        names = [a for a in words if "=" not in a] or ["(default)"]
        missing = [t for t in names if t != "(default)" and t not in targets]
        unknown = [a.split("=")[0] for a in words if "=" in a and a.split("=")[0] not in variables]
        if bool(missing or unknown) != c.expect_fail:
            bad.append(f"{c.where}: `{c.text}`: " + (f"no target {missing} " if missing else "")
                       + (f"no variable {unknown}" if unknown else "") + ("marked to fail" if c.expect_fail else ""))
    assert not bad, "\n".join(bad)


def entry_point(script: str) -> tuple[str, str]:
    """``(module, function)`` of a console script of pyproject.toml."""
    text = (REPO_ROOT / "pyproject.toml").read_text()
    return re.search(rf"^{script} = \"([\w.]+):(\w+)\"", text, re.M).groups()


def help_command(program: str) -> list[str]:
    """The command line asking ``program`` (``gspo-x``, ``-m mod``, ``bench/x.py``) for ``--help``."""
    if program.startswith("gspo-"):
        mod, fn = entry_point(program)
        return [sys.executable, "-c", f"import sys; sys.argv = ['{program}', '--help']; from {mod} import {fn}; "
                f"sys.exit({fn}())"]
    if program.startswith("-m "):
        return [sys.executable, "-m", program[3:], "--help"]
    return [sys.executable, str(REPO_ROOT / program), "--help"]


def test_every_program_answers_help():
    programs: dict[str, list[Command]] = {}
    for c in COMMANDS:
        if c.program != "make" and c.program not in NO_HELP and not re.search(r"\.\.\.|\*|-m [A-Z]+$", c.program):
            programs.setdefault(c.program, []).append(c)
    unknown = [f"{cs[0].where}: `{p}` is not a console script of pyproject.toml"
               for p, cs in programs.items() if p.startswith("gspo-") and p not in SCRIPTS]
    assert not unknown, "\n".join(unknown)
    # A console script whose module the docs also run as `python -m` is asked once, as `-m` (each --help is a
    # second or more of imports on 2 cores); its entry point is checked to be a function of that module.
    for p in [p for p in programs if p.startswith("gspo-")]:
        mod, fn = entry_point(p)
        if f"-m {mod}" in programs:
            assert re.search(rf"^def {fn}\(", (REPO_ROOT / mod.replace(".", "/")).with_suffix(".py").read_text(),
                             re.M), f"{programs[p][0].where}: {p}'s entry point {mod}:{fn} is no function"
            del programs[p]
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}

    def run(program: str) -> tuple[str, subprocess.CompletedProcess]:
        return program, subprocess.run(help_command(program), cwd=REPO_ROOT, env=env, capture_output=True,
                                       text=True, timeout=120)

    with ThreadPoolExecutor(max_workers=4) as pool:
        results = list(pool.map(run, sorted(programs)))
    bad = [f"{programs[p][0].where}: `{programs[p][0].text}`: `{p} --help` exits {r.returncode}: "
           f"{(r.stderr.strip().splitlines() or [''])[-1]}"
           for p, r in results if r.returncode != 0 or "usage" not in r.stdout.lower()]
    assert not bad, "\n".join(bad)


def test_config_keys_in_prose_exist():
    keys, open_keys = schema_keys()
    bad = [f"{where}: `{name}` is no key of the schema (docs/config.md)"
           for where, name in prose_keys() if unknown_key(name, keys, open_keys)]
    assert not bad, "\n".join(bad)


def test_override_keys_of_template_commands_exist():
    """A command with words to fill in is not loaded, but the keys it names still exist."""
    keys, open_keys = schema_keys()
    bad = []
    for c in COMMANDS:
        if FRONT_DOORS.get(c.program) and c.template:
            for a in c.args:
                if m := re.match(r"^([a-z_]+(?:\.[a-z_0-9]+)+)=", a):
                    if unknown_key(m.group(1), keys, open_keys):
                        bad.append(f"{c.where}: `{m.group(1)}` is no key of the schema")
    assert not bad, "\n".join(bad)


def test_links_and_anchors_resolve():
    bad = broken_links()
    assert not bad, "\n".join(bad)


def test_the_gpu_configs_are_among_the_checked_commands():
    """configs/qwen3_* are validated through --dry-run here (on the CPU) by the docs' own commands."""
    checked = {a for cs in TRAINING.values() for a in front_door_args(cs[0])}
    for config in sorted((REPO_ROOT / "configs").glob("qwen3_*.yaml")):
        assert str(config) in checked, f"no doc command runs {config.name}; its --dry-run is not checked"


# ---- the collector itself ----

DOC = """# Title

```bash
make train CONFIG=configs/tiny_moe.yaml ARGS="trainer.total_steps=2"   # a comment
cd ~/x && gspo-train /path/to/gspo-rl/configs/tiny_moe.yaml \\
    reward.verifier=myrew:score
ray start --head
PYTHONPATH=$PWD .venv/bin/python bench/sync.py --sizes 1m > out.txt
gspo-train configs/tiny_moe.yaml learner.no_such_key=1   # fails: no such key
```

<!-- fails -->
```bash
cat > myrew.py <<'PY'
def score(response, row):
    return 0.0
PY
python -m cluster.train CONFIG ...
```

Prose with `make test-fast` and `gspo-audit RUN_DIR --step N` and `learner.clip_low`, `reward.envs.calculator:calc`.
"""


def test_collector_reads_blocks_markers_and_spans(tmp_path):
    doc = tmp_path / "doc.md"
    doc.write_text(DOC)
    cmds = block_commands(doc, tmp_path)
    got = [(c.where, c.program, c.expect_fail, c.template) for c in cmds]
    assert got == [("doc.md:4", "make", False, False), ("doc.md:5", "gspo-train", False, False),
                   ("doc.md:8", "bench/sync.py", False, False), ("doc.md:9", "gspo-train", True, False),
                   ("doc.md:18", "-m cluster.train", True, True)]
    assert cmds[1].args == ["/path/to/gspo-rl/configs/tiny_moe.yaml", "reward.verifier=myrew:score"]
    assert cmds[2].args == ["--sizes", "1m"]  # the assignment and the redirection dropped
    assert cmds[4].files == {"myrew.py": "def score(response, row):\n    return 0.0\n"}
    assert door(cmds[0]) == "train" and front_door_args(cmds[0])[1:] == ["trainer.total_steps=2"]
    spans = [(c.where, c.program, c.template) for c in inline_commands(doc, tmp_path)]
    assert spans == [("doc.md:21", "make", False), ("doc.md:21", "gspo-audit", True)]


def test_a_command_marked_to_fail_that_passes_is_reported(tmp_path, monkeypatch, isolated_logging):
    """The inverted check can fail: the marked command is refused, the same command unmarked passes."""
    doc = tmp_path / "doc.md"
    doc.write_text(DOC)
    marked = block_commands(doc, tmp_path)[3]
    code, out = check_front_door("train", front_door_args(marked), tmp_path, monkeypatch)
    assert code == 2 and "no_such_key" in out
    good = block_commands(doc, tmp_path)[0]
    assert check_front_door("train", front_door_args(good), tmp_path, monkeypatch)[0] == 0


def test_links_check_finds_a_missing_anchor_and_file(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "README.md").write_text("# A `b` c: d\n\n[x](#a-b-c-d) [y](docs/u.md#nope) [z](missing.md)\n"
                                        "## A `b` c: d\n[w](#a-b-c-d-1)\n")
    (tmp_path / "docs" / "u.md").write_text("# U\n")
    assert broken_links(tmp_path) == ["README.md:3: docs/u.md#nope (no heading with anchor #nope in docs/u.md)",
                                      "README.md:3: missing.md (no such file)"]
