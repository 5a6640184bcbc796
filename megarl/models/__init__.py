"""megarl.models: model specs (HF config -> Megatron TransformerConfig + layer spec) and the weight
map that conversion, loading and resharding follow (`spec`, `weight_map`)."""
