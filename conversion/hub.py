"""Uploading a converted folder to the Hugging Face Hub.

Pulling needs nothing of ours: `AutoModelForCausalLM.from_pretrained(repo_id, trust_remote_code=True)`
reads the config's `auto_map` and the modeling files uploaded with the weights.
"""

import shlex
from pathlib import Path

from huggingface_hub import HfApi, get_token

from modeling_attnres.modeling_attnres import REMOTE_CODE_FILES

from .errors import ConversionError, hub_reason

REQUIRED_FILES = ("config.json", *REMOTE_CODE_FILES, "README.md")


def require_token(repo_id: str, token: str | None = None) -> None:
    """Refuse a push that has no Hub token to send (`token`, else `HF_TOKEN` or a saved login) before any
    work: the Hub would refuse it only after the conversion. Offline mode forbids it the same way."""
    from huggingface_hub import constants

    if constants.is_offline_mode():
        raise ConversionError(f"--push-to-hub {repo_id} needs the Hub, and offline mode (HF_HUB_OFFLINE=1 or "
                              "TRANSFORMERS_OFFLINE=1) forbids reaching it; unset the variable for this command.")
    if token is None and get_token() is None:
        raise ConversionError(f"--push-to-hub {repo_id} needs a Hub token and none was found; log in with "
                              "`hf auth login` or set HF_TOKEN, then run again.")


def push_folder(folder: Path, repo_id: str, *, private: bool | None = None, token: str | None = None,
                endpoint: str | None = None, revision: str | None = None) -> str:
    """Create `repo_id` if needed and upload every file of `folder` in one commit; returns the commit URL.

    `endpoint` defaults to `HF_ENDPOINT` (huggingface.co); `token` to the logged-in token / `HF_TOKEN`.
    """
    folder = Path(folder)
    missing = [name for name in REQUIRED_FILES if not (folder / name).exists()]
    if missing or not (list(folder.glob("*.safetensors"))):
        raise ConversionError(f"{folder} is not a converted AttnRes folder (missing: {missing or '*.safetensors'}); "
                              "push the DST of a finished attnres-convert run.")
    require_token(repo_id, token)
    api = HfApi(endpoint=endpoint, token=token)
    try:
        api.create_repo(repo_id, private=private, exist_ok=True)
        if private and not api.repo_info(repo_id).private:
            raise ConversionError(
                f"--private: the Hub repo {repo_id!r} already exists and is public, and a push does not change a "
                f"repo's visibility; nothing was uploaded. Make it private in its settings on the Hub, then push "
                f"with `{upload_command(repo_id, folder, private, revision)}` (or push to a new repo id).")
        # `delete_patterns`: the repo's files become exactly the folder's, so an earlier push's weights (a
        # `model.safetensors` beside new shards, which transformers would load first) do not survive it
        info = api.upload_folder(folder_path=folder, repo_id=repo_id, revision=revision, delete_patterns="*",
                                 commit_message="Upload AttnRes checkpoint converted with attnres-convert")
    except ConversionError:
        raise
    except Exception as err:  # HTTP, auth and validation errors all end the run the same way
        reason = hub_reason(err, revision, writing=True)
        raise ConversionError(f"Pushing {folder} to the Hub repo {repo_id!r} failed: {reason}. The converted "
                              f"checkpoint is complete at {folder}; push it again with "
                              f"`{upload_command(repo_id, folder, private, revision)}`.") from err
    return str(getattr(info, "commit_url", info))


def upload_command(repo_id: str, folder: Path, private: bool | None = None, revision: str | None = None) -> str:
    """The `hf upload` command that pushes `folder` as `push_folder` would, quoted for a shell: the repo's
    other files deleted (`--delete '*'`), with `--private` where the push asked for it (`hf upload` creates
    a missing repo public otherwise)."""
    words = ["hf", "upload", repo_id, str(folder), "--delete", "*"]
    words += ["--private"] if private else []
    words += ["--revision", revision] if revision else []
    return shlex.join(words)
