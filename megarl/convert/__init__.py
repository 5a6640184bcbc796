"""HF <-> Megatron checkpoint conversion, streaming tensor by tensor (see `megarl convert --help`).

`hf_to_mcore.convert_hf_to_mcore` and `mcore_to_hf.convert_mcore_to_hf`, imported from their modules:
this package imports nothing itself, so that `megarl convert --help` starts without torch.
"""
