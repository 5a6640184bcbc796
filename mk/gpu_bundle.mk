# Offline GPU bundle (included by the top-level Makefile).
# `make gpu-bundle` builds dist/gpu-bundle/megarl-gpu-bundle-cp312.tar.xz for the GPU image (CPython 3.12);
# on the GPU machine: `bash gpu_check.sh megarl-gpu-bundle-cp312.tar.xz --out results` (see README).
# `make gpu-bundle-dry-run` builds one for this machine's Python and runs the check's CPU dry run
# with a clean environment holding only the reference image's packages (.venv-gpu-ref). Paths are passed
# absolute: the check's steps run from its scratch directory.

GPU_BUNDLE_PYTHON ?= 3.12
GPU_BUNDLE_OUT ?= dist/gpu-bundle
GPU_BUNDLE_LEVEL ?= 9e
GPU_REF_VENV ?= .venv-gpu-ref
HOST_PYTHON_VERSION := $(shell $(PYTHON) -c 'import sys; print("%d.%d" % sys.version_info[:2])')
HOST_PYTHON_TAG := cp$(subst .,,$(HOST_PYTHON_VERSION))

.PHONY: gpu-bundle gpu-bundle-dry-run

gpu-bundle:
	PYTHON=$(PYTHON) tools/gpu_bundle.sh --python $(GPU_BUNDLE_PYTHON) --out $(GPU_BUNDLE_OUT) --level $(GPU_BUNDLE_LEVEL)

gpu-bundle-dry-run:
	PYTHON=$(PYTHON) tools/gpu_bundle.sh --python $(HOST_PYTHON_VERSION) --out $(GPU_BUNDLE_OUT) --level 1
	$(PYTHON) tools/gpu_check.py reference-env $(GPU_REF_VENV)
	tools/gpu_check.sh $(abspath $(GPU_BUNDLE_OUT))/megarl-gpu-bundle-$(HOST_PYTHON_TAG).tar.xz --dry-run \
		--python $(abspath $(GPU_REF_VENV))/bin/python --out $(abspath $(GPU_BUNDLE_OUT))/dry-run
