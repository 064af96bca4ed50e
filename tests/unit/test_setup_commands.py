"""The README's two set-up commands: the demo installs what running needs, the tests the rest."""

import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="needs make")


def make_dry_run(target: str) -> list[str]:
    out = subprocess.run(["make", "-n", "-C", str(ROOT), target], capture_output=True, text=True,
                         check=True).stdout
    return [line for line in out.splitlines() if line.strip() and not line.startswith("make")]


def pip_installs(commands: list[str]) -> list[str]:
    return [c for c in commands if " pip install " in c]


def test_demo_installs_the_package_without_the_test_extra():
    installs = pip_installs(make_dry_run("demo"))
    assert installs, "make demo installs nothing"
    assert all("[test]" not in c for c in installs), installs
    assert any("torch==" in c and c.rstrip().endswith("-e .") for c in installs), installs


def test_test_installs_the_test_extra():
    installs = pip_installs(make_dry_run("test"))
    assert any('-e ".[test]"' in c for c in installs), installs


def test_readme_states_the_commands_make_runs():
    readme = (ROOT / "README.md").read_text()
    for target in ("demo", "test"):
        said = re.search(rf"^make {target} +# = (.*)$", readme, re.MULTILINE)
        assert said, f"README does not say what `make {target}` runs"
        install = pip_installs(make_dry_run(target))[0].replace("python3 ", "", 1)
        assert install.split("pip install ", 1)[1] in said.group(1), (install, said.group(1))
