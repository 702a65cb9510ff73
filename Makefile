# Thin wrappers: every target calls a script in hack/.
PYTHON ?= .venv/bin/python

.PHONY: venv cluster cluster-down test unit lint crds verify bench demo

venv:
	hack/venv

cluster:
	hack/cluster up

cluster-down:
	hack/cluster down

test: venv
	$(PYTHON) -m pytest

unit: venv
	$(PYTHON) -m pytest tests/unit

lint: venv
	hack/lint

demo:
	hack/demo

crds: venv
	hack/update-crds

verify: venv
	hack/verify
