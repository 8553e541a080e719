"""Publish GSM8K warm-start runs (issue 33 item 1): a run folder made commit-ready; T18-warmstart-settings.

    python -m benchmarks.gsm8k_warmstart_publish run FOLDER --name NAME --into benchmarks/results/h200
    python -m benchmarks.gsm8k_warmstart_publish settings \\
        --out benchmarks/results/h200/gsm8k_warmstart_settings.json \\
        benchmarks/results/h200/gsm8k_warmstart.json benchmarks/results/h200/gsm8k_warmstart_NAME.json ...

``run`` takes a folder as :mod:`benchmarks.gsm8k_warmstart` left it, or one setting's pack of
``benchmarks/gpu/gsm8k_warmstart_settings.sh`` (``NAME.tar.xz``): ``gsm8k_warmstart.json``,
``gsm8k_warmstart.log`` where the call script wrote one, and ``eval_before/`` / ``eval_after/``
(``gsm8k_baseline.json``, ``completions.jsonl``). It writes ``<into>/gsm8k_warmstart_NAME.json`` (its tables
rebuilt by :func:`benchmarks.gsm8k_warmstart.document`), ``<into>/gsm8k_warmstart_NAME/eval_*/`` (the
evaluation document, the completions xz-compressed) and ``<into>/logs/gsm8k_warmstart_NAME.log`` (console
lines only). The machine's folders become ``$MODEL`` (the base model, when given as a folder), ``$DATA``
(GSM8K's folder, when absolute), ``$CKPT`` (the checkpoint) and ``$OUT`` (the run folder, read from the log's
last ``wrote`` line), and the GPU image's install paths their placeholders
(:data:`benchmarks._lib.publish.MACHINE_PATHS`); a machine path left after that stops the publication before
anything is written.

``declared`` prints the settings a declaration file (``benchmarks/gsm8k_warmstart_declared.yaml``) fixes, one
``NAME=ARGUMENTS`` line each, for ``benchmarks/gpu/gsm8k_warmstart_settings.sh``. ``select`` chooses the warm-start
setting of issue 45 from run documents of those settings: by greedy accuracy on the validation split
(:func:`select_setting`), refusing any run scored on test.

``settings`` builds ``T18-warmstart-settings`` from published run documents: one row per run (its learning
rate, length, last logged loss, greedy accuracy on the whole test split with its Wilson interval), and which
run is the best against issue 33's floor and target (:data:`FLOOR_PCT`, :data:`TARGET_PCT`).
"""

from __future__ import annotations

import argparse
import json
import lzma
import re
import sys
import tarfile
import tempfile
from pathlib import Path

from benchmarks import gsm8k_warmstart
from benchmarks._lib.publish import MACHINE_PATH, MACHINE_PATHS, console_lines
from benchmarks.gsm8k_warmstart import _pct
from bloggap_plugin._io import atomic_write_bytes
from bloggap_plugin.results import dumps

SETTINGS_TABLE_ID = "T18-warmstart-settings"
FLOOR_PCT = 10.0
"""Issue 33's floor, greedy accuracy % on the whole test split: the issue stops at item 1 when the best run is
under it."""
TARGET_PCT = 15.0
"""Issue 33's target, greedy accuracy % on the whole test split."""
_WROTE = re.compile(r"\[gsm8k_warmstart\] wrote (\S+)/" + re.escape(gsm8k_warmstart.DOCUMENT))


class PublishError(ValueError):
    """A run folder that cannot be published as it is; the message names the problem and the fix."""


def stem(name: str) -> str:
    """The published file stem of run ``name`` (``""``: the first run's ``gsm8k_warmstart``)."""
    if name and not re.fullmatch(r"[A-Za-z0-9._-]+", name):
        raise PublishError(f"bad run name {name!r}: use letters, digits, '.', '_', '-'")
    first = Path(gsm8k_warmstart.DOCUMENT).stem
    return f"{first}_{name}" if name else first


def machine_folders(params: dict, log: str) -> list[tuple[str, str]]:
    """(folder as the GPU machine wrote it, its placeholder), longest first so that no folder's name is cut
    inside a longer one's (``/tmp/vx/smollm2-gsm8k-sft`` before ``/tmp/vx/smollm2``)."""
    pairs = {}
    if params.get("model_spec", "").startswith("/"):
        pairs[params["model_spec"]] = "$MODEL"
    if params.get("data") and params["data"].startswith("/"):
        pairs[params["data"]] = "$DATA"
    if params.get("checkpoint_dir"):
        pairs[params["checkpoint_dir"]] = "$CKPT"
    wrote = _WROTE.findall(log)
    if wrote:
        pairs[wrote[-1]] = "$OUT"
    return sorted(pairs.items(), key=lambda pair: -len(pair[0]))


def _replace(text: str, folders: list[tuple[str, str]]) -> str:
    for path, name in (*folders, *MACHINE_PATHS):
        text = text.replace(path, name)
    return text


def run_files(folder: Path, name: str) -> dict[str, bytes]:
    """The files :func:`publish_run` writes for ``folder``, relative path -> bytes; nothing is written here.

    Raises :class:`PublishError` when the folder holds no document, or a machine path survives the
    replacements."""
    base = stem(name)
    folder = Path(folder)
    source = folder / gsm8k_warmstart.DOCUMENT
    if not source.is_file():
        raise PublishError(f"{folder}: no {gsm8k_warmstart.DOCUMENT}: pass the folder of one run or its "
                           "settings pack (NAME.tar.xz)")
    log_path = folder / "gsm8k_warmstart.log"
    log = log_path.read_text(errors="replace") if log_path.is_file() else ""
    payload = json.loads(source.read_text())
    folders = machine_folders(payload["params"], log)
    payload = json.loads(_replace(json.dumps(payload), folders))
    document = gsm8k_warmstart.document(payload["env"], payload["params"], payload["results"])
    document.validate(f"{base}.json")
    texts = {f"{base}.json": dumps(document.to_dict()) + "\n"}  # as ResultDocument.write writes it
    for _, evaluation in gsm8k_warmstart.EVALUATIONS:
        for name_in_run, published in (("gsm8k_baseline.json", "gsm8k_baseline.json"),
                                       ("completions.jsonl", "completions.jsonl.xz")):
            path = folder / evaluation / name_in_run
            if path.is_file():
                texts[f"{base}/{evaluation}/{published}"] = _replace(path.read_text(), folders)
    if log:
        texts[f"logs/{base}.log"] = console_lines(_replace(log, folders))
    for path, text in texts.items():
        left = MACHINE_PATH.findall(text)
        if left:
            raise PublishError(f"{path} would carry the machine path(s) {sorted(set(left))[:3]}: add them to "
                               "benchmarks/_lib/publish.py MACHINE_PATHS with a placeholder, then publish "
                               "again")
    return {path: lzma.compress(text.encode()) if path.endswith(".xz") else text.encode()
            for path, text in texts.items()}


def _unpack(pack: Path, into: Path) -> Path:
    """The run folder of a settings pack (``NAME.tar.xz`` holding ``NAME/...``), extracted under ``into``."""
    try:
        with tarfile.open(pack) as tar:
            tops = sorted({Path(member.name).parts[0] for member in tar.getmembers()})
            if len(tops) != 1:
                raise PublishError(f"{pack}: a settings pack holds one run folder, this one {tops}")
            tar.extractall(into, filter="data")
    except tarfile.TarError as err:
        raise PublishError(f"{pack}: not a readable pack ({err}): pass a run folder or a "
                           "NAME.tar.xz") from err
    return into / tops[0]


def publish_run(folder: Path, name: str, into: Path) -> list[Path]:
    """Write :func:`run_files` of ``folder`` (a run folder, or a settings pack ``NAME.tar.xz``) under
    ``into``; returns the paths written."""
    if Path(folder).is_file():
        with tempfile.TemporaryDirectory() as scratch:
            return publish_run(_unpack(Path(folder), Path(scratch)), name, into)
    written = []
    for relative, data in run_files(folder, name).items():
        path = Path(into) / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(path, data)
        written.append(path)
    return written


# ------------------------------------------------------------------------------------------------- settings


def setting_row(document_name: str, payload: dict) -> dict:
    """One published run's settings and outcome (accuracy cells: rows, correct, strict_correct, accuracy,
    ci95)."""
    params, results = payload["params"], payload["results"]
    train = results.get("train") or {}
    curve = train.get("curve") or []
    return {"document": document_name, "lr": params["lr"], "epochs": params["epochs"],
            "max_steps": params["max_steps"], "steps": train.get("steps"), "seed": params["seed"],
            "last_loss": curve[-1]["loss"] if curve else None,
            "train_s": (results.get("timing") or {}).get("train_s"),
            "complete": results.get("complete", False),
            "before": ((results.get("before") or {}).get("subsets") or {}).get("all"),
            "after": ((results.get("after") or {}).get("subsets") or {}).get("all"),
            "checkpoint_sha256": (results.get("checkpoint") or {}).get("sha256")}


def settings_results(documents: dict[str, dict]) -> dict:
    """``documents`` (published name -> run document) as rows, and the best complete run by greedy accuracy
    after the warm start, with where it stands against :data:`FLOOR_PCT` and :data:`TARGET_PCT`."""
    rows = [setting_row(name, payload) for name, payload in documents.items()]
    finished = [row for row in rows if row["complete"] and row["after"]]
    best = max(finished, key=lambda row: row["after"]["accuracy"], default=None)

    def reaches(pct: float) -> bool | None:  # counts, not rounded shares: 100 of 1,000 is exactly 10%
        return None if best is None else 100 * best["after"]["correct"] >= pct * best["after"]["rows"]

    return {"settings": rows, "best": None if best is None else best["document"], "floor_pct": FLOOR_PCT,
            "target_pct": TARGET_PCT, "best_reaches_floor": reaches(FLOOR_PCT),
            "best_reaches_target": reaches(TARGET_PCT)}


def settings_table(results: dict) -> dict:
    """``T18-warmstart-settings`` from :func:`settings_results`."""
    rows = []
    for row in results["settings"]:
        after, before = row["after"] or {}, row["before"] or {}
        low, high = after.get("ci95") or (None, None)
        length = f"{row['max_steps']} steps" if row["max_steps"] else f"{row['epochs']:g} epochs"
        rows.append([row["document"], row["complete"], row["lr"], length, row["steps"],
                     None if row["last_loss"] is None else round(row["last_loss"], 4), row["train_s"],
                     _pct(before.get("accuracy")), _pct(after.get("accuracy")), _pct(low), _pct(high),
                     None if not after else _pct(after["strict_correct"] / after["rows"]),
                     (row["checkpoint_sha256"] or "")[:16] or None])
    best = results["best"]
    verdict = ("no complete run" if best is None else
               f"best: {best}, {'at or above' if results['best_reaches_floor'] else 'under'} the floor"
               f"{', at or above the target' if results['best_reaches_target'] else ''}")
    notes = ("One row per published warm-start run (its document first: T18-warmstart and "
             "T18-warmstart-curve there; finished: every phase ran, the only rows that can be best). Greedy "
             "accuracy on the whole GSM8K test split, correct = the training reward; CI: Wilson 95%; strict: "
             "the number after '####' equals the gold answer (the task's strict reward). Issue 33's floor "
             f"{results['floor_pct']:g}% and target {results['target_pct']:g}% (accuracy after); {verdict}. "
             "Last loss: TRL's logged training loss at the last logging step. Seeds as in each document.")
    return {"id": SETTINGS_TABLE_ID, "title": "GSM8K warm-start settings: greedy accuracy after each",
            "columns": ["document", "finished", "lr", "length", "optimizer steps", "last loss", "train s",
                        "before %", "after %", "after CI low %", "after CI high %", "after strict %",
                        "checkpoint sha256"],
            "rows": rows, "notes": notes, "reference": None, "random_init": False,
            "plot": {"kind": "bar", "x": "document", "y": ["after %"],
                     "title": "Greedy accuracy after the warm start", "ylabel": "% of GSM8K test"}
            if rows else False}


def settings_document(paths: list[Path]):
    """The ``gsm8k_warmstart_settings`` result document over the run documents at ``paths``."""
    from bloggap_plugin.results import ResultDocument

    documents = {Path(path).name: json.loads(Path(path).read_text()) for path in paths}
    results = settings_results(documents)
    envs = {name: {key: payload["env"].get(key) for key in ("gpu", "torch", "trl", "date")}
            for name, payload in documents.items()}
    return ResultDocument(benchmark="gsm8k_warmstart_settings", env={"runs": envs},
                          params={"documents": list(documents), "floor_pct": FLOOR_PCT,
                                  "target_pct": TARGET_PCT},
                          results=results, tables=[settings_table(results)])


# ------------------------------------------------------------------------------------------- declared, select

SELECTION_SPLIT = "validation"
"""The only split :func:`select_setting` chooses on."""
MAX_DECLARED = 6
"""Most settings a declaration may list: issue 33's four plus at most two (issue 45)."""


def declared_settings(path: Path) -> dict[str, list[str]]:
    """``{name: full run arguments}`` of a declaration file: each setting's arguments, then ``eval_arguments``.
    Raises :class:`PublishError` (one line) for a file that does not read, a bad name, more than
    :data:`MAX_DECLARED` settings, arguments ``gsm8k_warmstart run`` does not take, or a setting not scored on
    :data:`SELECTION_SPLIT`."""
    from bloggap_plugin._input_files import load_yaml_file

    try:
        payload = load_yaml_file(path, "declared settings", "give benchmarks/gsm8k_warmstart_declared.yaml",
                                 error=PublishError)
    except PublishError as err:
        raise PublishError(str(err).splitlines()[0]) from None
    settings = payload.get("settings") if isinstance(payload, dict) else None
    common = payload.get("eval_arguments", []) if isinstance(payload, dict) else None
    if not isinstance(settings, dict) or not settings or not isinstance(common, list):
        raise PublishError(f"{path}: expected 'settings' (name: [arguments]) and 'eval_arguments' ([arguments])")
    if len(settings) > MAX_DECLARED:
        raise PublishError(f"{path}: {len(settings)} settings declared; at most {MAX_DECLARED}")
    declared = {}
    for name, arguments in settings.items():
        stem(str(name))  # letters, digits, '.', '_', '-'
        if not isinstance(arguments, list):
            raise PublishError(f"{path}: setting {name}: give its arguments as a list, e.g. [--lr, '2e-4']")
        argv = [str(a) for a in arguments] + [str(a) for a in common]
        try:
            params = gsm8k_warmstart.setting_params(argv)
        except gsm8k_warmstart.WarmstartError as err:
            raise PublishError(f"{path}: setting {name}: {err}") from None
        if params["eval_split"] != SELECTION_SPLIT:
            raise PublishError(f"{path}: setting {name} is scored on {params['eval_split']}: a setting is chosen on "
                               f"{SELECTION_SPLIT} only (--eval-split {SELECTION_SPLIT})")
        declared[str(name)] = argv
    return declared


def _document_setting(name: str, payload: dict, declared: dict[str, list[str]]) -> str:
    """The declared setting whose arguments give ``payload``'s params; :class:`PublishError` for a run scored on
    another split than validation or one no declared setting describes."""
    params = payload.get("params", {})
    split = params.get("eval_split", "test")  # documents from before --eval-split scored test
    if split != SELECTION_SPLIT:
        raise PublishError(f"{name} is scored on the {split} split: the warm start is chosen on {SELECTION_SPLIT} "
                           f"only; run the declared settings with --eval-split {SELECTION_SPLIT}")
    for setting, argv in declared.items():
        wanted = gsm8k_warmstart.setting_params(argv)
        if "model" in wanted:
            wanted["model_spec"] = wanted.pop("model")
        if all(params.get(key) == value for key, value in wanted.items()):
            return setting
    raise PublishError(f"{name}: its settings are none of the declared ones ({', '.join(declared)}); only declared "
                       "settings take part in the choice")


def select_setting(documents: dict[str, dict], declared: dict[str, list[str]]) -> dict:
    """The declared setting with the most validation rows correct after the warm start (ties: the first declared),
    from ``documents`` (name -> run document), one finished run per declared setting. Returns ``{"chosen",
    "arguments", "document", "checkpoint_sha256", "settings": [{setting, document, rows, correct, accuracy, ci95,
    checkpoint_sha256, gpu}]}`` (``gpu``: the card of the run's ``env``, None where it has none). Raises
    :class:`PublishError` for a run scored on test, an undeclared or repeated setting, an unfinished run, a declared
    setting without a run, or runs scored on different row counts."""
    found: dict[str, tuple[str, dict]] = {}
    for name, payload in documents.items():
        setting = _document_setting(name, payload, declared)
        if setting in found:
            raise PublishError(f"{name} and {found[setting][0]} are both runs of setting {setting}: give one")
        if not payload.get("results", {}).get("complete"):
            raise PublishError(f"{name} did not finish (results.complete false): run setting {setting} again")
        found[setting] = (name, payload)
    missing = [setting for setting in declared if setting not in found]
    if missing:
        raise PublishError(f"declared setting(s) {', '.join(missing)} have no run: every declared setting runs "
                           "before one is chosen")
    rows = []
    for setting in declared:
        name, payload = found[setting]
        after = payload["results"]["after"]["subsets"]["all"]
        rows.append({"setting": setting, "document": name, "rows": after["rows"], "correct": after["correct"],
                     "accuracy": after["accuracy"], "ci95": after["ci95"],
                     "checkpoint_sha256": payload["results"]["checkpoint"]["sha256"],
                     "gpu": payload.get("env", {}).get("gpu")})
    if len({row["rows"] for row in rows}) != 1:
        raise PublishError(f"the runs scored different numbers of validation rows ({sorted({r['rows'] for r in rows})})"
                           ": run every setting on the same rows (no --eval-limit)")
    best = max(rows, key=lambda row: row["correct"])  # max keeps the first of equals: declaration order
    return {"chosen": best["setting"], "arguments": declared[best["setting"]], "document": best["document"],
            "checkpoint_sha256": best["checkpoint_sha256"], "split": SELECTION_SPLIT, "settings": rows}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    one = commands.add_parser("run", help="one run folder into commit-ready files")
    one.add_argument("folder", help="the run's folder (gsm8k_warmstart.json, its log, eval_*/) or its "
                                    "settings pack NAME.tar.xz")
    one.add_argument("--name", required=True, help="published as gsm8k_warmstart_NAME ('' : gsm8k_warmstart)")
    one.add_argument("--into", required=True, help="results folder, e.g. benchmarks/results/h200")
    many = commands.add_parser("settings", help="T18-warmstart-settings from published run documents")
    many.add_argument("documents", nargs="+", help="published gsm8k_warmstart*.json documents")
    many.add_argument("--out", required=True, help="the settings document to write")
    listed = commands.add_parser("declared", help="print each declared setting as NAME=ARGUMENTS")
    listed.add_argument("--file", default="benchmarks/gsm8k_warmstart_declared.yaml")
    choose = commands.add_parser("select", help="choose the declared setting by validation accuracy")
    choose.add_argument("documents", nargs="+", help="run documents (gsm8k_warmstart.json) of the declared settings")
    choose.add_argument("--file", default="benchmarks/gsm8k_warmstart_declared.yaml")
    choose.add_argument("--out", required=True, help="the selection JSON to write")
    args = parser.parse_args(argv)
    try:
        if args.command == "declared":
            for name, arguments in declared_settings(Path(args.file)).items():
                print(f"{name}={' '.join(arguments)}")
            return 0
        if args.command == "select":
            return _select(args)
        if args.command == "run":
            for path in publish_run(Path(args.folder), args.name, Path(args.into)):
                print(f"wrote {path}")
            return 0
        missing = [path for path in args.documents if not Path(path).is_file()]
        if missing:
            raise PublishError(f"no such run document: {missing[0]}")
        print(f"wrote {settings_document([Path(p) for p in args.documents]).write(args.out)}")
        return 0
    except PublishError as err:
        print(f"gsm8k_warmstart_publish: {err}", file=sys.stderr)
        return 2


def _select(args) -> int:
    declared = declared_settings(Path(args.file))
    documents = {}
    for path in args.documents:
        try:
            documents[str(path)] = json.loads(Path(path).read_text())
        except (OSError, ValueError) as err:
            raise PublishError(f"{path}: not a readable run document ({err.__class__.__name__})") from None
    chosen = select_setting(documents, declared)
    chosen["declared_file"] = str(args.file)
    atomic_write_bytes(Path(args.out), (dumps(chosen) + "\n").encode())
    print(f"chosen: {chosen['chosen']} ({' '.join(chosen['arguments'])}), checkpoint sha256 "
          f"{chosen['checkpoint_sha256']}; wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
