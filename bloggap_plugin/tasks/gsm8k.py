"""GSM8K: loader, prompts, gold extraction, answer parsers and the accuracy reward.

Data: ``datasets.load_dataset("openai/gsm8k", "main")`` (the hub or the local Hugging Face cache), or a local
file / folder in GSM8K format (``question`` and ``answer`` columns, the answer ending in ``#### <number>``):
``.jsonl``, ``.json``, ``.parquet``, a folder holding such files, or a folder written by
``Dataset.save_to_disk``. :data:`SAMPLE_PATH` is a small fixture in that format, written for the tests.

Parsers (both return the answer as a string, or ``None``):

- :func:`parse_lenient`: the *last* number in the text, commas removed, trailing decimal zeros dropped
  (``"18.00"`` -> ``"18"``, ``"12.50"`` -> ``"12.5"``);
- :func:`parse_strict`: the number after the last ``####``, same normalisation.

The reference study's lenient parser also cut ``"7.5"`` to ``"7"``; this one keeps a non-zero decimal part, so
``7.5`` is never counted as ``7``.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from bloggap_plugin.errors import UsageError

__all__ = [
    "SYSTEM_PROMPT",
    "SAMPLE_PATH",
    "GSM8KDataError",
    "parse_lenient",
    "parse_strict",
    "gold_answer",
    "completion_text",
    "load_gsm8k",
    "build_messages",
    "accuracy_reward",
    "strict_accuracy_reward",
]

SYSTEM_PROMPT = (
    "You are a careful math tutor. Reason briefly, step by step, then give the final answer as an integer "
    "on its own line in the form '#### <number>'."
)

SAMPLE_PATH = Path(__file__).resolve().parent.parent / "data" / "gsm8k_sample.jsonl"

# A number: optional minus, either digits with well-formed thousands commas or plain digits, optional decimals.
_NUMBER = r"-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?"
_NUMBER_RE = re.compile(rf"(?<![\w.]){_NUMBER}")  # not inside a word or after a decimal point
_STRICT_RE = re.compile(rf"####\s*\$?\s*({_NUMBER})")


class GSM8KDataError(UsageError, RuntimeError):
    """The GSM8K data could not be loaded or is not in GSM8K format (a :class:`UsageError`: the CLI prints it as one
    line; still a ``RuntimeError`` for callers that catch that)."""


def _normalise(number: str) -> str:
    number = number.replace(",", "")
    if "." in number:  # "18.00" -> "18", "12.50" -> "12.5"
        whole, frac = number.split(".", 1)
        frac = frac.rstrip("0")
        number = f"{whole}.{frac}" if frac else whole
    if number in ("-0", ""):
        number = "0"
    return number


def parse_lenient(text: str | None) -> str | None:
    """The last number in ``text`` (commas removed, trailing decimal zeros dropped), or ``None`` if there is none."""
    if not text:
        return None
    matches = _NUMBER_RE.findall(text)
    return _normalise(matches[-1]) if matches else None


def parse_strict(text: str | None) -> str | None:
    """The number after the last ``####`` in ``text`` (normalised like :func:`parse_lenient`), or ``None``."""
    if not text:
        return None
    matches = _STRICT_RE.findall(text)
    return _normalise(matches[-1]) if matches else None


def gold_answer(answer: str) -> str:
    """Gold answer of a GSM8K reference solution: the text after the last ``####``, stripped, commas removed."""
    if "####" not in answer:
        raise GSM8KDataError(f"GSM8K answer has no '####' line: {answer[-80:]!r}")
    gold = answer.rsplit("####", 1)[1].strip().replace(",", "")
    if parse_lenient(gold) != _normalise(gold):
        raise GSM8KDataError(f"GSM8K gold answer is not a number: {gold!r}")
    return _normalise(gold)


def completion_text(completion) -> str:
    """Text of a TRL completion: a string, or a list of messages (the last message's content)."""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, list) and completion:
        last = completion[-1]
        if isinstance(last, dict):
            content = last.get("content", "")
            if isinstance(content, list):  # multimodal content blocks
                return " ".join(block.get("text", "") for block in content if isinstance(block, dict))
            return str(content)
    return str(completion)


def _offline_hint(split: str) -> str:
    return (
        "Provide the data as a local file or folder with --data PATH (GSM8K format: 'question' and 'answer' "
        "columns, answers ending in '#### <number>'): a .jsonl, .json or .parquet file, a folder holding them, or "
        "a folder from Dataset.save_to_disk. To make one on a machine with network: python -c \"import datasets; "
        f"datasets.load_dataset('openai/gsm8k', 'main', split='{split}').to_parquet('gsm8k_{split}.parquet')\". "
        "Or unset HF_HUB_OFFLINE to download into the Hugging Face cache."
    )


def _load_local(path: Path, split: str):
    import datasets

    if not path.exists():
        raise GSM8KDataError(f"GSM8K data path {path} does not exist. " + _offline_hint(split))
    if path.is_dir():
        if (path / "dataset_info.json").is_file() or (path / "state.json").is_file() or (path / "dataset_dict.json").is_file():
            loaded = datasets.load_from_disk(str(path))
            if isinstance(loaded, datasets.DatasetDict):
                if split not in loaded:
                    raise GSM8KDataError(f"{path} has splits {sorted(loaded)}, not {split!r}")
                loaded = loaded[split]
            return loaded
        files = sorted(p for p in path.rglob("*") if p.suffix in (".parquet", ".jsonl", ".json"))
        split_files = [p for p in files if p.name.startswith(split)] or files
        if not split_files:
            raise GSM8KDataError(f"{path} holds no .parquet, .jsonl or .json files. " + _offline_hint(split))
        kinds = {p.suffix for p in split_files}
        if len(kinds) > 1:
            raise GSM8KDataError(f"{path} mixes file kinds {sorted(kinds)}; point --data at one file")
        builder = "parquet" if kinds == {".parquet"} else "json"
        return datasets.load_dataset(builder, data_files=[str(p) for p in split_files], split="train")
    suffix = path.suffix.lower()
    if suffix == ".parquet":
        return datasets.load_dataset("parquet", data_files=str(path), split="train")
    if suffix in (".jsonl", ".json"):
        return datasets.load_dataset("json", data_files=str(path), split="train")
    raise GSM8KDataError(f"GSM8K data file {path} must end in .jsonl, .json or .parquet (got {suffix!r})")


def load_gsm8k(data: str | os.PathLike | None = None, split: str = "train"):
    """GSM8K as a ``datasets.Dataset`` with ``question`` and ``answer`` columns.

    ``data=None`` uses ``datasets.load_dataset("openai/gsm8k", "main", split=split)``; otherwise ``data`` is a
    local path (see the module docstring). Raises :class:`GSM8KDataError` with instructions when the data is
    unavailable or not in GSM8K format.
    """
    import datasets

    if data is None:
        try:
            dataset = datasets.load_dataset("openai/gsm8k", "main", split=split)
        except Exception as err:  # noqa: BLE001 - offline, missing cache, network: all need the same advice
            raise GSM8KDataError(
                f"could not load openai/gsm8k ('main', split={split!r}) from the Hugging Face hub or its local cache "
                f"({type(err).__name__}: {str(err)[:200]}). " + _offline_hint(split)
            ) from err
    else:
        dataset = _load_local(Path(data), split)
    missing = {"question", "answer"} - set(dataset.column_names)
    if missing:
        raise GSM8KDataError(
            f"GSM8K data {data or 'openai/gsm8k'} lacks column(s) {sorted(missing)}; has {dataset.column_names}. "
            "GSM8K format needs 'question' and 'answer' (ending in '#### <number>')."
        )
    if len(dataset) == 0:
        raise GSM8KDataError(f"GSM8K data {data or 'openai/gsm8k'} is empty")
    return dataset


def build_messages(question: str) -> list[dict[str, str]]:
    """Conversational prompt: the system prompt asking for ``#### <number>``, then the question."""
    return [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": question}]


def accuracy_reward(completions: list, answer: list[str], **kwargs) -> list[float]:
    """TRL reward function (lenient parser): 1.0 where the last number equals the gold ``answer``, else 0.0."""
    return [1.0 if parse_lenient(completion_text(c)) == str(gold) else 0.0 for c, gold in zip(completions, answer)]


def strict_accuracy_reward(completions: list, answer: list[str], **kwargs) -> list[float]:
    """TRL reward function (strict parser): 1.0 where ``#### n`` equals the gold ``answer``, else 0.0."""
    return [1.0 if parse_strict(completion_text(c)) == str(gold) else 0.0 for c, gold in zip(completions, answer)]
