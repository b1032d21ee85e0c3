"""Publishing a checkpoint on the Hugging Face Hub: `ptq quantize MODEL -o DIR --push-to-hub
org/name`.

Everything the upload needs is checked before the long work (the repository id, a connection to
the Hub, a token that may write, what the repository already holds), so that a quantization of
hours does not end in "401". The checkpoint is written and verified on disk first, as without the
flag, and then uploaded in one commit: the repository then holds exactly the checkpoint's files
(with --force, the files of an earlier upload that this one does not have are deleted in the same
commit, so that no stale shard is left beside the new ones). An upload that fails leaves the
checkpoint on disk, and the error says how to upload it again.
"""

from __future__ import annotations

from pathlib import Path

from ptq.errors import PtqError

FLAG = "--push-to-hub"
# the Hub's LFS rules: kept by huggingface_hub even when a delete pattern matches it
KEPT = ".gitattributes"


def check_push(repo: str, force: bool) -> None:
    """Refuse, in one line and before any work, an upload to `repo` that would fail or overwrite: an
    id that is not org/name, no connection to the Hub, no token, a read-only one or a
    fine-grained one without write access to `repo`, or a repository that already holds files
    (replaced only with `force`)."""
    from huggingface_hub import HfApi, get_token
    from huggingface_hub.errors import HfHubHTTPError, RepositoryNotFoundError

    from ptq.models.loading import HUB_REPO, hub_offline, hub_unreachable, one_line

    # org/name, no bare name or @revision: where it goes is explicit
    if not HUB_REPO.fullmatch(repo):
        raise PtqError(
            f"{FLAG} takes a Hub repository id org/name (your account or organization, then a "
            f"name), not '{repo}'"
        )
    reason = "HF_HUB_OFFLINE is set" if hub_offline() else hub_unreachable()
    if reason:
        raise PtqError(f"{FLAG} {repo}: the Hugging Face Hub cannot be reached ({reason})")
    if get_token() is None:
        raise PtqError(
            f"{FLAG} needs a Hugging Face token that may write: `hf auth login`, or set HF_TOKEN"
        )
    api = HfApi()
    try:
        token = (api.whoami().get("auth") or {}).get("accessToken") or {}
    except HfHubHTTPError as e:
        raise PtqError(
            f"{FLAG}: the Hugging Face Hub refused the token set ({one_line(e, 200)})"
        ) from None
    if token.get("role") == "read":
        raise PtqError(
            f"{FLAG} needs a Hugging Face token that may write; the one set is read-only "
            "(HF_TOKEN, `hf auth login`)"
        )
    if token.get("role") == "fineGrained" and not fine_grained_may_write(
        token.get("fineGrained"), repo
    ):
        owner = repo.split("/")[0]
        raise PtqError(
            f"{FLAG} {repo}: the fine-grained token set may not write there; give it write access "
            f"to the repositories of {owner}, or to {repo} itself if it exists "
            "(huggingface.co/settings/tokens)"
        )
    try:
        files = api.list_repo_files(repo)
    except RepositoryNotFoundError:  # created at the upload
        files = []
    except HfHubHTTPError as e:
        raise PtqError(
            f"{FLAG} {repo}: cannot list the repository's files ({one_line(e, 200)})"
        ) from None
    held = sorted(f for f in files if f != KEPT)
    if held and not force:
        shown = ", ".join(held[:3]) + (f" and {len(held) - 3} more" if len(held) > 3 else "")
        raise PtqError(
            f"Hub repository {repo} already holds files ({shown}): --force replaces them with this "
            "checkpoint"
        )


def fine_grained_may_write(permissions: dict | None, repo: str) -> bool:
    """Whether a fine-grained token's permissions (whoami's accessToken.fineGrained: scoped entries,
    each an entity and what the token may do to it) include 'repo.write' on `repo` or on its owner,
    a user or an organization. A shape this does not know (no scoped list, an entity without a name)
    counts as allowed: the upload then decides."""
    scoped = (permissions or {}).get("scoped")
    if not isinstance(scoped, list):
        return True
    owner = repo.split("/")[0].casefold()
    for entry in scoped:
        entity = entry.get("entity") or {}
        name = entity.get("name")
        if not isinstance(name, str):
            return True
        covers = name.casefold() == (repo.casefold() if entity.get("type") == "model" else owner)
        if (
            covers
            and entity.get("type") in ("model", "user", "org")
            and "repo.write" in entry.get("permissions", [])
        ):
            return True
    return False


def push(folder: Path, repo: str, private: bool, message: str) -> dict:
    """Upload the checkpoint `folder` to `repo` in one commit, its files replacing whatever the
    repository held (a repository it creates is private with `private`, else as the account or
    organization makes new ones; an existing one keeps its visibility). Returns the repository's
    address and the commit."""
    from huggingface_hub import HfApi, constants

    from ptq.models.loading import hub_transfers, one_line

    hub_transfers()
    api = HfApi()
    try:
        # without --private: the Hub's default (an organization may make its new repositories
        # private)
        api.create_repo(repo, private=True if private else None, exist_ok=True)
        commit = api.upload_folder(
            folder_path=folder, repo_id=repo, commit_message=message, delete_patterns="*"
        )
    except Exception as e:  # noqa: BLE001  (whatever failed, the checkpoint is kept and can be uploaded again)
        raise PtqError(
            f"the checkpoint is written to {folder}, but uploading it to {repo} failed "
            f"({one_line(e, 200)}): upload it with `hf upload {repo} {folder}`"
        ) from None
    return {"repo": repo, "url": f"{constants.ENDPOINT}/{repo}", "commit": commit.oid}
