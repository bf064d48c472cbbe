"""The one piece of packaging pyproject.toml cannot say: the repository's top-level `examples/` folder
ships inside the package as `relax/examples/` (one copy of each example in the repository, and
`relax examples list|copy` finds them after `pip install`). Everything else is in pyproject.toml."""

from setuptools import find_packages, setup

setup(
    packages=[*find_packages(include=["relax", "relax.*"]), "relax.examples"],
    package_dir={"relax.examples": "examples"},
    package_data={"relax.examples": ["*.yaml"]},
)
