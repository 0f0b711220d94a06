"""Generated from protos/tandem/v1/*.proto by scripts/gen-protos.sh; never edit the *_pb2 files."""
