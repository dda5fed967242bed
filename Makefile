# `make run` and `make test` each do all their own set-up on a fresh machine.
SHELL := /bin/bash
VENV := .venv
PY := $(VENV)/bin/python
POLICY ?= config/policy.yaml
LISTEN ?= 127.0.0.1:8080
ADMIN ?= 127.0.0.1:9090
# The runtime dependencies (the agent side and the proxy extra), every version
# and hash pinned; the image installs the same file. AGENT_LOCK: the agent side
# alone (`pip install sluice`, no mitmproxy), at the same versions.
LOCK := requirements.lock
AGENT_LOCK := requirements-agent.lock

.PHONY: venv run lint test unit bench lock clean

$(VENV)/.installed: pyproject.toml $(LOCK)
	@py=$$(scripts/find-python.sh) && $$py -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q --require-hashes -r $(LOCK)
	@# The editable install maps addons/ and policy/ into the `sluice` package
	@# (pyproject's package-dir); setuptools then prints an informational
	@# UserWarning about editable mode, which is silenced here. The wheel itself
	@# builds without warnings and holds only `sluice`. Runtime dependencies
	@# are already installed from the lock; this adds the test extras and the
	@# render extra (Playwright), whose tests run in CI.
	PYTHONWARNINGS=ignore::UserWarning $(PY) -m pip install -q -e '.[proxy,test,render]'
	@touch $@

venv: $(VENV)/.installed

# Regenerate requirements.lock from pyproject.toml's runtime dependencies and
# the proxy extra, then requirements-agent.lock from the agent side alone,
# constrained to the first (existing pins are kept unless LOCK_ARGS=--upgrade):
# run it whenever a dependency is added or changed; tests/unit/test_lock.py
# fails until then.
lock: venv
	$(PY) -m pip install -q 'uv>=0.5'
	$(VENV)/bin/uv pip compile pyproject.toml --extra proxy --universal --python-version 3.12 --generate-hashes \
	    --custom-compile-command 'make lock' --quiet $(LOCK_ARGS) -o $(LOCK)
	$(VENV)/bin/uv pip compile pyproject.toml -c $(LOCK) --universal --python-version 3.12 --generate-hashes \
	    --custom-compile-command 'make lock' --quiet -o $(AGENT_LOCK)

run: venv
	$(VENV)/bin/sluice proxy --policy $(POLICY) --listen $(LISTEN) --admin $(ADMIN)

# ruff over everything, mypy (strict) over pyproject's [tool.mypy] packages.
# mypy resolves the installed names (sluice.policy, ...), which the editable
# install maps with an import hook mypy cannot follow; a tree of links under
# build/ gives it the installed layout.
lint: venv
	$(VENV)/bin/ruff check .
	@rm -rf build/mypy-tree && mkdir -p build/mypy-tree/sluice
	@for f in sluice/*.py; do ln -s "$$PWD/$$f" build/mypy-tree/$$f; done
	@for d in addons policy webtools; do ln -s "$$PWD/$$d" build/mypy-tree/sluice/$$d; done
	$(VENV)/bin/mypy --cache-dir build/mypy-cache

# Everything runs inside a private network namespace where the test hosts
# live on `lo`: no test can send a packet off this machine.
test: venv lint
	scripts/in-netns.sh $(VENV)/bin/pytest -q -p no:cacheprovider $(PYTEST_ARGS)

unit: venv
	$(VENV)/bin/pytest -q -m 'not netns' $(PYTEST_ARGS)

# Installs nginx, wrk and tinyproxy first if missing (there is no package
# registry inside the namespace). BENCH_ARGS=--quick for shorter runs.
bench: venv
	$(PY) -m bench deps
	scripts/in-netns.sh $(PY) -m bench $(BENCH_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis build/mypy-tree build/mypy-cache
