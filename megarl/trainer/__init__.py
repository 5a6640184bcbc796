"""megarl.trainer."""
