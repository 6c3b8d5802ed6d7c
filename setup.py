"""Build glue that pyproject.toml cannot express: the cffi extension of
native/, the gRPC stubs of proto/duck.proto, and the duck firmware binary (native/bin/duckfw) built from
firmware/ and native/ sources by firmware/build.py."""
import importlib.util
from pathlib import Path

from setuptools import setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent


def _load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _firmware_build():
    spec = importlib.util.spec_from_file_location("duck_firmware_build", ROOT / "firmware" / "build.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


class build_ext_with_firmware(build_ext):
    """The cffi extension, then duckfw beside it (in place for editable installs)."""

    def run(self):
        super().run()
        target = ROOT if (self.inplace or getattr(self, "editable_mode", False)) else Path(self.build_lib)
        self._duckfw = _firmware_build().build("release", target / "native" / "bin" / "duckfw")
        # the gRPC stubs of proto/duck.proto (duck_proto/duck_pb2*.py)
        _load("duck_proto_build", ROOT / "proto" / "build.py").build(target)

    def get_outputs(self):
        outputs = super().get_outputs()
        if not (self.inplace or getattr(self, "editable_mode", False)):
            outputs.append(str(Path(self.build_lib) / "native" / "bin" / "duckfw"))
            outputs += [str(Path(self.build_lib) / "duck_proto" / f) for f in ("duck_pb2.py", "duck_pb2_grpc.py")]
        return outputs


setup(cffi_modules=["native/build_ffi.py:ffibuilder"], cmdclass={"build_ext": build_ext_with_firmware})
