"""Conversion's modules import its data types, never the orchestrator back (no import cycles)."""

import ast
from pathlib import Path

import attnres.conversion

PACKAGE = Path(attnres.conversion.__file__).parent
# Only the entry points (the package, the attnres-convert and attnres-retrofit commands, the eps report)
# build on the orchestrator.
ENTRY_POINTS = {"__init__.py", "cli.py", "eps_report.py", "retrofit.py"}


def imported_modules(path: Path) -> set[str]:
    """Every module a file imports, TYPE_CHECKING blocks included, relative ones as `.name`."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            names.add("." * node.level + (node.module or ""))
        elif isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
    return names


def test_only_entry_points_import_the_converter():
    importers = {path.name for path in PACKAGE.glob("*.py")
                 if {".converter", "attnres.conversion.converter"} & imported_modules(path)}
    assert importers <= ENTRY_POINTS, importers - ENTRY_POINTS
    assert {"verify.py", "card.py", "datatypes.py"} <= {p.name for p in PACKAGE.glob("*.py")}


def test_one_module_named_model_card_in_the_repository():
    """examples/model_card.py writes the shipped model's card; the converter's is conversion/card.py."""
    assert not (PACKAGE / "model_card.py").exists()
