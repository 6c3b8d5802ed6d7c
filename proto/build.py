"""Generates duck_proto/duck_pb2.py and duck_pb2_grpc.py from proto/duck.proto
with grpcio-tools' protoc. Run by the install (setup.py); also runnable by
hand: python proto/build.py."""
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO = ROOT / "proto" / "duck.proto"


def build(out_root: Path = ROOT) -> list[Path]:
    from grpc_tools import protoc
    import grpc_tools

    out_pkg = out_root / "duck_proto"
    out_pkg.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        # protoc names imports after the proto's path: place it as duck_proto/duck.proto
        src = Path(tmp) / "duck_proto"
        src.mkdir()
        shutil.copy(PROTO, src / "duck.proto")
        include = Path(grpc_tools.__file__).parent / "_proto"
        rc = protoc.main(["protoc", f"-I{tmp}", f"-I{include}", f"--python_out={out_root}",
                          f"--grpc_python_out={out_root}", str(src / "duck.proto")])
        if rc != 0:
            raise RuntimeError(f"protoc failed on {PROTO} (exit {rc})")
    if out_root != ROOT:
        shutil.copy(ROOT / "duck_proto" / "__init__.py", out_pkg / "__init__.py")
    return [out_pkg / "duck_pb2.py", out_pkg / "duck_pb2_grpc.py"]


if __name__ == "__main__":
    for p in build(Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT):
        print(p)
