"""Models by Hugging Face repo id (`--model deepseek-ai/DeepSeek-V2-Lite`): downloaded once into
the Hugging Face cache through huggingface_hub (progress bars, resumed downloads, HF_TOKEN,
HF_HOME and HF_HUB_OFFLINE honoured as everywhere else), then converted once like any folder.

Only what a conversion reads is fetched: safetensors weights, JSON configs, the tokenizer and
chat templates; never pickle checkpoints or remote code. A local path always wins over a repo
id of the same spelling.
"""

from __future__ import annotations

import re
from pathlib import Path

from colibri.engine.errors import ModelError

# owner/name as the Hub spells them (letters, digits, '-', '_', '.'; no '..')
_REPO_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")
ALLOW_PATTERNS = ["*.safetensors", "*.json", "tokenizer.model", "*.jinja",
                  "additional_chat_templates/*.jinja"]


def is_repo_id(spec: str | Path | None) -> bool:
    """Whether spec names a Hub repository rather than a folder here."""
    if not isinstance(spec, str) or Path(spec).exists():
        return False
    return bool(_REPO_ID.match(spec)) and ".." not in spec


def download(repo_id: str, revision: str | None = None) -> Path:
    """The local snapshot folder of repo_id (downloaded or completed now if need be);
    ModelError with what to do when it cannot be had."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    try:
        return Path(snapshot_download(repo_id, revision=revision,
                                      allow_patterns=ALLOW_PATTERNS))
    except GatedRepoError:
        raise ModelError(f"{repo_id} is gated on the Hugging Face Hub: accept its terms on "
                         "huggingface.co, then set HF_TOKEN to a token of that account") from None
    except RepositoryNotFoundError:
        raise ModelError(f"{repo_id}: no such model on the Hugging Face Hub (a private one "
                         "needs HF_TOKEN)") from None
    except RevisionNotFoundError:
        raise ModelError(f"{repo_id}: revision {revision!r} not found") from None
    except LocalEntryNotFoundError:
        raise ModelError(f"{repo_id} is not in the Hugging Face cache and the Hub cannot be "
                         "reached (HF_HUB_OFFLINE is set, or there is no network); download "
                         "it once while online") from None
    except HfHubHTTPError as e:
        raise ModelError(f"{repo_id}: the Hugging Face Hub answered {e}") from None


def repo_name(folder: Path) -> str | None:
    """owner/name when folder is a snapshot in the Hugging Face cache, else None."""
    parts = folder.resolve().parts
    if len(parts) >= 3 and parts[-2] == "snapshots" and parts[-3].startswith("models--"):
        return parts[-3][len("models--"):].replace("--", "/", 1)
    return None
