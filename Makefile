# Two entry points (see README): `make demo` and `make test`. Both build .venv first.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
UNAME := $(shell uname -s)
ifeq ($(UNAME),Linux)
EXTRAS := cpu,lm,bench,test
else
EXTRAS := lm,bench,test
endif

.PHONY: venv demo test lint lora-demo clean

$(VENV)/.installed: pyproject.toml constraints.txt
	@$(PYTHON) -c 'import sys; sys.exit(sys.version_info < (3, 11))' || { echo "make needs \
	Python >= 3.11 (mlx-lm 0.32.2, in its extras, requires it); pass PYTHON=python3.11. The \
	library alone runs on 3.10: pip install -e '.[cpu,test]'" >&2; exit 1; }
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c constraints.txt -e ".[$(EXTRAS)]"
	touch $@

venv: $(VENV)/.installed

demo: venv
	$(VENV)/bin/chunkscan repro

lora-demo: venv
	$(VENV)/bin/chunkscan lora --demo

lint: venv
	$(VENV)/bin/ruff check src tests bench tools
	$(VENV)/bin/ruff format --check src tests bench tools

test: lint
	$(PY) -m pytest -q

clean:
	rm -rf $(VENV) repro-out
