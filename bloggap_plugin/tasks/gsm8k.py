"""GSM8K: loader, prompts, gold extraction, answer parsers and the accuracy reward.

Data: a local file / folder in GSM8K format (``question`` and ``answer`` columns, the answer ending in
``#### <number>``): ``.jsonl``, ``.json``, ``.parquet``, a folder holding such files (``train*`` / ``test*`` picked
by split), or a folder written by ``Dataset.save_to_disk``; given as ``data=`` (``--data PATH``) or, when that is
``None``, by the environment variable ``BLOGGAP_GSM8K_DATA`` (:data:`DATA_ENV`). With neither,
``datasets.load_dataset("openai/gsm8k", "main")`` (the hub or the local Hugging Face cache).

The two files of the published data set, ``train.jsonl`` and ``test.jsonl`` (openai/grade-school-math), are
checked when a path resolves to a file of that name: its row count (7,473 / 1,319) and its sha256
(:data:`KNOWN_FILES`), so a cut or edited copy is refused with one line naming the file. The data is read where
it lies, never copied into the package. :data:`SAMPLE_PATH` is a small fixture in GSM8K format, written for the
tests (not GSM8K data).

Supervised targets: :func:`worked_solution` turns a reference solution into an assistant turn (calculator marks
removed, the final line ``#### <gold>``), a text that both reward functions score 1.0 against its gold answer.

Splits: ``"train"`` and ``"test"`` as published; ``"validation"``, :data:`VALIDATION_N` rows held out of train by a
fixed rule (:func:`validation_rows`), and ``"train_minus_validation"``, the rest of train: a warm start trained on
the rest can choose its setting on validation without touching test. The rule's rows for the published train file
are recorded in :data:`VALIDATION_FILE` and checked against it whenever the split is made from that file.

Difficulty: :func:`calc_steps` counts the ``<<...>>`` calculator marks of a reference solution (the number of
calculation steps); :func:`filter_by_calc_steps` keeps the rows with a given number or range of them.

Parsers (both return the answer as a string, or ``None``):

- :func:`parse_lenient`: the *last* number in the text, commas removed, trailing decimal zeros dropped
  (``"18.00"`` -> ``"18"``, ``"12.50"`` -> ``"12.5"``);
- :func:`parse_strict`: the number after the last ``####``, same normalisation.

The reference study's lenient parser also cut ``"7.5"`` to ``"7"``; this one keeps a non-zero decimal part, so
``7.5`` is never counted as ``7``.
"""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Iterator
from pathlib import Path

from bloggap_plugin.core.errors import UsageError

__all__ = [
    "SYSTEM_PROMPT",
    "SAMPLE_PATH",
    "DATA_ENV",
    "HUB_ID",
    "KNOWN_FILES",
    "GSM8KDataError",
    "resolve_data",
    "verify_known_file",
    "calc_steps",
    "parse_calc_steps",
    "filter_by_calc_steps",
    "parse_lenient",
    "parse_strict",
    "gold_answer",
    "worked_solution",
    "completion_text",
    "load_gsm8k",
    "column",
    "SPLITS",
    "VALIDATION_N",
    "VALIDATION_SALT",
    "VALIDATION_FILE",
    "validation_rows",
    "build_messages",
    "accuracy_reward",
    "strict_accuracy_reward",
]

SYSTEM_PROMPT = (
    "You are a careful math tutor. Reason briefly, step by step, then give the final answer as an integer "
    "on its own line in the form '#### <number>'."
)

SAMPLE_PATH = Path(__file__).resolve().parent.parent / "data" / "gsm8k_sample.jsonl"

DATA_ENV = "BLOGGAP_GSM8K_DATA"
"""Environment variable naming the local GSM8K data (a file or a folder) when ``data`` is not given."""

HUB_ID = "openai/gsm8k"
"""The hub data set used when neither ``data`` nor :data:`DATA_ENV` names a local path (config ``main``)."""

KNOWN_FILES: dict[str, tuple[int, str]] = {
    "train.jsonl": (7473, "17f347dc51477c50d4efb83959dbb7c56297aba886e5544ee2aaed3024813465"),
    "test.jsonl": (1319, "3730d312f6e3440559ace48831e51066acaca737f6eabec99bccb9e4b3c39d14"),
}
"""File name -> (rows, sha256) of the published GSM8K files (openai/grade-school-math at commit 3101c7d)."""

SPLITS = ("train", "test", "validation", "train_minus_validation")
"""Split names :func:`load_gsm8k` takes: the two published ones and the two made from train."""

VALIDATION_N = 500
"""Rows of the published train split held out as the validation split."""

VALIDATION_SALT = "bloggap-gsm8k-validation-v1"
"""Prefix of the text hashed to rank train rows for the validation split (:func:`validation_rows`)."""

VALIDATION_FILE = Path(__file__).resolve().parent.parent / "data" / "gsm8k_validation.json"
"""The validation rows of the published train.jsonl (0-based line indices), recorded once from
:func:`validation_rows`; :func:`load_gsm8k` refuses a split that differs from them."""

_CALC_RE = re.compile(r"<<.*?>>")

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


def worked_solution(answer: str, calc_marks: bool = False) -> str:
    """A GSM8K reference solution as the assistant's turn of a supervised example: its worked steps, then the final
    line ``#### <gold>`` with the gold answer as :func:`gold_answer` gives it (commas removed: ``#### 1,000`` becomes
    ``#### 1000``), surrounding whitespace stripped.

    The ``<<a*b=c>>`` calculator marks are removed unless ``calc_marks``: they were written for a calculator tool
    the model does not have when it answers, and the text beside each mark already states the result
    (``48/2 = <<48/2=24>>24`` becomes ``48/2 = 24``). Raises :class:`GSM8KDataError` when ``answer`` has no
    ``####`` line or its gold is not a number.
    """
    gold = gold_answer(answer)
    steps = answer.rsplit("####", 1)[0]
    if not calc_marks:
        steps = _CALC_RE.sub("", steps)
    steps = steps.strip()
    return f"{steps}\n#### {gold}" if steps else f"#### {gold}"


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
        f"Provide the data as a local file or folder with --data PATH or ${DATA_ENV}=PATH (GSM8K format: 'question' and 'answer' "
        "columns, answers ending in '#### <number>'): a .jsonl, .json or .parquet file, a folder holding them, or "
        "a folder from Dataset.save_to_disk. To make one on a machine with network: python -c \"import datasets; "
        f"datasets.load_dataset('openai/gsm8k', 'main', split='{split}').to_parquet('gsm8k_{split}.parquet')\". "
        "Or unset HF_HUB_OFFLINE to download into the Hugging Face cache."
    )


def resolve_data(data: str | os.PathLike | None) -> str | None:
    """The local GSM8K path to use: ``data`` if given, else ``$BLOGGAP_GSM8K_DATA`` if set and not empty, else
    ``None`` (the hub id :data:`HUB_ID`)."""
    if data is not None and str(data) != "":
        return str(data)
    return os.environ.get(DATA_ENV) or None


def verify_known_file(path: str | os.PathLike, option: str = "--data") -> None:
    """Check a published GSM8K file (named ``train.jsonl`` or ``test.jsonl``): row count, then sha256.

    Raises :class:`GSM8KDataError`, one line naming the file, what differs and the fix. Files of other names are
    not checked (a subset or a fixture of your own: name it otherwise). ``option`` says how the path was given
    (``--data`` or ``$BLOGGAP_GSM8K_DATA``), for the message. Reads the file once (5 MB for train.jsonl).
    """
    import hashlib

    path = Path(path)
    known = KNOWN_FILES.get(path.name)
    if known is None:
        return
    rows_expected, sha_expected = known
    content = path.read_bytes()
    rows = sum(1 for line in content.splitlines() if line.strip())
    fix = (f"restore the unchanged file (openai/grade-school-math, see the README beside it) or point "
           f"{option} at another copy; a subset of your own must not be named "
           f"{path.name}")
    if rows != rows_expected:
        raise GSM8KDataError(f"GSM8K file {path} has {rows:,} rows, the published {path.name} has "
                             f"{rows_expected:,}: {fix}")
    sha = hashlib.sha256(content).hexdigest()
    if sha != sha_expected:
        raise GSM8KDataError(f"GSM8K file {path} has the right row count ({rows:,}) but other bytes (sha256 "
                             f"{sha[:12]}..., the published {path.name} has {sha_expected[:12]}...): {fix}")


def _check_json_lines(path: Path) -> None:
    """Raise :class:`GSM8KDataError` naming ``path:line`` for the first line of a ``.jsonl`` file that is not one JSON
    object (``datasets`` would fail on it with a generation error naming no line)."""
    import json

    if path.suffix.lower() != ".jsonl":
        return
    with open(path, encoding="utf-8", errors="replace") as handle:
        for number, line in enumerate(handle, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                raise GSM8KDataError(f"{path}:{number}: not a JSON line ({err.msg}); each line of a GSM8K .jsonl file "
                                     "is one JSON object with 'question' and 'answer'") from None
            if not isinstance(row, dict):
                raise GSM8KDataError(f"{path}:{number}: a JSON {type(row).__name__}, not an object with 'question' "
                                     "and 'answer'")


def _load_local(path: Path, split: str, option: str = "--data"):
    import datasets

    if not path.exists():
        given = f" (given by {option})" if option != "--data" else ""
        raise GSM8KDataError(f"GSM8K data path {path}{given} does not exist. " + _offline_hint(split))
    if path.is_dir() and (path / f"{split}.jsonl").is_file():  # the published layout: train.jsonl, test.jsonl
        path = path / f"{split}.jsonl"
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
        for file in split_files:
            _check_json_lines(file)
        return datasets.load_dataset(builder, data_files=[str(p) for p in split_files], split="train")
    suffix = path.suffix.lower()
    if suffix == ".parquet":
        return datasets.load_dataset("parquet", data_files=str(path), split="train")
    if suffix in (".jsonl", ".json"):
        verify_known_file(path, option)
        _check_json_lines(path)
        return datasets.load_dataset("json", data_files=str(path), split="train")
    raise GSM8KDataError(f"GSM8K data file {path} must end in .jsonl, .json or .parquet (got {suffix!r})")


@contextlib.contextmanager
def _no_progress_bars(datasets) -> Iterator[None]:
    """datasets' progress bars off while reading a local file (its "Generating train split" bars on a cold cache are
    noise before a one-line message), then back as the user had them."""
    was_disabled = datasets.are_progress_bars_disabled()
    datasets.disable_progress_bars()
    try:
        yield
    finally:
        if not was_disabled:
            datasets.enable_progress_bars()


def column(dataset, name: str) -> list:
    """Column ``name`` of a ``datasets.Dataset`` as a list, read in one call: iterating the lazy ``Column`` that
    ``dataset[name]`` is (datasets >= 4) reads one row at a time, slowest after a ``shuffle`` or ``select``."""
    return dataset[name][:]


def validation_rows(questions: list[str], n: int = VALIDATION_N) -> list[int]:
    """Indices (ascending) of the ``n`` rows of ``questions`` held out as validation: the rows whose
    ``sha256(VALIDATION_SALT + "\\n" + question)`` (UTF-8, hex) sorts lowest, ties by index. The rule reads only each
    question's text, so it does not depend on file order, library versions or a random generator. Raises
    :class:`GSM8KDataError` when there are not more than ``n`` rows (nothing would be left to train on)."""
    import hashlib

    if len(questions) <= n:
        raise GSM8KDataError(f"the validation split holds {n} rows of GSM8K train, which has only {len(questions)}: "
                             "use the published train split (e.g. --data ../shared/data/gsm8k)")
    keys = sorted((hashlib.sha256(f"{VALIDATION_SALT}\n{q}".encode()).hexdigest(), i) for i, q in enumerate(questions))
    return sorted(i for _, i in keys[:n])


def _recorded_validation_rows() -> tuple[int, list[int]]:
    """``(train rows, validation rows)`` recorded in :data:`VALIDATION_FILE`."""
    import json

    recorded = json.loads(VALIDATION_FILE.read_text())
    return int(recorded["train_rows"]), [int(i) for i in recorded["rows"]]


def _split_train(dataset, split: str):
    """``split`` (``validation`` or ``train_minus_validation``) of the train split ``dataset``; checked against
    :data:`VALIDATION_FILE` when ``dataset`` has the published train split's row count."""
    held = validation_rows(column(dataset, "question"))
    train_rows, recorded = _recorded_validation_rows()
    if len(dataset) == train_rows and held != recorded:
        raise GSM8KDataError(f"the validation rows of this GSM8K train split ({len(dataset):,} rows) differ from those "
                             f"recorded in {VALIDATION_FILE.name}: the data is not the published train split; point "
                             "--data at an unchanged copy (../shared/data/gsm8k)")
    if split == "validation":
        return dataset.select(held)
    kept = sorted(set(range(len(dataset))) - set(held))
    return dataset.select(kept)


def load_gsm8k(data: str | os.PathLike | None = None, split: str = "train"):
    """GSM8K as a ``datasets.Dataset`` with ``question`` and ``answer`` columns.

    ``data`` is a local path (see the module docstring); ``None`` means ``$BLOGGAP_GSM8K_DATA``, and without that
    ``datasets.load_dataset("openai/gsm8k", "main", split=split)``. A folder holding ``<split>.jsonl`` reads that
    file; ``train.jsonl`` / ``test.jsonl`` are checked against the published row counts and sha256. ``split``: one of
    :data:`SPLITS`; ``validation`` and ``train_minus_validation`` are made from train (:func:`validation_rows`), in
    train's file order. Raises :class:`GSM8KDataError` with instructions when the data is unavailable, altered or not
    in GSM8K format.
    """
    import datasets

    if split not in SPLITS:
        raise GSM8KDataError(f"GSM8K split {split!r}: choose one of {', '.join(SPLITS)}")
    if split in ("validation", "train_minus_validation"):
        return _split_train(load_gsm8k(data, "train"), split)
    option = "--data" if data is not None and str(data) != "" else f"${DATA_ENV}"
    data = resolve_data(data)
    if data is None:
        try:
            dataset = datasets.load_dataset("openai/gsm8k", "main", split=split)
        except Exception as err:  # noqa: BLE001 - offline, missing cache, network: all need the same advice
            raise GSM8KDataError(
                f"could not load openai/gsm8k ('main', split={split!r}) from the Hugging Face hub or its local cache "
                f"({type(err).__name__}: {str(err)[:200]}). " + _offline_hint(split)
            ) from err
    else:
        with _no_progress_bars(datasets):
            dataset = _load_local(Path(data), split, option)
    missing = {"question", "answer"} - set(dataset.column_names)
    if missing:
        raise GSM8KDataError(
            f"GSM8K data {data or 'openai/gsm8k'} lacks column(s) {sorted(missing)}; has {dataset.column_names}. "
            "GSM8K format needs 'question' and 'answer' (ending in '#### <number>')."
        )
    if len(dataset) == 0:
        raise GSM8KDataError(f"GSM8K data {data or 'openai/gsm8k'} is empty")
    return dataset


def calc_steps(answer: str) -> int:
    """Number of calculation steps of a GSM8K reference solution: its ``<<...>>`` calculator marks."""
    return len(_CALC_RE.findall(answer))


def parse_calc_steps(value: int | str | tuple[int, int] | list[int] | None) -> tuple[int, int] | None:
    """``(low, high)`` inclusive from ``2`` / ``"2"`` (exactly two steps), ``"1-3"`` or ``(1, 3)``; ``None`` stays.

    Raises :class:`~bloggap_plugin.core.errors.UsageError` for anything else (negative, reversed, not a number).
    """
    if value is None:
        return None
    if isinstance(value, bool):
        raise UsageError(f"calc_steps must be a whole number of steps or a range like 1-2, got {value!r}")
    try:
        if isinstance(value, int):
            low = high = value
        elif isinstance(value, (tuple, list)) and len(value) == 2:
            low, high = (int(v) for v in value)
        else:
            parts = str(value).strip().split("-")
            if len(parts) not in (1, 2) or not all(p.strip().isdigit() for p in parts):
                raise ValueError
            low, high = int(parts[0]), int(parts[-1])
    except (TypeError, ValueError):
        raise UsageError(f"calc_steps must be a whole number of <<...>> calculation steps (e.g. 1) or a range like "
                         f"1-2, got {value!r}") from None
    if low < 0 or high < low:
        raise UsageError(f"calc_steps {value!r}: give a number >= 0 or a range low-high with low <= high")
    return low, high


def filter_by_calc_steps(dataset, steps: int | str | tuple[int, int] | None):
    """Rows of ``dataset`` whose reference solution has ``steps`` calculation steps (a number or a range, see
    :func:`parse_calc_steps`); ``None`` keeps every row. No row left raises :class:`GSM8KDataError`."""
    bounds = parse_calc_steps(steps)
    if bounds is None:
        return dataset
    low, high = bounds
    keep = [i for i, answer in enumerate(column(dataset, "answer")) if low <= calc_steps(answer) <= high]
    if not keep:
        wanted = str(low) if low == high else f"{low}-{high}"
        raise GSM8KDataError(f"no GSM8K row has {wanted} calculation step(s) (<<...>> marks) among {len(dataset)}; "
                             "choose another calc_steps")
    return dataset.select(keep)


def build_messages(question: str) -> list[dict[str, str]]:
    """Conversational prompt: the system prompt asking for ``#### <number>``, then the question."""
    return [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": question}]


def accuracy_reward(completions: list, answer: list[str], **kwargs) -> list[float]:
    """TRL reward function (lenient parser): 1.0 where the last number equals the gold ``answer``, else 0.0."""
    return [1.0 if parse_lenient(completion_text(c)) == str(gold) else 0.0 for c, gold in zip(completions, answer)]


def strict_accuracy_reward(completions: list, answer: list[str], **kwargs) -> list[float]:
    """TRL reward function (strict parser): 1.0 where ``#### n`` equals the gold ``answer``, else 0.0."""
    return [1.0 if parse_strict(completion_text(c)) == str(gold) else 0.0 for c, gold in zip(completions, answer)]
