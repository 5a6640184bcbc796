"""HF <-> Megatron checkpoint conversion, streaming tensor by tensor (see `megarl convert --help`).

`hf_to_mcore.convert_hf_to_mcore` and `mcore_to_hf.convert_mcore_to_hf`, imported from their modules:
this package imports nothing itself, so that `megarl convert --help` starts without torch.
"""

# A converted checkpoint (a Megatron distributed checkpoint written by `megarl convert hf-to-mcore`)
# keeps the source model's config and tokenizer files in this folder of it. Here, in a module that
# imports nothing, so that the config rules (which load no torch) can read a converted model's config.
HF_FILES_DIR = "hf"
MEGATRON_MARKER = "metadata.json"  # Megatron's format marker, in every distributed checkpoint
