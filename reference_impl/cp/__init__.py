"""Context parallelism: split metadata, collectives, rerange, materialization and output collection."""
