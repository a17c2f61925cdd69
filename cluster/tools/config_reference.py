"""The config reference (``docs/config.md``), generated from the schema: section by section, every key with its
type, default and description.

Regenerate after changing a config class::

    python -m cluster.tools.config_reference > docs/config.md

``tests/unit/cluster/test_config.py`` fails when ``docs/config.md`` differs from :func:`reference_markdown`.
"""

from __future__ import annotations

import sys
import types
import typing
from typing import Any, Literal

import annotated_types
import yaml
from pydantic import BaseModel
from pydantic.fields import FieldInfo

from cluster.config import Config

COMMAND = "python -m cluster.tools.config_reference > docs/config.md"


def _model_in(annotation: Any) -> tuple[type[BaseModel], bool] | None:
    """``(model class, is a list of them)`` when ``annotation`` is a section (``X``) or a list of sections
    (``list[X]``); None otherwise."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation, False
    if typing.get_origin(annotation) is list:
        (item,) = typing.get_args(annotation)
        if isinstance(item, type) and issubclass(item, BaseModel):
            return item, True
    return None


def sections(model: type[BaseModel] = Config, prefix: str = "") -> list[tuple[str, type[BaseModel]]]:
    """Every section of the composed schema, depth first in declaration order: ``[(dotted name, class)]``.

    The root is ``("", Config)``; a list of sections (``reward.extra_terms``) appears as ``name[]``.
    """
    out = [(prefix, model)]
    for name, field in model.model_fields.items():
        found = _model_in(field.annotation)
        if found is not None:
            cls, is_list = found
            out += sections(cls, f"{prefix}{'.' if prefix else ''}{name}{'[]' if is_list else ''}")
    return out


def _type_name(annotation: Any) -> str:
    """``annotation`` as a reader of the YAML sees it: ``int``, ``'a' | 'b'``, ``float | None``, ``list[str]``."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if annotation is type(None):
        return "None"
    if origin is Literal:
        return " | ".join(repr(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        return " | ".join(_type_name(a) for a in args)
    if origin in (list, tuple, dict):
        return f"{origin.__name__}[{', '.join(_type_name(a) for a in args)}]"
    found = _model_in(annotation)
    if found is not None:
        return "section"  # the caller shows the section's name
    return getattr(annotation, "__name__", str(annotation))


_BOUNDS = ((annotated_types.Gt, "gt", ">"), (annotated_types.Ge, "ge", ">="), (annotated_types.Lt, "lt", "<"),
           (annotated_types.Le, "le", "<="))


def _bounds(field: FieldInfo) -> str:
    """The numeric constraints of a field, e.g. ``>= 1, <= 3``."""
    parts = []
    for meta in field.metadata:
        for cls, attr, sign in _BOUNDS:
            if isinstance(meta, cls):
                parts.append(f"{sign} {getattr(meta, attr)}")
    return ", ".join(parts)


def _yaml(value: Any) -> str:
    """A default as it is written in a config file or an override (YAML flow style)."""
    if isinstance(value, tuple):
        value = list(value)
    text = yaml.safe_dump(value, default_flow_style=True, width=1000).strip()
    return text.removesuffix("...").strip()


def _default(field: FieldInfo, dotted: str) -> str:
    """The default as shown in the table: a YAML value, ``required``, or a pointer to a nested section."""
    found = _model_in(field.annotation)
    if found is not None and not found[1]:
        return f"see `{dotted}`"
    if field.is_required():
        return "required"
    value = field.get_default(call_default_factory=True)
    return f"`{_yaml(value)}`"


def _first_sentence(doc: str) -> str:
    text = " ".join(doc.split())
    return text.split(". ")[0].rstrip(".") + "." if text else ""


def _cell(text: str) -> str:
    """Text that stays inside one Markdown table cell."""
    return text.replace("|", "\\|").replace("\n", " ")


def reference_markdown() -> str:
    """The whole reference as Markdown (the content of ``docs/config.md``)."""
    lines = [
        "# Config reference",
        "",
        "Generated from the schema (`cluster/config.py`, `cluster/config_sections.py` and each service's `config.py`); "
        "do not edit by hand.",
        "Regenerate with",
        "",
        "```bash",
        COMMAND,
        "```",
        "",
        "`tests/unit/cluster/test_config.py` fails when this file and the schema differ.",
        "",
        "A run's config is one YAML file with these sections; any key can also be overridden on the command line",
        "as `section.key=value` (the value is parsed as YAML). Unknown keys, wrong types and impossible",
        "combinations stop the run before anything starts, with the key and the value in the message.",
    ]
    top = [(name, f) for name, f in Config.model_fields.items() if _model_in(f.annotation) is None]
    if top:  # run-level keys outside any section (``precision``)
        lines += ["", "## top-level keys", "", "Keys of the run config itself, beside its sections.", "",
                  "| key | type | default | description |", "|---|---|---|---|"]
        lines += [f"| `{name}` | {_cell(f'`{_type_name(f.annotation)}`')} | {_cell(_default(f, name))} | "
                  f"{_cell(f.description or '')} |" for name, f in top]
    for dotted, cls in sections():
        if not dotted:
            continue
        doc = " ".join((cls.__doc__ or "").split())
        lines += ["", f"## `{dotted}`", "", f"`{cls.__module__}.{cls.__name__}`: {doc}", ""]
        lines += ["| key | type | default | description |", "|---|---|---|---|"]
        for name, field in cls.model_fields.items():
            sub = f"{dotted}.{name}"
            found = _model_in(field.annotation)
            if found is not None:
                type_text = f"list of `{sub}[]`" if found[1] else f"section `{sub}`"
            else:
                type_text = _type_name(field.annotation)
                bounds = _bounds(field)
                type_text = f"`{type_text}`" + (f", {bounds}" if bounds else "")
            description = field.description
            if description is None and found is not None:
                description = _first_sentence(found[0].__doc__ or "")
            lines.append(f"| `{name}` | {_cell(type_text)} | {_cell(_default(field, sub))} | "
                         f"{_cell(description or '')} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    """Print the reference to stdout (``python -m cluster.tools.config_reference > docs/config.md``)."""
    if argv if argv is not None else sys.argv[1:]:
        print(f"usage: {COMMAND}", file=sys.stderr)
        return 2
    sys.stdout.write(reference_markdown())
    return 0


if __name__ == "__main__":
    sys.exit(main())
