"""cp-runtime: a long-context serving runtime for DeepSeek Sparse Attention (DSA) models.

The KV cache is an MLA latent cache (fp8 by default) plus a bf16 indexer cache, paged and sharded
by position over a `cp` mesh axis; see DESIGN.md for the math and README.md for the layout.
"""

__all__ = ["__version__"]
__version__ = "0.1.0"
