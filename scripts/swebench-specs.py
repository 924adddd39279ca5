#!/usr/bin/env python3
"""Writes crates/swebench/specs/swebench-<version>.json: SWE-bench's own environment and test
specs (MAP_REPO_VERSION_TO_SPECS_PY, MAP_REPO_TO_REQS_PATHS, MAP_REPO_TO_ENV_YML_PATHS,
NON_TEST_EXTS) for the Python repositories of SWE-bench Verified, read from the PyPI
`swebench` wheel. The tables are data: ARL maps them onto pyenv + venv builds in Rust
(crates/swebench). Run it to follow a new swebench release:

    python3 scripts/swebench-specs.py 4.1.0

It downloads the wheel with pip (no install) and reads the constants module by path, so
none of swebench's dependencies are needed.
"""
import importlib.util
import json
import pathlib
import subprocess
import sys
import tempfile
import zipfile

# The repositories of SWE-bench Verified (all 500 instances).
VERIFIED_REPOS = [
    "astropy/astropy", "django/django", "matplotlib/matplotlib", "mwaskom/seaborn",
    "pallets/flask", "psf/requests", "pydata/xarray", "pylint-dev/pylint",
    "pytest-dev/pytest", "scikit-learn/scikit-learn", "sphinx-doc/sphinx", "sympy/sympy",
]


def module(path: pathlib.Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    loaded = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(loaded)
    return loaded


def main() -> None:
    version = sys.argv[1] if len(sys.argv) > 1 else "4.1.0"
    out = pathlib.Path(__file__).resolve().parent.parent / "crates/swebench/specs" / f"swebench-{version}.json"
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", tmp, f"swebench=={version}"],
            check=True,
        )
        wheel = next(pathlib.Path(tmp).glob("swebench-*.whl"))
        with zipfile.ZipFile(wheel) as z:
            z.extractall(tmp)
        constants = pathlib.Path(tmp) / "swebench/harness/constants"
        python = module(constants / "python.py", "swebench_python_constants")
        # NON_TEST_EXTS lives in the package's __init__, which imports the rest of the
        # package; read the one list from its source instead.
        source = (constants / "__init__.py").read_text()
        start = source.index("NON_TEST_EXTS = [")
        non_test_exts = eval(source[start + len("NON_TEST_EXTS = "): source.index("]", start) + 1])
    table = {
        "swebench_version": version,
        "specs": {repo: python.MAP_REPO_VERSION_TO_SPECS_PY[repo] for repo in VERIFIED_REPOS},
        "requirements_paths": {r: p for r, p in python.MAP_REPO_TO_REQS_PATHS.items() if r in VERIFIED_REPOS},
        "environment_yml_paths": {r: p for r, p in python.MAP_REPO_TO_ENV_YML_PATHS.items() if r in VERIFIED_REPOS},
        "non_test_exts": non_test_exts,
    }
    out.write_text(json.dumps(table, indent=1, sort_keys=True) + "\n")
    print(f"wrote {out} ({sum(len(v) for v in table['specs'].values())} repository versions)")


if __name__ == "__main__":
    main()
