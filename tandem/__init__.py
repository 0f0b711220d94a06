"""Generated protocol stubs (tandem.v1); see protos/ and scripts/gen-protos.sh."""
