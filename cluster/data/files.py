"""Rows from your own files (``data.task: files``), and GSM8K as a preset of the same loader (``task: gsm8k``).

Sources: ``data.train_path`` / ``data.test_path`` name a ``.jsonl``/``.json``, ``.parquet`` or ``.csv`` file, a
glob of them (sorted, read in that order) or a folder written by ``datasets``' ``save_to_disk``. Files are read
with ``datasets.load_dataset`` (``"json"``, ``"parquet"``, ``"csv"``), folders with ``load_from_disk``. A JSONL
file ``datasets`` refuses as a whole (a broken line, bytes that are not UTF-8) is read line by line instead, so
that a bad line costs only itself (counted and skipped).

A row becomes a ``PromptRow``: the prompt is the ``data.prompt_key`` field (text, or chat messages
``[{role, content}, ...]``) or ``data.prompt_template`` filled from the row's fields, encoded by
``cluster.data.prompting.PromptEncoder`` (chat template, BOS); the reference is the ``data.answer_key`` field as
text; the verifier the row's ``data.verifier_key`` field, else ``data.verifier``; ``meta`` holds the
``data.meta_keys`` fields (and the ``data.solution_key`` field as ``"solution"``). A field the file does not
have at all stops loading with a ``DataError`` naming the key, the file and the row; a row without a value
for it, an empty prompt, an unusable answer or an over-long prompt is counted and skipped with a warning
naming the file and row. Without ``data.test_path``, a seeded ``data.eval_fraction`` of the training rows is
held out.
"""

from __future__ import annotations

import glob
import logging
import random
import re
import string
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from cluster.data.prompts import DataError, LoadReport, read_jsonl, resolve_data_path
from cluster.data.prompting import PromptError
from rollout.contracts import PromptRow

log = logging.getLogger(__name__)

FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}
GSM8K_PROMPT = "Question: {question}\nAnswer:"
_CALC = re.compile(r"<<[^>]*>>")

Encode = Callable[[Any], tuple[str, list[int]]]  # a row's prompt -> (text given to the model, token ids)


class SkipRow(ValueError):
    """A row that is counted and skipped; the message is the reason."""


def gsm8k_answer(answer: Any) -> tuple[str, dict[str, Any]]:
    """GSM8K's ``answer`` field -> (reference: the text after the last ``####``, commas removed; meta with
    ``solution``: the worked answer without the ``<<...>>`` calculator annotations).

    Raises:
        SkipRow: not text, or no ``####`` line.
    """
    if not isinstance(answer, str):
        raise SkipRow(f"answer is a {type(answer).__name__}, not text")
    if "####" not in answer:
        raise SkipRow("answer has no '####' line")
    return answer.rsplit("####", 1)[1].strip().replace(",", ""), {"solution": _CALC.sub("", answer).strip()}


@dataclass(frozen=True)
class RowSpec:
    """How a record becomes a ``PromptRow`` (the ``data.*_key`` settings; see the module docstring).
    ``parse_answer`` (presets) turns the answer field into (reference, extra meta) or raises ``SkipRow``."""

    prompt_key: str = "prompt"
    answer_key: str | None = "answer"
    verifier_key: str | None = None
    verifier: str = "math"
    meta_keys: tuple[str, ...] = ()
    solution_key: str | None = None
    prompt_template: str | None = None
    parse_answer: Callable[[Any], tuple[str, dict[str, Any]]] | None = None

    @classmethod
    def from_config(cls, d: Any) -> "RowSpec":
        """The spec of a ``DataConfig``: ``task: gsm8k`` is the GSM8K preset (fields ``question`` and
        ``answer``, ``GSM8K_PROMPT``, the ``math`` verifier); ``task: files`` takes the ``data.*`` keys."""
        if d.task == "gsm8k":
            return GSM8K_SPEC
        return cls(prompt_key=d.prompt_key, answer_key=d.answer_key, verifier_key=d.verifier_key,
                   verifier=d.verifier, meta_keys=tuple(d.meta_keys), solution_key=d.solution_key,
                   prompt_template=d.prompt_template)

    def required(self) -> dict[str, str]:
        """Field name -> the config key that names it, for every field each row must hold."""
        out: dict[str, str] = {}
        if self.prompt_template is not None:
            for _, name, _, _ in string.Formatter().parse(self.prompt_template):
                if name:
                    out.setdefault(name, "prompt_template")
        else:
            out[self.prompt_key] = "prompt_key"
        if self.answer_key is not None:
            out.setdefault(self.answer_key, "answer_key")
        if self.solution_key is not None:
            out.setdefault(self.solution_key, "solution_key")
        for k in self.meta_keys:
            out.setdefault(k, "meta_keys")
        return out


GSM8K_SPEC = RowSpec(prompt_key="question", answer_key="answer", verifier="math", prompt_template=GSM8K_PROMPT,
                     parse_answer=gsm8k_answer)


@dataclass
class Source:
    """One file (or ``save_to_disk`` folder) and its records: ``records[j]`` is ``(row index, record)``."""

    path: Path
    records: Any  # a datasets.Dataset (rows read on access) or a list of (row index, dict)
    from_dataset: bool = True
    columns: list[str] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.records)

    def get(self, j: int) -> tuple[int, dict[str, Any]]:
        return (j, self.records[j]) if self.from_dataset else self.records[j]


def find_files(path: str, key: str) -> list[Path]:
    """The files (or the ``save_to_disk`` folder) that ``data.<key>=path`` names, globs expanded and sorted.

    Raises:
        DataError: nothing exists there (the message names the key, the value and where it looked).
    """
    resolved = resolve_data_path(path)
    if glob.has_magic(str(resolved)):
        found = sorted(Path(f) for f in glob.glob(str(resolved), recursive=True) if Path(f).is_file())
        if not found:
            raise DataError(f"data.{key}={path!r}: no file matches {str(resolved)!r} (relative paths are tried "
                            "from the working directory, then from the repo root)")
        return found
    if not resolved.exists():
        raise DataError(f"data.{key}={path!r}: {str(resolved)!r} does not exist (relative paths are tried from "
                        "the working directory, then from the repo root)")
    return [resolved]


def _from_disk(folder: Path, key: str) -> Any:
    """A ``save_to_disk`` folder's Dataset; of a DatasetDict, its only split or the one named for the role
    (``train`` for train_path, ``test`` for test_path)."""
    from datasets import DatasetDict, load_from_disk

    if not ((folder / "state.json").is_file() or (folder / "dataset_dict.json").is_file()):
        raise DataError(f"data.{key}: folder {str(folder)!r} was not written by datasets' save_to_disk (no "
                        "state.json or dataset_dict.json); name its files, e.g. a glob like 'folder/*.jsonl'")
    ds = load_from_disk(str(folder))
    if isinstance(ds, DatasetDict):
        want = "train" if key == "train_path" else "test"
        if len(ds) == 1:
            return next(iter(ds.values()))
        if want not in ds:
            raise DataError(f"data.{key}: {str(folder)!r} holds splits {sorted(ds)}, none named {want!r}")
        return ds[want]
    return ds


def read_source(file: Path, key: str, report: LoadReport) -> Source:
    """Read one file or folder (see the module docstring).

    Raises:
        DataError: an unknown file type, or a file ``datasets`` cannot read (other than JSONL, which falls
            back to the line-by-line reader).
    """
    from datasets import load_dataset
    from datasets.exceptions import DatasetGenerationError

    if file.is_dir():
        ds = _from_disk(file, key)
        return Source(file, ds, columns=list(ds.column_names))
    fmt = FORMATS.get(file.suffix.lower())
    if fmt is None:
        raise DataError(f"data.{key}: {str(file)!r} is not one of the file types {sorted(FORMATS)}")
    try:
        ds = load_dataset(fmt, data_files=str(file), split="train")
    except (DatasetGenerationError, ValueError) as e:
        if file.suffix.lower() != ".jsonl":
            raise DataError(f"data.{key}: datasets cannot read {str(file)!r}: {e.__cause__ or e}") from e
        log.warning("%s: datasets refused the file (%s); reading it line by line", file.name, e.__cause__ or e)
        records = read_jsonl(file, report)
        columns = sorted({k for _, rec in records for k in rec})
        return Source(file, records, from_dataset=False, columns=columns)
    return Source(file, ds, columns=list(ds.column_names))


def check_columns(src: Source, spec: RowSpec, key: str) -> None:
    """Every field the spec needs is a column of the file (some rows may still lack a value).

    Raises:
        DataError: names the config key, the field, the file and its first row's fields.
    """
    for name, setting in spec.required().items():
        if name not in src.columns:
            first = sorted(src.get(0)[1]) if len(src) else []
            raise DataError(f"data.{setting} names field {name!r}, which {str(src.path)!r} (data.{key}) does not "
                            f"have: row 0 has fields {first}")


def make_row(rec: dict[str, Any], spec: RowSpec, encode: Encode, uid: str, max_prompt_tokens: int) -> PromptRow:
    """One record -> ``PromptRow`` (see the module docstring).

    Raises:
        SkipRow: a missing value, an empty prompt, an unusable answer or verifier, a prompt the encoder refuses,
            or more than ``max_prompt_tokens`` prompt tokens (the message is the skip reason).
    """
    for name, setting in spec.required().items():
        if rec.get(name) is None:
            raise SkipRow(f"no value for field {name!r} (data.{setting})")
    if spec.prompt_template is not None:
        fill = {k: v.strip() if isinstance(v, str) else v for k, v in rec.items()}
        empty = [name for name in spec.required() if spec.required()[name] == "prompt_template" and fill[name] == ""]
        if empty:
            raise SkipRow(f"empty field {empty[0]!r} (data.prompt_template)")
        prompt = spec.prompt_template.format_map(fill)
    else:
        prompt = rec[spec.prompt_key]
    if isinstance(prompt, str) and not prompt.strip():
        raise SkipRow("empty prompt")
    if not isinstance(prompt, (str, list)):
        raise SkipRow(f"prompt field {spec.prompt_key!r} is a {type(prompt).__name__}, not text or chat messages")
    meta: dict[str, Any] = {k: rec[k] for k in spec.meta_keys}
    answer: Any = "" if spec.answer_key is None else rec[spec.answer_key]
    if spec.parse_answer is not None:
        answer, extra = spec.parse_answer(answer)
        meta.update(extra)
    elif isinstance(answer, bool) or not isinstance(answer, (str, int, float)):
        raise SkipRow(f"answer field {spec.answer_key!r} is a {type(answer).__name__}, not text or a number")
    if spec.solution_key is not None:
        meta["solution"] = str(rec[spec.solution_key])
    verifier = rec.get(spec.verifier_key) if spec.verifier_key else None
    if verifier is not None and not isinstance(verifier, str):
        raise SkipRow(f"verifier field {spec.verifier_key!r} is a {type(verifier).__name__}, not a name")
    try:
        text, ids = encode(prompt)
    except PromptError as e:
        raise SkipRow(str(e)) from None
    if len(ids) > max_prompt_tokens:
        raise SkipRow(f"prompt of {len(ids)} tokens exceeds data.max_prompt_tokens={max_prompt_tokens}")
    return PromptRow(uid=uid, prompt=text, prompt_token_ids=ids, answer=str(answer),
                     verifier=verifier or spec.verifier, meta=meta)


def build_rows(picks: list[tuple[Source, int]], spec: RowSpec, encode: Encode, *, split: str, single: bool,
               max_prompt_tokens: int, limit: int | None, report: LoadReport) -> list[PromptRow]:
    """``PromptRow`` for each ``(source, record position)`` in order until ``limit`` are kept; skips are
    counted in ``report``. Uids are ``split/row`` (one source) or ``split/file name/row``.

    Raises:
        DataError: no usable row (the message names the files and the skip counts).
    """
    rows: list[PromptRow] = []
    for src, j in picks:
        i, rec = src.get(j)
        where = f"{src.path.name} row {i}"
        uid = f"{split}/{i}" if single else f"{split}/{src.path.name}/{i}"
        try:
            rows.append(make_row(rec, spec, encode, uid, max_prompt_tokens))
        except SkipRow as e:
            report.skip(str(e), where)
            continue
        if limit is not None and len(rows) >= limit:
            break
    report.kept = len(rows)
    names = sorted({str(s.path) for s, _ in picks}) or ["(no row)"]
    if not rows:
        raise DataError(f"{split} rows from {', '.join(names)}: no usable row (skipped: {report.skipped})")
    if report.skipped:
        log.warning("%s split: kept %d rows, skipped %s", split, report.kept, report.skipped)
    return rows


def _sources(path: str, key: str, spec: RowSpec, report: LoadReport) -> list[Source]:
    sources = [read_source(f, key, report) for f in find_files(path, key)]
    for src in sources:
        check_columns(src, spec, key)
    return sources


def file_rows(d: Any, encode: Encode) -> tuple[list[PromptRow], list[PromptRow]]:
    """Training and held-out rows for a ``DataConfig`` with ``task`` ``files`` or ``gsm8k``.

    The training rows are the first ``d.num_train`` usable ones in file order; the held-out rows the first
    ``d.num_eval`` usable ones of ``d.test_path``, or, without it, of a held-out share ``d.eval_fraction``
    (at least one row) of the training files' rows, chosen by ``random.Random(d.seed)`` before any row is
    checked (so the split does not depend on the tokenizer or the limits).

    Raises:
        DataError: a missing file or field, an unreadable file, or a split with no usable row.
    """
    spec = RowSpec.from_config(d)
    train_report, eval_report = LoadReport(), LoadReport()
    train_src = _sources(d.train_path, "train_path", spec, train_report)
    picks = [(s, j) for s in train_src for j in range(len(s))]
    if d.test_path:
        eval_src = _sources(d.test_path, "test_path", spec, eval_report)
        eval_picks = [(s, j) for s in eval_src for j in range(len(s))]
    else:
        eval_src = train_src
        order = list(range(len(picks)))
        random.Random(d.seed).shuffle(order)
        held = order[: max(1, round(len(picks) * d.eval_fraction))]
        if len(held) >= len(picks):
            raise DataError(f"data.eval_fraction={d.eval_fraction} leaves no training row of {len(picks)} in "
                            f"data.train_path={d.train_path!r}")
        eval_picks = [picks[k] for k in held]
        kept = set(held)
        picks = [p for k, p in enumerate(picks) if k not in kept]
    train = build_rows(picks, spec, encode, split="train", single=len(train_src) == 1,
                       max_prompt_tokens=d.max_prompt_tokens, limit=d.num_train, report=train_report)
    test = build_rows(eval_picks, spec, encode, split="eval", single=len(eval_src) == 1,
                      max_prompt_tokens=d.max_prompt_tokens, limit=d.num_eval, report=eval_report)
    return train, test


def gsm8k_rows(path: str, tokenize: Callable[[str], list[int]], *, split: str, max_prompt_tokens: int,
               limit: int | None) -> tuple[list[PromptRow], LoadReport]:
    """GSM8K rows (the preset ``GSM8K_SPEC``) of one path, prompts tokenized by ``tokenize`` as they are (for
    tools and tests; a run goes through ``file_rows``). Returns the rows and the load report.

    Raises:
        DataError: the path is missing or has no usable row.
    """
    report = LoadReport()
    key = "train_path" if split == "train" else "test_path"
    sources = _sources(path, key, GSM8K_SPEC, report)
    picks = [(s, j) for s in sources for j in range(len(s))]
    rows = build_rows(picks, GSM8K_SPEC, lambda p: (p, tokenize(p)), split=split, single=len(sources) == 1,
                      max_prompt_tokens=max_prompt_tokens, limit=limit, report=report)
    return rows, report
