# Benchmarks: `make bench` runs every section; `make bench-quick` the smoke sizes.
BENCH_VENV ?= .venv-bench
BENCH_STAMP := $(BENCH_VENV)/.megarl-bench-installed
BENCH_ARGS ?=

.PHONY: bench bench-quick bench-env

$(BENCH_STAMP): pyproject.toml benchmarks/make_bench_env.sh
	rm -rf $(BENCH_VENV)
	PYTHON=$(PYTHON) benchmarks/make_bench_env.sh $(BENCH_VENV)
	touch $(BENCH_STAMP)

bench-env: $(BENCH_STAMP)

bench: install $(BENCH_STAMP)
	$(BIN)/megarl bench $(BENCH_ARGS)

bench-quick: install $(BENCH_STAMP)
	$(BIN)/megarl bench --quick $(BENCH_ARGS)
