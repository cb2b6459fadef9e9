"""Packaging: services/ is the package `sssd` (services/<name>/ is `sssd.<name>`), with two
extension modules built by CMake (CMakeLists.txt) and copied next to the Python sources: the C++
drafter core (services/drafter/core/) as `sssd._core`, and the model's fused CPU operations
(services/common/model/kernels/) as `sssd._kernels`.

`pip install -e .` (what scripts/setup.sh runs) is an editable install: Python edits under
services/ take effect on the next run; a C++ edit needs `bash scripts/build_core.sh`. The CMake
build directory persists under build/, so a rebuild compiles only what changed.
"""

import os
import shutil
import subprocess
import sys
from pathlib import Path

from setuptools import Extension, find_packages, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent


class CMakeBuild(build_ext):
    """Builds the extension modules with CMake instead of setuptools' compiler driver."""

    def build_extension(self, ext: Extension) -> None:
        # One build directory per environment: each is configured for its own interpreter.
        build_dir = ROOT / "build" / f"cmake-{Path(sys.prefix).name.lstrip('.') or 'python'}"
        subprocess.run(["cmake", "-S", str(ROOT), "-B", str(build_dir),
                        "-DCMAKE_BUILD_TYPE=Release", f"-DPython_EXECUTABLE={sys.executable}"],
                       check=True)
        target = ext.name.rpartition(".")[2]
        subprocess.run(["cmake", "--build", str(build_dir), "--target", target, "--parallel",
                        str(os.cpu_count() or 1)], check=True)
        (built,) = build_dir.glob(f"{target}.*.so")
        target = Path(self.get_ext_fullpath(ext.name))
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(built, target)


setup(
    # bench/ is the package `bench` of the development install: the benchmarks import each other
    # and their shared flags (bench.flags) as `bench.<name>`, wherever they are run from.
    packages=["sssd", *(f"sssd.{name}" for name in find_packages("services")), "bench"],
    package_dir={"sssd": "services", "bench": "bench"},
    package_data={"sssd.v1": ["*.pyi"], "sssd.common.data": ["*.jsonl"]},
    ext_modules=[Extension("sssd._core", sources=[]), Extension("sssd._kernels", sources=[])],
    cmdclass={"build_ext": CMakeBuild},
)
