"""Every build (wheel, sdist, `pip install .`) generates the protobuf stubs, tandem/v1/*_pb2*.py, from
protos/: they are not in git, so a build from a clean checkout would otherwise ship a `tandem` that cannot
import its own wire types. scripts/gen-protos.sh runs the same command for a development checkout."""

from __future__ import annotations

import glob
import subprocess
import sys

from setuptools import setup
from setuptools.command.build_py import build_py


def generate_stubs() -> None:
    protos = sorted(glob.glob("protos/tandem/v1/*.proto"))
    if not protos:  # building from an sdist: the stubs came with it
        return
    subprocess.run([sys.executable, "-m", "grpc_tools.protoc", "-Iprotos", "--python_out=.", "--pyi_out=.",
                    "--grpc_python_out=.", *protos], check=True)


class BuildPyWithStubs(build_py):
    def run(self) -> None:
        generate_stubs()
        super().run()


setup(cmdclass={"build_py": BuildPyWithStubs})
