"""Whole seeds of a ``bloggap compare`` sweep, gathered from the packs of several machines into one ``runs/`` folder.

A sweep whose seeds run on different machines comes back as one pack per machine (``session.tgz`` from
``benchmarks/gpu/session.sh``, or the sweep's ``compare_gsm8k.tgz``). In the GSM8K comparison a fresh GPU machine
rebuilds the warm start under a new hash unless the checkpoint is carried to it, so a seed is comparable only when
every arm of it started from one checkpoint. ``collect`` reads each pack's ``runs/`` folder and copies into ``--into`` the seeds that
are whole there:

- every arm in ``--arms`` has a run log with its completion marker;
- each has its held-out result of that training attempt (``--no-heldout``: not required);
- all of them name one checkpoint (the markers' ``model_sha256``).

A seed whole in two packs with other runs (the same files, e.g. runs carried to the next machine and packed there
again, are one seed), or already in ``--into`` with other contents, is refused, naming both. The folder then
serves ``bloggap compare --table-only`` (the final tables), and, carried to the next machine, the sweep's resume,
which runs only the seeds still missing.

``--partial``, where every machine started from one checkpoint carried to it (``benchmarks/gpu/ckpt_join.sh``): the
finished runs of seeds that are whole nowhere are copied too (each trained, and evaluated unless ``--no-heldout``),
so the next machine's sweep trains only the arms still missing; all runs copied for a seed must name one
checkpoint, and a run finished in two packs as other files (or in a pack where its seed is whole and, as other files,
in another) is refused.

    python -m benchmarks.compare_seeds collect S1.tgz S2.tgz --into .dev/compare_gsm8k/runs --arms A,B,F,H,J
"""

from __future__ import annotations

import argparse
import re
import shutil
import sys
import tarfile
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from bloggap_plugin.compare.heldout import read_record
from bloggap_plugin.compare.logs import MODEL_SHA256_KEY, read_marker
from bloggap_plugin.compare.sweep import FAILED_CONSOLE

RUN_FILE = re.compile(r"^(?P<arm>[^/_]+)_s(?P<seed>\d+)"
                      rf"(?P<kind>\.jsonl|\.heldout\.json|\.out|{FAILED_CONSOLE}|\.spec\.json)$")
"""A run's file in ``runs/``: its log, held-out result, console output (and a failed attempt's, ``bloggap compare
--retries``) and spec (partial logs are left out)."""


class SeedsError(Exception):
    """A refusal, said in one line."""


@dataclass
class Seed:
    """One seed's runs as one pack holds them."""

    pack: str
    seed: int
    files: dict[str, dict[str, Path]] = field(default_factory=dict)  # arm -> kind -> extracted file
    missing: list[str] = field(default_factory=list)  # why it is not whole, one phrase per arm
    checkpoint: str | None = None
    finished: dict[str, str | None] = field(default_factory=dict)  # arm -> its checkpoint, for the finished arms


def _run_files(folder: Path) -> dict[int, dict[str, dict[str, Path]]]:
    """``{seed: {arm: {kind: path}}}`` of every ``runs/`` folder under ``folder``."""
    found: dict[int, dict[str, dict[str, Path]]] = {}
    for path in sorted(folder.rglob("*")):
        match = RUN_FILE.match(path.name)
        if path.is_file() and path.parent.name == "runs" and match:
            arm_files = found.setdefault(int(match["seed"]), {}).setdefault(match["arm"], {})
            if match["kind"] in arm_files:
                raise SeedsError(f"{path.name} appears twice in one pack ({arm_files[match['kind']]} and {path})")
            arm_files[match["kind"]] = path
    return found


def _judge(pack: str, seed: int, arms: list[str], by_arm: dict[str, dict[str, Path]], heldout: bool) -> Seed:
    """The seed with what keeps it from being whole (nothing when it is)."""
    result, checkpoints = Seed(pack, seed, files=by_arm), set()
    for arm in arms:
        files = by_arm.get(arm, {})
        marker = read_marker(files[".jsonl"]) if ".jsonl" in files else None
        if marker is None:
            result.missing.append(f"{arm} not trained")
            continue
        checkpoints.add(marker.get(MODEL_SHA256_KEY))
        if heldout:
            record = read_record(files[".heldout.json"], marker.get("attempt")) if ".heldout.json" in files else None
            if not record or not record.get("result"):
                result.missing.append(f"{arm} not evaluated")
                continue
        result.finished[arm] = marker.get(MODEL_SHA256_KEY)
    if len(checkpoints) > 1:
        shas = ", ".join(sorted(str(sha)[:12] for sha in checkpoints))
        result.missing.append(f"its arms started from different checkpoints ({shas})")
    elif checkpoints:
        result.checkpoint = next(iter(checkpoints))
    return result


def read_pack(pack: Path, arms: list[str], heldout: bool, scratch: Path) -> list[Seed]:
    """Every seed a pack's ``runs/`` holds, judged; its files extracted under ``scratch``."""
    target = scratch / f"{len(list(scratch.iterdir()))}"
    target.mkdir()
    try:
        with tarfile.open(pack) as archive:
            archive.extractall(target, filter="data")
    except (OSError, tarfile.TarError) as err:
        raise SeedsError(f"{pack}: not a readable tar pack ({err})") from None
    return [_judge(str(pack), seed, arms, by_arm, heldout) for seed, by_arm in sorted(_run_files(target).items())]


def collect(packs: list[Path], into: Path, arms: list[str], heldout: bool = True, echo=print,
            partial: bool = False) -> list[int]:
    """Copy the whole seeds of ``packs`` into ``into`` (created when there is one), and with ``partial`` the finished
    runs of the seeds whole in no pack; returns the seeds whole in ``into`` from this call (with ``partial`` also
    those whose arms came from several packs).
    Raises :class:`SeedsError` (nothing copied) for a seed whole in two packs, a run held otherwise in ``into``, and
    with ``partial`` a run finished in two packs or a seed whose runs name two checkpoints."""
    with tempfile.TemporaryDirectory() as scratch:
        whole: dict[int, Seed] = {}
        unwhole: list[Seed] = []
        for pack in packs:
            for seed in read_pack(pack, arms, heldout, Path(scratch)):
                if seed.missing:
                    echo(f"seed {seed.seed} in {pack}: not whole ({'; '.join(seed.missing)}), "
                         f"{'its finished runs kept' if partial and seed.finished else 'left out'}")
                    unwhole.append(seed)
                elif seed.seed in whole:
                    if not all(_same_run(whole[seed.seed], seed, arm) for arm in arms):
                        raise SeedsError(f"seed {seed.seed} is whole in both {whole[seed.seed].pack} and {pack}: keep "
                                         "one pack's runs of it (move the other pack aside) and collect again")
                else:
                    whole[seed.seed] = seed
        runs = {(number, arm): seed for number, seed in whole.items() for arm in arms}
        parted = _partial_runs(unwhole, runs) if partial else {}
        copies = []
        for (number, arm), seed in sorted({**runs, **parted}.items()):
            for kind, source in sorted(seed.files[arm].items()):
                destination = into / f"{arm}_s{number}{kind}"
                if destination.exists() and destination.read_bytes() != source.read_bytes():
                    raise SeedsError(f"{destination} holds another run than {seed.pack}'s: seed {number} is in "
                                     f"--into already from another machine; collect into an empty folder")
                copies.append((source, destination))
        if copies:
            into.mkdir(parents=True, exist_ok=True)
        for source, destination in copies:
            shutil.copyfile(source, destination)
    for number, seed in sorted(whole.items()):
        echo(f"seed {number}: whole in {seed.pack} (checkpoint {str(seed.checkpoint)[:12]}), in {into}")
    joined = []
    for number in sorted({number for number, _ in parted}):
        done = [arm for arm in arms if (number, arm) in parted]
        checkpoint = str(parted[(number, done[0])].finished[done[0]])[:12]
        left = [arm for arm in arms if arm not in done]
        if left:
            echo(f"seed {number}: {', '.join(done)} finished (checkpoint {checkpoint}), in {into}; still to run: "
                 f"{', '.join(left)}")
            continue
        joined.append(number)
        where = "; ".join(f"{arm} from {parted[(number, arm)].pack}" for arm in done)
        echo(f"seed {number}: whole across packs ({where}; checkpoint {checkpoint}), in {into}")
    return sorted([*whole, *joined])


def _same_run(one: Seed, other: Seed, arm: str) -> bool:
    """Whether two packs hold ``arm``'s run of a seed as the same files (a run carried to the next machine is in its
    pack again)."""
    mine, theirs = one.files.get(arm, {}), other.files.get(arm, {})
    return mine.keys() == theirs.keys() and all(mine[k].read_bytes() == theirs[k].read_bytes() for k in mine)


def _partial_runs(unwhole: list[Seed], runs: dict[tuple[int, str], Seed]) -> dict[tuple[int, str], Seed]:
    """``{(seed, arm): the pack's seed}`` of the finished runs in ``unwhole`` (seeds whole in no pack); refuses a run
    finished in two packs or already among ``runs`` (the whole seeds'), and a seed whose runs name two checkpoints."""
    parted: dict[tuple[int, str], Seed] = {}
    for seed in unwhole:
        for arm in seed.finished:
            key, earlier = (seed.seed, arm), parted.get((seed.seed, arm)) or runs.get((seed.seed, arm))
            if earlier is not None and _same_run(earlier, seed, arm):  # one run in two packs (carried, packed again)
                continue
            if earlier is not None:
                raise SeedsError(f"run {arm}_s{seed.seed} finished in both {earlier.pack} and {seed.pack}: keep one "
                                 "pack's run of it (move the other pack aside) and collect again")
            parted[key] = seed
    for number in sorted({number for number, _ in parted}):
        named = {(arm, s.pack): s.finished[arm] for (n, arm), s in parted.items() if n == number}
        if len(set(named.values())) > 1:
            shas = ", ".join(sorted(str(sha)[:12] for sha in set(named.values())))
            raise SeedsError(f"seed {number}'s finished runs started from different checkpoints ({shas}): --partial "
                             "needs one checkpoint carried to every machine (benchmarks/gpu/ckpt_join.sh); collect "
                             "without --partial")
    return parted


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.compare_seeds", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    go = sub.add_parser("collect", help="copy the whole seeds of several packs into one runs/ folder")
    go.add_argument("packs", nargs="+", type=Path, help="tar packs (session.tgz, compare_gsm8k.tgz) holding runs/")
    go.add_argument("--into", required=True, type=Path, help="the runs/ folder to fill (created)")
    go.add_argument("--arms", required=True, help="the sweep's arms, comma-separated (e.g. A,B,F,H,J)")
    go.add_argument("--no-heldout", action="store_true", help="do not require each run's held-out result")
    go.add_argument("--partial", action="store_true", help="also the finished runs of seeds whole in no pack (every "
                    "machine started from one carried checkpoint): the next sweep trains only the missing arms")
    args = parser.parse_args(argv)
    arms = [arm for arm in args.arms.split(",") if arm]
    try:
        seeds = collect(args.packs, args.into, arms, heldout=not args.no_heldout, partial=args.partial)
    except SeedsError as err:
        print(f"compare_seeds: {err}", file=sys.stderr)
        return 2
    print(f"{len(seeds)} whole seed(s): {', '.join(map(str, seeds)) or 'none'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
