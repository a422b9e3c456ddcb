"""The vocabulary every layer speaks: errors, dtypes and ops, operation records, array
adapters, configuration, logging and the CUDA runtime's few calls. Imports nothing above it."""
