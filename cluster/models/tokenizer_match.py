"""Whether two models share one tokenizer, as on-policy distillation needs of its teacher (``distill``): the teacher
scores the student's token ids, so every id must mean the same text in both and the special tokens (BOS, EOS, pad,
unk) must be the same ids.

Read from the files alone where they are on this machine, without torch or transformers (the config's check at
load, ``cluster.config.Config``): the builtin models' character tokenizer (``cluster.models.tiny_model``), a
model folder's ``tokenizer.json`` with its ``tokenizer_config.json``, a hub id's cached copies. A tokenizer known
only once the run has fetched it (a hub id not yet downloaded, a folder without ``tokenizer.json``) is compared
when the run starts, from the loaded ``transformers`` tokenizers (``loaded_identity``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SPECIALS = ("bos", "eos", "pad", "unk")


@dataclass(frozen=True)
class TokenizerIdentity:
    """What two tokenizers must share: ``vocab`` (token string -> id, added tokens included) and ``special``
    (``SPECIALS`` -> id, None where the tokenizer has none)."""

    vocab: dict[str, int]
    special: dict[str, int | None]


def builtin_identity() -> TokenizerIdentity:
    """The character tokenizer every ``builtin:`` model is built with (``cluster.models.tiny_model``)."""
    from cluster.models.tiny_model import BOS_TOKEN, EOS_TOKEN, PAD_TOKEN, UNK_TOKEN, char_vocab

    vocab = char_vocab()
    return TokenizerIdentity(vocab, {"bos": vocab[BOS_TOKEN], "eos": vocab[EOS_TOKEN], "pad": vocab[PAD_TOKEN],
                                     "unk": vocab[UNK_TOKEN]})


def folder_identity(folder: str | Path) -> TokenizerIdentity | None:
    """The tokenizer of a model folder from its ``tokenizer.json`` (vocabulary with the added tokens, read by the
    ``tokenizers`` library: no torch) and ``tokenizer_config.json`` (special tokens), or None when the folder has
    no ``tokenizer.json``.

    Raises:
        ValueError: a file that is not the JSON it should be (names the file).
    """
    folder = Path(folder)
    path = folder / "tokenizer.json"
    if not path.is_file():
        return None
    from tokenizers import Tokenizer

    try:
        vocab = Tokenizer.from_file(str(path)).get_vocab(with_added_tokens=True)
        conf_path = folder / "tokenizer_config.json"
        conf = json.loads(conf_path.read_text()) if conf_path.is_file() else {}
    except Exception as err:  # noqa: BLE001 - the tokenizers library raises a plain Exception for a bad file
        raise ValueError(f"{folder}: cannot read its tokenizer files ({type(err).__name__}: {err})") from None
    special: dict[str, int | None] = {}
    for name in SPECIALS:
        token = conf.get(f"{name}_token")
        if isinstance(token, dict):
            token = token.get("content")
        special[name] = vocab.get(token) if isinstance(token, str) else None
    return TokenizerIdentity(vocab, special)


def identity_of(path: str, cwd: str | Path | None = None) -> TokenizerIdentity | None:
    """The tokenizer of a ``model.path`` value if it can be read here without downloading: ``builtin:...``, a
    local folder (relative to ``cwd``), a hub id whose ``tokenizer.json`` is in the local cache. None otherwise
    (compared at the run's start instead)."""
    from cluster.models.hub_model import is_hub_id

    if path.startswith("builtin:"):
        return builtin_identity()
    if is_hub_id(path, cwd):
        try:
            from huggingface_hub import try_to_load_from_cache
        except ImportError:  # pragma: no cover - huggingface_hub comes with transformers
            return None
        cached = try_to_load_from_cache(path, "tokenizer.json")
        return folder_identity(Path(cached).parent) if isinstance(cached, str) else None
    folder = Path(path).expanduser()
    folder = folder if folder.is_absolute() else Path(cwd or ".") / folder
    return folder_identity(folder) if folder.is_dir() else None


def loaded_identity(tokenizer: Any) -> TokenizerIdentity:
    """The identity of a loaded ``transformers`` tokenizer (``get_vocab()``, ``<name>_token_id``)."""
    return TokenizerIdentity({str(k): int(v) for k, v in tokenizer.get_vocab().items()},
                             {name: getattr(tokenizer, f"{name}_token_id", None) for name in SPECIALS})


def mismatch(student: TokenizerIdentity, teacher: TokenizerIdentity) -> str | None:
    """Why the teacher's tokenizer is not the student's (the first difference found, named), or None when they
    are the same."""
    for name in SPECIALS:
        if student.special[name] != teacher.special[name]:
            return f"the {name} token is id {student.special[name]} in the student's, {teacher.special[name]} in " \
                   "the teacher's"
    if student.vocab == teacher.vocab:
        return None
    if len(student.vocab) != len(teacher.vocab):
        return f"the vocabularies differ in size ({len(student.vocab)} tokens in the student's, " \
               f"{len(teacher.vocab)} in the teacher's)"
    for token, i in student.vocab.items():
        if teacher.vocab.get(token) != i:
            return f"token {token!r} is id {i} in the student's, {teacher.vocab.get(token)} in the teacher's"
    return "the vocabularies differ"  # pragma: no cover - equal sizes and every student token equal means equal


def check_same_tokenizer(student: TokenizerIdentity, teacher: TokenizerIdentity, student_path: str,
                         teacher_path: str) -> None:
    """Raise unless the two tokenizers are the same.

    Raises:
        ValueError: naming ``model.path`` and ``distill.model_path`` with their values and the first difference.
    """
    why = mismatch(student, teacher)
    if why is not None:
        raise ValueError(f"distill.model_path={teacher_path!r} has another tokenizer than model.path="
                         f"{student_path!r}: {why}; on-policy distillation needs the student's tokenizer (the "
                         "teacher scores the student's token ids)")
