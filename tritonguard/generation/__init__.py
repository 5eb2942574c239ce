"""The generation plane: text generation with the vLLM backend's I/O contract.

- :mod:`.contract`: the inputs, output and sampling rules every decoupled generator and its guard share;
- :mod:`.decoder`: a tinylm-style artifact's tokenizer, step model and batched decoder;
- :mod:`.engine`: the decode loop of one model instance;
- :mod:`.generator`: the ``generator`` backend's Triton model;
- :mod:`.local`: a generator target run inside its guard (no second hop per token).

May import: :mod:`tritonguard.triton`, :mod:`tritonguard.core`.
"""
