"""tritonguard: a safety layer for NVIDIA Triton, as Python-based backends and a control CLI.

The modules here are the library; ``backends/<name>/model.py`` are thin Triton entries that
import it. Only :mod:`tritonguard.triton.backend` touches ``triton_python_backend_utils``, so
everything else is testable without a server.
"""

__version__ = "0.1.0"
