"""A corpus of small ONNX networks shaped like what real exporters produce (tests/models/corpus.py)."""
