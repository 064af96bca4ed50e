# The commands the README documents, written once. CI runs exactly `make test` (see .ci/run).
PYTHON = python3
TORCH = torch==2.13.0

.PHONY: install lint test test-slow demo bench
.NOTPARALLEL:

# torch pinned to the wheel CI holds; everything else from pyproject's [test] extra.
install:
	$(PYTHON) -m pip install $(TORCH) -e ".[test]"

lint:
	$(PYTHON) -m ruff check .

# Exit code 5 means pytest collected nothing: a broken tree, never a pass.
test: install lint
	$(PYTHON) -m pytest -q; rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "make test: pytest collected no tests" >&2; fi; \
	exit $$rc

test-slow:
	$(PYTHON) -m pytest -q -m slow

# `tessera` with no verb runs the embedded demo pretraining.
demo: install
	$(PYTHON) -m tessera

bench:
	$(PYTHON) bench/run_all.py
