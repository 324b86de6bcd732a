# mrc-book: the two commands of the README are `make all` (main job) and `make test` (tests).
# Both create the environment first; both work offline with MRC_DATA_DIR and online by
# downloading the official files into ~/.cache/mrc_lib.

PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PROFILE ?= auto
export PYTHONUNBUFFERED := 1
# Notebooks run in notebooks/: a relative data folder must be made absolute first.
ifdef MRC_DATA_DIR
export MRC_DATA_DIR := $(abspath $(MRC_DATA_DIR))
endif

.PHONY: all install data reproduce book chromium test lint clean

all: install data reproduce book     ## reproduce every chapter at the profile the hardware allows, build the HTML

$(VENV)/.installed: requirements.txt pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r requirements.txt
	$(PY) -m pip install -q --no-deps --no-build-isolation -e .
	touch $@

install: $(VENV)/.installed

data: install                        ## download (or find in MRC_DATA_DIR) and cache SQuAD + GloVe
	$(PY) -m mrc_lib prepare --dataset squad-v1.1

reproduce: install
	$(PY) -m mrc_lib reproduce --all --profile $(PROFILE)

book: install                        ## build the HTML book (notebooks are not executed)
	$(PY) -m mrc_lib.book fetch-mathjax
	$(VENV)/bin/jupyter-book build . -W -n --keep-going

chromium:                            ## headless browser for the browser check (Debian)
	@command -v chromium >/dev/null 2>&1 || { apt-get update -qq && \
	  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; }

lint: install
	$(VENV)/bin/ruff check .

test: install chromium lint book     ## unit, integration, notebook (nbval) and browser tests
	# two workers, one thread each (more threads than cores makes torch 10x slower); loadfile
	# keeps every notebook's cells on one worker, in order
	OMP_NUM_THREADS=1 MRC_REQUIRE_BROWSER=1 $(VENV)/bin/pytest -n 2 --dist loadfile \
	  --nbval-lax tests notebooks

clean:                               ## build outputs and run folders (not the committed runs/inbox)
	rm -rf _build .pytest_cache
	find runs -mindepth 1 -maxdepth 1 ! -name inbox -exec rm -rf {} + 2>/dev/null || true
