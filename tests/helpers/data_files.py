"""Rows from your own files (``data.task: files``): each file type, globs, ``save_to_disk`` folders, chat
prompts, templates, the errors and skips, the seeded held-out split; the prompt encoder (chat template, system
prompt, BOS never doubled) on tokenizers built here; the engine's EOS ids."""

from __future__ import annotations

import json

from cluster.models.tiny_model import char_vocab

BOS, EOS = char_vocab()["<bos>"], char_vocab()["<eos>"]


def chars(text):
    return [char_vocab()[c] for c in text]


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path
