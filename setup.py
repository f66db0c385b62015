"""Build hook: ship the top-level ``cuda/*.cu`` and ``*.cuh`` in the package, as ``commopt/cuda/``.

Everything else about the build is in ``pyproject.toml``. The CUDA C sources stay in ``cuda/``
(where nvcc and reviewers find them); a wheel gets a copy under ``commopt/cuda/``, which
:func:`commopt.kernels.cupy_kernels.cuda_source_dir` looks for first. An editable install reads
``cuda/`` in the checkout directly.
"""

from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

_ROOT = Path(__file__).resolve().parent


def _cuda_files() -> list[Path]:
    """The kernel sources and the headers they include."""
    return sorted([*(_ROOT / "cuda").glob("*.cu"), *(_ROOT / "cuda").glob("*.cuh")])


class _BuildPyWithCuda(build_py):
    """``build_py`` that also copies ``cuda/*.cu{,h}`` to ``<build_lib>/commopt/cuda/``."""

    def run(self) -> None:
        super().run()
        if getattr(self, "editable_mode", False):
            return
        target = Path(self.build_lib) / "commopt" / "cuda"
        self.mkpath(str(target))
        for source in _cuda_files():
            self.copy_file(str(source), str(target / source.name))

    def get_outputs(self, include_bytecode: bool = True) -> list[str]:
        outputs = super().get_outputs(include_bytecode)
        if getattr(self, "editable_mode", False):
            return outputs
        target = Path(self.build_lib) / "commopt" / "cuda"
        return outputs + [str(target / s.name) for s in _cuda_files()]


setup(cmdclass={"build_py": _BuildPyWithCuda})
