"""What `--model` names, resolved to a config and a place to read weights and tokenizer from:

- a local Hugging Face folder (config.json, model.safetensors or a sharded index, tokenizer.json, ...);
- a GGUF file (llama.cpp's, ollama's: model/gguf.py), or a folder holding one and no config.json;
- a Hub id such as meta-llama/Llama-3.2-1B-Instruct, or one without a namespace such as gpt2 when
  no folder has that name (the local cache first, then a download);
- `demo`: the small Shakespeare model that ships inside the package;
- `random:<preset>` (the config.json files in data/presets, e.g. `random:llama-3.2-1b`) or
  `random:<folder with config.json>`: random weights of real shapes, for benchmarks without a download;
- nothing: Llama-3.2-1B-Instruct when it is already in the local Hugging Face cache, else `demo`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from pagedcli.core.errors import RunError, UsageError
from pagedcli.model.config import ModelConfig, token_ids
from pagedcli.model.config_checks import check_generation_config
from pagedcli.model.files import read_json
from pagedcli.model.gguf import GGUFModel, gguf_path, read_gguf
from pagedcli.model.gguf_tokenizer import gguf_tokenizer
from pagedcli.model.presets import RANDOM_PRESETS
from pagedcli.model.tokenizer import Tokenizer

DATA = Path(__file__).parent.parent / "data"
DEMO_FOLDER = DATA / "demo"
REFERENCE_MODEL = "meta-llama/Llama-3.2-1B-Instruct"
HUB_PATTERNS = ["*.json", "*.safetensors", "*.jinja"]


@dataclass
class ModelSource:
    name: str  # what the user sees
    config: ModelConfig
    folder: Path | None  # weights and tokenizer; None for random weights
    random: bool = False
    generation_config: dict = field(default_factory=dict)
    gguf: GGUFModel | None = None  # a GGUF file: its header, read once (folder: None)

    @property
    def stop_ids(self) -> set[int]:
        return set(self.config.eos_token_ids) | set(token_ids(self.generation_config.get("eos_token_id")))

    @property
    def has_tokenizer(self) -> bool:
        if self.gguf is not None:
            return "tokenizer.ggml.tokens" in self.gguf.file.metadata
        return self.folder is not None and (self.folder / "tokenizer.json").exists()  # unreadable: said on reading

    def read_tokenizer(self) -> Tokenizer | None:
        """The model's tokenizer: the folder's files, or a GGUF file's vocabulary; None without one."""
        if not self.has_tokenizer:
            return None
        if self.gguf is not None:
            return gguf_tokenizer(self.gguf.file.metadata, str(self.gguf.file.path))
        return Tokenizer(self.folder)


def resolve_model(spec: str | None, notice: Callable[[str], None] = lambda _: None) -> ModelSource:
    if spec is None:
        folder = _cached_snapshot(REFERENCE_MODEL)
        if folder is not None:
            notice(f"Using {REFERENCE_MODEL} from the local Hugging Face cache.")
            return _from_folder(folder, REFERENCE_MODEL)
        notice(f"Using the built-in demo model (a tiny Llama trained on Shakespeare). For {REFERENCE_MODEL}: "
               f"accept its licence on the Hub, run `hf auth login`, then pass `model` {REFERENCE_MODEL}.")
        spec = "demo"
    if spec == "demo":
        if not (DEMO_FOLDER / "config.json").is_file():
            raise RunError(f"the built-in model is missing from {DEMO_FOLDER}", "reinstall pagedcli")
        return _from_folder(DEMO_FOLDER, "demo")
    if spec.startswith("random:"):
        return _random(spec)
    path = Path(spec).expanduser()
    gguf = gguf_path(path, spec)
    if gguf is not None:
        model = read_gguf(gguf)
        return ModelSource(spec, model.config, None, generation_config=model.generation_config, gguf=model)
    if path.is_dir():
        return _from_folder(path, spec)
    if path.exists():
        raise UsageError(f"`model` {spec}: is a file, not a model folder or a .gguf file",
                         "pass the folder that holds config.json, or a GGUF file")
    if path.suffix.lower() == ".gguf":  # not a Hub id: no repository is named like a file
        raise UsageError(f"`model` {spec}: no such file", "pass the path of a .gguf file")
    if not HUB_ID.fullmatch(spec) or spec.startswith((".", "/", "~")):
        raise UsageError(f"`model` {spec}: no such folder", "pass a model folder, a Hub id, or `demo`")
    return _from_folder(_download(spec), spec)


def found_here(spec: str) -> bool:
    """Whether `spec` names a model resolve_model finds without a download: `demo`, `random:...`, a
    folder, a GGUF file, or a Hub id in the local cache."""
    path = Path(spec).expanduser()
    return (spec == "demo" or spec.startswith("random:") or path.is_dir()
            or (path.is_file() and gguf_path(path, spec) is not None)
            or (HUB_ID.fullmatch(spec) is not None and _cached_snapshot(spec) is not None))


HUB_ID = re.compile(r"([\w.-]+/)?[\w.-]+")  # namespace/name, or a bare name (gpt2, distilgpt2)


def _from_folder(folder: Path, name: str) -> ModelSource:
    folder = Path(folder)
    config = ModelConfig.from_file(folder / "config.json")
    generation_config = read_json(folder / "generation_config.json")
    check_generation_config(generation_config, str(folder / "generation_config.json"))
    return ModelSource(name, config, folder, generation_config=generation_config)


def _random(spec: str) -> ModelSource:
    what = spec.removeprefix("random:")
    if what in RANDOM_PRESETS:
        config_path = RANDOM_PRESETS[what]
    else:
        config_path = Path(what).expanduser()
        config_path = config_path / "config.json" if config_path.is_dir() else config_path
        if not config_path.is_file():
            raise UsageError(f"`model` {spec}: no such preset or config file",
                             f"presets: {', '.join(RANDOM_PRESETS)}; or random:<folder with config.json>")
    return ModelSource(spec, ModelConfig.from_file(config_path), None, random=True)


def _cached_snapshot(repo_id: str) -> Path | None:
    from huggingface_hub import snapshot_download

    try:
        folder = Path(snapshot_download(repo_id, allow_patterns=HUB_PATTERNS, local_files_only=True))
    except Exception:  # not cached, or a broken cache entry: not an error for a default choice
        return None
    return folder if (folder / "config.json").is_file() and any(folder.glob("*.safetensors")) else None


def _download(repo_id: str) -> Path:
    cached = _cached_snapshot(repo_id)
    if cached is not None:
        return cached
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import GatedRepoError, HfHubHTTPError, RepositoryNotFoundError

    try:
        return Path(snapshot_download(repo_id, allow_patterns=HUB_PATTERNS))
    except GatedRepoError:
        raise UsageError(f"`model` {repo_id}: the repository is gated",
                         "accept its licence on the Hub, run `hf auth login`, or pass a local folder") from None
    except RepositoryNotFoundError:
        raise UsageError(f"`model` {repo_id}: no such folder here, and no such repository on the Hub "
                         f"(or it is private)", "pass a model folder, a Hub id, or `demo`") from None
    except (HfHubHTTPError, OSError, ValueError) as e:
        from huggingface_hub import constants

        why = "HF_HUB_OFFLINE is set" if constants.HF_HUB_OFFLINE else (str(e).strip().splitlines() or [""])[0][:80]
        folder = "" if "/" in repo_id else "no such folder here, "  # a bare name may have meant a folder
        raise RunError(f"`model` {repo_id}: {folder}not in the local Hugging Face cache, and the Hub cannot be reached "
                       f"({why})",
                       "connect once to download it, log in with `hf auth login` if it is gated, "
                       "or pass a local folder") from None
