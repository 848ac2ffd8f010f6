"""Generated from protos/conveyor/v1 by `python -m conveyor.protogen`."""
