# `make run` and `make test` each do all their own set-up on a fresh machine.
SHELL := /bin/bash
VENV := .venv
PY := $(VENV)/bin/python
POLICY ?= config/policy.yaml
LISTEN ?= 127.0.0.1:8080

.PHONY: venv run test unit bench clean

$(VENV)/.installed: pyproject.toml
	@py=$$(scripts/find-python.sh) && $$py -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	@# The editable install maps addons/ and policy/ into the `sluice` package
	@# (pyproject's package-dir); setuptools then prints an informational
	@# UserWarning about editable mode, which is silenced here. The wheel itself
	@# builds without warnings and holds only `sluice`.
	PYTHONWARNINGS=ignore::UserWarning $(PY) -m pip install -q -e '.[test]'
	@touch $@

venv: $(VENV)/.installed

run: venv
	$(VENV)/bin/sluice proxy --policy $(POLICY) --listen $(LISTEN)

# Everything runs inside a private network namespace where the test hosts
# live on `lo`: no test can send a packet off this machine.
test: venv
	scripts/in-netns.sh $(VENV)/bin/pytest -q -p no:cacheprovider $(PYTEST_ARGS)

unit: venv
	$(VENV)/bin/pytest -q -m 'not netns' $(PYTEST_ARGS)

# Installs nginx, wrk and tinyproxy first if missing (there is no package
# registry inside the namespace). BENCH_ARGS=--quick for shorter runs.
bench: venv
	$(PY) -m bench deps
	scripts/in-netns.sh $(PY) -m bench $(BENCH_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
