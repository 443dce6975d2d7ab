"""Installs the top-level folders shared/, services/ and kernels/ as meshserve.shared,
meshserve.services and meshserve.kernels, so the repository keeps the layout the
architecture describes while the installed names stay inside one namespace."""

from setuptools import find_packages, setup

ROOTS = ("shared", "services", "kernels", "bench", "cli")
packages = ["meshserve"] + [f"meshserve.{p}" for p in find_packages(include=[f"{r}*" for r in ROOTS])]
setup(
    packages=packages,
    package_dir={"meshserve": "meshserve", **{f"meshserve.{r}": r for r in ROOTS}},
    package_data={"meshserve.kernels": ["cuda/*.cu", "cpu/*.cpp"], "meshserve.bench": ["workloads/*"]},
)
