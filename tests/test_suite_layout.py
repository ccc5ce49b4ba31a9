"""The test suite's own rules: helpers come from tests/support (or a conftest.py), never from
another test module, whose tests would then be collected a second time."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

TESTS = Path(__file__).parent


def imported_modules(code: str, package: str) -> list[str]:
    """Every module that code imports, relative imports resolved against its package."""
    found: list[str] = []
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.Import):
            found += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            parts = package.split(".")
            base = parts[:len(parts) - node.level + 1] if node.level else []
            module = ".".join([*base, *([node.module] if node.module else [])])
            # `from tests import test_x` names the module among the imported names.
            found += [module, *(f"{module}.{alias.name}" for alias in node.names)]
    return found


def imports_of_test_modules(code: str, package: str) -> list[str]:
    """The test modules of this suite (tests/**/test_*.py) that code imports."""
    found = set()
    for module in imported_modules(code, package):
        parts = module.split(".")
        tests = [i for i, part in enumerate(parts) if part.startswith("test_")]
        if parts[0] == "tests" and tests:
            found.add(".".join(parts[:tests[0] + 1]))
    return sorted(found)


def test_no_file_of_the_suite_imports_a_test_module() -> None:
    offending = {}
    for source in sorted(TESTS.rglob("*.py")):
        package = ".".join(source.relative_to(TESTS.parent).parent.parts)
        if imported := imports_of_test_modules(source.read_text(), package):
            offending[str(source.relative_to(TESTS.parent))] = imported
    assert offending == {}, "move the helpers they use to tests/support or a conftest.py"


@pytest.mark.parametrize("code", [
    "from tests.test_mirror import BASE", "import tests.test_mirror",
    "from tests import test_mirror", "from .test_compliance import x",
    "from ..test_mirror import BASE", "import tests.store.test_compliance as c"])
def test_every_form_of_importing_a_test_module_is_caught(code: str) -> None:
    assert imports_of_test_modules(code, "tests.store") != [], code


@pytest.mark.parametrize("code", [
    "from tests.support.metrics import sample", "from tests.support import mirror_paths",
    "import proxy.store.archives", "from . import conftest", "from .support import x"])
def test_imports_of_helpers_are_not_caught(code: str) -> None:
    assert imports_of_test_modules(code, "tests") == [], code


def readme_test_command() -> list[str]:
    """The lines of the README's "Install and run the tests" command block."""
    readme = (TESTS.parent / "README.md").read_text()
    after = readme.split("Install and run the tests", 1)[1]
    return after.split("```sh\n", 1)[1].split("```", 1)[0].strip().splitlines()


def test_ci_runs_the_readme_test_command_which_starts_no_service() -> None:
    command = readme_test_command()
    ci = (TESTS.parent / ".ci" / "run").read_text().splitlines()
    assert [line for line in ci if line in command] == command  # verbatim, in order
    installs = [line for line in command if "apt-get install" in line]
    assert installs and all("--no-install-recommends" in line for line in installs)
    installed = " ".join(installs).split()
    # chromium renders the status page; prometheus is only unpacked (its package would start
    # the server, and recommend node-exporter, as services on the host).
    assert "chromium" in installed and "prometheus" not in installed
    assert any("apt-get download prometheus" in line and "dpkg-deb -x" in line
               for line in command)
