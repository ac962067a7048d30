"""mpserve: several llama.cpp instances behind one ZeroMQ broker, with per-GPU permits."""

from .client import AsyncClient, Client, Result
from .errors import MpserveError

__all__ = ["AsyncClient", "Client", "MpserveError", "Result"]
__version__ = "0.1.0"
