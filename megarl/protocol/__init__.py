"""megarl.protocol: `Batch`, the data that moves between the driver and the workers."""

from megarl.protocol.batch import Batch
from megarl.protocol.columns import MissingKeyError

__all__ = ["Batch", "MissingKeyError"]
