"""The README's first command block and its generated configuration reference stay true."""

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_readme_opens_with_the_two_commands_ci_uses():
    readme = (REPO / "README.md").read_text()
    block = readme.split("```bash", 1)[1].split("```", 1)[0].strip().splitlines()
    assert block[0].startswith("make demo") and block[1].startswith("make test")
    assert "make test" in (REPO / ".ci" / "run").read_text()


def test_config_reference_is_current():
    import importlib.util

    spec = importlib.util.spec_from_file_location("gen", REPO / "tools" / "gen_config_reference.py")
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    text = (REPO / "README.md").read_text()
    assert gen.with_reference(text) == text, "run: python tools/gen_config_reference.py"
