"""The docs stay true to the tree: docs/architecture.md names every module, every repository path the docs and
READMEs mention exists, and the conversion docs' commands run as written."""

from __future__ import annotations

import os
import re
import subprocess

import pytest

from tests.cli import ROOT, write_hf_checkpoint

DOCS = ["README.md", "benchmarks/README.md", "ds_configs/README.md"] + [
    os.path.join("docs", f) for f in sorted(os.listdir(os.path.join(ROOT, "docs"))) if f.endswith(".md")
]
TOP_FOLDERS = ("glm53_ds/", "launch/", "tests/", "benchmarks/", "ds_configs/", "docs/", "data/", ".ci/")


def _read(path: str) -> str:
    with open(os.path.join(ROOT, path), encoding="utf-8") as f:
        return f.read()


def _modules() -> list[str]:
    found = []
    for folder, _, files in os.walk(os.path.join(ROOT, "glm53_ds")):
        for name in files:
            if name.endswith(".py") and name != "__init__.py":
                found.append(os.path.relpath(os.path.join(folder, name), ROOT))
    return sorted(found)


def _named(module: str, text: str) -> bool:
    """By its path, or by its folder's path with the file name in the same table row / line."""
    if module in text:
        return True
    folder, name = os.path.split(module)
    return any(folder + "/" in line and name in line for line in text.splitlines())


def test_architecture_names_every_module():
    text = _read("docs/architecture.md")
    missing = [m for m in _modules() if not _named(m, text)]
    assert not missing, f"docs/architecture.md does not name: {missing}"


def test_control_a_module_missing_from_the_map_is_caught():
    text = _read("docs/architecture.md")
    lines = [line for line in text.splitlines() if "deepspeed_internals.py" not in line]
    assert not _named("glm53_ds/engine/deepspeed_internals.py", "\n".join(lines))


def test_paths_in_docs_exist():
    folders = "|".join(re.escape(f) for f in TOP_FOLDERS)
    pattern = re.compile(rf"`((?:{folders})[\w./<>*-]*)")
    missing = []
    for doc in DOCS:
        for path in pattern.findall(_read(doc)):
            path = path.split("::")[0].rstrip(".,:")
            if any(c in path for c in "<>*"):  # a pattern such as results/<name>.json
                continue
            if not os.path.exists(os.path.join(ROOT, path)):
                missing.append(f"{doc}: {path}")
    assert not missing, "paths named in the docs that do not exist: " + ", ".join(missing)


@pytest.mark.slow
def test_the_conversion_docs_commands_run_as_written(tmp_path):
    """docs/conversion.md's first block, run with its paths pointed at a tiny released checkpoint (the commands and
    options as written): hf-to-native at EP 8 x ETP 2, native-to-hf with a template, verify's verdict."""
    import re

    from glm53_ds.training.presets import tiny

    hf = tmp_path / "GLM-5.3-Flash"
    hf.mkdir()
    write_hf_checkpoint(hf, tiny())
    from glm53_ds.convert.tokenizer_files import write_byte_tokenizer

    write_byte_tokenizer(str(hf))
    text = open(os.path.join(ROOT, "docs", "conversion.md"), encoding="utf-8").read()
    block = re.findall(r"```bash\n(.*?)```", text, flags=re.S)[0]
    paths = {"/ckpt/GLM-5.3-Flash": str(hf), "/ckpt/native-ep8": str(tmp_path / "native-ep8"),
             "/ckpt/run1-hf": str(tmp_path / "run1-hf"), "/ckpt/run1": str(tmp_path / "native-ep8")}  # fmt: skip
    for line in block.strip().splitlines():
        command = line.split(" [", 1)[0]  # an optional flag shown in brackets
        for old, new in paths.items():
            command = command.replace(old, new)
        proc = subprocess.run(command, shell=True, capture_output=True, text=True, cwd=ROOT, timeout=1800)
        assert proc.returncode == 0, (command, proc.stdout[-2000:], proc.stderr[-2000:])
    assert proc.stdout.strip().splitlines()[-1].startswith("verify: OK")
    from transformers import AutoTokenizer

    assert AutoTokenizer.from_pretrained(tmp_path / "run1-hf").encode("a", add_special_tokens=False) == [97]
