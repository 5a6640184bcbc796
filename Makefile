# megarl: the two commands of the README are `make demo` and `make test`.
# Both create (or refresh) the virtual environment first. torch is installed on its own, before
# anything else, at the pinned version, so that no dependency can pick another torch. Where the
# registry serves the CPU build for the pin (as the CI machines' does) that is the CPU build; from
# stock PyPI on Linux it is the CUDA build (README, "The two commands", says how to start from the CPU one).

PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.megarl-installed
TORCH_VERSION := 2.13.0
# Where torch comes from: empty = the package registry; e.g. https://download.pytorch.org/whl/cpu for
# the CPU build where the registry (stock PyPI on Linux) serves the CUDA one. Passed to every environment.
TORCH_INDEX_URL ?=
export TORCH_INDEX_URL
# Extra `megarl train` overrides for the demo, e.g. `make demo DEMO_ARGS="trainer.total_training_steps=20"`.
DEMO_ARGS ?=
# Extra pytest arguments, e.g. `make test PYTEST_ARGS="-k config"`.
PYTEST_ARGS ?=
# Tiers that run on a CPU machine without extra environments (vllm has its own: `make test-vllm`);
# the slow variants run with `make test-slow`.
TEST_MARKERS ?= not gpu and not vllm and not slow

.PHONY: install demo demo-async demo-rm demo-tools test test-unit test-slow clean help

help:
	@echo "make demo   - install, then run the quickstart (tiny GRPO on CPU)"
	@echo "make demo-async - install, then the quickstart one-step-off-policy (rollout in its own process)"
	@echo "make demo-rm - install, then PPO on CPU with a reward model fitted on the task"
	@echo "make demo-tools - install, then multi-turn GRPO on CPU with a calculator tool"
	@echo "make test   - install, then run the test suite (unit, distributed, integration tiers, then vllm; SKIP_VLLM=1 leaves vllm out)"
	@echo "make test-unit - install, then the unit tier alone"
	@echo "make test-slow - install, then the long-running variants of integration tests"
	@echo "make bench  - install, then run the benchmarks (JSON + markdown under benchmarks/results)"
	@echo "make bench-quick - install, then the benchmarks at their smoke sizes"
	@echo "make bench-env - build the benchmark environment (.venv-bench: TRL for the end-to-end comparison)"
	@echo "make vllm-env - build the vLLM CPU environment (.venv-vllm); make demo then uses the vLLM engine"
	@echo "make test-vllm - build .venv-vllm, then the vllm test tier"
	@echo "make bench-rollout - build .venv-vllm, then the rollout engines' benchmark"
	@echo "make gpu-bundle - build the offline GPU bundle (dist/gpu-bundle, CPython 3.12)"
	@echo "make gpu-bundle-dry-run - build a bundle for this Python and run the GPU check's CPU dry run"
	@echo "make clean  - remove the virtual environments (.venv, .venv-vllm, .venv-bench) and test caches; dist/ and .venv-gpu-ref stay"

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

# Re-install when the dependency pins change. The packages the offline GPU bundle ships (direct and
# transitive, tools/gpu_bundle.py) are installed at the bundle's versions, so that what is tested here
# is what the bundle carries, whatever the registry has released since.
$(STAMP): pyproject.toml tools/gpu_bundle.py | $(BIN)/python
	$(BIN)/python -m pip install -q "torch==$(TORCH_VERSION)" $(if $(TORCH_INDEX_URL),--index-url $(TORCH_INDEX_URL))
	$(BIN)/python tools/gpu_bundle.py packages > $(VENV)/bundle-constraints.txt
	$(BIN)/python -m pip install -q -e ".[test]" -c $(VENV)/bundle-constraints.txt
	$(BIN)/python -c "import torch; assert torch.__version__.startswith('$(TORCH_VERSION)'), torch.__version__"
	touch $(STAMP)

install: $(STAMP)

# The quickstart: write the synthetic task and its tokenizer, then train (configs/quickstart_cpu.yaml)
# with the vLLM engine where its environment is built (`make vllm-env`), else with the HF engine.
# vLLM's CPU build was the faster on an AVX2 machine, the HF engine on an AVX-512/AMX one
# (benchmarks/results/demo_engines*.json); DEMO_ARGS=rollout.engine=hf picks HF in either case.
DEMO_DATA := data/arithmetic
# $(call train_demo,CONFIG): train CONFIG with the vLLM engine where its environment is built, else HF.
train_demo = if [ -f $(VLLM_STAMP) ]; then \
		$(VLLM_TEST_ENV) VLLM_LOGGING_LEVEL=ERROR $(VLLM_VENV)/bin/megarl train $(1) rollout.engine=vllm $(DEMO_ARGS); \
	else \
		$(BIN)/megarl train $(1) $(DEMO_ARGS); \
	fi
demo: install
	$(BIN)/megarl data make arithmetic --out $(DEMO_DATA) --tokenizer-out $(DEMO_DATA)/tokenizer \
		--num-operands 2 --min-value 0 --max-value 4 --operators +
	$(call train_demo,configs/quickstart_cpu.yaml)

# The quickstart's task, one-step-off-policy (configs/async_cpu.yaml): 1 training process and 1
# rollout process; the next batch is generated while the trainer updates on this one.
demo-async: install
	$(BIN)/megarl data make arithmetic --out $(DEMO_DATA) --tokenizer-out $(DEMO_DATA)/tokenizer \
		--num-operands 2 --min-value 0 --max-value 4 --operators +
	$(call train_demo,configs/async_cpu.yaml)

# PPO whose reward comes from a reward model (configs/ppo_rm_cpu.yaml): the task, a small reward
# model fitted on preference pairs of it (once; remove $(DEMO_DATA)/reward_model to refit), the run.
demo-rm: install
	$(BIN)/megarl data make arithmetic --out $(DEMO_DATA) --tokenizer-out $(DEMO_DATA)/tokenizer \
		--num-operands 2 --min-value 0 --max-value 4 --operators +
	test -f $(DEMO_DATA)/reward_model/model.safetensors || $(BIN)/python -m megarl.rewards.fit_preference_model \
		--data $(DEMO_DATA)/train.parquet --tokenizer $(DEMO_DATA)/tokenizer --out $(DEMO_DATA)/reward_model
	$(BIN)/megarl train configs/ppo_rm_cpu.yaml $(DEMO_ARGS)

# Multi-turn GRPO with a calculator tool (configs/tools_cpu.yaml): the task and its tokenizer, a short
# warm start on calculator demonstrations (once; remove $(TOOLS_DATA)/warm_start to redo it), the run.
TOOLS_DATA := data/arithmetic_tools
demo-tools: install
	$(BIN)/megarl data make arithmetic_tools --out $(TOOLS_DATA) --tokenizer-out $(TOOLS_DATA)/tokenizer \
		--train-size 2000 --val-size 64
	test -f $(TOOLS_DATA)/warm_start/model.safetensors || $(BIN)/python -m megarl.agent.warm_start \
		--data $(TOOLS_DATA)/train.parquet --tokenizer $(TOOLS_DATA)/tokenizer --out $(TOOLS_DATA)/warm_start \
		--steps 120 --mixed-steps 30 --tool-fraction 0.3
	$(BIN)/megarl train configs/tools_cpu.yaml $(DEMO_ARGS)

# The main tiers, then the vllm tier in its own environment (mk/vllm.mk). SKIP_VLLM=1 skips the latter.
# That environment is built (downloads, mostly: 2-4 minutes) while the main tiers run; its log
# follows theirs.
test: install
ifeq ($(SKIP_VLLM),1)
	$(BIN)/python -m pytest -m "$(TEST_MARKERS)" $(PYTEST_ARGS)
else
	$(MAKE) --no-print-directory vllm-env > $(VLLM_VENV).log 2>&1 & build=$$!; \
	$(BIN)/python -m pytest -m "$(TEST_MARKERS)" $(PYTEST_ARGS); tests=$$?; \
	wait $$build; built=$$?; echo "--- make vllm-env (exit $$built):"; cat $(VLLM_VENV).log; \
	[ $$tests -eq 0 ] && [ $$built -eq 0 ]
	$(MAKE) test-vllm
endif

test-unit: install
	$(BIN)/python -m pytest -m "unit" $(PYTEST_ARGS)

# The long-running variants left out of `make test` (the suite must fit CI's time on a 2-core machine).
test-slow: install
	$(BIN)/python -m pytest -m "slow and not gpu and not vllm" $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) $(VLLM_VENV) $(VLLM_VENV).log $(BENCH_VENV) .pytest_cache .hypothesis

include mk/vllm.mk
include mk/bench.mk
include mk/gpu_bundle.mk
