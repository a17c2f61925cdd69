"""Prompts for training and evaluation.

``prompts`` the generated arithmetic task, data paths and the prompt stream; ``files`` your own files (JSONL,
Parquet, CSV, ``datasets`` folders) and the GSM8K preset; ``prompting`` a row's prompt to token ids (chat
templates, the BOS rule); ``code_task`` the generated code task; ``arith_words`` arithmetic asked in words for
a chat model; ``tasks`` the tokenizer and the one dispatch from ``data.task`` to rows. Bad rows are counted and
skipped by name.
"""
