"""Synthetic tasks written as parquet datasets (``megarl data make TASK``)."""

from megarl.data.tasks.arithmetic import ArithmeticTask
from megarl.data.tasks.countdown import CountdownTask

__all__ = ["ArithmeticTask", "CountdownTask"]
