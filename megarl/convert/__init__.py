"""HF <-> Megatron checkpoint conversion, streaming tensor by tensor (see `megarl convert --help`)."""

from megarl.convert.hf_to_mcore import ConversionResult, convert_hf_to_mcore
from megarl.convert.mcore_to_hf import convert_mcore_to_hf

__all__ = ["ConversionResult", "convert_hf_to_mcore", "convert_mcore_to_hf"]
