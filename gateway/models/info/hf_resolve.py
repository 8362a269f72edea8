"""Hugging Face repo ids as model names, resolved through the Hugging Face cache (any
process; torch-free: the API server resolves the name before the engine starts).

A name that is not an existing path and is spelled `org/name` is a repo id, as in vLLM:
`org/name` (a model folder, or a repo holding exactly one .gguf file), `org/name:QUANT`
(the repo's GGUF file of that quantisation: `select_model_file`) or
`org/name/path/file.gguf`. The revision (`--revision`, default main) is looked up in the
cache first (`hub_cache_dir`), with no network; not found, it is downloaded with a
progress bar, unless HF_HUB_OFFLINE is set or the Hub cannot be reached: then
`ModelNotFoundError` says the id, where it looked and how to fetch it (docs/models.md).
"""

from __future__ import annotations

import fnmatch
import os
import re
from dataclasses import dataclass
from pathlib import Path

_REPO_PART = r"[A-Za-z0-9][A-Za-z0-9._-]*"
_REPO_ID = re.compile(rf"{_REPO_PART}/{_REPO_PART}")
_QUANT = re.compile(r"[A-Za-z0-9_+-]+")
_SPLIT_GGUF = re.compile(r"-\d{5}-of-\d{5}\.gguf$", re.IGNORECASE)
# What a model folder needs; not other formats' weights (.bin, .pt, .onnx, .gguf).
_FOLDER_PATTERNS = ["*.json", "*.safetensors", "*.jinja", "*.txt", "*.model"]
_TRUE = ("1", "on", "yes", "true")


class ModelNotFoundError(FileNotFoundError):
    """A repo id is neither in the Hugging Face cache nor downloadable (one line)."""


class _QuantNotFoundError(ModelNotFoundError):
    """The repo (as far as it is cached) has no GGUF file of the quantisation named."""


@dataclass(frozen=True)
class HFModelRef:
    """A repo id and what to take from the repo."""

    repo_id: str
    quant: str | None = None  # org/name:QUANT
    filename: str | None = None  # org/name/path/file.gguf

    @property
    def is_gguf_selection(self) -> bool:
        return self.quant is not None or self.filename is not None


def parse_hf_model_ref(model: str) -> HFModelRef | None:
    """The repo id `model` names, or None when it is not spelled like one."""
    if model.startswith(("/", ".", "~")) or "\\" in model:
        return None
    name, colon, quant = model.rpartition(":")
    if colon and _REPO_ID.fullmatch(name) and _QUANT.fullmatch(quant):
        return HFModelRef(name, quant=quant)
    if _REPO_ID.fullmatch(model):
        return HFModelRef(model)
    owner, _, rest = model.partition("/")
    repo, _, filename = rest.partition("/")
    if (filename.lower().endswith(".gguf") and _REPO_ID.fullmatch(f"{owner}/{repo}")
            and all(part not in ("", ".", "..") for part in filename.split("/"))):
        return HFModelRef(f"{owner}/{repo}", filename=filename)
    return None


def hub_cache_dir(download_dir: str | None = None) -> Path:
    """Where the Hugging Face cache is, by huggingface_hub's own rules (read now, not at
    import, so a test or a caller may set the variables)."""
    if download_dir:
        return Path(download_dir).expanduser()
    for variable in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if os.environ.get(variable):
            return Path(os.environ[variable]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    xdg = os.environ.get("XDG_CACHE_HOME") or "~/.cache"
    return Path(xdg).expanduser() / "huggingface" / "hub"


def is_hub_offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in _TRUE


def find_cached_model(ref: HFModelRef, revision: str | None = None,
                      download_dir: str | None = None) -> Path | None:
    """The model's path in the cache (a folder or a .gguf file), or None; no network."""
    snapshot = _cached_snapshot(ref.repo_id, revision, hub_cache_dir(download_dir))
    if snapshot is None:
        return None
    files = [p.relative_to(snapshot).as_posix() for p in snapshot.rglob("*") if p.is_file()]
    try:
        member = select_model_file(ref, files, str(snapshot))
    except _QuantNotFoundError:
        return None  # not in the cache (yet): a download may bring it
    if member is None:  # a folder: a config.json alone (cached by a config look-up) is not one
        has_weights = any(f.endswith(".safetensors") for f in files)
        return snapshot if "config.json" in files and has_weights else None
    return snapshot / member if member in files else None


def fetch_model(ref: HFModelRef, revision: str | None = None,
                download_dir: str | None = None) -> Path:
    """The model's local path: from the cache, else downloaded (with a progress bar)."""
    cache = hub_cache_dir(download_dir)
    cached = find_cached_model(ref, revision, download_dir)
    if cached is not None:
        return cached
    if is_hub_offline():
        raise ModelNotFoundError(f"{_not_cached(ref, revision, cache)} and HF_HUB_OFFLINE is "
                                 f"set; {_how_to_fetch(ref, revision, download_dir)}")
    try:
        return _download(ref, revision, cache)
    except ModelNotFoundError:
        raise
    except Exception as exc:  # the Hub's HTTP errors, no network, a full disk
        reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise ModelNotFoundError(
            f"{_not_cached(ref, revision, cache)} and cannot be downloaded "
            f"({type(exc).__name__}: {reason}); {_how_to_fetch(ref, revision, download_dir)}"
        ) from exc


def select_model_file(ref: HFModelRef, files: list[str], where: str) -> str | None:
    """Which of a repo's `files` to serve: a .gguf file's path, or None for the folder
    (its config.json). Raises ModelNotFoundError when the choice is not clear."""
    if ref.filename is not None:
        return ref.filename
    ggufs = sorted(f for f in files if f.lower().endswith(".gguf"))
    if ref.quant is not None:
        return _gguf_of_quant(ref, ggufs, where)
    if "config.json" in files or not ggufs:
        return None
    if len(ggufs) == 1:
        return ggufs[0]
    raise ModelNotFoundError(
        f"{ref.repo_id} ({where}) holds {len(ggufs)} GGUF files: pick one as "
        f"{ref.repo_id}:QUANT or {ref.repo_id}/FILE.gguf (files: {', '.join(ggufs)})")


def _gguf_of_quant(ref: HFModelRef, ggufs: list[str], where: str) -> str:
    """The repo's GGUF file of quantisation QUANT (vLLM's selection): `*-QUANT.gguf`,
    `*.QUANT.gguf`, `QUANT.gguf` (case-insensitive, also one folder down); of several, the
    name with the fewest '-' wins. A part of a split GGUF is refused.
    """
    quant = str(ref.quant).lower()
    patterns = [f"*-{quant}.gguf", f"*.{quant}.gguf", f"{quant}.gguf", f"*-{quant}-*.gguf"]
    matches = [f for f in ggufs
               if any(fnmatch.fnmatchcase(f.rpartition("/")[2].lower(), p) for p in patterns)
               and f.count("/") <= 1]
    if not matches:
        raise _QuantNotFoundError(
            f"{ref.repo_id} ({where}) has no GGUF file of quantisation {ref.quant}"
            + (f" (files: {', '.join(ggufs)})" if ggufs else " (it holds no .gguf file)"))
    choice = min(matches, key=lambda f: (f.count("-"), f))
    if _SPLIT_GGUF.search(choice):
        raise ModelNotFoundError(f"{ref.repo_id}: {choice} is one part of a split GGUF; only "
                                 f"single-file GGUF models load (merge them with gguf-split)")
    return choice


def _cached_snapshot(repo_id: str, revision: str | None, cache: Path) -> Path | None:
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(repo_id, revision=revision, cache_dir=cache,
                                      local_files_only=True))
    except (OSError, ValueError):  # LocalEntryNotFoundError is an OSError
        return None


def _download(ref: HFModelRef, revision: str | None, cache: Path) -> Path:
    from huggingface_hub import HfApi, hf_hub_download, snapshot_download

    info = HfApi().model_info(ref.repo_id, revision=revision)
    files = [s.rfilename for s in (info.siblings or [])]
    where = f"revision {revision or 'main'} on the Hub"
    member = select_model_file(ref, files, where)
    if member is not None:
        if member not in files:
            raise ModelNotFoundError(f"{ref.repo_id} has no file {member} ({where})")
        return Path(hf_hub_download(ref.repo_id, member, revision=info.sha or revision,
                                    cache_dir=cache))
    if "config.json" not in files:
        raise ModelNotFoundError(f"{ref.repo_id} ({where}) has neither config.json nor a "
                                 f".gguf file: it is not a model this server loads")
    return Path(snapshot_download(ref.repo_id, revision=info.sha or revision, cache_dir=cache,
                                  allow_patterns=_FOLDER_PATTERNS))


def _not_cached(ref: HFModelRef, revision: str | None, cache: Path) -> str:
    return (f"Model {_spelling(ref)!r} (revision {revision or 'main'}) is not a local path and "
            f"not in the Hugging Face cache {cache}")


def _how_to_fetch(ref: HFModelRef, revision: str | None, download_dir: str | None) -> str:
    command = f"hf download {ref.repo_id}"
    if ref.filename is not None:
        command += f" {ref.filename}"
    elif ref.quant is not None:
        command += f" --include '*{ref.quant}*.gguf'"
    if revision:
        command += f" --revision {revision}"
    if download_dir:
        command += f" --cache-dir {download_dir}"
    return (f"fetch it where the network allows with `{command}` (into that cache), or point "
            f"--download-dir or HF_HUB_CACHE at a cache that holds it")


def _spelling(ref: HFModelRef) -> str:
    if ref.quant is not None:
        return f"{ref.repo_id}:{ref.quant}"
    return f"{ref.repo_id}/{ref.filename}" if ref.filename else ref.repo_id
