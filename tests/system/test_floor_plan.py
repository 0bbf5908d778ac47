"""The floor plan as code: the import-linter layers contract holds, breaks when an import goes up a floor,
the package has no import cycle, and docs/ARCHITECTURE.md's floors are the contract's."""

from __future__ import annotations

import ast
import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import grimp

ROOT = Path(__file__).resolve().parents[2]
LINT = Path(sys.executable).with_name("lint-imports")


def _contract() -> dict[str, object]:
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    return next(c for c in cfg["contracts"] if c["id"] == "layers")


def _lint(root: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(root)}
    return subprocess.run([str(LINT), "--config", str(root / "pyproject.toml"), "--no-cache"], cwd=root, env=env,
                          capture_output=True, text=True, timeout=300)


def test_the_tree_keeps_its_floor_plan() -> None:
    r = _lint(ROOT)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "0 broken" in r.stdout


def test_an_import_up_a_floor_or_across_stages_breaks_the_lint(tmp_path: Path) -> None:
    shutil.copytree(ROOT / "edgehaul", tmp_path / "edgehaul", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    assert _lint(tmp_path).returncode == 0  # the copy alone is clean
    settings = tmp_path / "edgehaul" / "platform" / "settings.py"
    up = "\n\ndef _up() -> None:\n    from edgehaul.flows import core_ingest  # noqa\n"
    settings.write_text(settings.read_text() + up)
    r = _lint(tmp_path)
    assert r.returncode != 0 and "edgehaul.platform.settings -> edgehaul.flows.core_ingest" in r.stdout, r.stdout
    settings.write_text(settings.read_text().replace("from edgehaul.flows import core_ingest", "pass"))
    spool = tmp_path / "edgehaul" / "edge" / "spool.py"
    spool.write_text(spool.read_text() + "\n\ndef _across() -> None:\n    from edgehaul.core import datasets  # noqa\n")
    r = _lint(tmp_path)
    assert r.returncode != 0 and "edgehaul.edge.spool -> edgehaul.core.datasets" in r.stdout, r.stdout


def test_the_package_has_no_import_cycle() -> None:
    graph = grimp.build_graph("edgehaul", exclude_type_checking_imports=True, cache_dir=None)
    cycles = [(a, b) for a in graph.modules for b in graph.find_modules_directly_imported_by(a)
              if graph.chain_exists(importer=b, imported=a)]
    assert cycles == []


def test_architecture_doc_lists_the_contracts_floors() -> None:
    doc = (ROOT / "docs" / "ARCHITECTURE.md").read_text()
    table = doc.split("<!-- floors:", 1)[1].split("\n\n", 1)[0]
    rows = [line for line in table.splitlines() if re.match(r"^\| \d+ \|", line)]
    cells = [re.split(r"(?<!\\)\|", row) for row in rows]  # an escaped \| stays inside its cell
    documented = [sorted(re.findall(r"`(edgehaul[a-z_.]*)`", c[2])) for c in cells]
    layers = _contract()["layers"]
    assert isinstance(layers, list)
    assert documented == [sorted(p.strip() for p in layer.split("|")) for layer in layers]


FUNCTION_LINES = 100  # a product function longer than this is phases not yet named
FLOW_COMPLEXITY = 20  # radon's grade C: a flow reads as the steps of its docstring


def _functions(path: Path) -> list[ast.FunctionDef | ast.AsyncFunctionDef]:
    tree = ast.parse(path.read_text(), filename=str(path))
    return [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)]


def test_no_product_function_is_over_a_hundred_lines() -> None:
    long = [f"{p.relative_to(ROOT)}:{f.lineno} {f.name} ({(f.end_lineno or f.lineno) - f.lineno + 1} lines)"
            for p in sorted((ROOT / "edgehaul").rglob("*.py")) for f in _functions(p)
            if (f.end_lineno or f.lineno) - f.lineno + 1 > FUNCTION_LINES]
    assert long == []


def test_every_flow_is_at_most_complexity_c() -> None:
    from radon.complexity import cc_visit

    flows = sorted((ROOT / "edgehaul" / "flows").glob("*.py"))
    decorated = {(p, f.name) for p in flows for f in _functions(p)
                 if any("flow" in ast.unparse(d) for d in f.decorator_list)}
    assert len(decorated) >= 9  # every deployable flow is measured, not a file that lost its decorator
    over = [f"{p.relative_to(ROOT)}:{b.lineno} {b.name} {b.complexity}" for p in flows
            for b in cc_visit(p.read_text()) if (p, b.name) in decorated and b.complexity > FLOW_COMPLEXITY]
    assert over == []
