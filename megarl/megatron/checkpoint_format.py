"""The version of the engine's checkpoint format, in a module of its own: the driver checks it
before a resume (megarl.trainer.checkpoint_verify) without importing Megatron-Core."""

FORMAT_VERSION = 2  # 2: one optimizer entry per distributed optimizer (dense, experts)
