"""Several fresh-process cases that share a slow start (Python, torch, a model load): one subprocess runs the
shared set-up once, then forks a process per case, in which the case's environment is set and its code runs, with
its own stdout, stderr and exit code. A case's process has imported only what the set-up imported, which the
runner checks against the packages the cases must load for the first time."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

from _support.events import HANG_S

_RUNNER = '''
import json, os, sys, traceback
spec = json.loads(sys.argv[1])
shared = {"__name__": "__forked_case__"}
exec(spec["setup"], shared)
loaded = [name for name in sys.modules for package in spec["not_loaded"]
          if name == package or name.startswith(package + ".")]
assert not loaded, f"the set-up imported {loaded}, which each case must import for the first time"
for number, (env, code) in enumerate(spec["cases"]):
    pid = os.fork()
    if pid == 0:
        status = 0
        with open(f"{spec['folder']}/{number}.out", "w") as out, open(f"{spec['folder']}/{number}.err", "w") as err:
            os.dup2(out.fileno(), 1)
            os.dup2(err.fileno(), 2)
            os.environ.update(env)
            try:
                exec(code, dict(shared))
            except SystemExit as stop:
                status = stop.code if isinstance(stop.code, int) else int(stop.code is not None)
            except BaseException:
                traceback.print_exc()
                status = 1
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(status)
    _, waited = os.waitpid(pid, 0)
    with open(f"{spec['folder']}/{number}.code", "w") as out:
        out.write(str(os.waitstatus_to_exitcode(waited)))
'''


def run_forked(folder: Path, setup: str, cases: list[tuple[dict, str]], not_loaded: tuple[str, ...],
               env: dict | None = None) -> list[SimpleNamespace]:
    """Run ``setup`` (Python source) once in a subprocess with environment ``env`` (default: this one's), then each
    case ``(environment overrides, Python source)`` in a process forked from it, its source seeing the set-up's
    names. ``not_loaded``: packages the set-up must not have imported. Returns per case ``returncode``, ``stdout``
    and ``stderr`` (as :class:`subprocess.CompletedProcess` names them); the case files are kept in ``folder``."""
    spec = {"setup": setup, "cases": cases, "not_loaded": list(not_loaded), "folder": str(folder)}
    run = subprocess.run([sys.executable, "-c", _RUNNER, json.dumps(spec)], capture_output=True, text=True,
                         env=os.environ if env is None else env, timeout=HANG_S)
    assert run.returncode == 0, run.stderr[-3000:]
    return [SimpleNamespace(returncode=int((folder / f"{n}.code").read_text()), stdout=(folder / f"{n}.out").read_text(),
                            stderr=(folder / f"{n}.err").read_text()) for n in range(len(cases))]
