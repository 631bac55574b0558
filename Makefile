# The two commands of the README: `make demo` and `make test`. Each sets itself
# up on a fresh machine: a venv in .venv, an editable install (which compiles the
# CPU FFI library, and the CUDA one when nvcc is on the PATH), then runs.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.jax_mla-installed
NATIVE_SOURCES := $(wildcard ffi/*/*.cc ffi/*/*.cu ffi/include/*/*.h ffi/*.py)

.PHONY: demo test install

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -U pip

# Re-run the install (and so the native build) whenever the build inputs change.
$(STAMP): pyproject.toml CMakeLists.txt $(NATIVE_SOURCES) | $(PY)
	$(PY) -m pip install -q -e ".[test]"
	touch $@

install: $(STAMP)

demo: $(STAMP)
	$(PY) examples/demo.py

test: $(STAMP)
	$(PY) -m pytest -q -ra
