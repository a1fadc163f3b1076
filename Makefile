# Two commands on a fresh machine: `make demo` and `make test`.
# Both create .venv from requirements.txt (and install the package into it) when it is missing or
# older than requirements.txt / pyproject.toml; `make test` also installs requirements-test.txt.
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
TEST_STAMP := $(VENV)/.installed-test

.PHONY: demo test compare margin lint bench clean

$(STAMP): requirements.txt pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -r requirements.txt
	$(PY) -m pip install --quiet --no-deps -e .
	touch $(STAMP)

$(TEST_STAMP): $(STAMP) requirements-test.txt
	$(PY) -m pip install --quiet -r requirements-test.txt
	touch $(TEST_STAMP)

demo: $(STAMP)
	$(PY) tools/demo.py

# TEST_WORKERS test processes (pytest-xdist), each test file in one of them (module fixtures are
# built once); every test runs on one torch thread, so two workers use two cores.
TEST_WORKERS ?= 2

test: $(TEST_STAMP)
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile tests

# The results table of docs/results.md: eight methods x three seeds on the embedded dataset, two
# runs side by side with one thread each (docs/results.md gives the duration on each CPU kind).
METHODS := ce ls fl flsd ecp mbls cals_hr cals_alm
compare: $(STAMP)
	$(PY) tools/compare.py configs/synthetic_deeplabv3.yaml --methods $(METHODS) \
		--out runs/compare --seeds 0 1 2 --jobs 2 --set train.threads=1

# Margin of CALS-ALM chosen on the validation split: CE + margins 4 6 8 10, 20 epochs each, two
# runs side by side with one thread each; then the logit gaps of the CE run.
margin: $(STAMP)
	$(PY) tools/margin.py sweep configs/synthetic_deeplabv3.yaml --out runs/margin_sweep
	$(PY) tools/margin.py gaps runs/margin_sweep/runs/synthetic_deeplabv3_ce_seed0 \
		--out runs/margin_sweep/gaps_ce_val.json

lint: $(STAMP)
	$(PY) -m pip install --quiet ruff==0.17.5
	$(VENV)/bin/ruff check .

bench: $(STAMP)
	$(PY) benchmarks/bench_loss.py

clean:
	rm -rf runs outputs .pytest_cache
