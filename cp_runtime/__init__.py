"""cp-runtime: a long-context serving runtime for DeepSeek Sparse Attention (DSA) models.

The KV cache is an MLA latent cache (fp8 by default) plus a bf16 indexer cache, paged and sharded
by position over a `cp` mesh axis; docs/architecture.md describes the layers. `Client` and
`AsyncClient` talk to a running server (`cp-runtime serve`).
"""

from cp_runtime.serving.session.client import (AsyncClient, AsyncSession, Client, Generation,
                                               Retry, Session)
from cp_runtime.serving.session.protocol import (BadRequestError, CapacityError,
                                                 ContextLengthError, InternalError,
                                                 NotFoundError, OverloadedError, ServerError,
                                                 StorageError, UnauthorizedError,
                                                 UnavailableError)

__all__ = ["__version__", "AsyncClient", "AsyncSession", "BadRequestError", "CapacityError",
           "Client", "ContextLengthError", "Generation", "InternalError", "NotFoundError",
           "OverloadedError", "Retry", "ServerError", "Session", "StorageError",
           "UnauthorizedError", "UnavailableError"]
__version__ = "0.1.0"
