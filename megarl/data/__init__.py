"""RL datasets: parquet prompts in verl's layout, tokenizers without hub access, synthetic tasks.

- ``dataset.RLDataset`` / ``loader.RLDataLoader`` / ``sampler.StatefulSampler``: prompts to batches,
  resumable from a checkpoint.
- ``tokenizer``: ``build_char_tokenizer``, ``train_bpe_tokenizer``, ``load_tokenizer``.
- ``tasks``: arithmetic and countdown generators; ``prepare``: GSM8K / MATH conversion;
  ``cli``: ``megarl data make | inspect``.

Submodules are imported explicitly (``from megarl.data.dataset import RLDataset``): importing
``megarl.data`` itself loads nothing else. (``megarl data`` does load transformers and torch: it
builds tokenizers.)
"""
