"""``bloggap patch verl --check | --apply | --revert``: upstream-style diffs for what a plugin cannot reach from outside.

The diffs are applied by this module, not by GNU ``patch``, with three guarantees for a package in site-packages:

- **exact**: every hunk must match the file at its stated line, context included (no fuzz, no offset); a file that
  does not is reported as locally edited (or another version) and nothing is written;
- **all or nothing**: every target is checked (present, matching, writable) before the first write, the new
  contents are computed in memory, each file is replaced atomically, and a failure while writing restores the
  files already written; no ``.orig``/``.rej``/temporary file is left;
- **reversible**: ``--revert`` undoes the diffs exactly (bytes identical to the original), all or nothing too; it
  also undoes a half-patched tree (some files patched, the others pristine).
"""

from __future__ import annotations

import argparse
import os
import re
import stat
import sys
import tempfile
from dataclasses import dataclass, field

from bloggap_plugin._input_files import display_name, read_text_file
from bloggap_plugin._io import atomic_write_bytes, confined_path

HELP = "Check, apply or revert bloggap's patches to an installed package (verl: forward vLLM kept-set sizes)."

PATCHES = {"verl": ("support_size_replay.patch",)}
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
REINSTALL_HINT = {"verl": "pip install --force-reinstall --no-deps verl==0.9.1"}

PRISTINE, APPLIED, EDITED = "pristine", "applied", "edited"


class PatchError(Exception):
    """A one-line reason why nothing was (or would be) changed."""


@dataclass
class PatchConfig:
    """``bloggap patch TARGET --check | --apply | --revert``: exactly one of the three modes."""

    target: str = field(default="", metadata={"help": "package to patch", "positional": None,
                                              "choices": sorted(PATCHES)})
    check: bool = field(default=False, metadata={
        "help": "dry run: exit 0 only if --apply would patch every file exactly (never modifies)"})
    apply: bool = field(default=False, metadata={"help": "apply the patch to the installed package (all or nothing)"})
    revert: bool = field(default=False, metadata={"help": "undo an applied patch exactly (all or nothing)"})
    root: str | None = field(default=None, metadata={
        "help": "directory that contains the package (default: the installed one)"})
    patch_dir: str | None = field(default=None, metadata={
        "help": "directory holding the .patch files (default: patches/<target>)"})

    def mode(self) -> str:
        """``"check" | "apply" | "revert"``; a one-line ``UsageError`` unless exactly one was given."""
        from bloggap_plugin.core.errors import UsageError

        chosen = [name for name in ("check", "apply", "revert") if getattr(self, name)]
        if len(chosen) != 1:
            given = f"got {' and '.join('--' + c for c in chosen)}" if chosen else "got none"
            raise UsageError(f"bloggap patch {self.target}: choose exactly one of --check, --apply, --revert ({given})")
        return chosen[0]


def configure(parser: argparse.ArgumentParser) -> None:
    from bloggap_plugin.commands._config import add_config_arguments

    add_config_arguments(parser, PatchConfig)


def package_root(target: str) -> str:
    """The directory containing the installed ``target`` package (e.g. site-packages), without importing it."""
    import importlib.util

    spec = importlib.util.find_spec(target)
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit(f"bloggap patch: {target} is not installed in this environment ({sys.executable})")
    return os.path.dirname(list(spec.submodule_search_locations)[0])


def patch_files(target: str, patch_dir: str | None = None) -> list[str]:
    directory = patch_dir or os.path.join(REPO_ROOT, "patches", target)
    files = [os.path.join(directory, name) for name in PATCHES[target]]
    missing = [f for f in files if not os.path.isfile(f)]
    if missing:
        raise SystemExit(f"bloggap patch: patch file(s) not found: {missing} (pass --patch-dir)")
    return files


# ----------------------------------------------------------------------------------------------------------
# Unified diffs, applied exactly.


@dataclass
class Hunk:
    """One ``@@ -old_start,old_len +new_start,new_len @@`` block; ``lines`` are ``(tag, text)``, tag in `` -+``."""

    old_start: int
    old_len: int
    new_start: int
    new_len: int
    lines: list[tuple[str, str]] = field(default_factory=list)

    def reversed(self) -> Hunk:
        swap = {" ": " ", "-": "+", "+": "-"}
        return Hunk(self.new_start, self.new_len, self.old_start, self.old_len, [(swap[t], x) for t, x in self.lines])


@dataclass
class FilePatch:
    path: str  # relative to the root, leading a/ b/ stripped (patch -p1)
    hunks: list[Hunk]


_HUNK = re.compile(r"^@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@")


def parse_unified_diff(text: str, name: str) -> list[FilePatch]:
    """The file patches of a ``-p1`` unified diff (text before the first ``---`` is a description)."""
    lines = text.split("\n")
    patches: list[FilePatch] = []
    i = 0
    while i < len(lines):
        if not (lines[i].startswith("--- ") and i + 1 < len(lines) and lines[i + 1].startswith("+++ ")):
            i += 1
            continue
        target = lines[i + 1][4:].split("\t")[0].strip()
        path = target.split("/", 1)[1] if "/" in target else target
        current = FilePatch(path=path, hunks=[])
        patches.append(current)
        i += 2
        while i < len(lines) and lines[i].startswith("@@"):
            match = _HUNK.match(lines[i])
            if match is None:
                raise PatchError(f"{name}: malformed hunk header {lines[i]!r}")
            old_start, old_len, new_start, new_len = (int(g) if g is not None else 1 for g in match.groups())
            hunk = Hunk(old_start, old_len, new_start, new_len)
            i += 1
            old_seen = new_seen = 0
            while old_seen < old_len or new_seen < new_len:
                if i >= len(lines):
                    raise PatchError(f"{name}: hunk at {current.path}:{old_start} ends early")
                line = lines[i]
                tag, body = (line[0], line[1:]) if line else (" ", "")
                if tag == "\\":
                    raise PatchError(f"{name}: '\\ No newline at end of file' is not supported")
                if tag not in " -+":
                    raise PatchError(f"{name}: unexpected line {line!r} in hunk at {current.path}:{old_start}")
                hunk.lines.append((tag, body))
                old_seen += tag in " -"
                new_seen += tag in " +"
                i += 1
            if old_seen != old_len or new_seen != new_len:
                raise PatchError(f"{name}: hunk at {current.path}:{old_start} does not match its line counts")
            current.hunks.append(hunk)
        if not current.hunks:
            raise PatchError(f"{name}: no hunk for {current.path}")
    if not patches:
        raise PatchError(f"{name}: no file patch found")
    return patches


def apply_hunks(data: bytes, hunks: list[Hunk]) -> bytes | None:
    """``data`` with ``hunks`` applied exactly (each at its stated line, context included), or None if any hunk
    does not match. Untouched bytes (line endings, encoding) are kept as they are."""
    parts = data.decode("utf-8", "surrogateescape").split("\n")  # "\n" only: str.splitlines also splits at \f etc.
    lines = [part + "\n" for part in parts[:-1]] + ([parts[-1]] if parts[-1] else [])
    out: list[str] = []
    position = 0  # next unread line of the input
    for hunk in hunks:
        start = hunk.old_start - 1 if hunk.old_len else hunk.old_start  # an insertion goes after old_start
        old = [text for tag, text in hunk.lines if tag in " -"]
        if start < position or start + len(old) > len(lines):
            return None
        if [line[:-1] if line.endswith("\n") else line for line in lines[start : start + len(old)]] != old:
            return None
        out.extend(lines[position:start])
        window = iter(lines[start : start + len(old)])
        for tag, text in hunk.lines:
            if tag == " ":
                out.append(next(window))
            elif tag == "-":
                next(window)
            else:
                out.append(text + "\n")
        position = start + len(old)
    out.extend(lines[position:])
    return "".join(out).encode("utf-8", "surrogateescape")


@dataclass
class Target:
    """One file a patch touches: its current bytes, its state, and its contents patched and reverted."""

    path: str
    full_path: str
    data: bytes
    patched: bytes | None  # None when the forward hunks do not match
    reverted: bytes | None  # None when the reverse hunks do not match

    @property
    def state(self) -> str:
        if self.patched is not None:
            return PRISTINE
        return APPLIED if self.reverted is not None else EDITED


def load_targets(root: str, patch_paths: list[str]) -> list[Target]:
    """Every file the patches touch under ``root``, with its state; PatchError if one is missing."""
    if not os.path.isdir(root):
        raise PatchError(f"--root {root} is not a directory")
    targets: list[Target] = []
    seen: set[str] = set()
    for patch_path in patch_paths:
        text = read_text_file(patch_path, f"patch {display_name(patch_path)}",
                              "give the unified diff as it ships in patches/")  # bad input: UsageError, exit 2
        file_patches = parse_unified_diff(text, os.path.basename(patch_path))
        for file_patch in file_patches:
            if file_patch.path in seen:
                raise PatchError(f"{file_patch.path} is patched twice; one patch per file is supported")
            seen.add(file_patch.path)
            full = confined_path(root, file_patch.path)
            if full is None:
                raise PatchError(f"{display_name(patch_path)} names {file_patch.path!r}, outside --root {root}; "
                                 "nothing changed. Fix: use a patch whose paths stay inside the package folder")
            if not os.path.isfile(full):
                raise PatchError(
                    f"{file_patch.path} not found in {root}; --root must be the folder that contains the package"
                )
            with open(full, "rb") as handle:
                data = handle.read()
            reverse = [hunk.reversed() for hunk in file_patch.hunks]
            targets.append(Target(file_patch.path, str(full), data, apply_hunks(data, file_patch.hunks), apply_hunks(data, reverse)))
    return targets


def read_only_problem(target: Target) -> str | None:
    """Why ``target`` cannot be replaced, or None. The mode bits are checked too: as root ``os.access`` ignores
    them, and an atomic replace would silently overwrite a file its owner made read-only."""
    folder = os.path.dirname(target.full_path)
    mode = os.stat(target.full_path).st_mode
    if not os.access(target.full_path, os.W_OK) or not mode & (stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH):
        return f"{target.path} is read-only"
    if not os.access(folder, os.W_OK | os.X_OK):
        return f"the folder of {target.path} is not writable"
    return None


def write_all(changes: list[tuple[Target, bytes]]) -> None:
    """Replace each target's bytes; on a failure restore the ones already written, then raise PatchError."""
    done: list[Target] = []
    for target, data in changes:
        try:
            atomic_write_bytes(target.full_path, data)
        except OSError as err:
            failed = []
            for written in reversed(done):
                try:
                    atomic_write_bytes(written.full_path, written.data)
                except OSError:
                    failed.append(written)
            if failed:
                backup = tempfile.mkdtemp(prefix="bloggap-patch-backup-")
                for item in failed:
                    os.makedirs(os.path.join(backup, os.path.dirname(item.path)), exist_ok=True)
                    with open(os.path.join(backup, item.path), "wb") as handle:
                        handle.write(item.data)
                raise PatchError(
                    f"writing {target.path} failed ({err}); could not roll back {[t.path for t in failed]}: the "
                    f"originals are in {backup}, copy them back"
                ) from None
            raise PatchError(f"writing {target.path} failed ({err}); rolled back, nothing changed") from None
        done.append(target)


def _describe(targets: list[Target]) -> str:
    return ", ".join(f"{t.path} ({t.state})" for t in targets)


def plan(targets: list[Target], action: str, target_name: str) -> list[tuple[Target, bytes]]:
    """The writes ``action`` (``apply`` / ``revert``) needs; PatchError (nothing written) when it must refuse."""
    states = {t.state for t in targets}
    fix = f"reinstall {target_name} ({REINSTALL_HINT.get(target_name, 'pip install --force-reinstall')})"
    edited = [t.path for t in targets if t.state == EDITED]
    if edited:
        raise PatchError(
            f"{', '.join(edited)} locally edited or not the {target_name} version the patch is for (a hunk does not "
            f"match exactly); nothing changed. Fix: {fix}"
        )
    if action == "apply":
        if states == {PRISTINE, APPLIED}:
            raise PatchError(
                f"half-patched: {_describe(targets)}; nothing changed. Fix: `bloggap patch {target_name} --revert`, "
                "then --apply"
            )
        changes = [(t, t.patched) for t in targets if t.state == PRISTINE]
    else:
        changes = [(t, t.reverted) for t in targets if t.state == APPLIED]
    problems = [p for p in (read_only_problem(t) for t, _ in changes) if p]
    if problems:
        raise PatchError(f"{'; '.join(problems)}; nothing changed. Fix: make it writable (chmod u+w) and retry")
    return changes


def run(args: argparse.Namespace) -> int:
    from bloggap_plugin.commands._config import config_from_args

    config = config_from_args(PatchConfig, args)
    mode = config.mode()
    root = config.root or package_root(config.target)
    files = patch_files(config.target, config.patch_dir)
    names = ", ".join(os.path.basename(f) for f in files)
    try:
        targets = load_targets(root, files)
        states = {t.state for t in targets}
        if mode == "check":
            if states == {APPLIED}:
                raise PatchError(f"already applied in {root} (not clean; `bloggap patch {config.target} --revert` undoes it)")
            changes = plan(targets, "apply", config.target)
            print(f"{names}: applies cleanly to {len(changes)} files in {root} (exact, no fuzz)")
            return 0
        action = mode
        changes = plan(targets, action, config.target)
        if not changes:
            print(f"{names}: {'already applied in' if action == 'apply' else 'not applied in'} {root}; nothing changed")
            return 0
        write_all(changes)
    except PatchError as err:
        print(f"bloggap patch: {names}: {err}", file=sys.stderr)
        return 1
    done = "applied to" if action == "apply" else "reverted in"
    print(f"{names}: {done} {len(changes)} files in {root}: {', '.join(t.path for t, _ in changes)}")
    return 0
