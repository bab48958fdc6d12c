"""Every test that tests/conftest.py's HEAVY_FIRST names exists: a renamed one would drop out of
the order silently (it would still run, but late, and the suite's last minutes would be one
worker's long test)."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _heavy_first() -> tuple[str, ...]:
    tree = ast.parse((ROOT / "tests" / "conftest.py").read_text())
    [value] = [node.value for node in tree.body if isinstance(node, ast.Assign)
               and any(isinstance(t, ast.Name) and t.id == "HEAVY_FIRST" for t in node.targets)]
    return ast.literal_eval(value)


def test_every_test_heavy_first_names_exists() -> None:
    named = _heavy_first()
    assert len(named) > 10
    gone = []
    for test in named:
        path, name = test.split("::", 1)
        module = ROOT / path
        if not module.is_file() or f"def {name}(" not in module.read_text():
            gone.append(test)
    assert gone == [], f"tests/conftest.py HEAVY_FIRST names tests that are gone: {gone} (take the heaviest " \
                       "tests' ids from a `./scripts/test.sh --durations=0` run)"
