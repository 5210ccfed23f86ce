"""LoRA adapters (``model.lora``): the policy trains low-rank adapters on a frozen base model.

What lives here, used by the torch learner (``runtime.backends.learner``), the vLLM backend
(``runtime.backends.vllm_backend``), the dry run and ``scalinginter export``:

- ``LoraSpec``: the run's adapter settings, and ``attach_adapters``, which injects PEFT's LoRA layers into a
  causal LM in place (the transformers model object stays the one the learner runs; PEFT's wrapper is kept beside
  it for saving, loading and switching the adapters off);
- the base's identity: ``weights_sha256`` of its weight files (cached by path, size and mtime) is written into
  every adapter folder (``lora_base.json``); ``check_base`` refuses an adapter on another base, naming both;
- the adapter as data: ``adapter_config`` / ``adapter_tensors`` (PEFT's file names, what vLLM's LoRA loader
  reads), ``FolderAdapter`` for an adapter folder on disk, and merged weights (``merged_entries``: base + scale x
  B A per adapted layer, one tensor at a time) for engines that cannot serve LoRA and for a merged export;
- ``export_checkpoint``: a checkpoint (LoRA or full) as an HF folder transformers and vLLM load as it is;
- ``LoraCritic``: PPO's critic with its own frozen backbone and adapters (plus its value head);
- ``adapter_param_count``: the adapters' size from a ``config.json`` alone (the dry run's memory plan).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
BASE_RECORD = "lora_base.json"  # the base an adapter folder belongs to: {"base_sha256", "base_dir"}
ADAPTER_NAME = "default"  # PEFT's adapter name inside the learner's model
# the files of a checkpoint that are training state, not the model (left out of an export)
TRAINING_FILES = ("optimizer.pt", "rng.pt", "trainer_state.json", "manifest.json", "critic")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "vocab.json", "merges.txt", "tokenizer.model", "chat_template.jinja")
# PEFT's "all-linear" on the decoder architectures served here: every projection of attention and MLP
ALL_LINEAR_HINT = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class WrongBaseModel(ValueError):
    """An adapter was loaded onto a base model other than the one it was trained on."""


@dataclass(frozen=True)
class LoraSpec:
    """The adapters the learner trains (``model.lora``)."""

    rank: int
    alpha: float
    dropout: float = 0.0
    target_modules: tuple[str, ...] | str = "all-linear"

    @classmethod
    def from_config(cls, lo: Any) -> "LoraSpec | None":
        """From ``core.config.LoraConfig`` (None when LoRA is off)."""
        if lo is None or not lo.rank:
            return None
        targets = lo.target_modules if isinstance(lo.target_modules, str) else tuple(lo.target_modules)
        return cls(int(lo.rank), float(lo.scale_alpha), float(lo.dropout), targets)

    def peft_config(self):
        from peft import LoraConfig

        targets = self.target_modules if isinstance(self.target_modules, str) else list(self.target_modules)
        return LoraConfig(r=self.rank, lora_alpha=self.alpha, lora_dropout=self.dropout, target_modules=targets,
                          bias="none")


def _quiet_peft():
    """Import peft with bitsandbytes' import-time warnings about kernels this code never uses kept quiet."""
    import logging

    log = logging.getLogger("bitsandbytes")
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        import peft  # noqa: F401
    except ImportError as e:
        raise RuntimeError("model.lora needs peft: pip install 'peft>=0.21'") from e
    finally:
        log.setLevel(level)


# --- the base's identity -----------------------------------------------------------------------------------------
def is_adapter_dir(path: str | os.PathLike | None) -> bool:
    """A folder holding a PEFT adapter (``adapter_config.json``) rather than a full model."""
    return path is not None and (Path(path) / ADAPTER_CONFIG).is_file()


def weight_files(model_dir: str | os.PathLike) -> list[Path]:
    """The weight files of an HF model folder (its safetensors shards, else ``pytorch_model*.bin``)."""
    d = Path(model_dir)
    index = d / "model.safetensors.index.json"
    if index.exists():
        return [d / f for f in sorted(set(json.loads(index.read_text())["weight_map"].values()))]
    files = sorted(d.glob("*.safetensors")) or sorted(d.glob("pytorch_model*.bin"))
    files = [f for f in files if f.name != ADAPTER_WEIGHTS]
    if not files:
        raise FileNotFoundError(f"{model_dir} holds no model weights (*.safetensors): not a base model folder")
    return files


def _sha_cache() -> Path:
    from envs.cache import cache_root

    return cache_root() / "lora" / "base-sha256.json"


def weights_sha256(model_dir: str | os.PathLike) -> str:
    """sha256 over a base model's weight files (names and bytes, in order): what an adapter records as its base.
    Cached by the files' paths, sizes and modification times (a 7B base is read once, ~15 GB)."""
    files = weight_files(model_dir)
    key = [[str(f.resolve()), f.stat().st_size, f.stat().st_mtime_ns] for f in files]
    ident = hashlib.sha256(json.dumps(key).encode()).hexdigest()
    cache = _sha_cache()
    try:
        known = json.loads(cache.read_text())
    except (OSError, ValueError):
        known = {}
    if ident in known:
        return known[ident]
    h = hashlib.sha256()
    for f in files:
        h.update(f.name.encode() + b"\0")
        with open(f, "rb") as fh:
            while chunk := fh.read(8 << 20):
                h.update(chunk)
    digest = h.hexdigest()
    known[ident] = digest
    try:
        cache.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(known))
        os.replace(tmp, cache)
    except OSError:
        pass  # a read-only cache only costs the hash again
    return digest


def read_base_record(adapter_dir: str | os.PathLike) -> dict[str, Any]:
    """The adapter's base record: ``lora_base.json`` when there is one, else PEFT's ``base_model_name_or_path``
    (an adapter made elsewhere: no sha256 to check)."""
    d = Path(adapter_dir)
    rec: dict[str, Any] = {}
    if (d / BASE_RECORD).exists():
        rec = json.loads((d / BASE_RECORD).read_text())
    if not rec.get("base_dir") and (d / ADAPTER_CONFIG).exists():
        rec["base_dir"] = json.loads((d / ADAPTER_CONFIG).read_text()).get("base_model_name_or_path")
    return rec


def write_base_record(directory: str | os.PathLike, base_dir: str, base_sha256: str) -> None:
    (Path(directory) / BASE_RECORD).write_text(json.dumps({"base_sha256": base_sha256, "base_dir": str(base_dir)},
                                                          indent=2))


def check_base(adapter_dir: str | os.PathLike, base_dir: str | os.PathLike) -> str:
    """Refuse ``adapter_dir``'s adapter on ``base_dir`` when the base's weights are not those it was trained on
    (its recorded sha256). Returns the base's sha256."""
    rec = read_base_record(adapter_dir)
    sha = weights_sha256(base_dir)
    want = rec.get("base_sha256")
    if want and want != sha:
        raise WrongBaseModel(
            f"the LoRA adapter in {adapter_dir} was trained on the base model with weights sha256 {want[:16]}... "
            f"(recorded folder: {rec.get('base_dir')}), but {base_dir} has weights sha256 {sha[:16]}...: load it onto "
            "its own base (--set model.path=<that model>), or export it merged (scalinginter export CKPT OUT --merge)")
    return sha


def base_of(adapter_dir: str | os.PathLike, given: str | os.PathLike | None = None) -> str:
    """The local base folder of an adapter folder: ``given`` (a full model folder, checked against the record), else
    the recorded one (checked too). Raises WrongBaseModel or FileNotFoundError saying what to pass."""
    if given is not None and not is_adapter_dir(given):
        check_base(adapter_dir, given)
        return str(given)
    rec = read_base_record(adapter_dir)
    base = rec.get("base_dir")
    if not base:
        raise FileNotFoundError(f"{adapter_dir} is a LoRA adapter without a recorded base model: pass the base "
                                "(--set model.path=...)")
    if not Path(base).is_dir():
        from runtime.backends.model import resolve_model

        base = resolve_model(base)  # a hub id (an adapter made elsewhere) or an embedded name
    check_base(adapter_dir, base)
    return str(base)


# --- adapters on a transformers model ------------------------------------------------------------------------------
def attach_adapters(model: torch.nn.Module, spec: LoraSpec, adapter_dir: str | os.PathLike | None = None):
    """Inject ``spec``'s LoRA layers into ``model`` (a transformers causal LM, changed in place: its linear layers
    become PEFT LoRA layers, its base weights frozen) and return PEFT's wrapper around it. With ``adapter_dir``, the
    adapter weights saved there are loaded (every one must match: a rank or target change is refused)."""
    _quiet_peft()
    from peft import get_peft_model

    peft_model = get_peft_model(model, spec.peft_config())
    if adapter_dir is not None:
        load_adapter_weights(peft_model, adapter_dir)
    for n, p in model.named_parameters():  # only the adapters train
        p.requires_grad_(".lora_" in n)
    return peft_model


def load_adapter_weights(peft_model, adapter_dir: str | os.PathLike) -> None:
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    saved = load_file(str(Path(adapter_dir) / ADAPTER_WEIGHTS))
    want = set(adapter_tensors(peft_model))
    if set(saved) != want:
        missing, extra = sorted(want - set(saved)), sorted(set(saved) - want)
        raise ValueError(f"the adapter in {adapter_dir} does not match model.lora (missing {missing[:3]}, "
                         f"unexpected {extra[:3]}): resume with the target modules it was trained with")
    ours = adapter_tensors(peft_model)
    for k, v in saved.items():
        if tuple(v.shape) != tuple(ours[k].shape):
            raise ValueError(f"the adapter in {adapter_dir} has {k} of shape {tuple(v.shape)}, model.lora makes "
                             f"{tuple(ours[k].shape)}: resume with the rank it was trained with")
    set_peft_model_state_dict(peft_model, saved)


def adapter_tensors(peft_model) -> dict[str, torch.Tensor]:
    """The adapter's tensors under PEFT's file names (``base_model.model.<module>.lora_A.weight``), live (not
    copies)."""
    from peft import get_peft_model_state_dict

    return get_peft_model_state_dict(peft_model, adapter_name=ADAPTER_NAME, save_embedding_layers=False)


def adapter_config(peft_model) -> dict[str, Any]:
    """The adapter's ``adapter_config.json`` content (JSON values)."""
    cfg = peft_model.peft_config[ADAPTER_NAME].to_dict()
    return json.loads(json.dumps(cfg, default=lambda o: sorted(o) if isinstance(o, (set, frozenset)) else str(o)))


def lora_layers(model: torch.nn.Module) -> dict[str, Any]:
    """Module name -> PEFT LoRA layer holding the adapter, in ``model``."""
    from peft.tuners.lora import LoraLayer

    return {n: m for n, m in model.named_modules() if isinstance(m, LoraLayer) and ADAPTER_NAME in m.lora_A}


def freeze_base_bf16(model: torch.nn.Module, skip: tuple[torch.nn.Module, ...] = ()) -> int:
    """Store the frozen linear layers of ``model`` (the adapted layers' base weights, and any layer left without an
    adapter) in bf16, for a learner that runs under bf16 autocast: every forward casts them to bf16 anyway, so the
    outputs are the same at half the bytes. The adapters, norms and embeddings keep fp32; ``skip`` (the output
    projection, tied to the embedding in small models) too. Returns how many layers."""
    n = 0
    for m in model.modules():
        if (type(m) is torch.nn.Linear and not any(m is s for s in skip)
                and not any(p.requires_grad for p in m.parameters())):
            m.to(torch.bfloat16)
            n += 1
    return n


def _hf_name(name: str) -> str:
    return name.replace(".base_layer.", ".")


def merged_entries(model: torch.nn.Module) -> list[tuple[str, tuple[int, ...], Callable[[], torch.Tensor]]]:
    """The policy's weights with the adapters merged in, as ``(hf_name, shape, fetch)``: ``fetch()`` computes one
    tensor (base + scale x B A for an adapted layer's weight, fp32) when it is asked for, so a full merged copy never
    exists at once. The names are the model's own transformers names (tied weights once, as ``named_parameters``)."""
    layers = lora_layers(model)
    out = []
    for name, p in model.named_parameters():
        if ".lora_" in name:
            continue
        mod, _, leaf = name.rpartition(".")
        owner = mod.removesuffix(".base_layer")
        layer = layers.get(owner) if mod.endswith(".base_layer") else None
        if layer is not None and leaf == "weight":
            def fetch(p=p, layer=layer):
                with torch.no_grad():
                    return p.detach().float() + layer.get_delta_weight(ADAPTER_NAME).float()
        else:
            def fetch(p=p):
                return p.detach()
        out.append((_hf_name(name), tuple(p.shape), fetch))
    return out


def save_merged(model: torch.nn.Module, directory: str | os.PathLike, tokenizer: Any = None,
                dtype: torch.dtype = torch.float32) -> None:
    """An HF model folder of ``model`` with its adapters merged (``config.json``, ``generation_config.json``,
    ``model.safetensors`` in ``dtype``, the tokenizer): loads in transformers and vLLM as a plain model."""
    from safetensors.torch import save_file

    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    state = {n: f().to(dtype).contiguous() for n, _, f in merged_entries(model)}
    save_file(state, str(d / "model.safetensors"), metadata={"format": "pt"})
    config = model.config
    use_cache, config.use_cache = config.use_cache, True
    try:
        config.save_pretrained(d)
    finally:
        config.use_cache = use_cache
    gen = getattr(model, "generation_config", None)
    if gen is not None:
        gen.save_pretrained(d)
    if tokenizer is not None:
        tokenizer.save_pretrained(d)


# --- an adapter as the engine takes it ------------------------------------------------------------------------------
class PolicyAdapter:
    """The learner's live adapter, read at each sync: ``config()`` and ``tensors()`` for an engine that serves
    LoRA, ``merged_entries()`` for one that does not."""

    def __init__(self, peft_model, model: torch.nn.Module):
        self.peft_model, self.model = peft_model, model

    @property
    def rank(self) -> int:
        return int(self.peft_model.peft_config[ADAPTER_NAME].r)

    def config(self) -> dict[str, Any]:
        return adapter_config(self.peft_model)

    def tensors(self) -> dict[str, torch.Tensor]:
        return adapter_tensors(self.peft_model)

    def merged_entries(self):
        return merged_entries(self.model)


class FolderAdapter:
    """An adapter folder on disk (a LoRA checkpoint, an export) as the engine takes it: its config and tensors, or
    its base's weights with it merged (``merged_entries``: the base's safetensors read one tensor at a time)."""

    def __init__(self, adapter_dir: str | os.PathLike, base_dir: str | os.PathLike):
        self.dir, self.base_dir = Path(adapter_dir), Path(base_dir)

    @property
    def rank(self) -> int:
        c = self.config()
        return int(max([c.get("r", 0), *(c.get("rank_pattern") or {}).values()]))

    def config(self) -> dict[str, Any]:
        return json.loads((self.dir / ADAPTER_CONFIG).read_text())

    def tensors(self) -> dict[str, torch.Tensor]:
        from safetensors.torch import load_file

        return load_file(str(self.dir / ADAPTER_WEIGHTS))

    def merged_entries(self):
        from contextlib import ExitStack

        from safetensors import safe_open

        c = self.config()
        if c.get("rank_pattern") or c.get("alpha_pattern") or c.get("use_dora") or c.get("fan_in_fan_out"):
            raise ValueError(f"{self.dir}: merging adapters with rank/alpha patterns, DoRA or fan-in-fan-out is not "
                             "supported here: serve it as an adapter (model.lora.engine=adapter)")
        r = float(c["r"])
        scale = float(c["lora_alpha"]) / (r ** 0.5 if c.get("use_rslora") else r)
        ad = self.tensors()
        pairs = {}
        for k in ad:
            if k.endswith(".lora_A.weight"):
                mod = k.removeprefix("base_model.model.").removesuffix(".lora_A.weight")
                pairs[f"{mod}.weight"] = (ad[k], ad[k.replace(".lora_A.", ".lora_B.")])
        out, stack = [], ExitStack()
        for f in weight_files(self.base_dir):
            h = stack.enter_context(safe_open(str(f), framework="pt"))
            for name in h.keys():
                def fetch(h=h, name=name):
                    w = h.get_tensor(name)
                    if name in pairs:
                        a, b = pairs[name]
                        w = w.float() + scale * (b.float() @ a.float())
                    return w
                out.append((name, tuple(h.get_slice(name).get_shape()), fetch))
        self._files = stack  # the files stay open while the entries are read (closed with this object)
        return out


# --- loading a model folder that may be an adapter ------------------------------------------------------------------
def load_merged_causal_lm(adapter_dir: str | os.PathLike, base_dir: str | os.PathLike | None = None,
                          dtype: torch.dtype = torch.float32):
    """A causal LM from an adapter folder: its base (``base_dir``, else the recorded one, checked) with the adapter
    merged into the weights (a plain transformers model, no PEFT layers left)."""
    from transformers import AutoModelForCausalLM

    _quiet_peft()
    from peft import PeftModel

    base = base_of(adapter_dir, base_dir)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=dtype)
    return PeftModel.from_pretrained(model, str(adapter_dir)).merge_and_unload()


# --- export -----------------------------------------------------------------------------------------------------------
def export_checkpoint(src: str | os.PathLike, out: str | os.PathLike, merge: bool = False,
                      base_dir: str | os.PathLike | None = None) -> dict[str, Any]:
    """Write checkpoint folder ``src`` as an HF folder ``out`` that transformers and vLLM load as it is: a LoRA
    checkpoint as its adapter (``adapter_config.json``, ``adapter_model.safetensors``, the tokenizer, the base
    record), or with ``merge`` as its base with the adapter merged (a plain model folder); a full checkpoint as its
    model files. Training state (optimizer, RNG, trainer state, critic, manifest) is left out. Returns what was
    written: ``{"kind": "adapter" | "merged" | "full", "base": ..., "files": [...]}``."""
    src, out = Path(src), Path(out)
    if out.exists() and any(out.iterdir()):
        raise FileExistsError(f"{out} exists and is not empty: pass a new folder")
    tmp = out.with_name(f".{out.name}.export-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    info: dict[str, Any]
    try:
        if is_adapter_dir(src):
            base = base_of(src, base_dir)
            if merge:
                from transformers import AutoTokenizer

                model = load_merged_causal_lm(src, base)
                model.config.use_cache = True
                model.save_pretrained(tmp)
                AutoTokenizer.from_pretrained(src).save_pretrained(tmp)
                info = {"kind": "merged", "base": base}
            else:
                for f in src.iterdir():
                    if f.is_file() and f.name not in TRAINING_FILES:
                        shutil.copy2(f, tmp / f.name)
                c = json.loads((tmp / ADAPTER_CONFIG).read_text())
                c["base_model_name_or_path"] = str(base)
                c["inference_mode"] = True
                (tmp / ADAPTER_CONFIG).write_text(json.dumps(c, indent=2))
                info = {"kind": "adapter", "base": base}
        else:
            if not (src / "config.json").exists():
                raise FileNotFoundError(f"{src} holds neither an adapter (adapter_config.json) nor a model "
                                        "(config.json): pass a checkpoint folder")
            for f in src.iterdir():
                if f.is_file() and f.name not in TRAINING_FILES:
                    shutil.copy2(f, tmp / f.name)
            info = {"kind": "full", "base": None}
        if out.exists():
            out.rmdir()
        out.parent.mkdir(parents=True, exist_ok=True)
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    info["files"] = sorted(f.name for f in out.iterdir())
    return info


# --- PPO's critic with adapters ---------------------------------------------------------------------------------------
def _critic_base():
    from runtime.backends.critic import Critic

    return Critic


class LoraCritic(_critic_base()):
    """PPO's critic under ``model.lora``: its backbone (the policy's base by default, or ``algo.critic.model``)
    frozen, with its own LoRA adapters (the policy's spec) and the value head trained. It keeps its own copy of the
    backbone: the policy's base carries the policy's adapters, and PEFT switches between two adapters on one model by
    flipping their parameters' ``requires_grad``, which the learner's gradient hooks rely on. Under bf16 autocast the
    copy's linear layers are stored in bf16 (2 bytes per parameter, not the 16 of a fully trained critic).
    Checkpoints hold the adapters and the head only (``critic/model.pt``) and their optimizer state."""

    def __init__(self, model_path: str, spec: LoraSpec, lr: float, value_clip: float = 0.2, micro_batch_size: int = 4,
                 bf16_autocast: bool = True, grad_clip: float = 1.0, pad_id: int = 0, device: Any = None):
        from runtime.backends.critic import ValueModel, _load_backbone

        _quiet_peft()
        from peft import inject_adapter_in_model

        if is_adapter_dir(model_path):
            model_path = base_of(model_path)
        backbone, hidden = _load_backbone(model_path)
        backbone = inject_adapter_in_model(spec.peft_config(), backbone, adapter_name=ADAPTER_NAME)
        for n, p in backbone.named_parameters():
            p.requires_grad_(".lora_" in n)
        if bf16_autocast:
            freeze_base_bf16(backbone)
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.net = ValueModel(backbone, hidden).to(self.device)
        self.net.train()
        self.lr, self.value_clip, self.mb, self.bf16, self.grad_clip, self.pad_id = (
            lr, value_clip, micro_batch_size, bf16_autocast, grad_clip, pad_id)
        self.opt = torch.optim.AdamW(self.trainable(), lr=lr, weight_decay=0.0)

    def trainable(self) -> list[torch.nn.Parameter]:
        return [p for p in self.net.parameters() if p.requires_grad]

    def step(self) -> float:
        gn = torch.nn.utils.clip_grad_norm_(self.trainable(), self.grad_clip)
        self.opt.step()
        return float(gn)

    def save(self, directory: Path) -> None:
        d = Path(directory) / "critic"
        d.mkdir(parents=True, exist_ok=True)
        torch.save({n: p.detach() for n, p in self.net.named_parameters() if p.requires_grad}, d / "model.pt")
        self._save_optimizer(d)

    def load(self, directory: Path) -> bool:
        from runtime.backends.safe_load import load_plain

        d = Path(directory) / "critic"
        if not (d / "model.pt").exists():
            return False
        saved = load_plain(d / "model.pt", map_location="cpu")
        by_name = dict(self.net.named_parameters())
        want = {n for n, p in by_name.items() if p.requires_grad}
        if set(saved) != want:
            raise ValueError(f"{d / 'model.pt'} is not this LoRA critic's (adapters and value head): it was saved "
                             "with other model.lora settings, or without LoRA")
        with torch.no_grad():
            for n, t in saved.items():
                by_name[n].copy_(t)
        self._load_optimizer(d)
        return True


# --- sizes for the dry run --------------------------------------------------------------------------------------------
def adapter_param_count(c: dict[str, Any], rank: int, targets: tuple[str, ...] | list[str] | str) -> int:
    """Parameters of rank-``rank`` adapters on a decoder described by ``config.json`` ``c`` (a ``text_config`` inside
    is used): r x (in + out) per adapted projection per layer. ``all-linear``: the attention and gated-MLP
    projections (q, k, v, o, gate, up, down)."""
    c = c.get("text_config", c)
    h, layers = int(c["hidden_size"]), int(c["num_hidden_layers"])
    heads = int(c["num_attention_heads"])
    kv = int(c.get("num_key_value_heads") or heads)
    hd = int(c.get("head_dim") or h // heads)
    inter = int(c.get("intermediate_size") or 4 * h)
    shapes = {"q_proj": (h, heads * hd), "k_proj": (h, kv * hd), "v_proj": (h, kv * hd), "o_proj": (heads * hd, h),
              "gate_proj": (h, inter), "up_proj": (h, inter), "down_proj": (inter, h)}
    names = ALL_LINEAR_HINT if isinstance(targets, str) and targets == "all-linear" else tuple(
        [targets] if isinstance(targets, str) else targets)
    unknown = [n for n in names if n not in shapes]
    if unknown:
        raise ValueError(f"the dry run sizes adapters on {sorted(shapes)}; unknown target modules {unknown}")
    return layers * sum(rank * (shapes[n][0] + shapes[n][1]) for n in names)

