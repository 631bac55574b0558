# The two commands of the README: `make demo` and `make test`. Each sets itself
# up on a fresh machine: a venv in .venv, an editable install (which compiles the
# CPU FFI library, and the CUDA one when nvcc is on the PATH), then runs.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.jax_mla-installed
NATIVE_SOURCES := $(wildcard ffi/*/*.cc ffi/*/*.cu ffi/*/*.cuh ffi/*/*.h ffi/include/*/*.h tools/*/*.cu)
# The editable install maps the package's modules as they were at install time, so
# a new module needs a reinstall: keep the module list in a file that changes only
# when the list does, and depend on it.
MODULE_LIST := $(VENV)/.jax_mla-modules
MODULES := $(sort $(wildcard jax_mla/*.py jax_mla/*/*.py))
$(shell mkdir -p $(VENV) && (echo '$(MODULES)' | cmp -s - $(MODULE_LIST) || echo '$(MODULES)' > $(MODULE_LIST)))

.PHONY: demo test install

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -U pip

# Re-run the install (and so the native build) whenever the build inputs change.
# The demo needs only flax and safetensors; the tests also bring torch and
# transformers (HF parity), so each target installs its own extras.
INPUTS := pyproject.toml CMakeLists.txt $(NATIVE_SOURCES) $(MODULE_LIST)
$(STAMP)-demo: $(INPUTS) | $(PY)
	$(PY) -m pip install -q -e ".[demo]"
	touch $@
$(STAMP)-test: $(INPUTS) | $(PY)
	$(PY) -m pip install -q -e ".[test]"
	touch $@

install: $(STAMP)-test

demo: $(STAMP)-demo
	$(PY) examples/demo.py

test: $(STAMP)-test
	$(PY) -m pytest -q -ra
