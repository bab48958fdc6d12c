"""A rank never imports the doctor: `commlib.observe` is imported only from itself, the doctor's
command line (`commlib/doctor.py`), `fsdp_overlap/timeline.py` and `chaos/`; `commlib/record/`
(what a rank writes) imports none of it. Read from each module's own imports with `ast`."""

from __future__ import annotations

import ast
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("commlib", "fsdp_overlap", "chaos")
MAY_IMPORT_THE_DOCTOR = ("commlib/observe/", "commlib/doctor.py", "fsdp_overlap/timeline.py", "chaos/")
_MODULE_NAME = re.compile(r"commlib(\.\w+)+")


def _imports(path: Path) -> set[str]:
    """The modules `path` imports, at its top or in a function, and the modules a table of lazy
    imports names (a string that is a dotted name under `commlib`, as `commlib/__init__.py` has)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module is not None and node.level == 0:
            found |= {node.module} | {f"{node.module}.{alias.name}" for alias in node.names}
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and _MODULE_NAME.fullmatch(node.value):
            found.add(node.value)
    return found


def _importers_of_the_doctor() -> dict[str, list[str]]:
    """Module path -> what it imports of `commlib.observe`, for every module of the packages."""
    found = {}
    for package in PACKAGES:
        for path in sorted((REPO / package).rglob("*.py")):
            names = sorted(m for m in _imports(path) if m == "commlib.observe" or m.startswith("commlib.observe."))
            if names:
                found[path.relative_to(REPO).as_posix()] = names
    return found


def test_only_the_doctor_and_the_tools_above_it_import_it() -> None:
    """Nothing of the runtime (commlib, `commlib/record/` included) imports `commlib.observe`."""
    importers = _importers_of_the_doctor()
    assert "commlib/doctor.py" in importers, "expected the doctor's command line among the importers"
    wrong = {path: names for path, names in importers.items() if not path.startswith(MAY_IMPORT_THE_DOCTOR)}
    assert not wrong, f"expected only {MAY_IMPORT_THE_DOCTOR} to import commlib.observe; found {wrong}"
    record = REPO / "commlib" / "record"
    assert record.is_dir() and not [p for p in importers if p.startswith("commlib/record/")]
