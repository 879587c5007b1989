# Set-up and everyday commands. `make run` and `make test` work on a fresh machine: each
# creates the virtual environment in .venv and installs the project (building the native engine).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
NVCC ?= nvcc

.PHONY: run test install gpu-check hip-check clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

install: $(BIN)/python
	$(BIN)/python -m pip install -q -e ".[test]" -C editable.mode=inplace

run: install
	$(BIN)/ds4-app

test: install
	$(BIN)/python -m pytest -q -n 2 --dist loadfile

# GPU sources without a GPU (CI). gpu-check: nvcc compiles every ext/gpu .cu for sm_90 (and the
# device harness), links the harness and runs its --decode check, which executes the device
# weight decoders on the host against the CPU dequantizer. hip-check: the same sources through
# hipcc for an RDNA target, compile only, HIP_JOBS files at once (matvec.cu, the longest, first);
# skipped where hipcc is not installed.
HIPCC ?= hipcc
HIP_ARCH ?= gfx1030
HIP_JOBS ?= $(shell nproc 2>/dev/null || echo 2)

gpu-check:
	@if ls ext/gpu/*.cu >/dev/null 2>&1; then \
	  NVCC=$(NVCC) ext/gpu/bench/build.sh build/gpu-check && build/gpu-check/harness --decode; \
	else echo "no GPU sources yet"; fi

hip-check:
	@if ! command -v $(HIPCC) >/dev/null 2>&1; then echo "hipcc not found: skipping the HIP compile check"; exit 0; fi; \
	{ ls ext/gpu/matvec.cu; ls ext/gpu/*.cu ext/gpu/bench/harness.cu | grep -v '^ext/gpu/matvec.cu$$'; } | \
	  xargs -P $(HIP_JOBS) -I{} sh -c 'echo "hipcc {}"; HIP_PLATFORM=$${HIP_PLATFORM:-amd} $(HIPCC) -x hip -std=c++17 \
	    --offload-arch=$(HIP_ARCH) -ffp-contract=off -DDS4_GPU_HIP=1 -Iext/include -Iext/gpu -Iext/cpu -c {} \
	    -o /tmp/ds4-hip-check-$$(basename {} .cu).o || exit 255'

clean:
	rm -rf build $(VENV) ds4_app/engine/_native*.so
