# decodelab: `make demo` and `make test` work on a fresh machine; they build .venv on first use.
SHELL := /bin/bash
VENV := .venv
STAMP := $(VENV)/.installed
PY := $(VENV)/bin/python

# A Python 3.12 that really runs: python3.12 on PATH (a pyenv shim there may not run, so each
# candidate is tried), else pyenv's newest 3.12.x, else empty (and a clear error below).
PYTHON312 ?= $(shell \
  works() { "$$1" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))' >/dev/null 2>&1; }; \
  c=$$(command -v python3.12 2>/dev/null); if [ -n "$$c" ] && works "$$c"; then echo "$$c"; exit 0; fi; \
  if command -v pyenv >/dev/null 2>&1; then \
    for v in $$(pyenv versions --bare 2>/dev/null | grep -E '^3\.12(\.[0-9]+)?$$' | sort -V -r); do \
      c="$$(pyenv prefix $$v 2>/dev/null)/bin/python3.12"; if works "$$c"; then echo "$$c"; exit 0; fi; \
    done; \
  fi)

.PHONY: venv demo test lint bench notebooks clean

venv: $(STAMP)

# Reinstall only when the project's metadata changes (the install is editable, so code edits need none).
$(STAMP): pyproject.toml
	@if [ -z "$(PYTHON312)" ]; then echo "error: no Python 3.12 found (need python3.12 on PATH or pyenv with a 3.12.x)"; exit 1; fi
	@echo "using $(PYTHON312)"
	test -x $(PY) || $(PYTHON312) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e ".[test,notebooks]"
	$(PY) -m ipykernel install --sys-prefix --name python3 >/dev/null
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m serving demo

# The ci hypothesis profile is derandomized and bounded; -n 2 uses both cores of a CI machine.
# --dist loadfile runs each file's tests on one worker: a module-scoped fixture (the serving
# suite's whole dry run, about a minute) then runs once, not once a worker.
# --max-worker-restart=0: a worker that dies (a segfault in native code) fails the run at once;
# pytest-xdist 3.8 replacing a crashed worker under --dist loadfile can wait forever at the end.
# pytest exits 5 when it collects no test: say so (make then fails, as for any failure).
# --durations=30: the slowest tests named at the end of every run, for keeping it under 20 minutes.
test: $(STAMP)
	@HYPOTHESIS_PROFILE=ci $(PY) -m pytest -q -n 2 --dist loadfile --max-worker-restart=0 --durations=30 --nbmake notebooks tests paged kernels_pallas sampling speculative serving bench; \
	status=$$?; if [ $$status -eq 5 ]; then echo "error: pytest collected no tests"; fi; exit $$status

# Execute every notebook on this machine's CPU and save it with its outputs and figures, so a
# reader on GitHub sees them; CI executes them again (without saving) in `make test`.
notebooks: $(STAMP)
	@for nb in notebooks/*.ipynb; do echo "executing $$nb"; \
	  JAX_PLATFORMS=cpu $(PY) -c 'import sys, nbformat, nbclient; path = sys.argv[1]; \
	nb = nbformat.read(path, as_version=4); \
	nbclient.NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": "notebooks"}}).execute(); \
	nbformat.write(nb, path)' "$$nb" || exit 1; done

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

bench: $(STAMP)
	$(PY) -m bench peers
	$(PY) -m bench decode

clean:
	rm -rf $(VENV)
