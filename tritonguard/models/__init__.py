"""The models plane: the Python-based backends that serve models (not guards).

- :mod:`.engines`: onnxruntime / TorchScript / AOTInductor / TensorRT engines (shared with the
  guard's in-process placement and the exporter's offline runs);
- :mod:`.runtime`: the ``runtime`` backend;
- :mod:`.tokenizer`: the ``tokenizer`` backend (text -> input ids);
- :mod:`.intake`: the ``intake`` backend (a text guard's unbatched first step).

May import: :mod:`tritonguard.triton`, :mod:`tritonguard.core`.
"""
