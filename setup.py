"""The build step setup.cfg cannot declare: the run-time configs travel inside the `core` package of a wheel.

Every run loads `configs/base.yaml`, and the tiny and demo model configs (`configs/models/*.json`) are found by
the relative path `configs/models` that base.yaml names. In a clone they stay where they are, the one copy that
is edited; a built package carries a copy of them as `core/configs/` (`core.config.CONFIGS_DIR` prefers it when
present), so an installed package runs from any working directory.
"""
from __future__ import annotations

from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

CONFIGS = Path(__file__).resolve().parent / "configs"
# What a run reads without being told a path: the defaults and the model configs base.yaml points at.
PACKAGED_CONFIGS = ("base.yaml", "models/*.json")
TARGET = Path("core", "configs")


class BuildWithConfigs(build_py):
    """`build_py`, then the run-time configs copied into the built `core` package."""

    def run(self) -> None:
        super().run()
        if self.editable_mode:  # an editable install reads the clone's configs/ directly
            return
        for source in self._config_files():
            target = Path(self.build_lib) / TARGET / source.relative_to(CONFIGS)
            self.mkpath(str(target.parent))
            self.copy_file(str(source), str(target))

    def get_outputs(self, include_bytecode: bool = True) -> list:
        outputs = super().get_outputs(include_bytecode)
        if self.editable_mode:
            return outputs
        return outputs + [str(Path(self.build_lib) / TARGET / f.relative_to(CONFIGS)) for f in self._config_files()]

    @staticmethod
    def _config_files() -> list:
        files = sorted(path for pattern in PACKAGED_CONFIGS for path in CONFIGS.glob(pattern))
        if not (CONFIGS / "base.yaml").is_file():
            raise FileNotFoundError(f"{CONFIGS / 'base.yaml'} is missing: a package without it cannot load a config")
        return files


setup(cmdclass={"build_py": BuildWithConfigs})
