"""``model.path`` as a Hugging Face hub id (``HuggingFaceTB/SmolLM2-135M-Instruct``), as transformers, TRL and
OpenRLHF take it: a local folder of that name wins; otherwise the repository's files are fetched with
``huggingface_hub.snapshot_download`` (its cache, ``HF_HOME``; ``HF_HUB_OFFLINE=1`` serves only what is cached)
and the snapshot folder is what the engines and the learner load."""

from __future__ import annotations

import re
from pathlib import Path

# owner/name as the hub spells them: no leading dot or slash, exactly one slash
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
# what a causal LM's engines and learner read; weights as safetensors only (no pickled .bin)
ALLOW_PATTERNS = ["*.json", "*.safetensors", "*.jinja", "*.txt", "*.model", "*.tiktoken"]


def is_hub_id(path: str, cwd: str | Path | None = None) -> bool:
    """True when ``path`` has the form of a hub id (``owner/name``) and names no local file or folder (relative
    to ``cwd``, default the working directory)."""
    return bool(_HUB_ID.match(path)) and not (Path(cwd or ".") / Path(path).expanduser()).exists()


def download(repo_id: str) -> Path:
    """The local snapshot folder of hub model ``repo_id`` (downloaded or taken from the cache).

    Raises:
        FileNotFoundError: the hub is unreachable (or offline) and nothing is cached, or no such repository; the
            message names ``model.path`` and the cause.
    """
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(repo_id, allow_patterns=ALLOW_PATTERNS))
    except Exception as e:  # noqa: BLE001 - the hub's errors (offline, 404, gated, network) all end here
        raise FileNotFoundError(
            f"model.path={repo_id!r}: not a local folder, and the Hugging Face hub did not give it "
            f"({type(e).__name__}: {str(e)[:300]}); give a local model folder, or for SmolLM2-135M-Instruct "
            f"offline run `make real-model` and use models/smollm2-135m-instruct") from None
