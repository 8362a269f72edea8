"""Write files into a Hugging Face cache folder the way huggingface_hub lays one out, so
tests resolve repo ids with no network: blobs/<sha256>, snapshots/<commit>/<path> linking
to its blob, refs/<revision> holding the commit."""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path


def add_to_hf_cache(cache: Path, repo_id: str, files: dict[str, Path | bytes | str], *,
                    revision: str = "main", commit: str | None = None) -> Path:
    """Put `files` (path in the repo -> a file to copy, or its content) in the cache as
    `revision` of `repo_id`; returns the snapshot folder."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    commit = commit or hashlib.sha1(f"{repo_id}@{revision}".encode()).hexdigest()
    snapshot = repo / "snapshots" / commit
    for name, source in files.items():
        data = source.read_bytes() if isinstance(source, Path) else (
            source.encode() if isinstance(source, str) else source)
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.parent.mkdir(parents=True, exist_ok=True)
        if not blob.exists():
            if isinstance(source, Path):
                shutil.copyfile(source, blob)
            else:
                blob.write_bytes(data)
        link = snapshot / name
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    (repo / "refs" / revision).write_text(commit)
    return snapshot


def add_folder_to_hf_cache(cache: Path, repo_id: str, folder: Path, **options: str) -> Path:
    """Every file of a model `folder` as a cached snapshot of `repo_id`."""
    files: dict[str, Path | bytes | str] = {
        p.relative_to(folder).as_posix(): p for p in folder.rglob("*") if p.is_file()}
    return add_to_hf_cache(cache, repo_id, files, **options)
