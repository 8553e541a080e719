"""Where a step's device time goes: torch profiles of optimizer steps (the text that
``benchmarks._lib.profile.StepProfiler`` writes, e.g. ``benchmarks.arm_i_live run ... --profile-steps 10-11``) summed
by kernel family.

``collect LABEL=FILE ... --out FILE --revision R --table-id ID --env DOC [--real-weights]`` (``DOC``: a result
document written on the machine that profiled, for its ``env``; ``--real-weights``: the model is a trained one, else
the table is marked random-init): one row per profile; the device time of the
profiled steps (every kernel), the host's own time (every op's self CPU time), and per kernel family (first match in
:data:`KERNEL_FAMILIES` on the kernel's name) the time of the kernels among the table's listed rows; what the listed
rows leave out is reported as its own column. A kernel row is one with no CPU time of its own (ops have some) that
is not an annotated range on the device (``Optimizer.step#AdamW.step``: its kernels have rows of their own).
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

from bloggap_plugin._io import atomic_write_text

KERNEL_FAMILIES: list[tuple[str, tuple[str, ...]]] = [
    ("batch-invariant Triton matmul", ("matmul_kernel_persistent",)),
    ("attention", ("flash", "fmha", "attn")),
    ("fp32 GEMM", ("sgemm", "f32f32")),
    ("16-bit GEMM", ("nvjet", "gemm", "cutlass")),
    ("optimizer", ("multi_tensor",)),
    ("elementwise, copies, reductions", ("elementwise", "catarray", "reduce_kernel", "copy")),
]
"""(family, substrings of a kernel's name, lower case): the first family with a matching substring takes it; a kernel
that matches none is ``other kernels``."""

_UNITS_MS = {"s": 1000.0, "ms": 1.0, "us": 1e-3}


def duration_ms(text: str) -> float:
    """``"1.787s"`` -> 1787.0, ``"881.557ms"`` -> 881.557, ``"72.528us"`` -> 0.072528."""
    match = re.fullmatch(r"([0-9.]+)(s|ms|us)", text.strip())
    if match is None:
        raise ValueError(f"not a profiler duration: {text!r}")
    return float(match.group(1)) * _UNITS_MS[match.group(2)]


def family_of(kernel: str) -> str:
    name = kernel.lower()
    return next((family for family, keys in KERNEL_FAMILIES if any(k in name for k in keys)), "other kernels")


def summarize(text: str) -> dict:
    """The first table of a profile (by self device time): ``device_ms`` (all kernels), ``host_ms`` (self CPU of all
    ops), ``families`` ``{family: {"ms", "calls"}}`` over the listed kernel rows, ``unlisted_ms`` (kernels below the
    listed rows), ``steps`` (from the header)."""
    first = text.split("\nby cpu_time_total")[0]
    header = first.splitlines()[0]
    steps = re.match(r"steps (\S+),", header)
    device = re.search(r"Self CUDA time total: (\S+)", first)
    host = re.search(r"Self CPU time total: (\S+)", first)
    if steps is None or device is None or host is None:
        raise ValueError("not a StepProfiler device profile: expected 'steps A-B, by self_cuda_time_total' and the "
                         "Self CPU / Self CUDA totals")
    families: dict[str, dict] = {}
    for line in first.splitlines():
        cells = re.split(r"\s{2,}", line.strip())
        if len(cells) != 11 or not cells[10].isdigit():
            continue
        if duration_ms(cells[2]) != 0.0 or re.match(r"[\w.]+#", cells[0]):  # an op, or an annotated range
            continue
        entry = families.setdefault(family_of(cells[0]), {"ms": 0.0, "calls": 0})
        entry["ms"] += duration_ms(cells[6])
        entry["calls"] += int(cells[10])
    device_ms = duration_ms(device.group(1))
    listed = sum(e["ms"] for e in families.values())
    return {"steps": steps.group(1), "device_ms": device_ms, "host_ms": duration_ms(host.group(1)),
            "families": {k: {"ms": round(v["ms"], 3), "calls": v["calls"]} for k, v in families.items()},
            "unlisted_ms": round(device_ms - listed, 3)}


def profile_table(summaries: dict[str, dict], table_id: str, random_init: bool = True) -> dict:
    """One row per label: device and host ms, each family's ms and share of the device time, the unlisted ms."""
    names = [family for family, _ in KERNEL_FAMILIES] + ["other kernels"]
    columns = ["run", "steps", "device ms", "host ms (self CPU)"]
    for name in names:
        columns += [f"{name} ms", f"{name} %"]
    columns.append("kernels below the listed rows ms")
    rows = []
    for label, s in summaries.items():
        row = [label, s["steps"], round(s["device_ms"], 1), round(s["host_ms"], 1)]
        for name in names:
            ms = s["families"].get(name, {}).get("ms", 0.0)
            row += [round(ms, 1), round(100 * ms / s["device_ms"], 1)]
        rows.append(row + [round(s["unlisted_ms"], 1)])
    return {"id": table_id, "title": "Where the profiled steps' device time goes, by kernel family",
            "columns": columns, "rows": rows, "reference": None, "random_init": random_init,
            "notes": "torch.profiler over the steps named (one training-only and one generating step with "
                     "num_iterations 2), GapCallback entry (benchmarks.arm_i_live callback runs), so a harness "
                     "profile: the profiler slows the host. Families by kernel name (benchmarks/step_profile.py "
                     "KERNEL_FAMILIES); a family's time counts the kernels among the profile's 40 listed rows."}


def collect_main(args: argparse.Namespace) -> int:
    from bloggap_plugin.results import SCHEMA_VERSION

    summaries = {}
    for spec in args.profiles:
        label, _, path = spec.partition("=")
        if not path:
            raise SystemExit(f"{spec!r}: expected LABEL=FILE")
        summaries[label] = summarize(Path(path).read_text())
    env = json.loads(Path(args.env).read_text())["env"]
    document = {"benchmark": "step_profile", "schema_version": SCHEMA_VERSION, "env": env,
                "params": {"revision": args.revision, "profiles": {s.partition("=")[0]: Path(s.partition("=")[2]).name
                                                                  for s in args.profiles}},
                "results": summaries, "tables": [profile_table(summaries, args.table_id,
                                                               random_init=not args.real_weights)]}
    atomic_write_text(Path(args.out), json.dumps(document, indent=1) + "\n")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    col = sub.add_parser("collect", help="one document from profile texts")
    col.add_argument("profiles", nargs="+", help="LABEL=FILE (a StepProfiler text)")
    col.add_argument("--out", required=True)
    col.add_argument("--revision", required=True)
    col.add_argument("--table-id", required=True)
    col.add_argument("--env", required=True, help="a result document written on the machine that ran the profiles")
    col.add_argument("--real-weights", action="store_true",
                     help="the profiled model has trained weights (SmolLM2-135M); default: a random-init shape")
    args = parser.parse_args(argv)
    return {"collect": collect_main}[args.command](args)


if __name__ == "__main__":
    raise SystemExit(main())
