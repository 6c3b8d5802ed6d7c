"""gRPC stubs of duckd's API, generated from proto/duck.proto by the install
(proto/build.py): duck_pb2 (messages) and duck_pb2_grpc (stubs, servicers).
Nothing here is written by hand; this file only makes the folder a package."""
