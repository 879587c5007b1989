# Set-up and everyday commands. `make run` and `make test` work on a fresh machine: each
# creates the virtual environment in .venv and installs the project (building the native engine).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
NVCC ?= nvcc

.PHONY: run test install gpu-check clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

install: $(BIN)/python
	$(BIN)/python -m pip install -q -e ".[test]" -C editable.mode=inplace

run: install
	$(BIN)/ds4-app

test: install
	$(BIN)/python -m pytest -q -n 2 --dist loadfile

# Compile-only check of the GPU sources with nvcc (no GPU needed).
gpu-check:
	@if ls ext/gpu/*.cu >/dev/null 2>&1; then \
	  for f in ext/gpu/*.cu; do echo "nvcc $$f"; \
	    $(NVCC) -std=c++17 -arch=sm_90 -Iext/include -Iext/engine -Iext/gpu -c $$f -o /tmp/ds4-gpu-check.o || exit 1; \
	  done; \
	else echo "no GPU sources yet"; fi

clean:
	rm -rf build $(VENV) ds4_app/engine/_native*.so
