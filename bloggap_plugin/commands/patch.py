"""``bloggap patch verl --check | --apply``: upstream-style diffs for what a plugin cannot reach from outside."""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys

HELP = "Check or apply bloggap's patches to an installed package (verl: forward vLLM kept-set sizes)."

PATCHES = {"verl": ("support_size_replay.patch",)}
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("target", choices=sorted(PATCHES), help="package to patch")
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--check", action="store_true", help="dry run: report whether the patch applies (never modifies)")
    mode.add_argument("--apply", action="store_true", help="apply the patch to the installed package")
    parser.add_argument("--root", default=None, help="directory that contains the package (default: the installed one)")
    parser.add_argument("--patch-dir", default=None, help="directory holding the .patch files (default: patches/<target>)")


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


def run_patch(patch_file: str, root: str, dry_run: bool) -> tuple[bool, str]:
    """Apply (or dry-run) one unified diff with ``patch -p1 -d root``; returns (ok, output)."""
    if shutil.which("patch") is None:
        raise SystemExit("bloggap patch: the `patch` program is not installed (apt-get install patch)")
    cmd = ["patch", "-p1", "--forward", "--batch", "-d", root, "-i", patch_file]
    if dry_run:
        cmd.insert(1, "--dry-run")
    done = subprocess.run(cmd, capture_output=True, text=True)
    return done.returncode == 0, (done.stdout + done.stderr).strip()


def already_applied(patch_file: str, root: str) -> bool:
    """True when the reverse patch applies cleanly (the patch is in place)."""
    done = subprocess.run(
        ["patch", "-p1", "--dry-run", "--reverse", "--force", "--batch", "-d", root, "-i", patch_file],
        capture_output=True,
        text=True,
    )
    return done.returncode == 0


def run(args: argparse.Namespace) -> int:
    root = args.root or package_root(args.target)
    status = 0
    for patch_file in patch_files(args.target, args.patch_dir):
        name = os.path.basename(patch_file)
        if already_applied(patch_file, root):
            print(f"{name}: already applied in {root}")
            continue
        ok, output = run_patch(patch_file, root, dry_run=True)
        if not ok:
            print(f"{name}: does NOT apply cleanly to {root} (different {args.target} version?)\n{output}")
            status = 1
            continue
        if args.check:
            print(f"{name}: applies cleanly to {root}")
            continue
        ok, output = run_patch(patch_file, root, dry_run=False)
        print(f"{name}: {'applied to' if ok else 'FAILED on'} {root}\n{output}")
        status = status or (0 if ok else 1)
    return status
