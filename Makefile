# The commands the README documents, written once. CI runs exactly `make test` (see .ci/run).
PYTHON = python3
TORCH = torch==2.13.0

.PHONY: install install-run lint docs test test-slow demo bench gpu-check
.NOTPARALLEL:

# torch pinned to the wheel CI holds. Running (the demo) needs only the package's own
# dependencies; the tests and lint also need pyproject's [test] extra.
install-run:
	$(PYTHON) -m pip install $(TORCH) -e .

install:
	$(PYTHON) -m pip install $(TORCH) -e ".[test]"

# lint-imports checks the import contracts in pyproject.toml. It finds a package's modules by
# walking its folder, and ours are mapped from top-level folders (package-dir), so it reads a
# tree of links laid out as installed: build/import-tree/tessera/{__init__.py,core,...}.
IMPORT_TREE = build/import-tree
SUBPACKAGES = core training tuning converters serving clients plan

lint:
	$(PYTHON) -m ruff check .
	rm -rf $(IMPORT_TREE) && mkdir -p $(IMPORT_TREE)/tessera
	ln -s $(CURDIR)/tessera/*.py $(IMPORT_TREE)/tessera/
	for d in $(SUBPACKAGES); do ln -s $(CURDIR)/$$d $(IMPORT_TREE)/tessera/$$d; done
	$(PYTHON) -c 'import os; os.chdir("$(IMPORT_TREE)"); from importlinter.cli \
	import lint_imports_command as lint; lint(["--config", "$(CURDIR)/pyproject.toml", "--no-cache"])'
	$(PYTHON) tools/import_cycles.py $(IMPORT_TREE)
	$(MAKE) docs

# The documentation site (mkdocs.yml) into site/; `mkdocs serve` previews it live. Strict: a broken
# link or anchor, or a `tessera VERB --flag` the parsers do not know, fails the build (and lint).
docs:
	NO_MKDOCS_2_WARNING=1 $(PYTHON) -m mkdocs build --strict

# Exit code 5 means pytest collected nothing: a broken tree, never a pass. PYTEST_ARGS: two
# pytest-xdist workers by default (the rank-spawning tests stay on one of them, see
# tests/conftest.py): on 2 cores the suite ran in 603 s against ~900 s in one process, most tests
# being process start-up and import time one core cannot overlap. `PYTEST_ARGS=` runs it serially.
PYTEST_ARGS = -n 2 --dist loadgroup
test: install lint
	$(PYTHON) -m pytest -q $(PYTEST_ARGS); rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "make test: pytest collected no tests" >&2; fi; \
	exit $$rc

test-slow:
	$(PYTHON) -m pytest -q -m slow

# `tessera` with no verb runs the embedded demo pretraining.
demo: install-run
	$(PYTHON) -m tessera

bench:
	$(PYTHON) bench/run_all.py

# One CUDA GPU, at most 7 minutes: every GPU figure, streamed, into bench/results/gpu_check-<card>.md
# (bench/gpu_check.py --help). On a machine without network, tools/gpu_session.sh first installs
# the wheels carried in .whl/ (../shared/tools/gpu-wheels.sh fetches them).
gpu-check:
	$(PYTHON) bench/gpu_check.py $(GPU_CHECK_ARGS)
