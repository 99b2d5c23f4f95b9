# Two commands: `make run` starts the studio, `make test` runs every test.
# Both create .venv with the pinned dependencies first if it is missing or stale.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: run test test-gpu browser setup clean

# requirements-reference.txt: the implementations the metric tests compare with, installed with --no-deps
# because they declare torchvision, which Atelier never installs
$(STAMP): requirements.txt requirements-dev.txt requirements-reference.txt
	@test -x $(PY) || $(PYTHON) -c 'import sys; sys.exit(sys.version_info < (3, 11))' || \
	  { echo "Atelier needs Python >= 3.11 (the pinned numpy, scipy, diffusers need it): PYTHON=python3.11 make ..."; exit 1; }
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r requirements.txt -r requirements-dev.txt
	$(PY) -m pip install -q --no-deps -r requirements-reference.txt
	@touch $(STAMP)

setup: $(STAMP)

run: $(STAMP)
	$(PY) app.py

# Browser tests drive Debian's chromium; install it when missing (root, or sudo).
browser:
	@command -v chromium >/dev/null 2>&1 || { \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq chromium fonts-noto-color-emoji >/dev/null; }
	@fc-list 2>/dev/null | grep -qi "Noto Color Emoji" || { \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq fonts-noto-color-emoji >/dev/null; }

test: $(STAMP) browser
	$(PY) -m pytest -q

# On a CUDA machine: the gpu-marked tests only.
test-gpu: $(STAMP)
	$(PY) -m pytest -q -m gpu

clean:
	rm -rf $(VENV) .pytest_cache outputs .cache
