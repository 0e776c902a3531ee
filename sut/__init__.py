"""MLPerf Inference Llama 3.1 8B harness on vLLM: systems-under-test for LoadGen.

Entry point: ``python -m sut --help``.
"""

__version__ = "0.1.0"
