"""The commands, config keys and links a reader meets in the docs (README.md, CONTRIBUTING.md, docs/*.md), collected
with the file and line they stand on, for tests/unit/cluster/test_docs_commands.py.

A command is a line of a shell block (```bash, ```sh, ```console or a plain ```) or an inline code span whose
program is one of ours: ``make``, a ``gspo-*`` console script, ``python -m MODULE`` or ``python bench/....py``
(any ``python``, ``.venv/bin/python`` or ``/path/to/gspo-rl/.venv/bin/python``; leading ``NAME=value``
assignments, ``cd DIR &&`` and redirections are dropped). Other programs (``ray start``, ``ssh``, ``srun``) are not
ours to check. A command meant to fail is marked in the text (CONTRIBUTING.md, "Docs that run"): an HTML comment
``<!-- fails -->`` on the line before a block marks each command in it, a trailing ``# fails: why`` one line.
A ``cat > NAME <<'TAG'`` here-document in a block is a file the block's later commands may use.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path

from tests.helpers import REPO_ROOT

DOC_GLOBS = ("README.md", "CONTRIBUTING.md", "docs/*.md")
SHELL_LANGS = {"", "bash", "sh", "shell", "console"}
FAILS_BLOCK = "<!-- fails -->"
FAILS_LINE = re.compile(r"#\s*fails\b")
PYTHON = re.compile(r"^(?:.*/)?python(?:3(?:\.\d+)?)?$")
FENCE = re.compile(r"^\s*```\s*([\w-]*)")
HEREDOC = re.compile(r"^\s*cat\s+>\s*(\S+)\s+<<-?\s*'?(\w+)'?\s*$")
ASSIGN = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")
# A token a reader is meant to fill in: CONFIG, FILE, <the run>, ..., raysubmit_XXXX, HEAD:8265.
PLACEHOLDER = re.compile(r"(?<![\w./$-])(?:[A-Z][A-Z_]{2,}|[A-Z])(?![\w./=-])|<[^>]*>|\bHEAD\b|\[--")
ELLIPSIS = re.compile(r"\.\.\.|XXXX")  # a placeholder even inside quotes (ARGS="...")
SCRIPTS = set(re.findall(r"^(gspo-[a-z-]+) = ", (REPO_ROOT / "pyproject.toml").read_text(), re.M))
REPO_STANDIN = "/path/to/gspo-rl"  # the docs' name for the checkout


def doc_files(root: Path = REPO_ROOT) -> list[Path]:
    """The docs a reader reads, in a fixed order."""
    return [p for g in DOC_GLOBS for p in sorted(root.glob(g))]


@dataclass
class Command:
    """One command as the docs give it.

    Attributes:
        where: ``file:line`` of its first line.
        text: the command line (continuations joined, the comment dropped).
        argv: its words, ``NAME=value`` prefixes, ``cd DIR &&`` and redirections dropped.
        expect_fail: the text marks it as meant to fail.
        files: here-documents written earlier in the same block (name -> text).
    """

    where: str
    text: str
    argv: list[str]
    expect_fail: bool = False
    files: dict[str, str] = field(default_factory=dict)

    @property
    def program(self) -> str:
        """``make``, ``gspo-<name>``, ``-m <module>``, ``bench/<script>.py`` or ``""`` for a program not ours."""
        if not self.argv:
            return ""
        head = self.argv[0]
        if head == "make":
            return "make"
        if m := re.match(r"^(?:(?:.*/)?\.venv/bin/)?(gspo-[a-z-]+)$", head):
            return m.group(1) if m.group(1) in SCRIPTS or len(self.argv) > 1 else ""
        if PYTHON.match(head) and len(self.argv) > 1:
            if self.argv[1] == "-m" and len(self.argv) > 2:
                return f"-m {self.argv[2]}"
            if self.argv[1].endswith(".py"):
                return self.argv[1].replace(REPO_STANDIN + "/", "")
        return ""

    @property
    def args(self) -> list[str]:
        """The words after the program."""
        skip = {"make": 1}.get(self.program, 3 if self.program.startswith("-m ") else 2)
        return self.argv[1:] if self.program.startswith("gspo-") else self.argv[skip:]

    @property
    def template(self) -> bool:
        """It has words for the reader to fill in (``CONFIG``, ``<run>``, ``...``): only its program is checked."""
        unquoted = re.sub(r"'[^']*'|\"[^\"]*\"", "", self.text)
        return bool(PLACEHOLDER.search(unquoted) or ELLIPSIS.search(self.text))


def _segments(text: str) -> list[list[str]]:
    """The simple commands of a shell line: split at ``&&``, ``||``, ``;`` and ``|``, redirections dropped."""
    lex = shlex.shlex(text, posix=True, punctuation_chars="();<>|&")
    lex.whitespace_split = True
    lex.commenters = ""
    try:
        words = list(lex)
    except ValueError:  # an unclosed quote: not a command we can read
        return []
    out, cur, skip = [], [], False
    for w in words:
        if skip:
            skip = False
            continue
        if w in {"&&", "||", ";", "|", "&", "(", ")"}:
            out.append(cur)
            cur = []
        elif w in {">", ">>", "<", "2>", "&>"} or set(w) <= set("<>&") and w:
            skip = True
        else:
            cur.append(w)
    return [s for s in out + [cur] if s]


def _strip_comment(line: str) -> str:
    """``line`` without a trailing ``# ...`` shell comment (one outside quotes, after a blank)."""
    quote = None
    for i, ch in enumerate(line):
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or line[i - 1] in " \t"):
            return line[:i].rstrip()
    return line


def parse_command_line(line: str, where: str, expect_fail: bool = False,
                       files: dict[str, str] | None = None) -> list[Command]:
    """The commands of ours on one shell line (see the module docstring); ``[]`` for none."""
    out = []
    line = _strip_comment(line.replace("\\|", "|"))
    for seg in _segments(line):
        while seg and (ASSIGN.match(seg[0]) or seg[0] in {"exec", "time", "nohup"}):
            seg = seg[1:]
        if seg[:1] == ["cd"] or not seg:
            continue
        cmd = Command(where, line.strip(), seg, expect_fail, dict(files or {}))
        if cmd.program:
            out.append(cmd)
    return out


def _blank_fences(lines: list[str]) -> list[str]:
    """``lines`` with every fenced block's lines (fences included) blanked, so inline spans are found only in prose."""
    out, inside = [], False
    for line in lines:
        if FENCE.match(line):
            inside = not inside
            out.append("")
        else:
            out.append("" if inside else line)
    return out


def code_spans(path: Path) -> list[tuple[int, str]]:
    """Inline code spans of the prose (outside fenced blocks) as ``(line, text)``; a span may wrap a line."""
    text = "\n".join(_blank_fences(path.read_text().splitlines()))
    spans = []
    for m in re.finditer(r"(?<!`)`([^`]+?)`(?!`)", text):
        if "\n\n" in m.group(1):
            continue
        spans.append((text.count("\n", 0, m.start()) + 1, " ".join(m.group(1).split())))
    return spans


def block_commands(path: Path, root: Path = REPO_ROOT) -> list[Command]:
    """The commands of ours in ``path``'s shell blocks."""
    lines = path.read_text().splitlines()
    rel = path.relative_to(root)
    out: list[Command] = []
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        lang, block_fails = m.group(1), i > 0 and lines[i - 1].strip() == FAILS_BLOCK
        i += 1
        files: dict[str, str] = {}
        while i < len(lines) and not FENCE.match(lines[i]):
            start, line = i, lines[i]
            while line.rstrip().endswith("\\") and i + 1 < len(lines):
                i += 1
                line = line.rstrip()[:-1] + " " + lines[i].strip()
            i += 1
            if lang not in SHELL_LANGS:
                continue
            if (h := HEREDOC.match(line)) is not None:
                body = []
                while i < len(lines) and lines[i].strip() != h.group(2):
                    body.append(lines[i])
                    i += 1
                files[h.group(1)] = "\n".join(body) + "\n"
                i += 1
                continue
            fails = block_fails or bool(FAILS_LINE.search(line))
            out.extend(parse_command_line(line, f"{rel}:{start + 1}", fails, files))
        i += 1
    return out


def inline_commands(path: Path, root: Path = REPO_ROOT) -> list[Command]:
    """The commands of ours in ``path``'s inline code spans (a span whose first word is a program of ours)."""
    rel = path.relative_to(root)
    out = []
    for line, span in code_spans(path):
        first = span.split()[0] if span.split() else ""
        if first in {"make", "cd"} or "gspo-" in first or PYTHON.match(first) or ASSIGN.match(first):
            out.extend(parse_command_line(span, f"{rel}:{line}"))
    return out


def all_commands(root: Path = REPO_ROOT) -> list[Command]:
    """Every command of ours in the docs, blocks first, in file order."""
    return [c for p in doc_files(root) for c in block_commands(p, root) + inline_commands(p, root)]


def python_blocks(root: Path = REPO_ROOT) -> dict[str, str]:
    """Python blocks that open with ``# NAME.py``: the docs' example modules, by module name."""
    out = {}
    for p in doc_files(root):
        for m in re.finditer(r"```python\n# (\w+)\.py\n(.*?)```", p.read_text(), re.S):
            out[m.group(1)] = m.group(2)
    return out


# ---- config keys named in prose ----

def schema_keys(root: Path = REPO_ROOT) -> tuple[set[str], set[str]]:
    """The config keys of docs/config.md (generated from the schema) as ``section.key``, and the subset whose
    values are mappings (any key below them is the user's)."""
    keys, open_keys = set(), set()
    section = ""
    for line in (root / "docs/config.md").read_text().splitlines():
        if m := re.match(r"^## `([\w.\[\]]+)`", line):
            section = m.group(1).replace("[]", "")
            keys.add(section)
        elif line.startswith("## top-level keys"):
            section = ""
        elif m := re.match(r"^\| `(\w+)` \| `([^`]*)`", line):
            key = f"{section}.{m.group(1)}" if section else m.group(1)
            keys.add(key)
            if "dict" in m.group(2):
                open_keys.add(key)
    return keys, open_keys


FILE_SUFFIXES = {"py", "md", "json", "jsonl", "yaml", "yml", "toml", "txt", "png", "safetensors", "csv", "parquet"}
KEY_TOKEN = re.compile(r"(?<![\w./:$-])([a-z_]+(?:\.[a-z_0-9]+|\.\*)+)(?=$|[=\s,)]|:(?:\s|$))")


def prose_keys(root: Path = REPO_ROOT) -> list[tuple[str, str]]:
    """``(file:line, key)`` for each dotted name in an inline code span whose first part is a config section
    (``learner.clip_low``, ``trainer.max_staleness=1``, ``learner.critic.*``, ``env.tools: [...]``). Module paths
    (a file ``a/b.py`` or folder ``a/b/`` exists, or ``a.b:name``) are not keys."""
    keys, _ = schema_keys(root)
    sections = {k.split(".")[0] for k in keys}
    out = []
    for p in doc_files(root):
        if p.name == "config.md":
            continue
        rel = p.relative_to(root)
        for line, span in code_spans(p):
            if span.split()[:1] and (span.split()[0] in {"make"} or "gspo-" in span.split()[0]
                                     or PYTHON.match(span.split()[0])):
                continue  # a command: its overrides go through the config load
            for m in KEY_TOKEN.finditer(span):
                name = m.group(1)
                parts = name.split(".")
                if parts[0] not in sections:
                    continue
                if parts[-1] in FILE_SUFFIXES or any(
                        root.joinpath(*parts[:i]).with_suffix(".py").exists() for i in range(2, len(parts) + 1)):
                    continue  # a file name, a module or a module's attribute
                if root.joinpath(*parts).is_dir():
                    continue
                out.append((f"{rel}:{line}", name))
    return out


def unknown_key(name: str, keys: set[str], open_keys: set[str]) -> bool:
    """True when ``name`` (``a.b``, ``a.b.*``, ``a.b.c``) is no key or section of the schema nor below a mapping."""
    name = name.removesuffix(".*")
    if name in keys:
        return False
    parts = name.split(".")
    return not any(".".join(parts[:i]) in open_keys for i in range(1, len(parts)))


# ---- links ----

def slug(heading: str) -> str:
    """GitHub's anchor for a heading's text: inline markup dropped, lower case, punctuation but ``-`` and ``_``
    removed, spaces to ``-``."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)
    text = text.replace("`", "").strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """The heading anchors of a Markdown file (a repeated heading gets ``-1``, ``-2``, ... as on GitHub)."""
    seen: dict[str, int] = {}
    out = set()
    for line in _blank_fences(path.read_text().splitlines()):
        if m := re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line):
            s = slug(m.group(1))
            n = seen.get(s, 0)
            seen[s] = n + 1
            out.add(s if n == 0 else f"{s}-{n}")
    return out


def broken_links(root: Path = REPO_ROOT) -> list[str]:
    """``file:line: target (why)`` for each relative link or ``#anchor`` of the docs that does not resolve."""
    bad = []
    for p in doc_files(root):
        lines = _blank_fences(p.read_text().splitlines())
        text = "\n".join(re.sub(r"`[^`]*`", "", line) for line in lines)
        for m in re.finditer(r"\]\(([^)\s]+)\)", text):
            target = m.group(1)
            if re.match(r"^[a-z]+:", target):
                continue
            where = f"{p.relative_to(root)}:{text.count(chr(10), 0, m.start()) + 1}"
            file, _, anchor = target.partition("#")
            dest = (p.parent / file).resolve() if file else p
            if not dest.exists():
                bad.append(f"{where}: {target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                bad.append(f"{where}: {target} (no heading with anchor #{anchor} in {dest.relative_to(root)})")
    return bad
