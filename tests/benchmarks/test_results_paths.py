"""No committed result holds a machine's paths: every text file under benchmarks/results, and every member of a
packed archive there, is scanned (the GPU machine's output folder, caches, installs, the model's folder, the
checkout's absolute path). Placeholders such as ``<vllm-cache>/`` or ``$OUT/`` take their place."""

from __future__ import annotations

import tarfile

import pytest
from _support import ROOT

from benchmarks._lib.publish import MACHINE_PATH

RESULTS = ROOT / "benchmarks" / "results"
ARCHIVES = (".tar.xz", ".tgz", ".tar.gz", ".tar")
BINARY = (".png", ".pt")


def _texts():
    for path in sorted(RESULTS.rglob("*")):
        if not path.is_file() or path.suffix in BINARY:
            continue
        if path.name.endswith(ARCHIVES):
            with tarfile.open(path) as archive:
                for member in archive.getmembers():
                    if member.isfile():
                        yield f"{path.relative_to(ROOT)}:{member.name}", archive.extractfile(member).read()
        elif path.suffix != ".xz":  # a single compressed file: read it too
            yield str(path.relative_to(ROOT)), path.read_bytes()
        else:
            import lzma

            yield str(path.relative_to(ROOT)), lzma.decompress(path.read_bytes())


def test_the_pattern_finds_what_it_must():
    assert MACHINE_PATH.findall("wrote /root/out/r/x.json and /work/main/recipes/a.yaml") == [
        "/root/out/r/x.json", "/work/main/recipes/a.yaml"]
    assert MACHINE_PATH.findall("<vllm-cache>/torch_compile_cache $OUT/r/x.json recipes/arm_A.yaml 1/tmp") == []
    # at the start of the text, after a word character or a dot, after another slash
    assert MACHINE_PATH.findall("/tmp/a x/tmp/b ./tmp/c .//tmp/d") == ["/tmp/a", "/tmp/d"]
    # an install path of any Python version (MACHINE_PATHS names /usr/lib/python3.12/ and its site-packages)
    assert MACHINE_PATH.findall("in /usr/lib/python3.12/site-packages/trl/x.py and /usr/local/lib/python3/y") == [
        "/usr/lib/python3.12/site-packages/trl/x.py", "/usr/local/lib/python3/y"]


@pytest.mark.skipif(not RESULTS.is_dir(), reason="no committed results")
def test_no_committed_result_holds_a_machine_path():
    found = {}
    for name, data in _texts():
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError:
            continue
        paths = MACHINE_PATH.findall(text)
        if paths:
            found[name] = sorted(set(paths))[:3]
    assert not found, f"machine paths in committed results (strip them, compare_sweep_publish.MACHINE_PATHS): {found}"
