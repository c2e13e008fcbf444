"""The README's one-minute smoke test (issue #41, item 10): its command uses a marker pyproject registers, and the
marked tests span the layers a newcomer meets (the CLI, an op against its reference, a module)."""
from __future__ import annotations

import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent
COMMAND = "python -m pytest -q -m smoke tests"


def test_readme_smoke_command_selects_a_registered_marker_across_layers(pytestconfig):
    readme = (ROOT / "README.md").read_text()
    assert COMMAND in readme[readme.index("## Tests"):], "README's Tests section lost the smoke command"
    assert any(m.startswith("smoke:") for m in pytestconfig.getini("markers"))  # pyproject's markers
    marked = {p.relative_to(ROOT / "tests").as_posix() for p in (ROOT / "tests").rglob("test_*.py")
              if "pytest.mark.smoke" in p.read_text() and p.name != pathlib.Path(__file__).name}
    for where in ("test_cli.py", "torch_ops/", "modules/"):
        assert any(m.startswith(where) for m in marked), f"no smoke test in tests/{where}: {sorted(marked)}"
    assert len(marked) <= 6, f"the smoke subset must stay small (about a minute): {sorted(marked)}"
