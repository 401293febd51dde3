"""Uploading a converted folder to the Hugging Face Hub.

Pulling needs nothing of ours: `AutoModelForCausalLM.from_pretrained(repo_id, trust_remote_code=True)`
reads the config's `auto_map` and the modeling files uploaded with the weights.
"""

from pathlib import Path

from huggingface_hub import HfApi

from modeling_attnres.modeling_attnres import REMOTE_CODE_FILES

from .errors import ConversionError, hub_reason

REQUIRED_FILES = ("config.json", *REMOTE_CODE_FILES, "README.md")


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
    api = HfApi(endpoint=endpoint, token=token)
    try:
        api.create_repo(repo_id, private=private, exist_ok=True)
        info = api.upload_folder(folder_path=folder, repo_id=repo_id, revision=revision,
                                 commit_message="Upload AttnRes checkpoint converted with attnres-convert")
    except Exception as err:  # HTTP, auth and validation errors all end the run the same way
        raise ConversionError(f"Pushing {folder} to the Hub repo {repo_id!r} failed: {hub_reason(err)}. The "
                              f"converted checkpoint is complete at {folder}; push it again with "
                              f"`hf upload {repo_id} {folder}`.") from err
    return str(getattr(info, "commit_url", info))
