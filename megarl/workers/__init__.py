"""megarl.workers."""
